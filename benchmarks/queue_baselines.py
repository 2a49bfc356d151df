"""The queueing replay's baseline policies: strict FIFO, Kueue's BestEffortFIFO, EASY backfill.

Vocabulary
- *job*: a :class:`Job` waiting for one gang of ``count`` units of ``offer`` on one node (the
  replay's pods are single-node: a multi-GPU pod is one ledger request), with a ``limit`` (its time
  limit: how long it may run once started).
- *live*: a started job as the baselines see it (:class:`Live`): its allocation id and the time its
  limit ends.
- *fits*: :meth:`Ledger.allocate` grants the job's request (placement by the ledger's policy, the
  replay uses best-fit); a gang is one request, so it is granted whole or not at all.
- *head*: the first job in arrival order that does not fit now.
- *shadow time*: when the head would fit if every live job ended at its limit: live jobs are
  released from a copy of the ledger in order of limit end until the head fits there.

Contract: each policy is one *pass* ``policy(ledger, queue, live, now) -> started ids``: it
allocates the jobs it starts on ``ledger`` (allocation id ``<job id>#0``), in the order returned,
and changes nothing else; ``queue`` is in arrival order. None of them calls gpupool's queue
(:mod:`gpupool.core.queue`); exact definitions are in benchmarks/README.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gpupool.core.errors import PoolError
from gpupool.core.ledger import Ledger
from gpupool.core.offers import Request


@dataclass(frozen=True)
class Job:
    id: str
    team: str
    offer: str
    count: int
    arrival: float
    limit: float


@dataclass(frozen=True)
class Live:
    id: str
    allocation: str
    limit_end: float


Pass = Callable[[Ledger, Sequence[Job], Sequence[Live], float], list[str]]


def allocation_id(job_id: str) -> str:
    return f"{job_id}#0"


def request_of(job: Job) -> Request:
    return Request(job.id, job.team, job.offer, job.count, "job", job.id)


def start(ledger: Ledger, job: Job, alloc_id: str = "") -> bool:
    """Allocate ``job`` on ``ledger``; False (ledger unchanged) when it does not fit."""
    try:
        ledger.allocate(request_of(job), alloc_id or allocation_id(job.id))
    except PoolError:
        return False
    return True


def fits(ledger: Ledger, job: Job) -> bool:
    """Whether ``job`` fits on ``ledger`` now (``ledger`` is left as it was)."""
    probe = f"?{job.id}"
    if not start(ledger, job, probe):
        return False
    ledger.release(probe)
    return True


def fifo(ledger: Ledger, queue: Sequence[Job], live: Sequence[Live], now: float) -> list[str]:
    """Strict FIFO: start jobs in arrival order until the first that does not fit."""
    started = []
    for job in queue:
        if not start(ledger, job):
            break
        started.append(job.id)
    return started


def best_effort_fifo(
    ledger: Ledger, queue: Sequence[Job], live: Sequence[Live], now: float
) -> list[str]:
    """Kueue's BestEffortFIFO: every job in arrival order is tried; one that does not fit is
    skipped and does not block the jobs behind it."""
    return [job.id for job in queue if start(ledger, job)]


def shadow_time(ledger: Ledger, head: Job, live: Sequence[Live], now: float) -> float:
    """When ``head`` fits if live jobs end at their limits (``now`` if it fits now, ``inf`` if it
    never fits on this pool)."""
    trial = ledger.clone()
    if fits(trial, head):
        return now
    for job in sorted(live, key=lambda j: j.limit_end):
        if job.allocation in trial.allocations:
            trial.release(job.allocation)
        if fits(trial, head):
            return job.limit_end
    return float("inf")


def head_fits_at(ledger: Ledger, head: Job, live: Sequence[Live], at: float) -> bool:
    """Whether ``head`` fits on ``ledger`` once the live jobs whose limits end by ``at`` are
    gone."""
    trial = ledger.clone()
    for job in live:
        if job.limit_end <= at and job.allocation in trial.allocations:
            trial.release(job.allocation)
    return fits(trial, head)


def easy_backfill(
    ledger: Ledger, queue: Sequence[Job], live: Sequence[Live], now: float
) -> list[str]:
    """Slurm-style EASY backfill: FIFO until the head; the head gets a reservation at its shadow
    time; a later job starts if it fits now and either its limit ends by the shadow time or,
    placed where it lands now, the head still fits at the shadow time."""
    started: list[str] = []
    running = list(live)
    head: Job | None = None
    shadow = float("inf")
    for job in queue:
        if head is None:
            if start(ledger, job):
                started.append(job.id)
                running.append(Live(job.id, allocation_id(job.id), now + job.limit))
                continue
            head, shadow = job, shadow_time(ledger, job, running, now)
            continue
        if not start(ledger, job):
            continue
        ends = now + job.limit
        if ends <= shadow or head_fits_at(ledger, head, running, shadow):
            started.append(job.id)
            running.append(Live(job.id, allocation_id(job.id), ends))
        else:
            ledger.release(allocation_id(job.id))
    return started


BASELINES: dict[str, Pass] = {
    "fifo": fifo,
    "kueue-besteffort": best_effort_fifo,
    "easy-backfill": easy_backfill,
}
