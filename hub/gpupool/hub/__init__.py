"""gpupool inside JupyterHub: ``setup(c)`` builds the hub's objects and wires them in.

Vocabulary
- *hub objects* (:class:`gpupool.hub.objects.HubObjects`): the pool, the job manager and the
  idle reclaimer of this hub process, built once by ``setup(c)`` and handed to handlers, pages
  and spawners through JupyterHub's tornado settings (``settings["gpupool"]``), so both doors
  (notebooks and jobs) meet the same allocator and the same lock.
- ``setup(c)``: called at the end of ``jupyterhub_config.py``; it validates ``c.GPUPool`` right
  away (a bad key stops the hub at start, named), builds the pool, reconciles it with what runs,
  adds the REST API (``/hub/api/gpupool/...``), its custom scopes and roles, the pages, the
  metrics collector and the reclaimer's service, and starts the job manager and the reclaimer
  (and, for a Kubernetes inventory, :class:`gpupool.kube.reconcile.KubeReconciler`), the
  share watch and the device watch (which first closes what something else uses, at once);
  it also keeps JupyterHub from logging refused spawns as errors (:mod:`gpupool.hub.refusals`).

Contract: nothing here blocks on the network; NVML discovery and SQLite are local and quick.
Nothing is kept in module globals: a second ``setup`` (another config, a test) builds its own.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jupyterhub.roles import get_default_roles
from tornado.ioloop import PeriodicCallback

from gpupool.config import GPUPool
from gpupool.hub import reconcile, refusals, server_port, shutdown, spawn_gate
from gpupool.hub.collector import PoolCollector, register
from gpupool.hub.form import check_profile_offers, check_spawn_form
from gpupool.hub.handlers import handlers
from gpupool.hub.objects import SETTINGS_KEY, HubObjects, build
from gpupool.hub.pages import pages
from gpupool.hub.reclaim import SERVICE, SERVICE_SCOPES, hub_urls
from gpupool.hub.reconcile import Reconciler
from gpupool.hub.scopes import ADMIN_SCOPE, CUSTOM_SCOPES, JOBS_SCOPE, SERVER_ROLE_SCOPES
from gpupool.kube.dra_inventory import uses_dra
from gpupool.kube.jobs import check_kube_settings
from gpupool.kube.reconcile import KubeReconciler
from gpupool.kube.settings import kueue_cohort, kueue_warnings
from gpupool.monitors.dcgm import DCGMSource
from gpupool.pool import Pool
from gpupool.slurm.engine import SlurmEngine
from gpupool.slurm.notebook import check_spawner_config
from gpupool.usercode import check_shared_mode, spawner_setting

log = logging.getLogger("gpupool")
ADMIN_ROLE = "gpupool-admin"
"""The role ``setup`` gives JupyterHub's ``admin_users``: the pool's admin scope."""


def setup(c: Any, logger: logging.Logger = log) -> HubObjects:
    """Validate ``c.GPUPool`` and build the pool now, so bad config stops the hub at start; then
    reconcile it with what runs, both ways, before JupyterHub serves anything, and again every
    ``c.Reconciler.period`` seconds (see :mod:`gpupool.hub.reconcile`).

    Pass ``logging.getLogger("JupyterHub").getChild("gpupool")`` to log with the hub's handler.
    """
    _check_local_spawner(c)
    check_spawn_form(c)
    check_kube_settings(c)
    settings = GPUPool(config=c)
    check_spawner_config(c, settings.inventory)
    pool = Pool.from_config(settings, logger, kueue_cohort(c), dra=uses_dra(c))
    for warning in kueue_warnings(c, pool.inventory):
        logger.warning("gpupool: %s", warning)
    check_profile_offers(c, pool.ledger.offers)
    refusals.install()
    hub_db = c.JupyterHub.get("db_url", "sqlite:///jupyterhub.sqlite")
    api_url, _public_url = hub_urls(c)
    reconciler = Reconciler(pool, hub_db, api_url, secrets.token_hex(32), config=c, log=logger)
    reconciler.at_start()
    kube = _kube_reconciler(pool, settings.inventory, reconciler, c, logger)
    slurm = _slurm_engine(pool, settings.inventory, c, logger)
    hub = build(pool, c, logger, kube, slurm)
    if hub.devices is not None:  # what something else uses is not handed out from the start
        hub.devices.close_now()
    c.JupyterHub.tornado_settings = {**c.JupyterHub.get("tornado_settings", {}), SETTINGS_KEY: hub}
    _add_api(c)
    _add_pages(c)
    _add_spawn_gate(hub)
    _add_service(c, SERVICE, SERVICE_SCOPES, hub.reclaimer.token)
    _add_service(c, reconcile.SERVICE, reconcile.SERVICE_SCOPES, reconciler.hub.token)
    register(PoolCollector(pool, hub.jobs, hub.reclaimer.idle))
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not inside a running hub (e.g. ``python -m gpupool.describe``)
        return hub
    hub.jobs.starting = loop.create_task(hub.jobs.start())
    hub.reclaimer.start()
    if hub.shares is not None:
        hub.shares.start()
    if hub.devices is not None and hub.devices.view()["watching"]:
        hub.devices.start()
    reconciler.start()
    stops = [hub.jobs.shutting_down, reconciler.shutting_down]
    # the outbox's backoff decides when it writes
    owed = PeriodicCallback(_discard(pool.writes.retry_due), 1000)
    owed.start()
    stops.append(owed.stop)
    if pool.mig is not None:  # draining MIG instances: destroyed once their processes end
        drain = PeriodicCallback(_discard(pool.retry_draining), 10_000)
        drain.start()
        stops.append(drain.stop)  # no retry (no NVML call) once the hub shuts down
    if kube is not None:
        kube.start()
        stops.append(kube.shutting_down)
    if slurm is not None:
        slurm.start()
        stops.append(slurm.shutting_down)
    stops.append(pool.monitor.close)  # the NVML sessions the device readings hold
    for stop in stops:
        shutdown.watch(logging.getLogger("JupyterHub"), stop)
    return hub


def _discard(call: Callable[[], object]) -> Callable[[], None]:
    """``call`` for tornado's ``PeriodicCallback``, which wants nothing back (``__wrapped__``
    names ``call``)."""

    @functools.wraps(call)
    def run() -> None:
        call()

    return run


def _slurm_engine(pool: Pool, inventory: str, c: Any, logger: logging.Logger) -> SlurmEngine | None:
    """For a Slurm inventory (``GPUPool.inventory = "slurm"``), the hub's Slurm side: the
    shared poller, whose snapshots the ledger mirrors, the node watch, and the teams' accounts,
    applied to slurmdbd now (:mod:`gpupool.slurm.engine`); ``None`` for any other inventory."""
    if inventory != "slurm":
        return None
    engine = SlurmEngine.from_config(c, logger, pool)
    engine.apply_accounts(pool.ledger)  # SlurmAccounts.manage: a cluster that cannot, stops the hub
    return engine


def _kube_reconciler(
    pool: Pool, inventory: str, reconciler: Reconciler, c: Any, logger: logging.Logger
) -> KubeReconciler | None:
    """For a Kubernetes inventory (``kubernetes[:<node selector>]``), the reconciler that
    follows the cluster's nodes and compares the ledger with the pods (see
    :mod:`gpupool.kube.reconcile`), reading JupyterHub's servers as the periodic
    reconciler does (its service's token); ``None`` for any other inventory."""
    if inventory != "kubernetes" and not inventory.startswith("kubernetes:"):
        return None
    selector = inventory.partition(":")[2].strip() or None
    records = reconciler.hub_records
    url = c.IdleReclaimer.get("dcgm_prometheus_url", "")  # the read-back's source, if any
    dcgm = DCGMSource(url, c.IdleReclaimer.get("dcgm_timeout", 5.0), logger) if url else None
    kube = KubeReconciler(
        pool,
        records=records,
        node_selector=selector,
        config=c,
        log=logger,
        dcgm=dcgm,
        dra=uses_dra(c),
    )
    kube.claim_nodes()  # another release on these nodes stops the hub here (gpupool.kube.claim)
    return kube


def _add_spawn_gate(hub: HubObjects) -> None:
    """Starts beyond ``user_limits.spawns`` refused before JupyterHub's spawn begins
    (:mod:`gpupool.hub.spawn_gate`), in the hub whose configuration this is."""
    app = sys.modules.get("jupyterhub.app")  # not imported outside a hub (gpupool.describe)
    if app is not None and app.JupyterHub.initialized() and hub.gate is not None:
        spawn_gate.install(app.JupyterHub.instance(), hub.gate)


def _check_local_spawner(c: Any) -> None:
    """The local spawner's shared mode never runs servers as root: stop the hub at start."""
    spawner = c.JupyterHub.get("spawner_class", "")
    name = spawner if isinstance(spawner, str) else getattr(spawner, "__name__", "")
    local = name in ("gpupool-local", "gpupool_spawner.local.LocalGPUSpawner", "LocalGPUSpawner")
    if local and spawner_setting(c, "run_as_hub_user", True):
        shared = spawner_setting(c, "shared_account", "")
        check_shared_mode(shared, "LocalGPUSpawner.shared_account")


def _add_service(c: Any, name: str, scopes: list[str], token: str) -> None:
    """A JupyterHub service of gpupool's own (the reclaimer, the reconciler): it acts through
    the hub's REST API with ``token`` and a role of exactly ``scopes``."""
    services = [s for s in c.JupyterHub.get("services", []) if s.get("name") != name]
    c.JupyterHub.services = [*services, {"name": name, "api_token": token, "display": False}]
    roles = [r for r in c.JupyterHub.get("load_roles", []) if r.get("name") != name]
    roles.append({"name": name, "scopes": list(scopes), "services": [name]})
    c.JupyterHub.load_roles = roles


def _add_pages(c: Any) -> None:
    """The admin page ``/hub/gpupool`` and "My GPUs" ``/hub/gpupool/mine``, with their templates."""
    c.JupyterHub.extra_handlers = _with_routes(c.JupyterHub.get("extra_handlers", []), pages())
    templates = str(Path(__file__).parent / "templates")
    paths = list(c.JupyterHub.get("template_paths", []))
    c.JupyterHub.template_paths = paths if templates in paths else [*paths, templates]


def _add_api(c: Any) -> None:
    """The REST API's routes, its scopes, and the roles that grant them."""
    routes = [*handlers(), *server_port.handlers()]
    c.JupyterHub.extra_handlers = _with_routes(c.JupyterHub.get("extra_handlers", []), routes)
    c.JupyterHub.custom_scopes = {**c.JupyterHub.get("custom_scopes", {}), **CUSTOM_SCOPES}
    roles = [dict(r) for r in c.JupyterHub.get("load_roles", [])]
    _add_to_role(roles, "user", [JOBS_SCOPE])
    admins = sorted(c.Authenticator.get("admin_users", set()))
    _add_to_role(roles, ADMIN_ROLE, [ADMIN_SCOPE], users=admins)
    _add_to_role(roles, "server", SERVER_ROLE_SCOPES)
    c.JupyterHub.load_roles = roles


def _add_to_role(
    roles: list[dict[str, Any]],
    name: str,
    scopes: Sequence[str],
    users: Sequence[str] | None = None,
) -> None:
    """Add ``scopes`` (and ``users``) to the role ``name`` of ``load_roles``: to its definition
    there (the admin's, or a former ``setup``'s: JupyterHub refuses a role defined twice), or to
    JupyterHub's default one (a role in ``load_roles`` replaces the default's scopes), or to a new
    one. A server's token gets the ``server`` role's scopes, unless
    ``Spawner.server_token_scopes`` is set (then JupyterHub ignores the role, and gpupool's scopes
    must be listed there)."""
    default: dict[str, Any] = next(
        (r for r in get_default_roles() if r["name"] == name), {"scopes": []}
    )
    role = next((r for r in roles if r.get("name") == name), None)
    if role is None:
        role = {"name": name}
        roles.append(role)
    have = role["scopes"] = list(role.get("scopes", default["scopes"]))
    have.extend(s for s in scopes if s not in have)
    if users is not None:  # listed even when empty: JupyterHub then keeps no one else in it
        members = role["users"] = list(role.get("users", []))
        members.extend(u for u in users if u not in members)


def _with_routes(routes: list[Any], ours: list[Any]) -> list[Any]:
    """``extra_handlers`` with ``ours`` added once (a second ``setup`` adds none again)."""
    return [*routes, *(r for r in ours if r not in routes)]
