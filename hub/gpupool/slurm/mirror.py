"""The ledger mirrors what Slurm granted: each answered ``squeue`` snapshot, compared both ways.

Vocabulary
- *this hub's job*: a Slurm job whose tag (``--comment``, :mod:`gpupool.slurm.names`) carries
  this hub's marker, names an allocation (``server``) or gpupool job (``job``) the ledger holds,
  and runs as that allocation's user. A tag that fails any of these is a user's edit or another
  hub's: the job is someone else's.
- *read back*: a running job of this hub holds, per node, the gres indices ``gres_detail`` names;
  a whole-GPU allocation is re-keyed to those GPUs (the ledger decided node and count, Slurm the
  device; :func:`gpupool.readback.plan_readback` moves any allocation the ledger had put
  there onto the GPUs vacated). MIG instances and shards are of one kind per node and cost the
  same whichever index: not re-keyed.
- *outside use*: every other running job's GPU gres indices on the pool's nodes close those
  devices (a whole GPU, or a fixed MIG instance) and its shards take their memory from the GPU:
  admission then says "wait", with "used outside gpupool". Users see no more than that (another
  user's job is theirs); the log and the admin page name the Slurm job.
- *orphan*: a tagged job of this hub (marker) whose allocation or gpupool job the ledger no
  longer holds: cancelled (its holder stopped or was released while the controller was away).

Contract: :func:`plan` is pure (snapshot and ledger in, decisions out); :class:`SlurmMirror`
applies each answered snapshot under the pool's lock, and never acts on an unknown one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpupool.core.ledger import Allocation, Ledger
from gpupool.pool import Pool
from gpupool.readback import Seen, apply_readback, plan_readback
from gpupool.slurm.commands import SlurmCommands, SlurmUnavailable
from gpupool.slurm.inventory import SHARD_RESOURCE, gpu_name
from gpupool.slurm.names import parse_tag
from gpupool.slurm.parse import SlurmJob
from gpupool.slurm.poller import Snapshot

log = logging.getLogger("gpupool")
PUBLIC = "{device} is used outside gpupool"
HOLDING = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "CONFIGURING", "STOPPED"})
"""Job states in which Slurm holds the job's gres."""


@dataclass
class Plan:
    readback: dict[str, list[Seen]] = field(default_factory=dict)
    """Allocation id → the whole GPUs Slurm gave it (by gres index)."""
    outside: dict[str, str] = field(default_factory=dict)
    """Device → why, naming the Slurm job (admins and the log)."""
    outside_shares: dict[str, tuple[int, str]] = field(default_factory=dict)
    """GPU → (MiB, why) held by other jobs' shards."""
    orphans: list[SlurmJob] = field(default_factory=list)
    held: dict[int, list[str]] = field(default_factory=dict)
    """This hub's Slurm jobs → the allocation ids they hold."""


def owned(job: SlurmJob, ledger: Ledger, marker: str) -> list[Allocation] | None:
    """The allocations a job of this hub holds; ``[]`` for an orphan of this hub; ``None`` when
    the job is not this hub's (see the module's vocabulary)."""
    tag = parse_tag(job.comment)
    if tag is None or tag.marker != marker:
        return None
    if tag.kind == "server":
        found = [a for a in (ledger.allocations.get(tag.id),) if a is not None]
    else:
        found = [a for a in ledger.allocations.values() if a.kind == "job" and a.ref == tag.id]
    if any(a.user != job.user for a in found):
        return None  # a user's own edit of the tag claims someone else's allocation
    return found


