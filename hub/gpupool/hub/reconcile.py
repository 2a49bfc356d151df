"""Reconciliation, both ways: every allocation has a live holder, and every live process that holds
devices has an allocation.

Vocabulary
- *record*: JupyterHub's record of an active server (started, starting or stopping): its user
  and name, the user's groups, and the spawner's state: ``gpupool_allocation``
  (:data:`STATE_KEY`), and for a local server ``pid`` and ``gpupool_process_start``
  (:data:`START_KEY`). A record is *alive* when that pid is the very process (same start time;
  or, for a state without one, a process whose environment names the allocation), *dead* when
  not, and *unchecked* (``None``) without a pid (not a local process: Kubernetes) or while its
  start is in progress (the spawner's). Records are read two ways, parsed by one function
  (:func:`record`): at start from JupyterHub's database through JupyterHub's own ORM
  (:func:`read_records`; JupyterHub has not loaded it yet and its REST API is not up), and while
  the hub runs from its REST API (:func:`fetch_users`, :func:`rest_records`) as the
  ``gpupool-reconciler`` service (:data:`SERVICE`, :data:`SERVICE_SCOPES`: list users, their
  groups and servers, and the servers' state), whose token ``setup(c)`` makes at start.
- *marker*: ``GPUPOOL_HUB=<Pool.hub_marker>``, in the environment of every server this hub starts
  (and so of everything a server starts). The *scan* reads ``/proc/*/environ`` and keeps only
  processes with this hub's marker: processes of another hub, another test run or anyone else
  are never touched, whatever else they carry.
- *claim*: what a scanned process says it holds: ``GPUPOOL_ALLOCATION`` (servers and their
  kernels) or ``GPUPOOL_JOB`` (job ranks), and ``CUDA_VISIBLE_DEVICES``; plus the devices whose
  NVML process list names it (:class:`gpupool.monitors.activity.DeviceMonitor`).
- *actions* (:class:`Action`, the metric ``gpupool_reconcile_actions_total{action}``):
  ``released`` (an allocation without a live holder), ``stopped`` (processes holding devices
  without an allocation: SIGTERM to their process group, SIGKILL after ``stop_grace``),
  ``adopted`` (a live server's allocation the pool had lost, taken back into the ledger) and
  ``reported`` (what gpupool cannot fix and leaves alone; logged when it appears, not again
  while it lasts).

Rules (:func:`plan`, pure: the ledger, the records, the scanned processes and the known jobs in,
actions out):
1. A notebook allocation named by a dead record is released, and processes still claiming it
   (kernels left behind) are stopped. Named by an alive or unchecked record: held.
2. At start, a notebook allocation no record names is released; if processes claim it (a
   server the hub started but died before recording: JupyterHub will never stop it), they are
   stopped first. While the hub runs such an allocation is released only once it has had no
   holder at all for ``holderless_grace`` seconds (:func:`holderless`: no process claims it and
   JupyterHub records no server of its ref, which covers a start in progress, allocated before
   its state names it); a stop whose release was lost leaves no GPU held for good.
3. Processes claiming an allocation the ledger does not know are stopped, except at start, where
   they are adopted when that is consistent: an alive record names the allocation and its pid is
   one of them; the offer and team in the server's environment exist, the record's user is in the
   team and the team may use the offer; ``CUDA_VISIBLE_DEVICES`` names devices of this inventory
   that fit the offer and are free (after the releases above); no process of it uses another
   device. The allocation keeps its id, its owner and ref come from the record, its time from
   the server's start. Only processes of the server's own account count for it; others claiming
   its allocation are stopped. While the hub runs, an unknown allocation was released (a server
   being stopped, a kernel left behind): stopped, never adopted.
4. Job ranks (``GPUPOOL_JOB``) of a job the job store does not know are stopped; ranks of known
   jobs are the job manager's (it re-attaches active jobs and releases what no job holds). When
   the pool database was lost (rule 6) and knows no job at all, such ranks are reported and left
   running, then and in every later pass (``kept_jobs``): an admin decides.
   Job allocations are the job manager's too.
5. A process of this hub claiming no allocation and no job but holding devices is stopped.
6. Reported: a record naming an allocation the ledger does not know, with no process of it to
   read (not a local server, or started before servers carried the marker); a process of this
   hub running as root (user code never does; not stopped). And once, at start, a pool database
   that holds no allocation while JupyterHub records running servers that hold some: deleted
   or emptied, not an empty pool.
Processes NVML finds on a device they do not hold (this hub's, of a device their allocation
does not hold, or anyone's without its marker) are the device watch's
(:mod:`gpupool.hub.device_watch`): it warns and stops user code, and keeps such devices from
being handed out.

When and how atomic: :meth:`Reconciler.at_start` runs in ``setup(c)``, before JupyterHub loads
its database or spawners or serves a request, so nothing is allocated while it decides, stops,
releases and adopts (stops wait for the processes to be gone). :meth:`Reconciler.periodic` runs
every ``period`` seconds in the hub's event loop: JupyterHub's records come from its REST API
(``GET /users?state=active``, every page), then ``/proc`` is read in a worker thread, then the
decision reads the ledger under the pool's lock (:meth:`Pool.deciding`), after the scan: an
allocation made since is known, and an id unknown then is unknown for good (ids are never
reused). It adopts nothing, and releases only allocations whose holders are gone. When the REST
API cannot be read (not up, refused, a bad reply), the pass is skipped with a warning (and
counted in ``gpupool_reconcile_failures_total``): "could not read" is never taken for "no
servers". Without an API URL (``api_url``) only the pass at start runs.

Contract: JupyterHub's database is read only at start, through JupyterHub's ORM models
(``users``, ``spawners``, ``groups``, ``user_group_map``; only the columns needed), never
written, created or upgraded; while the hub runs, only its REST API is read. Reconciliation
signals only processes with this hub's marker (or the pid of an alive record), never pid 1, the
hub's own process group, or a process running as root; a process is signalled only while it is
the very process scanned (pid and start time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from jupyterhub import orm
from sqlalchemy import create_engine, inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest
from traitlets import Float
from traitlets.config import LoggingConfigurable

from gpupool import metrics
from gpupool.core.errors import PoolError, UnknownAllocation
from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Allocation, Device, Ledger
from gpupool.core.quota import check_offer, resolve_team
from gpupool.pool import Pool
from gpupool.procfs import boot_time, environ, parse_environ, process_start, stat_fields, with_item

STATE_KEY = "gpupool_allocation"
"""The spawner state key naming a server's allocation."""
START_KEY = "gpupool_process_start"
"""The spawner state key with a local server's process start time (clock ticks since boot)."""
MARKER = "GPUPOOL_HUB"
SERVICE = "gpupool-reconciler"
"""The JupyterHub service the periodic passes read JupyterHub's records as."""
SERVICE_SCOPES = ["list:users", "read:users:groups", "read:servers", "admin:server_state"]
"""Its scopes: list the users with their groups and active servers, and the servers' state."""

