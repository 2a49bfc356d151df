"""gpupool inside JupyterHub: the pool and job manager of the hub process, and ``setup(c)``.

Vocabulary
- *the pool*: one :class:`gpupool.pool.Pool` per hub process, built from the hub's config on first
  use (:func:`get_pool`) and shared by every spawner and handler, so both doors (notebooks and
  jobs) meet the same allocator and the same lock.
- *the job manager*: one :class:`gpupool.jobs.manager.JobManager` over that pool (:func:`get_jobs`).
- *the reclaimer*: one :class:`gpupool.hub.reclaim.IdleReclaimer` (:func:`get_reclaimer`), acting
  as the ``gpupool-reclaimer`` service with a token made at start.
- ``setup(c)``: called at the end of ``jupyterhub_config.py``; it validates ``c.GPUPool`` right
  away (a bad key stops the hub at start, named), builds the pool, adds the REST API
  (``/hub/api/gpupool/...``), its custom scopes and roles, the pages, the metrics collector
  and the reclaimer's service, and starts the job manager and the reclaimer; it also keeps
  JupyterHub from logging refused spawns as errors (:mod:`gpupool.hub.refusals`).

Contract: nothing here blocks on the network; NVML discovery and SQLite are local and quick.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

from traitlets.config import Config

from .. import metrics
from ..config import GPUPool
from ..jobs.manager import JobManager
from ..pool import Pool
from ..usercode import check_shared_mode, spawner_setting
from . import refusals, shutdown
from .reclaim import SERVICE, SERVICE_SCOPES, IdleReclaimer
from .reconcile import Reconciler

log = logging.getLogger("gpupool")
_pool: Pool | None = None
_jobs: JobManager | None = None
_reclaimer: IdleReclaimer | None = None
JOBS_SCOPE = "custom:gpupool:jobs"
ADMIN_SCOPE = "custom:gpupool:admin"
SERVER_SCOPES = ["users:activity!user", "access:servers!server", JOBS_SCOPE, ADMIN_SCOPE]
"""A server's token: JupyterHub's defaults plus gpupool's (only those its user holds)."""


def get_pool(config: Config | None = None, logger: logging.Logger = log) -> Pool:
    """The hub's pool, built from ``config`` (the hub's config) the first time."""
    global _pool
    if _pool is None:
        _pool = Pool.from_config(GPUPool(config=config or Config()), logger)
    return _pool


def get_jobs(config: Config | None = None, logger: logging.Logger = log) -> JobManager:
    """The hub's job manager over :func:`get_pool`."""
    global _jobs
    if _jobs is None:
        _jobs = JobManager(get_pool(config, logger), config=config or Config(), log=logger)
    return _jobs


def get_reclaimer(config: Config | None = None, logger: logging.Logger = log) -> IdleReclaimer:
    """The hub's idle GPU reclaimer over :func:`get_pool`, with its service token."""
    global _reclaimer
    if _reclaimer is None:
        pool = get_pool(config, logger)
        token = secrets.token_hex(32)
        _reclaimer = IdleReclaimer(pool, token, config=config or Config(), log=logger)
    return _reclaimer


def setup(c: Any, logger: logging.Logger = log) -> Pool:
    """Validate ``c.GPUPool`` and build the pool now, so bad config stops the hub at start; then
    reconcile it with what runs, both ways, before JupyterHub serves anything, and again every
    ``c.Reconciler.period`` seconds (see :mod:`gpupool.hub.reconcile`).

    Pass ``logging.getLogger("JupyterHub").getChild("gpupool")`` to log with the hub's handler.
    """
    _check_local_spawner(c)
    pool = get_pool(c, logger)
    refusals.install()
    hub_db = c.JupyterHub.get("db_url", "sqlite:///jupyterhub.sqlite")
    reconciler = Reconciler(pool, hub_db, config=c, log=logger)
    reconciler.at_start()
    _add_api(c)
    _add_pages(c)
    manager = get_jobs(c, logger)
    reclaimer = get_reclaimer(c, logger)
    _add_reclaimer_service(c, reclaimer.token)
    metrics.register(metrics.PoolCollector(pool, get_running_jobs, reclaimer.idle))
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not inside a running hub (e.g. ``python -m gpupool.inspect``)
        return pool
    manager.starting = loop.create_task(manager.start())
    reclaimer.start()
    reconciler.start()
    for stop in (manager.shutting_down, reconciler.shutting_down):
        shutdown.watch(logging.getLogger("JupyterHub"), stop)
    return pool


def _check_local_spawner(c: Any) -> None:
    """The local spawner's shared mode never runs servers as root: stop the hub at start."""
    spawner = c.JupyterHub.get("spawner_class", "")
    name = spawner if isinstance(spawner, str) else getattr(spawner, "__name__", "")
    local = name in ("gpupool-local", "gpupool_spawner.local.LocalGPUSpawner", "LocalGPUSpawner")
    if local and spawner_setting(c, "run_as_hub_user", True):
        shared = spawner_setting(c, "shared_account", "")
        check_shared_mode(shared, "LocalGPUSpawner.shared_account")


def get_running_jobs() -> JobManager | None:
    """The job manager if it exists (the metrics collector must not build one)."""
    return _jobs


def _add_reclaimer_service(c: Any, token: str) -> None:
    """The reclaimer acts through the hub's REST API as a service of its own."""
    services = [s for s in c.JupyterHub.get("services", []) if s.get("name") != SERVICE]
    c.JupyterHub.services = [*services, {"name": SERVICE, "api_token": token, "display": False}]
    roles = [r for r in c.JupyterHub.get("load_roles", []) if r.get("name") != SERVICE]
    roles.append({"name": SERVICE, "scopes": SERVICE_SCOPES, "services": [SERVICE]})
    c.JupyterHub.load_roles = roles


def _add_pages(c: Any) -> None:
    """The admin page ``/hub/gpupool`` and "My GPUs" ``/hub/gpupool/mine``, with their templates."""
    from pathlib import Path

    from .pages import pages

    c.JupyterHub.extra_handlers = [*c.JupyterHub.get("extra_handlers", []), *pages()]
    templates = str(Path(__file__).parent / "templates")
    paths = list(c.JupyterHub.get("template_paths", []))
    c.JupyterHub.template_paths = paths if templates in paths else [*paths, templates]


def _add_api(c: Any) -> None:
    """The REST API's routes, its scopes, and the roles that grant them."""
    from .handlers import handlers

    c.JupyterHub.extra_handlers = [*c.JupyterHub.get("extra_handlers", []), *handlers()]
    c.JupyterHub.custom_scopes = {
        **c.JupyterHub.get("custom_scopes", {}),
        JOBS_SCOPE: {"description": "Submit, list, read logs of and cancel your own GPU jobs."},
        ADMIN_SCOPE: {
            "description": "See and cancel everyone's GPU jobs.",
            "subscopes": [JOBS_SCOPE],
        },
    }
    roles = list(c.JupyterHub.get("load_roles", []))
    user_role = next((r for r in roles if r.get("name") == "user"), None)
    if user_role is None:
        roles.append({"name": "user", "scopes": ["self", JOBS_SCOPE]})
    elif JOBS_SCOPE not in user_role.setdefault("scopes", ["self"]):
        user_role["scopes"].append(JOBS_SCOPE)
    admins = sorted(c.Authenticator.get("admin_users", set()))
    roles.append({"name": "gpupool-admin", "scopes": [ADMIN_SCOPE], "users": admins})
    c.JupyterHub.load_roles = roles
    if "server_token_scopes" not in c.Spawner:
        c.Spawner.server_token_scopes = SERVER_SCOPES
