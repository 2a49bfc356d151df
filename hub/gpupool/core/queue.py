"""The job queue's decisions: which queued jobs start now and which running jobs yield.

Vocabulary
- *gang*: a job's ``nodes`` requests of ``gpus`` each are granted all together or not at all; a
  queued job holds nothing.
- *order*: within a team, priority (higher first), then submission time; across teams, team
  fair share (the team furthest below its guarantee first: the smallest used / guarantee), then
  *place time*: the latest submission time among a job and its team's jobs ordered before it.
  A job's place is never earlier than its own submission, so priority orders only a team's own
  jobs and never moves one ahead of another team's job (it can cost the team places, not gain).
- *head*: the first job in order that cannot start. Its *shadow time* is the earliest moment it
  could start if the running jobs end at their time limits (never, if notebooks or quotas keep it
  out).
- *reserved nodes*: the nodes the head would be placed on at its shadow time.
- *backfill*: a later job may start ahead of the head only if it cannot delay it: it ends (by its
  time limit) before the shadow time, or the head still fits at the shadow time with it and
  every earlier start that outlasts the shadow time running (:class:`AtShadow`).
  It is placed off the reserved nodes when it fits there (*keep-off*), and the grant places it
  the same way, so small jobs flow around a big gang's reservation instead of being refused
  because the placement policy would have put them on its nodes.
- *starving*: a job queued for at least ``reserve_after`` seconds. The oldest starving job is
  considered before the fair-share order: while it cannot start it is the head, and every other
  job is backfill against its reservation. Otherwise the head is the first blocked job in
  fair-share order, which changes as the teams' shares move, so a big gang is overtaken by the
  small jobs of teams ordered before it without bound (benchmarks/README.md, the queue replay).
  While a job starves the queue preempts nothing: the reservation is how the oldest job gets
  its GPUs, and a preempted job keeps its submission time, so it would soon be the oldest and
  preempt in turn (the replay lost 5-9% of GPU-time to such restarts).
- *limits*: what bounds jobs that cost no GPU-equivalents (:class:`Limits`): the ranks the
  machine runs at once (all jobs), and per user the CPU-only jobs and their ranks running at
  once. A job over a limit waits with the limit named, and does not block the jobs behind it.
- *scale-up*: what a declared autoscaled node pool should add for the queue: for each node pool,
  the first job in order that waits only for new nodes of it (admission cause ``scale-up``)
  and how many nodes that job needs from it (:func:`scale_ups`; the backend turns that into
  pending pods the cluster's autoscaler acts on).
- *preemption*: a head whose team is within its guarantee may take back capacity from running
  jobs of teams above their guarantee (borrowing), newest first, as few as it needs. Notebooks
  are never preempted.

Contract: pure. :func:`schedule` plans on a clone of the ledger and returns what to do; the caller
does it (allocations for real, in the returned order) and may re-plan at any time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpupool.core.admission import Usage, admit
from gpupool.core.errors import PoolError
from gpupool.core.ledger import Ledger
from gpupool.core.offers import Request


@dataclass(frozen=True)
class Queued:
    id: str
    user: str
    team: str
    offer: str
    gpus: int
    nodes: int
    priority: int
    created: float
    time_limit: float
    cpu: bool = False
    procs: int = 0
    """Processes per node when they are not ``gpus`` (a CPU-only job asks for 1 ``cpu``)."""
    distinct: bool = False
    """Whether each of the job's nodes must be a different machine (the backend says so)."""

    @property
    def ranks(self) -> int:
        return (self.procs or self.gpus) * self.nodes

    def requests(self) -> list[Request]:
        return [Request(self.user, self.team, self.offer, self.gpus, "job", self.id)] * self.nodes

    def request(
        self, held: Iterable[str | None], keep_off: frozenset[str] = frozenset()
    ) -> Request:
        """The request for the job's next node, given the machines its granted nodes are on and
        the nodes the plan keeps it off (:attr:`Plan.keep_off`): the one rule for the queue's
        plan and the job manager's grant alike."""
        avoid = frozenset(n for n in held if n) if self.distinct else frozenset()
        return Request(
            self.user, self.team, self.offer, self.gpus, "job", self.id, avoid | keep_off
        )


@dataclass(frozen=True)
class Running:
    id: str
    team: str
    allocations: tuple[str, ...]
    ends_at: float
    started: float
    user: str = ""
    ranks: int = 0
    cpu: bool = False