_background: set[asyncio.Task[None]] = set()


# -- what is read ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Record:
    """JupyterHub's record of one running server."""

    user: str
    name: str = ""
    groups: frozenset[str] = frozenset()
    allocation: str = ""
    pid: int | None = None
    alive: bool | None = None

    @property
    def ref(self) -> str:
        return f"{self.user}/{self.name}"


@dataclass(frozen=True)
class Proc:
    """One live process of this hub and what it claims (see the module docstring)."""

    pid: int
    pgid: int
    uid: int
    start: int | None
    allocation: str = ""
    job: str = ""
    offer: str = ""
    team: str = ""
    visible: tuple[str, ...] = ()
    on_devices: tuple[str, ...] = ()
    started_at: float = 0.0

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.visible, *self.on_devices)))


@dataclass(frozen=True)
class Action:
    """One thing reconciliation does: ``message`` is its log line."""

    action: str
    message: str
    release: str = ""
    stop: tuple[Proc, ...] = ()
    adopt: Allocation | None = None
    claim: tuple[Proc, ...] = ()
    level: int = logging.WARNING


# -- the decision ---------------------------------------------------------------------------------
def plan(
    ledger: Ledger,
    records: Sequence[Record],
    procs: Sequence[Proc],
    jobs: Iterable[str] = (),
    *,
    at_start: bool,
    holderless_since: Mapping[str, float] | None = None,
    now: float = 0.0,
    grace: float = 0.0,
    keep_unknown_jobs: bool = False,
) -> list[Action]:
    """What to do (the module docstring's rules); ``jobs``: the ids the job store knows;
    ``holderless_since``: when each allocation was first seen without a holder (rule 2 while
    the hub runs: released once that is ``grace`` seconds before ``now``); ``keep_unknown_jobs``
    (the pool database was lost): ranks of jobs it does not know are reported, not stopped."""
    known_jobs = set(jobs)
    allocations = ledger.allocations
    named = {r.allocation: r for r in records if r.allocation}
    refs = {r.ref for r in records}
    since = holderless_since or {}
    by_alloc: dict[str, list[Proc]] = defaultdict(list)
    by_job: dict[str, list[Proc]] = defaultdict(list)
    loose: list[Proc] = []
    for p in sorted(procs, key=lambda p: p.pid):
        if p.job:
            by_job[p.job].append(p)
        elif p.allocation:
            by_alloc[p.allocation].append(p)
        elif p.devices:
            loose.append(p)
    actions: list[Action] = []
    trial = ledger.clone() if at_start else None  # the ledger to be, to check adoptions against

    # 1, 2: every notebook allocation has a live holder
    for a in sorted(allocations.values(), key=lambda a: (a.created, a.id)):
        if a.kind != "notebook":
            continue
        record, claim = named.get(a.id), tuple(by_alloc.get(a.id, ()))
        what = f"{a.id} ({a.ref}, {a.offer}{_on(a.visible_devices)})"
        if record is not None and record.alive is False:
            left = f"; stopping what it left running ({_pids(claim)})" if claim else ""
            reason = f"its server's process {record.pid} is gone{left}"
            actions.append(Action("released", f"released {what}: {reason}", a.id, claim))
        elif record is None and at_start and claim:
            reason = (
                f"server {_pids(claim)} runs with it but JupyterHub has no record of it (a start "
                "the hub did not finish): stopped, then released"
            )
            actions.append(Action("stopped", f"stopped {what}: {reason}", a.id, claim))
        elif record is None and at_start:
            actions.append(Action("released", f"released {what}: no running server holds it", a.id))
        elif record is None and not claim and a.ref not in refs and a.id in since:
            if now - since[a.id] < grace:
                continue
            reason = (
                f"no process holds it and JupyterHub records no server {a.ref} (for "
                f"{now - since[a.id]:.0f} s; its stop or release was lost)"
            )
            actions.append(Action("released", f"released {what}: {reason}", a.id))
        else:
            continue
        if trial is not None:
            trial.release(a.id)

    # 3: every process claiming an allocation has one the ledger knows
    for alloc_id, claim_list in sorted(by_alloc.items()):
        claim = tuple(claim_list)
        if alloc_id in allocations:
            continue  # a process of it on another device: the device watch's
        record = named.get(alloc_id)
        devices = ", ".join(dict.fromkeys(d for p in claim for d in p.devices)) or "no device"
        head = f"processes {_pids(claim)} hold {devices} under allocation {alloc_id}"
        if trial is not None:
            server = next((p for p in claim if record and p.pid == record.pid), None)
            if server is not None:  # only the server's own account's processes count
                others = tuple(p for p in claim if p.uid != server.uid)
                claim = tuple(p for p in claim if p.uid == server.uid)
                if others:
                    message = (
                        f"stopped processes {_pids(others)}: they claim allocation {alloc_id} "
                        f"of server {server.pid}, but run as another account"
                    )
                    actions.append(Action("stopped", message, stop=others))
            adopted, why_not = _adoptable(trial, alloc_id, record, claim)
            if adopted is not None:
                message = (
                    f"adopted {alloc_id} ({adopted.ref}, team {adopted.team}, {adopted.offer}"
                    f"{_on(adopted.visible_devices)}): its server {record.pid if record else '?'} "
                    "runs with it and JupyterHub records it, but the pool did not know it"
                )
                actions.append(Action("adopted", message, adopt=adopted, claim=claim))
                continue
            reason = f"the pool does not know it, and it cannot be taken back: {why_not}"
        else:
            reason = "the pool does not know it (released, or never granted)"
        actions.append(Action("stopped", f"stopped {head}: {reason}", stop=claim))

    # 4, 5: job ranks of unknown jobs, and processes holding devices with no claim at all
    for job_id, ranks in sorted(by_job.items()):
        if job_id not in known_jobs and keep_unknown_jobs:
            what = ", ".join(dict.fromkeys(d for p in ranks for d in p.devices)) or "no device"
            message = (
                f"job {job_id} runs (processes {_pids(ranks)}, {what}) but the pool database, "
                "deleted or emptied, does not know it: left running; its history is gone. An "
                "admin stops it (kill its processes) or lets it finish"
            )
            actions.append(Action("reported", message, level=logging.ERROR))
        elif job_id not in known_jobs:
            what = ", ".join(dict.fromkeys(d for p in ranks for d in p.devices)) or "no device"
            message = (
                f"stopped processes {_pids(ranks)} of job {job_id} ({what}): the job store does "
                "not know the job"
            )
            actions.append(Action("stopped", message, stop=tuple(ranks)))
    for p in loose:
        message = f"stopped process {p.pid}: it holds {', '.join(p.devices)} without an allocation"
        actions.append(Action("stopped", message, stop=(p,)))

    # 6: what cannot be checked or is not ours to stop
    unread = [
        r
        for r in records
        if r.allocation not in allocations and r.allocation not in by_alloc and r.alive is not False
    ]
    for r in unread if at_start else ():
        if r.allocation:
            where = "not a local process" if r.pid is None else f"process {r.pid}"
            message = (
                f"server {r.ref} holds allocation {r.allocation}, which the pool does not know, "
                f"and it cannot be checked here ({where}, whose environment cannot be read): its "
                "devices may be handed out twice; stop the server or restore the pool database"
            )
            actions.append(Action("reported", message, level=logging.ERROR))
    return actions


