"""Reconciliation's decision, pure: the ledger, JupyterHub's records of running servers and this
hub's processes in, the actions out (:func:`plan`). Reading them and carrying the actions out is
:mod:`gpupool.hub.reconcile`'s; the rules, and why, are in docs/architecture.md
("Reconciliation").

Vocabulary
- *record* (:class:`Record`): JupyterHub's record of an active server: user, name, the user's
  groups, the allocation its spawner's state names, and for a local server its pid and whether
  that is the very process (``alive``; ``None``: unchecked, not a local process or a start in
  progress).
- *process* (:class:`Proc`): a live process of this hub and what it *claims*:
  ``GPUPOOL_ALLOCATION`` (a server and its kernels) or ``GPUPOOL_JOB`` (a job's ranks), the
  devices of its ``CUDA_VISIBLE_DEVICES`` and those NVML finds it on.
- *action* (:class:`Action`): ``released`` (an allocation without a live holder), ``stopped``
  (processes holding devices without an allocation), ``adopted`` (a live server's allocation the
  ledger had lost) or ``reported`` (left alone, for an admin).

Contract: nothing here reads or changes anything outside its arguments: ``plan`` works on a clone
of the ledger when it checks adoptions, and the caller decides under the pool's lock.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpupool.core.errors import PoolError
from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Allocation, Device, Ledger
from gpupool.core.quota import check_offer, resolve_team


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
    """One live process of this hub and what it claims."""

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
    """What to do, by the rules (docs/architecture.md, "Reconciliation", has them whole):

    1. a notebook allocation a dead record names is released, what still claims it stopped;
    2. one no record names: at start released (its processes stopped first); while the hub
       runs only after ``grace`` seconds without any holder (``holderless_since``, ``now``);
    3. processes claiming an allocation the ledger does not know are stopped, or at start
       adopted when the record, offer, team and devices agree;
    4. ranks of a job the job store does not know (``jobs``) are stopped, or reported when the
       pool database was lost (``keep_unknown_jobs``);
    5. a process of this hub holding devices with no claim is stopped;
    6. at start, a record naming an allocation that cannot be checked here is reported.
    """
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