@dataclass(frozen=True)
class Limits:
    """Bounds on load that quotas do not see (``None``: no bound)."""

    ranks: int | None = None
    """Ranks running at once on the machine, over all jobs (``LocalJobBackend.max_ranks``)."""
    user_cpu_jobs: int | None = None
    """CPU-only jobs one user runs at once (``JobManager.max_cpu_jobs_per_user``)."""
    user_cpu_ranks: int | None = None
    """Ranks of one user's CPU-only jobs at once (``JobManager.max_cpu_ranks_per_user``)."""


@dataclass
class Load:
    """What runs now, as :class:`Limits` count it."""

    ranks: int = 0
    cpu_jobs: dict[str, int] = field(default_factory=dict)
    cpu_ranks: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, running: Iterable[Running]) -> Load:
        load = cls()
        for r in running:
            load.add(r.user, r.ranks, r.cpu)
        return load

    def add(self, user: str, ranks: int, cpu: bool, sign: int = 1) -> None:
        self.ranks += sign * ranks
        if cpu:
            self.cpu_jobs[user] = self.cpu_jobs.get(user, 0) + sign
            self.cpu_ranks[user] = self.cpu_ranks.get(user, 0) + sign * ranks

    def over(self, job: Queued, limits: Limits) -> str:
        """Why starting ``job`` now would break a limit ('' if it would not)."""
        if limits.ranks is not None and self.ranks + job.ranks > limits.ranks:
            return (
                f"waiting for CPUs: this machine runs at most {limits.ranks} ranks at once "
                f"(LocalJobBackend.max_ranks) and {self.ranks} are running"
            )
        if not job.cpu:
            return ""
        jobs, ranks = self.cpu_jobs.get(job.user, 0), self.cpu_ranks.get(job.user, 0)
        if limits.user_cpu_jobs is not None and jobs + 1 > limits.user_cpu_jobs:
            return (
                f"waiting: you run {jobs} CPU-only jobs, the most at once "
                f"(JobManager.max_cpu_jobs_per_user = {limits.user_cpu_jobs})"
            )
        if limits.user_cpu_ranks is not None and ranks + job.ranks > limits.user_cpu_ranks:
            return (
                f"waiting: your CPU-only jobs run {ranks} ranks; this one would exceed "
                f"JobManager.max_cpu_ranks_per_user = {limits.user_cpu_ranks}"
            )
        return ""


@dataclass
class Plan:
    start: list[str] = field(default_factory=list)
    preempt: list[str] = field(default_factory=list)
    head: str | None = None
    shadow: float = float("inf")
    waiting: dict[str, str] = field(default_factory=dict)
    """Why each job that stays queued waits, in words."""
    reserved: frozenset[str] = frozenset()
    """The head's reserved nodes (see *reserved nodes*)."""
    keep_off: dict[str, frozenset[str]] = field(default_factory=dict)
    """The nodes a started job must be granted off (pass to :meth:`Queued.request`)."""


def fair_share(ledger: Ledger, team: str) -> float:
    """Used over guarantee: smaller means further below its guarantee (served first)."""
    guarantee = ledger.team(team).guarantee_milli
    return ledger.team_used[team] / guarantee if guarantee else float("inf")


def team_order(jobs: Iterable[Queued]) -> list[Queued]:
    """One team's own jobs in order: priority (higher first), then submission time."""
    return sorted(jobs, key=lambda q: (-q.priority, q.created, q.id))


def order(ledger: Ledger, queued: Iterable[Queued]) -> list[Queued]:
    """The queue's order (see *order* above): fair share, then place time, across teams."""
    teams: dict[str, list[Queued]] = {}
    for job in queued:
        teams.setdefault(job.team, []).append(job)
    keyed: list[tuple[tuple[float, float, str, int], Queued]] = []
    for team, jobs in teams.items():
        share, place = fair_share(ledger, team), float("-inf")
        for rank, job in enumerate(team_order(jobs)):
            place = max(place, job.created)  # never earlier than a job of the team it passed
            keyed.append(((share, place, team, rank), job))
    return [job for _, job in sorted(keyed, key=lambda kj: kj[0])]


def serving_order(
    ledger: Ledger, queued: Iterable[Queued], now: float, reserve_after: float = float("inf")
) -> list[Queued]:
    """The order a pass considers jobs in: :func:`order`, with the oldest *starving* job first
    (the queue positions users see are this order)."""
    ordered = order(ledger, queued)
    starving = oldest_starving(ordered, now, reserve_after)
    if starving is None:
        return ordered
    return [starving, *(q for q in ordered if q is not starving)]


