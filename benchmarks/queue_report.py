"""The queueing replay's metrics and tables (see :mod:`benchmarks.queue`).

Contract: pure functions of a run's records; waits in seconds; tables in
:mod:`benchmarks.text`'s style.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.queue_baselines import BASELINES
from benchmarks.queue_gpupool import HeadCounts
from benchmarks.queue_jobs import SHAPES, TEAMS, Run, SimJob
from benchmarks.stats import mean, percentile
from benchmarks.text import align


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


def gang_table(jobs: Sequence[SimJob], run: Run, counts: dict[str, HeadCounts]) -> str:
    rows = [["gang", "GPUs", "team", "wait s", "passes queued", "as head", "overtaken"]]
    for j in jobs:
        if j.id in counts:
            c = counts[j.id]
            wait = _s(run.starts[j.id] - j.arrival) if j.id in run.starts else "never"
            rows.append([j.id, str(j.count), j.team, wait, f"{c.queued:,}", f"{c.head:,}",
                         f"{c.overtaken:,}"])  # fmt: skip
    return align(rows, left=(0, 2))


def floor_table(jobs: Sequence[SimJob], runs: dict[str, Run]) -> str:
    """Per multi-GPU job and policy: its wait, and the part of it that is its *floor* (see
    :attr:`Run.floors`): the wait left once nothing that happened after it arrived counts."""
    rows = [["gang", "GPUs", *(f"{p} wait / floor s" for p in runs)]]
    for j in jobs:
        if j.count > 1:
            cells = []
            for run in runs.values():
                wait = run.starts[j.id] - j.arrival if j.id in run.starts else math.inf
                cells.append(f"{_s(wait)} / {_s(run.floors[j.id] - j.arrival)}")
            rows.append([j.id, str(j.count), *cells])
    return align(rows, left=(0,))
