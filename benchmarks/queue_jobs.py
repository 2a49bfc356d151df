"""The queueing replay's jobs and pool: reading the trace with times, the window, teams, load
scaling, and the records of a run (see :mod:`benchmarks.queue`).

Vocabulary
- *job*: one GPU pod of the trace with a start time: it arrives at its (scaled) ``creation_time``
  and, once started, runs for ``deletion_time - scheduled_time`` (cut at a maximum). Pods without
  both times, or with a duration <= 0, are skipped and counted; GPU-less pods too.
- *shape*: ``fractional`` (a MIG instance or a share), ``1 GPU``, ``2-4 GPUs``, ``8 GPUs``
  (whole GPUs on one node, one gang).
- *cost*: the GPU-equivalents a job's allocation blocks (:meth:`Ledger.unit_cost_milli`).
- *offered demand*: sum of cost x duration over capacity x arrival span; *load scaling*
  multiplies every inter-arrival gap by one factor so that it hits a target.
- *team*: ``t<crc32(pod name) mod 4>``; each team's guarantee is a quarter of the pool and it
  may borrow the rest, so quotas never cap utilisation.

Contract: pure functions apart from reading the CSV; nothing is copied from the trace.
"""

from __future__ import annotations

import csv
import itertools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.replay import GPU_MILLI, Shape, TracePod, build_offers, shape_of
from benchmarks.stats import percentile
from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Ledger
from gpupool.core.placement import make_policy
from gpupool.core.quota import Team

TEAMS = 4
SHAPES: tuple[str, ...] = ("fractional", "1 GPU", "2-4 GPUs", "8 GPUs")
GAP_MEDIANS = 20.0


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
    floors: dict[str, float] = field(default_factory=dict)
    """Per multi-GPU job, its *floor*: the earliest it could start without preempting, given
    the jobs this policy had running when it arrived (ending at their time limits) and ignoring
    every job queued or arriving (a wait at its floor lost nothing after the job arrived)."""
