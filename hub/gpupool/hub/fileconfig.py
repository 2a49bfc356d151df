"""Hub settings from a JSON file: how the Helm chart hands its values to ``jupyterhub_config.py``.

Vocabulary
- *config file*: a JSON object of traitlets sections, ``{"GPUPool": {"teams": {...}}, ...}``, the
  same keys as ``c.GPUPool.teams = ...`` in a ``jupyterhub_config.py``. The Helm chart renders it
  into the ``gpupool-config`` ConfigMap from ``values.yaml`` and the hub's ``extraConfig`` loads it
  with :func:`load_config_file` before :func:`gpupool.hub.setup`.

Contract: the file's values replace the same keys already in ``c``; other keys are kept. A file
that is missing, not JSON, or not shaped as sections of settings raises
:class:`gpupool.declarations.ConfigError` naming the file (and the section), so the hub stops at
start.
The values themselves are checked where they always are: by the traitlets that receive them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from gpupool.declarations import ConfigError

_SECTION = re.compile(r"^[A-Z][A-Za-z0-9]*$")


def load_config_file(c: Any, path: str | Path) -> dict[str, dict[str, Any]]:
    """Copy each section's settings from the JSON file at ``path`` into the config ``c``; return
    what was read."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(where, "no such file; is the gpupool-config ConfigMap mounted?") from None
    except (OSError, ValueError) as e:
        raise ConfigError(where, f"cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(where, 'must hold a JSON object of sections, e.g. {"GPUPool": {...}}')
    for section, settings in data.items():
        if not _SECTION.match(section) or not isinstance(settings, dict):
            raise ConfigError(
                f"{where}: {section}",
                "must be a configurable class name (like GPUPool) holding an object of settings",
            )
        for key, value in settings.items():
            setattr(c[section], key, value)
    return data
