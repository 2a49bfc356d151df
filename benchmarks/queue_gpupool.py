"""gpupool's real queue as the replay drives it: :func:`gpupool.core.queue.schedule`, its plan
carried out as :meth:`gpupool.jobs.manager.JobManager.schedule_pass` does, and a watch that counts
how each gang fares (see :mod:`benchmarks.queue`).

Contract: a *step* ``(ledger, queue, running, now) -> (started ids, preempted ids)`` allocates the
jobs it starts and releases the jobs it preempts on ``ledger``; the caller moves them between its
queue and its running jobs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.queue_jobs import SimJob, Started
from gpupool.core.errors import PoolError
from gpupool.core.ledger import Ledger
from gpupool.core.queue import Plan, Queued, Running, order, schedule

StepResult = tuple[list[str], list[str]]
Step = Callable[[Ledger, dict[str, SimJob], dict[str, Started], float], StepResult]


Watch = Callable[[Ledger, list[Queued], Plan], None]


def gpupool_step(
    ledger: Ledger,
    queue: dict[str, SimJob],
    running: dict[str, Started],
    now: float,
    watch: Watch | None = None,
    reserve_after: float = float("inf"),
) -> StepResult:
    """gpupool's pass as :meth:`gpupool.jobs.manager.JobManager.schedule_pass` does it: plan
    with :func:`schedule`, release the preempted jobs (requeued by the caller), then grant each
    planned job still queued node by node with :meth:`Queued.request` (all or nothing);
    ``reserve_after`` as ``JobManager.reserve_after``.
    ``watch`` sees the ledger, the queue and the plan before the plan is carried out."""
    queued = [as_queued(j) for j in queue.values()]
    live = [as_running(s) for s in running.values()]
    plan = schedule(ledger, queued, live, now, reserve_after=reserve_after)
    if watch is not None:
        watch(ledger, queued, plan)
    for job_id in plan.preempt:
        for alloc_id in running[job_id].allocations:
            ledger.release(alloc_id)
    granted = []
    for job_id in plan.start:
        keep_off = plan.keep_off.get(job_id, frozenset())
        if job_id in queue and grant(ledger, as_queued(queue[job_id]), keep_off):
            granted.append(job_id)
    return granted, list(plan.preempt)


def as_running(s: Started) -> Running:
    job = s.job
    return Running(job.id, job.team, s.allocations, s.start + job.limit, s.start, job.id, job.count)


def as_queued(job: SimJob) -> Queued:
    return Queued(job.id, job.id, job.team, job.offer, job.count, 1, 0, job.arrival, job.limit)


def grant(ledger: Ledger, q: Queued, keep_off: frozenset[str] = frozenset()) -> bool:
    """The manager's ``_grant``: each node's request in turn (off the nodes the plan keeps it
    off), all released if one fails."""
    taken: list[str] = []
    held: list[str | None] = []
    try:
        for i in range(q.nodes):
            a = ledger.allocate(q.request(held, keep_off), f"{q.id}#{i}")
            taken.append(a.id)
            held.append(a.node)
    except PoolError:
        for alloc_id in taken:
            ledger.release(alloc_id)
        return False
    return True


@dataclass
class HeadCounts:
    """For one gang: passes it waited through, passes it was the plan's head, and jobs the
    queue ordered ahead of it that started in those passes."""

    queued: int = 0
    head: int = 0
    overtaken: int = 0


def watch_gangs(counts: dict[str, HeadCounts]) -> Watch:
    """A ``watch`` for :func:`gpupool_step` that fills ``counts`` for the jobs named in it."""

    def watch(ledger: Ledger, queued: list[Queued], plan: Plan) -> None:
        place = {q.id: i for i, q in enumerate(order(ledger, queued))}
        for job_id, c in counts.items():
            if job_id not in place:
                continue
            c.queued += 1
            c.head += plan.head == job_id
            c.overtaken += sum(place[s] < place[job_id] for s in plan.start)

    return watch