def plan(jobs: Iterable[SlurmJob], ledger: Ledger, marker: str) -> Plan:
    out = Plan()
    gpus = {g.uuid: g for g in ledger.inventory.gpus}
    devices = set(gpus) | {i.uuid for g in gpus.values() for i in g.instances if i.uuid}
    for job in jobs:
        mine = owned(job, ledger, marker)
        if mine == [] and not job.ended:
            out.orphans.append(job)
            continue
        if job.state not in HOLDING:
            continue
        if mine:
            out.held[job.job_id] = [a.id for a in mine]
            for a in mine:
                node = a.node or ""
                whole = [
                    Seen(i, gpu_name(node, i))
                    for g in job.gpu_indices(node)
                    if g.name == "gpu"
                    for i in g.indices
                    if gpu_name(node, i) in gpus
                ]
                if whole:
                    out.readback[a.id] = whole
            continue
        for node, held in zip(job.nodes, job.gres, strict=False):
            for g in held:
                why = f"Slurm job {job.job_id} ({job.name}) of {job.user} on {node}"
                if g.name == "gpu":
                    for i in g.indices:
                        device = gpu_name(node, i)
                        if device in devices:
                            out.outside[device] = f"{device} is used by {why}"
                elif g.name == SHARD_RESOURCE:
                    for i in g.indices:
                        gpu = gpus.get(gpu_name(node, i))
                        if gpu is None or not gpu.share_slots:
                            continue
                        # the count is the job's on this node; spread over its GPUs by Slurm
                        per = max(1, g.count // max(1, len(g.indices)))
                        mib = gpu.memory_mib * per // gpu.share_slots
                        before = out.outside_shares.get(gpu.uuid, (0, ""))[0]
                        out.outside_shares[gpu.uuid] = (before + mib, f"{gpu.uuid}: {why}")
    return out


def _plan_readback(ledger: Ledger, alloc_id: str, seen: list[Seen]) -> list[Allocation]:
    return plan_readback(ledger, alloc_id, seen)


def public(detail: Mapping[str, str]) -> dict[str, str]:
    return {device: PUBLIC.format(device=device) for device in detail}


class SlurmMirror:
    """Applies each answered snapshot of the shared poller to the pool (see the module)."""

    def __init__(self, pool: Pool, commands: SlurmCommands, logger: logging.Logger = log) -> None:
        self.pool = pool
        self.commands = commands
        self.log = logger
        self.detail: dict[str, str] = {}
        """Device → why, naming the Slurm job: for the admin page and the log."""
        self.cancelled: set[int] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        """Nothing of its own to run: it listens to the poller (see :meth:`apply`)."""

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))

    def apply(self, snapshot: Snapshot) -> Plan:
        marker = self.pool.hub_marker
        decided: Plan = self.pool.deciding(
            lambda ledger: plan(snapshot.jobs.values(), ledger, marker)
        )
        self._read_back(decided)
        self._outside(decided)
        for job in decided.orphans:
            if job.job_id not in self.cancelled:
                self.cancelled.add(job.job_id)
                self.log.warning(
                    "gpupool: Slurm job %s (%s of %s) holds nothing of this hub's any more; "
                    "cancelling it",
                    job.job_id,
                    job.name,
                    job.user,
                )
                self._spawn(self._cancel(job.job_id))
        return decided

    def _read_back(self, decided: Plan) -> None:
        for alloc_id, seen in sorted(decided.readback.items()):
            before = self.pool.ledger.allocations.get(alloc_id)
            moves: list[Allocation] = self.pool.deciding(
                functools.partial(_plan_readback, alloc_id=alloc_id, seen=seen)
            )
            if not moves or before is None:
                continue
            if apply_readback(self.pool, moves):
                after = self.pool.ledger.allocations[alloc_id]
                self.log.info(
                    "gpupool: allocation %s holds %s on %s (Slurm's gres_detail); the ledger "
                    "had %s",
                    alloc_id,
                    after.visible_devices,
                    after.node,
                    before.visible_devices,
                )

    def _outside(self, decided: Plan) -> None:
        for device, why in sorted(decided.outside.items()):
            if self.detail.get(device) != why:
                self.log.info("gpupool: outside use: %s", why)
        self.detail = dict(decided.outside)
        reasons = public(decided.outside)
        if reasons != self.pool.ledger.outside:
            self.pool.set_outside_use(reasons)
        shares = decided.outside_shares
        before = self.pool.deciding(lambda ledger: dict(ledger.outside_shares))
        if shares != before:
            self.pool.deciding(lambda ledger: ledger.set_outside_shares(shares))
            if any(u not in shares or shares[u][0] < m for u, (m, _) in before.items()):
                for listener in self.pool.on_inventory:
                    listener()

    async def _cancel(self, job_id: int) -> None:
        try:
            await self.commands.scancel(job_id)
        except SlurmUnavailable as e:
            self.cancelled.discard(job_id)  # tried again on the next snapshot
            self.log.warning("gpupool: could not cancel Slurm job %s: %s", job_id, e.message)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            coro.close()
            return
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