def holderless(ledger: Ledger, records: Sequence[Record], procs: Sequence[Proc]) -> set[str]:
    """The notebook allocations with no holder at all: no record names them or their server
    (a start in progress has a record of its server), and no process claims them."""
    named = {r.allocation for r in records} | {r.ref for r in records}
    claimed = {p.allocation for p in procs}
    return {
        a.id
        for a in ledger.allocations.values()
        if a.kind == "notebook" and not ({a.id, a.ref} & named) and a.id not in claimed
    }


def lost_database(ledger: Ledger, records: Sequence[Record]) -> list[Record]:
    """The running servers holding allocations, when the ledger has none at all: the pool's
    database was deleted or emptied while they ran (none when the ledger has any)."""
    if ledger.allocations:
        return []
    return [r for r in records if r.allocation and r.alive is not False]


def _adoptable(
    trial: Ledger, alloc_id: str, record: Record | None, claim: tuple[Proc, ...]
) -> tuple[Allocation | None, str]:
    """The allocation to adopt for ``claim`` (restored into ``trial``), or ``None`` and why
    not."""
    if record is None:
        return None, "JupyterHub records no running server with it"
    if record.alive is not True:
        return None, f"JupyterHub's server {record.ref} is not a live local process"
    server = next((p for p in claim if p.pid == record.pid), None)
    if server is None:
        return None, f"JupyterHub's server {record.ref} is process {record.pid}, not one of these"
    offer = trial.offers.get(server.offer)
    if offer is None:
        return None, f"its offer {server.offer!r} does not exist"
    try:
        team = resolve_team(trial.teams, trial.everyone, record.groups, server.team or None)
        if team.name != server.team:
            return None, f"its team {server.team!r} is not {record.user}'s"
        devices = _devices(trial.inventory, server.visible)
        if devices is None:
            return None, f"its devices {','.join(server.visible)} are not all in this pool"
        count = len(devices) if offer.counted else 1
        check_offer(team, trial.offers, offer.name, count)
    except PoolError as e:
        return None, e.message
    if offer.kind == "share":  # its size is the ledger's alone, not in the process
        return None, f"its share of {','.join(server.visible)} is not in the pool's database"
    kinds = {"cpu": 0, "gpu": count, "mig": count}
    wrong_kind = any((d.profile is None) != (offer.kind == "gpu") for d in devices)
    if len(devices) != kinds[offer.kind] or wrong_kind or not _fits(trial, offer, devices):
        return None, f"its devices {','.join(server.visible) or 'none'} do not fit {offer.name}"
    elsewhere = [d for p in claim for d in p.devices if d not in server.visible]
    if elsewhere:
        return None, f"its processes also use {', '.join(dict.fromkeys(elsewhere))}"
    cost = sum(_cost(trial.inventory, d) for d in devices)
    allocation = Allocation(
        alloc_id, record.user, team.name, offer.name, "notebook", record.ref, count, cost, None,
        tuple(devices), server.started_at,
    )  # fmt: skip
    restored, _lost = trial.restore([allocation])
    if not restored:
        return None, "its devices are held by another allocation"
    return restored[0], ""


