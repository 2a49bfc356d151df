"""Time to a GPU: replay the trace's GPU pods through a queue on simulated time, per policy.

Run as ``python -m benchmarks.queue [--model mig|sharing|all] [--load 0.8,0.95,1.1]
[--policy NAME|all] [--pods N] [--gpus G] [--json] [--traces DIR]``, or ``--decide`` for the
cost of one scheduling pass of gpupool's queue at scale. Definitions and results are in
benchmarks/README.md ("Queueing replay").

Vocabulary
- *job*: one GPU pod of the trace with a start time: it arrives at its (scaled) ``creation_time``
  and, once started, runs for ``deletion_time - scheduled_time`` (capped at ``--max-duration``).
  Pods without both times, or with a duration <= 0, are skipped and counted; GPU-less pods too.
- *shape*: ``fractional`` (a MIG instance or a share), ``1 GPU``, ``2-4 GPUs``, ``8 GPUs``
  (whole GPUs on one node, one gang).
- *cost*: the GPU-equivalents a job's allocation blocks (:meth:`Ledger.unit_cost_milli`).
- *offered demand*: sum of cost x duration over capacity x arrival span; *load scaling*
  multiplies every inter-arrival gap by one factor so that it hits a target.
- *team*: ``t<crc32(pod name) mod 4>``; each team's guarantee is a quarter of the pool and it
  may borrow the rest, so quotas never cap utilisation.
- *pass*: one scheduling round at an event time (all completions and arrivals at that instant
  first); *policy*: ``gpupool`` (gpupool's real :func:`gpupool.core.queue.schedule`, its plan
  carried out as the job manager does) or one of :mod:`benchmarks.queue_baselines`.

Contract: simulated time only (floats handed in, no clock, no sleep); loading reads the CSV, the
rest is pure apart from the ledger each run owns. Nothing is copied from the trace.
"""

from __future__ import annotations

import argparse
import csv
import functools
import heapq
import itertools
import json
import random
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks import trace as traces
from benchmarks.queue_baselines import BASELINES, Job, Live
from benchmarks.replay import (
    GPU_MILLI,
    MODELS,
    Shape,
    TracePod,
    build_inventory,
    build_offers,
    read_nodes,
    shape_of,
)
from benchmarks.stats import mean, percentile
from benchmarks.text import align
from gpupool.core.errors import PoolError
from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Ledger
from gpupool.core.placement import make_policy
from gpupool.core.queue import Plan, Queued, Running, order, schedule
from gpupool.core.quota import Team

TEAMS = 4
SHAPES: tuple[str, ...] = ("fractional", "1 GPU", "2-4 GPUs", "8 GPUs")
POLICIES: tuple[str, ...] = ("gpupool", *BASELINES)
LOADS: tuple[float, ...] = (0.8, 0.95, 1.1)
DEFAULT_PODS = 1000
DEFAULT_GPUS = 32
DEFAULT_MAX_DURATION = 21_600.0
GAP_MEDIANS = 20.0
BASELINE_PLACEMENT = "best-fit"
RESULTS = Path(__file__).resolve().parent / "results" / "queue.json"


# -- the trace ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimedPod:
    """A GPU pod with its arrival and duration (seconds)."""

    pod: TracePod
    created: float
    duration: float


@dataclass(frozen=True)
class Skipped:
    gpu_less: int = 0
    no_times: int = 0
    not_positive: int = 0


def read_timed_pods(path: Path) -> tuple[list[TimedPod], Skipped]:
    """The GPU pods that have a creation time and a positive duration, in ``creation_time``
    order (ties in file order), and how many were skipped for each reason."""
    gpu_less = no_times = not_positive = 0
    pods: list[TimedPod] = []
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            if int(row["num_gpu"]) == 0:
                gpu_less += 1
                continue
            times = [(row.get(k) or "").strip() for k in ("creation_time", "scheduled_time")]
            ended = (row.get("deletion_time") or "").strip()
            if not all(times) or not ended:
                no_times += 1
                continue
            duration = float(int(ended) - int(times[1]))
            if duration <= 0:
                not_positive += 1
                continue
            pod = TracePod(row["name"], int(row["num_gpu"]), int(row["gpu_milli"]), int(times[0]))
            pods.append(TimedPod(pod, float(times[0]), duration))
    pods.sort(key=lambda p: p.created)
    return pods, Skipped(gpu_less, no_times, not_positive)