def oldest_starving(ordered: Sequence[Queued], now: float, reserve_after: float) -> Queued | None:
    """The oldest job queued for at least ``reserve_after`` seconds (see *starving*)."""
    starving = [q for q in ordered if now - q.created >= reserve_after]
    return min(starving, key=lambda q: (q.created, q.id)) if starving else None


def try_gang(
    ledger: Ledger,
    job: Queued,
    tag: str = "",
    explain: bool = True,
    keep_off: frozenset[str] = frozenset(),
) -> str:
    """Allocate every request of ``job`` on ``ledger`` (off the nodes ``keep_off``) or none;
    '' on success, else the reason (in full only with ``explain``: trials that only ask whether
    it fits skip the sentence)."""
    taken: list[str] = []
    held: list[str | None] = []
    for i in range(job.nodes):
        try:
            a = ledger.allocate(job.request(held, keep_off), f"{tag}{job.id}#{i}", explain=explain)
            taken.append(a.id)
            held.append(a.node)
        except PoolError as e:
            for alloc_id in taken:
                ledger.release(alloc_id)
            return e.message
    return ""


def gang_allocations(ledger: Ledger, job_id: str, tag: str = "") -> list[str]:
    """The ids of a job's allocations as :func:`try_gang` names them: ``<tag><id>#0``, ``#1``,
    … (a gang is granted whole, so they run without a gap)."""
    ids: list[str] = []
    while (alloc_id := f"{tag}{job_id}#{len(ids)}") in ledger.allocations:
        ids.append(alloc_id)
    return ids


def release_job(ledger: Ledger, job_id: str, tag: str = "") -> None:
    for alloc_id in gang_allocations(ledger, job_id, tag):
        ledger.release(alloc_id)


def reservation(
    ledger: Ledger, head: Queued, running: Sequence[Running], now: float
) -> tuple[float, frozenset[str]]:
    """The earliest time ``head`` fits if running jobs end at their limits (``inf``: not by
    that) and the nodes it would be placed on then (its *reserved nodes*)."""
    trial = ledger.clone()
    at = now
    for job in [None, *sorted(running, key=lambda r: r.ends_at)]:
        if job is not None:
            at = job.ends_at
            for alloc_id in job.allocations:
                if alloc_id in trial.allocations:
                    trial.release(alloc_id)
        if not try_gang(trial, head, "?", explain=False):
            nodes = {trial.allocations[a].node for a in gang_allocations(trial, head.id, "?")}
            return at, frozenset(n for n in nodes if n)
    return float("inf"), frozenset()


def victims(ledger: Ledger, head: Queued, running: Sequence[Running]) -> list[str] | None:
    """The fewest newest borrowing jobs whose release lets ``head`` start, or ``None``."""
    team = ledger.team(head.team)
    need = sum(ledger.unit_cost_milli(ledger.offers[r.offer]) * r.count for r in head.requests())
    if ledger.team_used[head.team] + need > team.guarantee_milli:
        return None  # the head itself would borrow: it waits like everyone else
    trial = ledger.clone()
    chosen: list[str] = []
    for job in sorted(running, key=lambda r: -r.started):
        lender = ledger.team(job.team)
        if job.team == head.team or trial.team_used[job.team] <= lender.guarantee_milli:
            continue
        for alloc_id in job.allocations:
            if alloc_id in trial.allocations:
                trial.release(alloc_id)
        chosen.append(job.id)
        if not try_gang(trial, head, "?", explain=False):
            return chosen
    return None