def _devices(inventory: Inventory, visible: Sequence[str]) -> list[Device] | None:
    """The ledger's devices for ``CUDA_VISIBLE_DEVICES`` UUIDs (``None`` if one is unknown)."""
    gpus = {g.uuid: g for g in inventory.gpus}
    instances = {i.uuid: (g, i) for g in inventory.gpus for i in g.instances if i.uuid}
    out: list[Device] = []
    for uuid in visible:
        if uuid in gpus:
            out.append(Device(uuid))
        elif uuid in instances:
            gpu, inst = instances[uuid]
            out.append(Device(gpu.uuid, inst.profile, inst.start, inst.uuid))
        else:
            return None
    return out


def _fits(ledger: Ledger, offer: Any, devices: Sequence[Device]) -> bool:
    """Whether the devices are of the offer's model and (for MIG) profile."""
    gpus = {g.uuid: g for g in ledger.inventory.gpus}
    for d in devices:
        gpu = gpus[d.gpu]
        if offer.model and gpu.model != offer.model:
            return False
        if d.profile is not None:
            geo = gpu.geometry
            wanted = geo.resolve(offer.profile) if geo else None
            if wanted is None or geo is None or geo.resolve(d.profile) != wanted:
                return False
    return True


def _cost(inventory: Inventory, device: Device) -> int:
    if device.share_milli is not None:
        return device.share_milli
    if device.profile is None:
        return 1000
    gpu = next(g for g in inventory.gpus if g.uuid == device.gpu)
    geo = gpu.geometry
    profile = geo.resolve(device.profile) if geo else None
    return geo.cost_milli(profile) if geo and profile else 1000


def _pids(procs: Iterable[Proc]) -> str:
    return ", ".join(str(p.pid) for p in procs)


def _on(visible: str) -> str:
    return f" on {visible}" if visible else ""


