"""gpupool's notebook side: runs in the user's server (never imports the hub package ``gpupool``).

It holds the notebook-to-script converter, the DDP runtime helper used inside jobs
(``gpupool_lab.ddp``), the one hub API client, the ``gpupool`` command line, the Jupyter Server
extension (``gpupool_lab.server``: the lab front end's ``<base_url>gpupool/`` API) and, for use
inside a notebook, the ipywidgets launcher, job handles and the ``%%distributed`` cell magic
(``gpupool_lab.widget``).

Hooks, each found by its own name, so they do not clash:

- ``_jupyter_server_extension_points()``: Jupyter Server loads ``gpupool_lab.server``'s
  ``_load_jupyter_server_extension``;
- ``_jupyter_labextension_paths()``: the prebuilt lab extension in ``gpupool_lab/labextension``;
- ``load_ipython_extension(ipython)``: ``%load_ext gpupool_lab`` registers ``%%distributed``.

``launcher``, ``submit`` and ``Job`` are imported from ``gpupool_lab.widget`` on first use, so
importing this package (the CLI does) needs neither ipywidgets nor Jupyter Server.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Job", "launcher", "load_ipython_extension", "submit"]

_WIDGET_NAMES = frozenset({"Job", "launcher", "submit"})


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "gpupool_lab.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "gpupool-lab"}]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext gpupool_lab``: register the ``%%distributed`` cell magic."""
    from gpupool_lab.widget import DistributedMagics

    ipython.register_magics(DistributedMagics)


def __getattr__(name: str) -> Any:
    if name in _WIDGET_NAMES:
        from gpupool_lab import widget

        return getattr(widget, name)
    raise AttributeError(f"module 'gpupool_lab' has no attribute {name!r}")