def schedule(
    ledger: Ledger,
    queued: Iterable[Queued],
    running: Sequence[Running],
    now: float,
    limits: Limits = Limits(),
    reserve_after: float = float("inf"),
) -> Plan:
    plan = Plan()
    work = ledger.clone()
    live = list(running)
    load = Load.of(live)
    at_shadow: AtShadow | None = None  # once the head is found
    ordered = serving_order(ledger, queued, now, reserve_after)
    starving = oldest_starving(ordered, now, reserve_after)
    for job in ordered:
        over = load.over(job, limits)
        if over:
            plan.waiting[job.id] = over
            continue
        if at_shadow is None:
            why = try_gang(work, job)
            if not why:
                plan.start.append(job.id)
                load.add(job.user, job.ranks, job.cpu)
                continue
            chosen = victims(work, job, live) if starving is None else None
            if chosen:
                trial = work.clone()
                for r in live:
                    if r.id in chosen:
                        for alloc_id in r.allocations:
                            trial.release(alloc_id)
                if not try_gang(trial, job, explain=False):
                    for r in live:
                        if r.id in chosen:
                            load.add(r.user, r.ranks, r.cpu, -1)
                    work, live = trial, [r for r in live if r.id not in chosen]
                    plan.preempt += chosen
                    plan.start.append(job.id)
                    load.add(job.user, job.ranks, job.cpu)
                    continue
            plan.head, (plan.shadow, plan.reserved) = job.id, reservation(work, job, live, now)
            at_shadow = AtShadow(job, live, plan.shadow)
            plan.waiting[job.id] = scale_up_reason(ledger, job) or why
            continue
        if plan.reserved and not try_gang(work, job, explain=False, keep_off=plan.reserved):
            if at_shadow.admits(work, job, now):
                plan.start.append(job.id)
                plan.keep_off[job.id] = plan.reserved
                load.add(job.user, job.ranks, job.cpu)
                continue
            release_job(work, job.id)
        why = try_gang(work, job)
        if why:
            plan.waiting[job.id] = scale_up_reason(ledger, job) or why
            continue
        if at_shadow.admits(work, job, now):
            plan.start.append(job.id)
            load.add(job.user, job.ranks, job.cpu)
        else:
            release_job(work, job.id)
            plan.waiting[job.id] = f"would delay job {plan.head}, which is first in the queue"
    return plan


class AtShadow:
    """The pass's ledger as it will be at the head's shadow time, for the backfill check: the
    plan's ledger without the running jobs that end by then, built when first needed and then
    kept in step with the starts that outlast the shadow time (each check costs one trial of the
    head, not a copy of the pool)."""

    def __init__(self, head: Queued, running: Sequence[Running], at: float) -> None:
        self.head, self.running, self.at = head, running, at
        self.ledger: Ledger | None = None

    def admits(self, work: Ledger, job: Queued, now: float) -> bool:
        """Whether ``job``, just placed on ``work``, cannot delay the head (see *backfill*); if
        it can, the caller takes it off ``work`` again."""
        if now + job.time_limit <= self.at:
            return True  # gone by the shadow time
        taken = [work.allocations[a] for a in gang_allocations(work, job.id)]
        if self.ledger is None:
            self.ledger = work.clone()
            for r in self.running:
                if r.ends_at <= self.at:
                    for alloc_id in r.allocations:
                        if alloc_id in self.ledger.allocations:
                            self.ledger.release(alloc_id)
        else:
            _restored, lost = self.ledger.restore(taken)
            assert not lost, "a start fits now but not on the ledger at the shadow time"
        if not try_gang(self.ledger, self.head, "?", explain=False):
            release_job(self.ledger, self.head.id, "?")
            return True
        for a in taken:
            self.ledger.release(a.id)
        return False


@dataclass(frozen=True)
class ScaleUp:
    """``nodes`` new nodes of ``node_pool``, each to hold ``count`` of ``offer``."""

    node_pool: str
    offer: str
    count: int
    nodes: int


def scale_ups(ledger: Ledger, queued: Iterable[Queued]) -> list[ScaleUp]:
    """What each declared node pool should add for the queue (see *scale-up*)."""
    wanted: dict[str, ScaleUp] = {}
    pools = {p.name: p for p in ledger.inventory.node_pools}
    for job in order(ledger, queued) if pools else ():
        found = _scale_up(ledger, job)
        if found is None or found[0].scale_up in wanted:
            continue
        usage, _ = found
        present = (usage.machines or 0) if usage.capacity >= job.gpus else 0
        need = job.nodes - present if job.distinct and job.nodes > 1 else 1
        pool = pools[usage.scale_up]
        wanted[pool.name] = ScaleUp(pool.name, job.offer, job.gpus, min(need, pool.max_nodes))
    return list(wanted.values())


def scale_up_reason(ledger: Ledger, job: Queued) -> str:
    """Why ``job`` waits when it waits for a node pool's new nodes ('' otherwise)."""
    found = _scale_up(ledger, job) if ledger.inventory.node_pools else None
    return found[1] if found else ""


def _scale_up(ledger: Ledger, job: Queued) -> tuple[Usage, str] | None:
    """The snapshot and reason when ``job`` waits only for a node pool to grow."""
    offer = ledger.offers.get(job.offer)
    if job.cpu or offer is None:
        return None
    team = ledger.team(job.team)
    usage = ledger.usage(team, job.user, offer, job.gpus, job.distinct and job.nodes > 1)
    verdict = admit(team, offer, job.gpus, job.nodes, usage)
    return (usage, verdict.reason) if verdict.cause == "scale-up" else None