# -- reading processes --------------------------------------------------------------------------
def read_process(pid: int, env: Mapping[str, str] | None = None) -> Proc | None:
    """What process ``pid`` claims, from its environment (``None`` if gone or unreadable)."""
    fields = stat_fields(pid)
    if env is None:
        env = environ(pid)
    if fields is None or env is None or fields[0] in ("Z", "X"):
        return None
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    start = int(fields[19])
    visible = tuple(d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip())
    return Proc(
        pid=pid,
        pgid=int(fields[2]),
        uid=uid,
        start=start,
        allocation=env.get("GPUPOOL_ALLOCATION", ""),
        job=env.get("GPUPOOL_JOB", ""),
        offer=env.get("GPUPOOL_OFFER", ""),
        team=env.get("GPUPOOL_TEAM", ""),
        visible=visible,
        started_at=boot_time() + start / os.sysconf("SC_CLK_TCK"),
    )


def scan(marker: str) -> list[Proc]:
    """Every live process whose environment carries ``GPUPOOL_HUB=<marker>``."""
    found = []
    for pid, items in with_item(f"{MARKER}={marker}"):
        proc = read_process(pid, parse_environ(items))
        if proc is not None:
            found.append(proc)
    return found


def same(p: Proc) -> bool:
    """Whether ``p`` is still the very process it was when read (not gone, not a recycled pid)."""
    return p.start is not None and process_start(p.pid) == p.start


def server_alive(pid: int, start: int | None, allocation: str) -> bool:
    """Whether a local server JupyterHub records is the live process ``pid``: with the start
    time its state saved, or (a state from before they were saved) a process whose
    environment names its allocation (when readable)."""
    now = process_start(pid)
    if now is None:
        return False
    if start is not None:
        return now == start
    env = environ(pid)
    if env is None or not allocation:
        return True
    return env.get("GPUPOOL_ALLOCATION") == allocation


# -- reading JupyterHub's records ----------------------------------------------------------------
def record(user: str, name: str, groups: Iterable[str], state: Any, pending: Any = None) -> Record:
    """One running server as JupyterHub keeps it, read the same way from its database and from
    its REST API: the spawner's saved ``state`` (:data:`STATE_KEY`, ``pid``, :data:`START_KEY`)
    and, for a local server, whether that pid is alive (``/proc``). A server whose start is in
    progress (``pending == "spawn"``) is its spawner's: unchecked."""
    value: Any = json.loads(state) if isinstance(state, str | bytes) else state
    value = value if isinstance(value, dict) else {}
    allocation = str(value.get(STATE_KEY) or "")
    pid = _int(value.get("pid"))
    pid = pid if pid is not None and pid > 0 else None
    start = _int(value.get(START_KEY))
    alive = None
    if pid is not None and pending != "spawn":
        alive = server_alive(pid, start, allocation)
    return Record(user, name or "", frozenset(groups), allocation, pid, alive)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_records(url: str) -> list[Record]:
    """JupyterHub's running servers (spawners with a server) from its database at ``url``,
    through JupyterHub's own ORM (:mod:`jupyterhub.orm`), read only: nothing is created,
    upgraded or written, and a database that does not exist yet, or has no tables yet, records
    none. Only the columns read are selected, so a database JupyterHub has yet to upgrade reads
    too."""
    if _missing_sqlite(url):
        return []
    # no statement cache: JupyterHub's JSONDict type cannot be cached (SQLAlchemy warns)
    base = create_engine(url)
    engine = base.execution_options(compiled_cache=None)
    try:
        tables = set(inspect(engine).get_table_names())
        if not {orm.User.__tablename__, orm.Spawner.__tablename__} <= tables:
            return []
        with Session(engine) as db:
            rows = db.execute(
                select(orm.User.id, orm.User.name, orm.Spawner.name, orm.Spawner.state)
                .join(orm.Spawner, orm.Spawner.user_id == orm.User.id)
                .where(orm.Spawner.server_id.is_not(None))
            ).all()
            groups: dict[int, set[str]] = defaultdict(set)
            if {orm.Group.__tablename__, orm.user_group_map.name} <= tables:
                for user_id, group in db.execute(
                    select(orm.User.id, orm.Group.name).join(orm.User.groups)
                ):
                    groups[user_id].add(group)
    finally:
        base.dispose()
    return [record(user, name, groups[user_id], state) for user_id, user, name, state in rows]


def _missing_sqlite(url: str) -> bool:
    """Whether ``url`` is a SQLite database that does not exist (opening it would create it)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return False
    path = parsed.database or ""
    if path in ("", ":memory:"):
        return True  # a fresh, empty database: no records
    return not path.startswith("file:") and not os.path.exists(path)


def _safe_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "(unparsable URL)"


class HubUnreadable(Exception):
    """JupyterHub's REST API could not be read (unreachable, refused, or an unexpected reply)."""


PAGINATION = "application/jupyterhub-pagination+json"
PAGE = 200
"""Users per page asked for (JupyterHub's default ``api_page_max_limit``)."""


