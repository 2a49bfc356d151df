"""gpupool inside JupyterHub: the pool singleton of the hub process, and ``setup(c)``.

Vocabulary
- *the pool*: one :class:`gpupool.pool.Pool` per hub process, built from the hub's config on first
  use (:func:`get_pool`) and shared by every spawner and handler, so both doors (notebooks and
  jobs) meet the same allocator and the same lock.
- ``setup(c)``: called at the end of ``jupyterhub_config.py``; it validates ``c.GPUPool`` right
  away (a bad key stops the hub at start, named) and builds the pool.

Contract: nothing here blocks on the network; NVML discovery and SQLite are local and quick.
"""

from __future__ import annotations

import logging
from typing import Any

from traitlets.config import Config

from ..config import GPUPool
from ..pool import Pool
from .reconcile import release_orphans

log = logging.getLogger("gpupool")
_pool: Pool | None = None


def get_pool(config: Config | None = None, logger: logging.Logger = log) -> Pool:
    """The hub's pool, built from ``config`` (the hub's config) the first time."""
    global _pool
    if _pool is None:
        _pool = Pool.from_config(GPUPool(config=config or Config()), logger)
    return _pool


def reset_pool() -> None:
    """Forget the pool (tests that build several hubs in one process)."""
    global _pool
    if _pool is not None:
        _pool.store.close()
    _pool = None


def setup(c: Any, logger: logging.Logger = log) -> Pool:
    """Validate ``c.GPUPool`` and build the pool now, so bad config stops the hub at start; then
    release notebook allocations no running server holds (see :mod:`gpupool.hub.reconcile`).

    Pass ``logging.getLogger("JupyterHub").getChild("gpupool")`` to log with the hub's handler.
    """
    pool = get_pool(c, logger)
    release_orphans(pool, c.JupyterHub.get("db_url", "sqlite:///jupyterhub.sqlite"))
    return pool
