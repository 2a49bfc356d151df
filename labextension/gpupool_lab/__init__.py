"""gpupool's notebook side: runs in the user's server (never imports the hub package ``gpupool``).

Modules, each with its vocabulary and contract in its docstring:

- ``client``: the one hub API client; ``options``: a job's options as people type them (choices,
  the default offer, durations, cell ranges), shared by everything below;
- ``convert``: notebook → torchrun-safe script; ``ddp``: the DDP runtime helper used inside jobs;
  ``rank_log``: the per-rank launcher torchrun runs;
- ``cli`` (with ``tables``): the ``gpupool`` command line;
- ``server``: the Jupyter Server extension, the lab front end's ``<base_url>gpupool/`` API, with
  ``hubcall`` (calling the hub from a handler), ``submissions`` (submit requests and the store
  behind resubmit) and ``allocation`` (what this server holds, for the status bar);
- for use inside a notebook: ``job`` (``submit()`` and the :class:`Job` handle), ``widget`` (the
  ipywidgets launcher) and ``magics`` (the ``%%distributed`` cell magic).

Hooks, each found by its own name, so they do not clash:

- ``_jupyter_server_extension_points()``: Jupyter Server loads ``gpupool_lab.server``'s
  ``_load_jupyter_server_extension``;
- ``_jupyter_labextension_paths()``: the prebuilt lab extension in ``gpupool_lab/labextension``;
- ``load_ipython_extension(ipython)``: ``%load_ext gpupool_lab`` registers ``%%distributed``.

``submit`` and ``Job`` (from ``gpupool_lab.job``) and ``launcher`` (from ``gpupool_lab.widget``)
are imported on first use, so importing this package (the CLI does) needs neither IPython,
ipywidgets nor Jupyter Server.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy names below are
    from IPython.core.interactiveshell import InteractiveShell

    from gpupool_lab.job import Job, submit
    from gpupool_lab.widget import launcher

__all__ = ["Job", "launcher", "load_ipython_extension", "submit"]

#: lazy name → the module that defines it
_LAZY = {"Job": "gpupool_lab.job", "submit": "gpupool_lab.job", "launcher": "gpupool_lab.widget"}


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "gpupool_lab.server"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "gpupool-lab"}]


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """``%load_ext gpupool_lab``: register the ``%%distributed`` cell magic."""
    from gpupool_lab.magics import DistributedMagics

    ipython.register_magics(DistributedMagics)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpupool_lab' has no attribute {name!r}")