def sample_nodes(nodes: Sequence[tuple[str, int]], gpus: int) -> list[tuple[str, int]]:
    """Evenly spaced nodes of the node file (keeping its mix) holding about ``gpus`` GPUs
    (all of them when ``gpus`` is 0 or more than the file has)."""
    total = sum(n for _, n in nodes)
    if gpus <= 0 or gpus >= total:
        return list(nodes)
    k = max(1, round(len(nodes) * gpus / total))
    return [nodes[i * len(nodes) // k] for i in range(k)]


# -- jobs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimJob:
    id: str
    team: str
    shape: str
    offer: str
    count: int
    cost_milli: int
    arrival: float
    duration: float
    limit: float


def shape_class(pod: TracePod) -> str:
    if pod.gpu_milli < GPU_MILLI:
        return "fractional"
    return "1 GPU" if pod.num_gpu == 1 else "8 GPUs" if pod.num_gpu >= 8 else "2-4 GPUs"


def team_of(name: str, teams: int = TEAMS) -> str:
    """A stable team for a pod: crc32 of its name, modulo ``teams``."""
    return f"t{zlib.crc32(name.encode()) % teams}"


def build_teams(capacity_milli: int, teams: int = TEAMS) -> dict[str, Team]:
    """Guarantees summing to the pool (the remainder to ``t0``), each may borrow up to all of it."""
    share = capacity_milli // teams
    out = {}
    for i in range(teams):
        guarantee = share + (capacity_milli - share * teams if i == 0 else 0)
        out[f"t{i}"] = Team(
            f"t{i}", guarantee_milli=guarantee, borrow_limit_milli=capacity_milli - guarantee
        )
    return out


def make_jobs(
    pods: Sequence[TimedPod],
    model: str,
    offer_cost: Callable[[str], int],
    estimate_factor: float = 1.0,
    max_duration: float = 0.0,
) -> list[SimJob]:
    """One job per pod; arrivals relative to the first; ``limit = duration * estimate_factor``;
    durations above ``max_duration`` (when > 0) cut to it."""
    if not pods:
        return []
    first = pods[0].created
    jobs = []
    for p in pods:
        shape = shape_of(p.pod, model)
        assert shape is not None  # GPU-less pods were skipped on reading
        duration = min(p.duration, max_duration) if max_duration > 0 else p.duration
        jobs.append(
            SimJob(
                id=p.pod.name,
                team=team_of(p.pod.name),
                shape=shape_class(p.pod),
                offer=shape.offer,
                count=shape.count,
                cost_milli=offer_cost(shape.offer) * shape.count,
                arrival=p.created - first,
                duration=duration,
                limit=duration * estimate_factor,
            )
        )
    return jobs


def offer_costs(inventory: Inventory, pods: Sequence[TimedPod], model: str) -> Callable[[str], int]:
    """The GPU-equivalents one unit of each of the pods' offers costs on ``inventory``."""
    shapes = [s for p in pods if (s := shape_of(p.pod, model)) is not None]
    probe = Ledger(inventory, build_offers(shapes), {})
    return lambda offer: probe.unit_cost_milli(probe.offers[offer])


def offered_demand(jobs: Sequence[SimJob], capacity_milli: int) -> float:
    """Sum of cost x duration over capacity x arrival span (``inf`` for a zero span)."""
    span = max(j.arrival for j in jobs) - min(j.arrival for j in jobs)
    work = sum(j.cost_milli * j.duration for j in jobs)
    return work / (capacity_milli * span) if span > 0 else float("inf")


def cap_gaps(jobs: Sequence[SimJob], medians: float = GAP_MEDIANS) -> list[SimJob]:
    """``jobs`` (in arrival order) with every gap between arrivals longer than ``medians``
    times the median gap cut to that: an idle stretch of the trace is an empty pool, not a
    queue."""
    gaps = [b.arrival - a.arrival for a, b in itertools.pairwise(jobs)]
    cap = percentile(gaps, 0.5) * medians
    out, at = [], jobs[0].arrival if jobs else 0.0
    for k, j in enumerate(jobs):
        at += min(gaps[k - 1], cap) if k else 0.0
        out.append(replace(j, arrival=at))
    return out


def scale_arrivals(jobs: Sequence[SimJob], capacity_milli: int, target: float) -> list[SimJob]:
    """``jobs`` with every gap between arrivals multiplied by one factor so that the offered
    demand is ``target``."""
    factor = offered_demand(jobs, capacity_milli) / target
    first = min(j.arrival for j in jobs)
    return [replace(j, arrival=first + (j.arrival - first) * factor) for j in jobs]


# -- the pool -------------------------------------------------------------------------------
def build_pool(inventory: Inventory, jobs: Sequence[SimJob], placement: str) -> Ledger:
    """The real ledger over ``inventory`` with the four teams and the replay's offers."""
    shapes = [Shape(j.id, j.offer, j.count, 0) for j in jobs]
    capacity = len(inventory.gpus) * GPU_MILLI
    return Ledger(
        inventory, build_offers(shapes), build_teams(capacity), policy=make_policy(placement)
    )


# -- one run --------------------------------------------------------------------------------
@dataclass
class Started:
    job: SimJob
    start: float
    end: float
    allocations: tuple[str, ...]


@dataclass
class Run:
    """What one policy did: per job its last start, the GPU-time held, preemptions."""

    starts: dict[str, float] = field(default_factory=dict)
    segments: list[tuple[float, float, int, str]] = field(default_factory=list)
    """(start, stop, cost, team) of every stretch a job held its GPUs."""
    held_milli_s: dict[str, float] = field(default_factory=dict)
    lost_milli_s: float = 0.0
    preemptions: int = 0
    passes: int = 0
    last_end: float = 0.0
    unstarted: list[str] = field(default_factory=list)
    seconds: float = 0.0


StepResult = tuple[list[str], list[str]]
Step = Callable[[Ledger, dict[str, SimJob], dict[str, Started], float], StepResult]


Watch = Callable[[Ledger, list[Queued], Plan], None]


def gpupool_step(
    ledger: Ledger,
    queue: dict[str, SimJob],
    running: dict[str, Started],
    now: float,
    watch: Watch | None = None,
) -> StepResult:
    """gpupool's pass as :meth:`gpupool.jobs.manager.JobManager.schedule_pass` does it: plan
    with :func:`schedule`, release the preempted jobs (requeued by the caller), then grant each
    planned job still queued node by node with :meth:`Queued.request` (all or nothing).
    ``watch`` sees the ledger, the queue and the plan before the plan is carried out."""
    queued = [as_queued(j) for j in queue.values()]
    live = [as_running(s) for s in running.values()]
    plan = schedule(ledger, queued, live, now)
    if watch is not None:
        watch(ledger, queued, plan)
    for job_id in plan.preempt:
        for alloc_id in running[job_id].allocations:
            ledger.release(alloc_id)
    granted = []
    for job_id in plan.start:
        if job_id in queue and grant(ledger, as_queued(queue[job_id])):
            granted.append(job_id)
    return granted, list(plan.preempt)


def as_running(s: Started) -> Running:
    job = s.job
    return Running(job.id, job.team, s.allocations, s.start + job.limit, s.start, job.id, job.count)


def as_queued(job: SimJob) -> Queued:
    return Queued(job.id, job.id, job.team, job.offer, job.count, 1, 0, job.arrival, job.limit)


def grant(ledger: Ledger, q: Queued) -> bool:
    """The manager's ``_grant``: each node's request in turn, all released if one fails."""
    taken: list[str] = []
    held: list[str | None] = []
    try:
        for i in range(q.nodes):
            a = ledger.allocate(q.request(held), f"{q.id}#{i}")
            taken.append(a.id)
            held.append(a.node)
    except PoolError:
        for alloc_id in taken:
            ledger.release(alloc_id)
        return False
    return True


def baseline_step(name: str) -> Step:
    policy = BASELINES[name]

    def step(
        ledger: Ledger, queue: dict[str, SimJob], running: dict[str, Started], now: float
    ) -> StepResult:
        waiting = [Job(j.id, j.team, j.offer, j.count, j.arrival, j.limit) for j in queue.values()]
        live = [Live(s.job.id, s.allocations[0], s.start + s.job.limit) for s in running.values()]
        return policy(ledger, waiting, live, now), []

    return step


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


def gang_table(jobs: Sequence[SimJob], run: Run, counts: dict[str, HeadCounts]) -> str:
    rows = [["gang", "GPUs", "team", "wait s", "passes queued", "as head", "overtaken"]]
    for j in jobs:
        if j.id in counts:
            c = counts[j.id]
            wait = _s(run.starts[j.id] - j.arrival) if j.id in run.starts else "never"
            rows.append([j.id, str(j.count), j.team, wait, f"{c.queued:,}", f"{c.head:,}",
                         f"{c.overtaken:,}"])  # fmt: skip
    return align(rows, left=(0, 2))


def step_for(policy: str) -> Step:
    return gpupool_step if policy == "gpupool" else baseline_step(policy)


def simulate(ledger: Ledger, jobs: Sequence[SimJob], step: Step) -> Run:
    """Replay ``jobs`` on ``ledger`` with one ``step`` per event time until nothing is left
    (or nothing can ever start: those are ``unstarted``)."""
    t0 = time.perf_counter()
    run = Run()
    arrivals = sorted(jobs, key=lambda j: j.arrival)
    queue: dict[str, SimJob] = {}
    running: dict[str, Started] = {}
    ends: list[tuple[float, int, str]] = []  # (end, serial, job id)
    serial = 0
    i = 0
    while i < len(arrivals) or ends or queue:
        upcoming = [arrivals[i].arrival] if i < len(arrivals) else []
        upcoming += [ends[0][0]] if ends else []
        if not upcoming:
            run.unstarted = sorted(queue)
            break
        now = min(upcoming)
        while ends and ends[0][0] <= now:
            end, _, job_id = heapq.heappop(ends)
            done = running.get(job_id)
            if done is None or done.end != end:
                continue  # preempted since; its completion is void
            for alloc_id in done.allocations:
                ledger.release(alloc_id)
            del running[job_id]
            run.segments.append((done.start, end, done.job.cost_milli, done.job.team))
            run.last_end = max(run.last_end, end)
        while i < len(arrivals) and arrivals[i].arrival <= now:
            queue[arrivals[i].id] = arrivals[i]
            i += 1
        if not queue:
            continue
        started, preempted = step(ledger, queue, running, now)
        run.passes += 1
        for job_id in preempted:
            s = running.pop(job_id)
            run.held_milli_s[job_id] -= s.job.cost_milli * (s.end - now)  # never ran
            run.segments.append((s.start, now, s.job.cost_milli, s.job.team))
            run.lost_milli_s += s.job.cost_milli * (now - s.start)
            run.preemptions += 1
            queue[job_id] = s.job
        for job_id in started:
            job = queue.pop(job_id)
            allocs = tuple(a for a in ledger.allocations if a.startswith(f"{job_id}#"))
            end = now + job.duration
            running[job_id] = Started(job, now, end, allocs)
            run.starts[job_id] = now
            run.held_milli_s[job_id] = run.held_milli_s.get(job_id, 0.0) + job.cost_milli * (
                job.duration
            )
            heapq.heappush(ends, (end, serial, job_id))
            serial += 1
    run.seconds = time.perf_counter() - t0
    return run


# -- metrics --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Waits:
    n: int
    mean: float
    p50: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Waits:
        return cls(
            len(values),
            mean(values),
            percentile(values, 0.5),
            percentile(values, 0.95),
            percentile(values, 0.99),
            max(values, default=0.0),
        )


@dataclass(frozen=True)
class Outcome:
    model: str
    load: float
    policy: str
    waits: dict[str, Waits]
    utilisation: float
    arrival_utilisation: float
    makespan: float
    team_share: dict[str, float]
    preemptions: int
    lost_share: float
    unstarted: int
    jobs: int
    passes: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "load": self.load,
            "policy": self.policy,
            "wait_s": {k: vars(w) for k, w in self.waits.items()},
            "utilisation": self.utilisation,
            "utilisation_arrival_window": self.arrival_utilisation,
            "makespan_s": self.makespan,
            "team_share_of_gpu_time": self.team_share,
            "preemptions": self.preemptions,
            "lost_gpu_time_share": self.lost_share,
            "unstarted": self.unstarted,
            "jobs": self.jobs,
            "passes": self.passes,
            "runtime_s": self.seconds,
            "events_per_s": self.passes / self.seconds if self.seconds else None,
        }


def outcome(
    model: str, load: float, policy: str, jobs: Sequence[SimJob], run: Run, capacity_milli: int
) -> Outcome:
    by_shape: dict[str, list[float]] = {s: [] for s in SHAPES}
    waits_all = []
    for j in jobs:
        if j.id in run.starts:
            w = run.starts[j.id] - j.arrival
            by_shape[j.shape].append(w)
            waits_all.append(w)
    waits = {s: Waits.of(v) for s, v in by_shape.items()} | {"all": Waits.of(waits_all)}
    first = min(j.arrival for j in jobs)
    makespan = run.last_end - first
    held = sum(run.held_milli_s.values())
    last = max(j.arrival for j in jobs)
    teams: dict[str, float] = {f"t{i}": 0.0 for i in range(TEAMS)}
    for start, stop, cost, team in run.segments:  # within the arrival window only
        teams[team] += cost * max(0.0, min(stop, last) - max(start, first))
    in_window = sum(teams.values())
    return Outcome(
        model=model,
        load=load,
        policy=policy,
        waits=waits,
        utilisation=held / (capacity_milli * makespan) if makespan > 0 else 0.0,
        makespan=makespan,
        arrival_utilisation=in_window / (capacity_milli * (last - first)) if last > first else 0.0,
        team_share={t: v / in_window if in_window else 0.0 for t, v in teams.items()},
        preemptions=run.preemptions,
        lost_share=run.lost_milli_s / held if held else 0.0,
        unstarted=len(run.unstarted),
        jobs=len(jobs),
        passes=run.passes,
        seconds=run.seconds,
    )


# -- output ---------------------------------------------------------------------------------
def _s(seconds: float) -> str:
    return f"{seconds:,.0f}"


def wait_table(outcomes: Sequence[Outcome]) -> str:
    """One row per policy and shape: job count and wait statistics in seconds."""
    rows = [["policy", "shape", "jobs", "mean s", "p50 s", "p95 s", "p99 s", "max s"]]
    for o in outcomes:
        for shape in (*SHAPES, "all"):
            w = o.waits[shape]
            if not w.n:
                continue
            rows.append(
                [o.policy, shape, f"{w.n:,}", _s(w.mean), _s(w.p50), _s(w.p95), _s(w.p99),
                 _s(w.max)]
            )  # fmt: skip
    return align(rows, left=(0, 1))


def summary_table(outcomes: Sequence[Outcome]) -> str:
    """One row per policy: utilisation, makespan, team shares, preemptions, runtime."""
    header = [
        "policy",
        "util",
        "makespan s",
        *(f"{t} share" for t in sorted(outcomes[0].team_share)),
    ]
    header.insert(2, "util arr")
    rows = [[*header, "preempt", "lost", "unstarted", "passes", "run s", "passes/s"]]
    for o in outcomes:
        rows.append(
            [
                o.policy,
                f"{o.utilisation:.1%}",
                f"{o.arrival_utilisation:.1%}",
                _s(o.makespan),
                *(f"{o.team_share[t]:.1%}" for t in sorted(o.team_share)),
                f"{o.preemptions:,}",
                f"{o.lost_share:.1%}",
                f"{o.unstarted:,}",
                f"{o.passes:,}",
                f"{o.seconds:.1f}",
                f"{o.passes / o.seconds:,.0f}" if o.seconds else "-",
            ]
        )
    return align(rows, left=(0,))


def _ratio(ours: float, theirs: float) -> str:
    return f"{ours / theirs:.2f}" if theirs else "=" if ours == 0 else "inf"


def comparison_table(entries: Sequence[dict[str, Any]]) -> str:
    """gpupool against the best baseline per shape (the lowest p95, then max): the ratios
    p95 / p99 / max of gpupool's wait to that baseline's (< 1: gpupool waits less), and
    utilisation against the best baseline's. ``entries`` are :meth:`Outcome.to_json` dicts of one
    trace, model and load."""
    by_policy = {e["policy"]: e for e in entries}
    ours = by_policy["gpupool"]
    rows = [["shape", "best baseline", "p95 ratio", "p99 ratio", "max ratio"]]
    for shape in SHAPES:
        if not ours["wait_s"][shape]["n"]:
            continue
        best = min(
            BASELINES, key=lambda p: (by_policy[p]["wait_s"][shape]["p95"],
                                      by_policy[p]["wait_s"][shape]["max"])
        )  # fmt: skip
        a, b = ours["wait_s"][shape], by_policy[best]["wait_s"][shape]
        rows.append([shape, best, *(_ratio(a[k], b[k]) for k in ("p95", "p99", "max"))])
    best = max(BASELINES, key=lambda p: by_policy[p]["utilisation"])
    rows.append(
        ["utilisation", best, f"{ours['utilisation']:.1%}", "vs",
         f"{by_policy[best]['utilisation']:.1%}"]
    )  # fmt: skip
    return align(rows, left=(0, 1))


# -- the cost of deciding -------------------------------------------------------------------
def decide_cost(
    gpus: int, queued: int, passes: int, seed: int, model: str = "mig"
) -> dict[str, Any]:
    """Wall time of :func:`schedule` with ``queued`` jobs on a pool of ``gpus`` GPUs (8 per node)
    filled with running jobs; the jobs' shapes drawn from the trace's published mix."""
    rng = random.Random(seed)
    nodes = [(f"n{i:05d}", 8) for i in range(gpus // 8)]
    inventory = build_inventory(nodes, model)
    mix = [(n, m, c) for n, m, c in traces.GPU_REQUESTS if n]

    def draw(i: int, t: float) -> SimJob:
        num, milli, _ = rng.choices(mix, weights=[c for *_, c in mix])[0]
        pod = TracePod(f"d{i}", num, milli)
        shape = shape_of(pod, model)
        assert shape is not None
        limit = float(rng.choice((600, 3600, 4 * 3600, 86_400)))
        return SimJob(f"d{i}", team_of(pod.name), shape_class(pod), shape.offer, shape.count, 0,
                      t, limit, limit)  # fmt: skip

    pool_jobs = [draw(i, 0.0) for i in range(gpus * 2)]
    ledger = build_pool(inventory, pool_jobs, "gpupool")
    running: list[Running] = []
    for j in pool_jobs:  # fill: offer twice as many jobs as GPUs, keep those that fit
        q = as_queued(j)
        if grant(ledger, q):
            running.append(Running(j.id, j.team, (f"{j.id}#0",), j.limit, 0.0, j.id, j.count))
    waiting = [as_queued(draw(gpus * 2 + i, float(i))) for i in range(queued)]
    timings = []
    clones = [0]
    real_clone = Ledger.clone

    def counted(self: Ledger) -> Ledger:
        clones[0] += 1
        return real_clone(self)

    Ledger.clone = counted  # type: ignore[method-assign]  # counts only; restored below
    try:
        for _ in range(passes):
            t0 = time.perf_counter()
            plan = schedule(ledger, waiting, running, 1.0)
            timings.append(time.perf_counter() - t0)
    finally:
        Ledger.clone = real_clone  # type: ignore[method-assign]
    used = sum(ledger.team_used.values()) / (gpus * GPU_MILLI)
    return {
        "gpus": gpus,
        "queued": queued,
        "policy": "gpupool",
        "placement": "gpupool",
        "running": len(running),
        "pool_used": used,
        "passes": passes,
        "p50_s": percentile(timings, 0.5),
        "p99_s": percentile(timings, 0.99),
        "clones_per_pass": clones[0] / passes,
        "plan_starts": len(plan.start),
        "plan_preempts": len(plan.preempt),
        "model": model,
        "seed": seed,
    }


# -- the command ----------------------------------------------------------------------------
def load_trace(args: argparse.Namespace, tmp: Path) -> tuple[str, Path, Path]:
    source = traces.locate(args.traces)
    if source.folder is not None:
        return traces.label(source.pods), source.pods, source.nodes
    print(traces.notice(source), file=sys.stderr)
    folder = traces.write_synthetic_trace(tmp, args.trace_seed)
    return traces.SYNTHETIC, folder / traces.POD_FILE, folder / traces.NODE_FILE


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.queue",
        description="Replay the trace's GPU pods through gpupool's queue and three baselines.",
    )
    parser.add_argument("--traces", type=Path, metavar="DIR", help="folder holding the trace")
    parser.add_argument("--trace-seed", type=int, default=0, metavar="S")
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--policy", choices=[*POLICIES, "all"], default="all")
    parser.add_argument(
        "--load", default=",".join(map(str, LOADS)), help="offered demand targets, comma-separated"
    )
    parser.add_argument("--pods", type=int, default=DEFAULT_PODS, help="window: first N GPU pods")
    parser.add_argument("--skip", type=int, default=0, help="window starts after N GPU pods")
    parser.add_argument(
        "--gpus", type=int, default=DEFAULT_GPUS, help="pool: evenly spaced nodes, ~G GPUs (0: all)"
    )
    parser.add_argument(
        "--max-duration",
        type=float,
        default=DEFAULT_MAX_DURATION,
        help="cut longer durations to this many seconds (0: no cut)",
    )
    parser.add_argument("--estimate-factor", type=float, default=1.0)
    parser.add_argument(
        "--placement", default="gpupool", help="placement policy of the gpupool policy's ledger"
    )
    parser.add_argument(
        "--gangs",
        action="store_true",
        help="gpupool: per multi-GPU job, passes queued, as the head, and jobs started ahead of it",
    )
    parser.add_argument("--json", action="store_true", help=f"also write {RESULTS}")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--decide", action="store_true", help="measure one pass's cost instead")
    parser.add_argument(
        "--decide-sizes",
        default="256:39:5,512:78:5,1024:156:3,2048:312:1",
        help="GPUS:QUEUED[:PASSES],... (queued jobs in the 65,536:10,000 ratio)",
    )
    parser.add_argument("--decide-passes", type=int, default=5)
    return parser.parse_args(argv)


def run_decide(args: argparse.Namespace) -> int:
    rows = [["GPUs", "queued", "running", "pool used", "passes", "p50 s", "p99 s", "clones",
             "starts", "preempts"]]  # fmt: skip
    found = []
    for size in args.decide_sizes.split(","):
        gpus, queued, *more = (int(x) for x in size.split(":"))
        r = decide_cost(gpus, queued, more[0] if more else args.decide_passes, args.trace_seed)
        found.append(r)
        rows.append(
            [f"{gpus:,}", f"{queued:,}", f"{r['running']:,}", f"{r['pool_used']:.1%}",
             str(r["passes"]), f"{r['p50_s']:.3f}", f"{r['p99_s']:.3f}",
             f"{r['clones_per_pass']:.0f}", str(r["plan_starts"]), str(r["plan_preempts"])]
        )  # fmt: skip
        print(align(rows, left=()), flush=True)
    if args.json:
        _merge_json(args.out, {"decide": found})
    return 0


IDENTITY = ("trace", "model", "load", "policy", "placement", "window", "skip", "gpus",
            "max_duration_s", "estimate_factor", "queued", "seed")  # fmt: skip


def merge_entries(old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> list[Any]:
    """``old`` with each entry that ``new`` measures again replaced, then the rest of ``new``."""
    key = lambda e: tuple(e.get(k) for k in IDENTITY)  # noqa: E731
    fresh = {key(e) for e in new}
    return [e for e in old if key(e) not in fresh] + list(new)


def _merge_json(path: Path, part: dict[str, list[Any]]) -> None:
    """Add ``part``'s sections to the JSON file at ``path`` (see :func:`merge_entries`)."""
    old = json.loads(path.read_text()) if path.is_file() else {}
    for section, entries in part.items():
        old[section] = merge_entries(old.get(section, []), entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.decide:
        return run_decide(args)
    with tempfile.TemporaryDirectory(prefix="gpupool-trace-") as tmp:
        name, pod_file, node_file = load_trace(args, Path(tmp))
        pods, skipped = read_timed_pods(pod_file)
        all_nodes = read_nodes(node_file)
    window = pods[args.skip : args.skip + args.pods]
    nodes = sample_nodes(all_nodes, args.gpus)
    models = list(MODELS) if args.model == "all" else [args.model]
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    loads = [float(x) for x in args.load.split(",")]
    seed = args.trace_seed if name == traces.SYNTHETIC else None
    gpus = sum(n for _, n in nodes)
    capacity = gpus * GPU_MILLI
    print(
        f"trace: {name}{f' (seed {seed})' if seed is not None else ''}; {len(pods):,} GPU pods "
        f"with times (skipped: {skipped.gpu_less:,} GPU-less, {skipped.no_times:,} without "
        f"scheduled/deletion time, {skipped.not_positive:,} with duration <= 0); window: "
        f"{len(window):,} pods from #{args.skip}; pool: {len(nodes):,} nodes, {gpus:,} GPUs; "
        f"durations cut at {args.max_duration:,.0f} s, arrival gaps at {GAP_MEDIANS:.0f} "
        f"median gaps; time limits = duration x {args.estimate_factor}"
    )
    entries = []
    for model in models:
        inventory = build_inventory(nodes, model)
        base = cap_gaps(
            make_jobs(
                window, model, offer_costs(inventory, window, model), args.estimate_factor,
                args.max_duration,
            )
        )  # fmt: skip
        for load in loads:
            jobs = scale_arrivals(base, capacity, load)
            outcomes = []
            for policy in policies:
                placement = args.placement if policy == "gpupool" else BASELINE_PLACEMENT
                ledger = build_pool(inventory, jobs, placement)
                gangs = {j.id: HeadCounts() for j in jobs if j.count > 1}
                step = step_for(policy)
                if policy == "gpupool" and args.gangs:
                    step = functools.partial(gpupool_step, watch=watch_gangs(gangs))
                run = simulate(ledger, jobs, step)
                o = outcome(model, load, policy, jobs, run, capacity)
                if policy == "gpupool" and args.gangs:
                    print(gang_table(jobs, run, gangs))
                outcomes.append(o)
                entries.append(
                    {"trace": name, "seed": seed, "window": len(window), "skip": args.skip,
                     "gpus": gpus, "max_duration_s": args.max_duration,
                     "estimate_factor": args.estimate_factor,
                     "placement": placement,
                     "offered_demand": offered_demand(jobs, capacity)} | o.to_json()
                )  # fmt: skip
            print(f"\n== model {model}, offered demand {load:.0%} of {gpus:,} GPUs ==")
            print(wait_table(outcomes))
            print()
            print(summary_table(outcomes), flush=True)
            if {"gpupool", *BASELINES} <= set(policies):
                print()
                print(comparison_table([o.to_json() for o in outcomes]), flush=True)
    if args.json:
        _merge_json(args.out, {"replay": entries})
    return 0


if __name__ == "__main__":
    sys.exit(main())
