"""Fixtures and helpers shared by the notebook side's tests (``gpupool_lab``).

- ``hub``: a running :class:`tests.lab.fake_hub.FakeHub`, with the single-user environment
  (``JUPYTERHUB_API_URL``, ``JUPYTERHUB_API_TOKEN``, ``JUPYTERHUB_USER``) pointing at it as
  ``alice``. A module that defines its own ``hub`` fixture (``test_browser.py``: the real demo
  hub) overrides this one, as pytest does for any module fixture of the same name.
- :func:`later`: run an action on a thread after a delay (job progress while a call waits).
- :func:`run_script`: run a generated script with this Python; its stdout.
- :func:`write_notebook`: write a notebook of the given cells.

Nothing here is autouse.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_notebook

from tests.lab.fake_hub import FakeHub


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.thread.start()
    monkeypatch.setenv("JUPYTERHUB_API_URL", fake.api_url)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "alice-token")
    monkeypatch.setenv("JUPYTERHUB_USER", "alice")
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def later(seconds: float, action: Callable[..., object], *args: object) -> threading.Thread:
    """Call ``action(*args)`` on a daemon thread after ``seconds``."""

    def act() -> None:
        time.sleep(seconds)
        action(*args)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


def run_script(script: str) -> str:
    """Run ``script`` (Python source) in a fresh interpreter; its stdout (it must exit 0)."""
    result = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def write_notebook(path: Path, *cells: nbformat.NotebookNode) -> Path:
    """Write a notebook of ``cells`` at ``path`` (folders made as needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(new_notebook(cells=list(cells)), path)
    return path