async def fetch_users(api_url: str, token: str, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Every user with an active server (a server started, starting or stopping), as JupyterHub's
    REST API models them: ``GET {api_url}/users?state=active``, page by page. Raises
    :class:`HubUnreadable` if any page cannot be read: never a partial list."""
    users: list[dict[str, Any]] = []
    offset = 0
    while True:
        url = f"{api_url}/users?state=active&offset={offset}&limit={PAGE}"
        request = HTTPRequest(
            url,
            headers={"Authorization": f"token {token}", "Accept": PAGINATION},
            request_timeout=timeout,
            follow_redirects=False,
        )
        try:
            response = await AsyncHTTPClient().fetch(request)
            reply = json.loads(response.body)
        except (HTTPClientError, OSError, ValueError) as e:
            raise HubUnreadable(f"GET {url}: {e}") from e
        if isinstance(reply, list):  # a hub that does not page
            items, following = reply, None
        elif isinstance(reply, dict) and isinstance(reply.get("items"), list):
            items = reply["items"]
            following = (reply.get("_pagination") or {}).get("next")
        else:
            raise HubUnreadable(f"GET {url}: not a list of users")
        users += [u for u in items if isinstance(u, dict)]
        if not following:
            return users
        after = following.get("offset") if isinstance(following, dict) else None
        if not isinstance(after, int) or after <= offset:
            raise HubUnreadable(f"GET {url}: the next page is at offset {after!r}")
        offset = after


def rest_records(users: Iterable[Mapping[str, Any]]) -> list[Record]:
    """JupyterHub's running servers from its REST API's user models: each user's ``groups`` and
    active ``servers`` with their ``state`` (present only with ``admin:server_state``) and
    ``pending`` event."""
    records = []
    for user in users:
        name = user.get("name")
        servers = user.get("servers")
        if not isinstance(name, str) or not isinstance(servers, dict):
            continue
        groups = [g for g in user.get("groups") or () if isinstance(g, str)]
        for server_name, server in servers.items():
            if isinstance(server, dict) and not server.get("stopped"):
                state = server.get("state")
                records.append(record(name, server_name, groups, state, server.get("pending")))
    return records


# -- the hub's reconciler -------------------------------------------------------------------------
class Reconciler(LoggingConfigurable):
    """Runs the passes (see the module docstring) for one pool and JupyterHub database."""

    period = Float(
        60.0,
        config=True,
        help="""Seconds between reconciliation passes while the hub runs (0: only the pass at
        start). Example: ``c.Reconciler.period = 30``""",
    )
    stop_grace = Float(
        5.0,
        config=True,
        help="""Seconds a process stopped by reconciliation gets between SIGTERM and SIGKILL.
        Example: ``c.Reconciler.stop_grace = 10``""",
    )

    request_timeout = Float(
        10.0,
        config=True,
        help="""Seconds one call to JupyterHub's REST API may take. Example:
        ``c.Reconciler.request_timeout = 30``""",
    )
    holderless_grace = Float(
        60.0,
        config=True,
        help="""Seconds a notebook allocation may go without any holder (no live process claims
        it and JupyterHub records no server for it) before a pass releases it, while the hub
        runs. Example: ``c.Reconciler.holderless_grace = 120``""",
    )

    def __init__(
        self, pool: Pool, hub_db_url: str, api_url: str = "", token: str = "", **kwargs: Any
    ) -> None:
        """``hub_db_url``: JupyterHub's database (read at start); ``api_url``: its REST API
        (``http://127.0.0.1:8081/hub/api``) and ``token`` the :data:`SERVICE`'s, for the
        periodic passes (none without them)."""
        super().__init__(**kwargs)
        self.pool = pool
        self.hub_db_url = hub_db_url
        self.api_url = api_url.rstrip("/")
        self.token = token
        self._said: set[str] = set()
        """What the last pass reported (reported again only once it has been gone a pass)."""
        self._saying: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._warned: set[str] = set()
        """The one-time warnings given (no REST API; no servers' state)."""
        self.kept_jobs: set[str] = set()
        """Jobs found running at start when the pool database was lost: never stopped by a pass
        (an admin decides), reported once."""
        self._holderless: dict[str, float] = {}
        """When each allocation without a holder was first seen so (monotonic seconds)."""

    # -- observing ---------------------------------------------------------------------------
    def processes(self, records: Sequence[Record]) -> list[Proc]:
        """This hub's processes: those with its marker, and the live servers JupyterHub records
        (servers started before they carried the marker)."""
        procs = {p.pid: p for p in scan(self.pool.hub_marker)}
        for r in records:
            if r.alive and r.pid is not None and r.pid not in procs:
                found = read_process(r.pid)
                if found is not None and found.allocation == r.allocation:
                    procs[r.pid] = found
        return list(procs.values())

    async def read_hub(self) -> list[dict[str, Any]] | None:
        """The users with active servers, from JupyterHub's REST API as :data:`SERVICE`; ``None``
        (logged) when it cannot be read: never taken for "no servers"."""
        if not self.api_url:
            self._warn_once(
                "no-api",
                "gpupool: reconciliation while the hub runs is off: no URL of JupyterHub's REST "
                "API was given (Reconciler api_url); only the pass at start runs",
            )
            return None
        try:
            users = await fetch_users(self.api_url, self.token, self.request_timeout)
        except HubUnreadable as e:
            metrics.RECONCILE_FAILURES.inc()
            self.log.warning(
                "gpupool: a reconciliation pass was skipped: JupyterHub's REST API could not "
                "be read (%s); nothing is released or stopped until it can be",
                e,
            )
            return None
        servers = [s for u in users for s in (u.get("servers") or {}).values()]
        if any(isinstance(s, dict) and "state" not in s for s in servers):
            self._warn_once(
                "no-state",
                f"gpupool: JupyterHub's REST API gives the {SERVICE} service no servers' state "
                "(it needs the admin:server_state scope): dead servers' allocations are not "
                "released while the hub runs",
            )
        return users

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message)

    def on_devices(self, procs: list[Proc]) -> list[Proc]:
        """``procs`` with the devices NVML finds each on."""
        ours = {p.pid for p in procs}
        found: dict[int, list[str]] = defaultdict(list)
        monitor = self.pool.monitor
        for node in self.pool.inventory.nodes:
            if not monitor.can_read(node.name):
                continue
            uuids = [g.uuid for g in node.gpus if not g.instances]
            uuids += [i.uuid for g in node.gpus for i in g.instances if i.uuid]
            for uuid, sample in monitor.sample(node.name, uuids).items():
                for pid in sample.pids:
                    if pid in ours:
                        found[pid].append(uuid)
        return [replace(p, on_devices=tuple(found[p.pid])) if p.pid in found else p for p in procs]

    def known_jobs(self, procs: list[Proc]) -> set[str]:
        """The job ids the job store knows (read only when a job's process is found)."""
        if not any(p.job for p in procs):
            return set()
        return {j.id for j in self.pool.store.load_jobs()}

    # -- the passes ----------------------------------------------------------------------------
    def at_start(self) -> list[Action]:
        """The pass at hub start, before JupyterHub serves anything: synchronous, and it
        returns once what it stopped is gone."""
        began = time.perf_counter()
        self._said, self._saying = self._saying, set()
        try:
            records = read_records(self.hub_db_url)
            procs = self.on_devices(self.processes(records))
            jobs = self.known_jobs(procs)

            def decide(ledger: Ledger) -> tuple[list[Record], list[Action]]:
                lost = lost_database(ledger, records)
                keep = bool(lost) and not jobs
                return lost, plan(
                    ledger, records, procs, jobs, at_start=True, keep_unknown_jobs=keep
                )

            lost, actions = cast(tuple[list[Record], list[Action]], self.pool.deciding(decide))
            if lost:
                self._lost_database(lost)
                self.kept_jobs = {p.job for p in procs if p.job and p.job not in jobs}
            self._stop_now([p for a in actions for p in a.stop])
            refused = self._carry_out(actions)
            for a in refused:  # devices taken since the decision: cannot happen at start
                self.log.error("gpupool: could not adopt %s after all; stopping it", a.message)
                self._stop_now(list(a.claim))
                metrics.RECONCILE_ACTIONS.labels(action="stopped").inc()
        except Exception:
            metrics.RECONCILE_FAILURES.inc()
            raise
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - began)
        return actions

    async def periodic(self) -> list[Action]:
        """One pass while the hub runs: JupyterHub's records from its REST API (the pass is
        skipped, logged, when it cannot be read), ``/proc`` read in a worker thread, NVML and
        the decision in the event loop, the decision under the pool's lock; what it stops gets
        ``stop_grace`` seconds without blocking the loop."""
        began = time.perf_counter()
        users = await self.read_hub()
        if users is None:
            return []
        self._said, self._saying = self._saying, set()

        def look() -> tuple[list[Record], list[Proc]]:
            records = rest_records(users)
            return records, self.processes(records)

        records, procs = await asyncio.to_thread(look)
        procs = self.on_devices(procs)
        jobs = self.known_jobs(procs) | self.kept_jobs

        def decide(ledger: Ledger) -> list[Action]:
            now = time.monotonic()
            alone = holderless(ledger, records, procs)
            self._holderless = {a: self._holderless.get(a, now) for a in alone}
            return plan(
                ledger,
                records,
                procs,
                jobs,
                at_start=False,
                holderless_since=self._holderless,
                now=now,
                grace=self.holderless_grace,
            )

        actions = cast(list[Action], self.pool.deciding(decide))
        await self._stop_soon([p for a in actions for p in a.stop])
        self._carry_out(actions)
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - began)
        return actions

    def start(self) -> None:
        """Run :meth:`periodic` every ``period`` seconds in the running event loop."""
        if self.period > 0:
            self._task = asyncio.get_running_loop().create_task(self._loop())
            _background.add(self._task)
            self._task.add_done_callback(_background.discard)

    def shutting_down(self) -> None:
        """The hub is going away (its servers are being stopped): no more passes."""
        if self._task:
            self._task.cancel()

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                await self.periodic()
            except SQLAlchemyError as e:  # e.g. the job store's SQLite busy: the next pass will do
                metrics.RECONCILE_FAILURES.inc()
                self.log.warning("gpupool: a reconciliation pass could not read a database: %s", e)
            except Exception:
                metrics.RECONCILE_FAILURES.inc()
                self.log.exception("gpupool: a reconciliation pass failed")

    # -- acting --------------------------------------------------------------------------------
    def _carry_out(self, actions: list[Action]) -> list[Action]:
        """Log, count, release, then adopt (what is to be stopped is stopped already);
        returns the adoptions the ledger refused."""
        for a in actions:
            if a.adopt is not None:
                continue
            if a.action == "reported" and not self._first_time(a.message):
                continue
            self.log.log(a.level, "gpupool: %s", a.message)
            metrics.RECONCILE_ACTIONS.labels(action=a.action).inc()
            if a.release:
                with contextlib.suppress(UnknownAllocation):
                    self.pool.release(a.release)
        adoptions = [a for a in actions if a.adopt is not None]
        if not adoptions:
            return []
        adopted = {x.id for x in self.pool.adopt(a.adopt for a in adoptions if a.adopt)}
        refused = []
        for a in adoptions:
            if a.adopt is not None and a.adopt.id in adopted:
                self.log.log(a.level, "gpupool: %s", a.message)
                metrics.RECONCILE_ACTIONS.labels(action="adopted").inc()
            else:
                refused.append(a)
        return refused

    def _first_time(self, message: str) -> bool:
        """Whether ``message`` is news: not reported by the last pass as well."""
        self._saying.add(message)
        return message not in self._said

    def _targets(self, procs: list[Proc]) -> list[Proc]:
        """The processes that may be signalled: never root, pid 1 or the hub's own group."""
        hub = {os.getpid(), os.getpgrp()}
        ok = []
        for p in procs:
            if p.uid == 0 or p.pid == 1 or p.pid in hub or p.pgid in hub:
                message = (
                    f"process {p.pid} was not stopped: it runs as root or in the hub's process "
                    "group (user code never does)"
                )
                if self._first_time(message):
                    self.log.error("gpupool: %s", message)
                continue
            ok.append(p)
        return ok

    def _signal(self, procs: list[Proc], sig: signal.Signals) -> None:
        """``sig`` to each process's group when the group's leader is one of them (and still
        the same process), else to the process alone."""
        leaders = {p.pid: p for p in procs}
        groups: set[int] = set()
        for p in procs:
            if not same(p):
                continue
            leader = leaders.get(p.pgid)
            try:
                if leader is not None and same(leader):
                    if p.pgid not in groups:
                        groups.add(p.pgid)
                        os.killpg(p.pgid, sig)
                else:
                    os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
            except PermissionError:
                self.log.error("gpupool: not allowed to signal process %d (%s)", p.pid, sig.name)

    def _stop_now(self, procs: list[Proc]) -> None:
        procs = self._targets(procs)
        if not procs:
            return
        self._signal(procs, signal.SIGTERM)
        if _wait_gone(procs, self.stop_grace):
            return
        self._signal(procs, signal.SIGKILL)
        if not _wait_gone(procs, 10):
            left = ", ".join(str(p.pid) for p in procs if same(p))
            self.log.error("gpupool: processes %s survived SIGKILL for 10 s", left)

    async def _stop_soon(self, procs: list[Proc]) -> None:
        procs = self._targets(procs)
        if not procs:
            return
        self._signal(procs, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace
        while any(same(p) for p in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if any(same(p) for p in procs):
            self._signal(procs, signal.SIGKILL)

    def _lost_database(self, lost: list[Record]) -> None:
        self.log.error(
            "gpupool: the pool database %s holds no allocation, but JupyterHub's database %s "
            "records %d running server(s) holding one (%s): the pool database was deleted or "
            "emptied, and is not taken for an empty pool: each server is taken back where "
            "what it runs with is consistent, or else stopped, before anything is handed out; "
            "the history of jobs is gone, and jobs found running are left running (listed next)",
            self.pool.store.engine.url.render_as_string(hide_password=True),
            _safe_url(self.hub_db_url),
            len(lost),
            ", ".join(r.ref for r in lost),
        )
        metrics.RECONCILE_ACTIONS.labels(action="reported").inc()


def _wait_gone(procs: Sequence[Proc], timeout: float) -> bool:
    """Wait until none of ``procs`` is alive (a zombie is not); ``False`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(same(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
