"""Time to a GPU: replay the trace's GPU pods through a queue on simulated time, per policy.

Run as ``python -m benchmarks.queue [--model mig|sharing|all] [--load 0.8,0.95,1.1]
[--policy NAME|all] [--pods N] [--gpus G] [--gangs] [--json] [--traces DIR]``, or
``--decide`` for the cost of one scheduling pass of gpupool's queue at scale. Definitions and
results are in benchmarks/README.md (``benchmarks.queue``).

Vocabulary (jobs, shapes, cost, offered demand and teams: :mod:`benchmarks.queue_jobs`)
- *pass*: one scheduling round at an event time (all completions and arrivals at that instant
  first); *step*: one policy's pass (:mod:`benchmarks.queue_gpupool` for gpupool's real queue,
  :mod:`benchmarks.queue_baselines` for FIFO, BestEffortFIFO and EASY backfill).
- *run*: one policy replaying one window at one load until nothing is queued or running; its
  metrics and tables are :mod:`benchmarks.queue_report`, ``--decide`` is
  :mod:`benchmarks.queue_decide`.

Contract: simulated time only: event times are floats handed to each step, nothing sleeps, and
the only clock read measures the replay's own run time. Loading reads the CSV; the rest is pure
apart from the ledger each run owns. Nothing is copied from the trace.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import trace as traces
from benchmarks.load_report import commit
from benchmarks.queue_baselines import BASELINES, Job, Live
from benchmarks.queue_decide import decide_cost, decide_table
from benchmarks.queue_gpupool import (
    HeadCounts,
    Step,
    StepResult,
    as_queued,
    as_running,
    gpupool_step,
    watch_gangs,
)
from benchmarks.queue_jobs import (
    GAP_MEDIANS,
    Run,
    SimJob,
    Started,
    build_pool,
    cap_gaps,
    make_jobs,
    offer_costs,
    offered_demand,
    read_timed_pods,
    sample_nodes,
    scale_arrivals,
)
from benchmarks.queue_report import (
    comparison_table,
    floor_table,
    gang_table,
    outcome,
    summary_table,
    wait_table,
)
from benchmarks.replay import GPU_MILLI, MODELS, build_inventory, read_nodes
from gpupool.core.ledger import Ledger
from gpupool.core.queue import reservation
from gpupool.jobs.manager import JobManager

POLICIES: tuple[str, ...] = ("gpupool", *BASELINES)
LOADS: tuple[float, ...] = (0.8, 0.95, 1.1)
DEFAULT_PODS = 1000
DEFAULT_GPUS = 32
DEFAULT_MAX_DURATION = 21_600.0
BASELINE_PLACEMENT = "best-fit"
RESULTS = Path(__file__).resolve().parent / "results" / "queue.json"


# -- one run --------------------------------------------------------------------------------
def baseline_step(name: str) -> Step:
    policy = BASELINES[name]

    def step(
        ledger: Ledger, queue: dict[str, SimJob], running: dict[str, Started], now: float
    ) -> StepResult:
        waiting = [Job(j.id, j.team, j.offer, j.count, j.arrival, j.limit) for j in queue.values()]
        live = [Live(s.job.id, s.allocations[0], s.start + s.job.limit) for s in running.values()]
        return policy(ledger, waiting, live, now), []

    return step


def step_for(policy: str, reserve_after: float = float("inf")) -> Step:
    if policy == "gpupool":
        return functools.partial(gpupool_step, reserve_after=reserve_after)
    return baseline_step(policy)


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
            job = arrivals[i]
            queue[job.id] = job
            if job.count > 1:
                live = [as_running(s) for s in running.values()]
                run.floors[job.id] = reservation(ledger, as_queued(job), live, now)[0]
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
        "--reserve-after",
        type=float,
        default=JobManager.reserve_after.default_value,
        metavar="SECONDS",
        help="gpupool: the queue's reserve_after (c.JobManager.reserve_after; inf: never)",
    )
    parser.add_argument(
        "--placement", default="gpupool", help="placement policy of the gpupool policy's ledger"
    )
    parser.add_argument(
        "--gangs",
        action="store_true",
        help="per multi-GPU job: for gpupool, passes queued, as the head and jobs started "
        "ahead of it; for every policy, its wait and its floor (the part no later decision avoids)",
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
    found = []
    for size in args.decide_sizes.split(","):
        gpus, queued, *more = (int(x) for x in size.split(":"))
        found.append(
            decide_cost(gpus, queued, more[0] if more else args.decide_passes, args.trace_seed)
        )
        print(f"{gpus:,} GPUs, {queued:,} queued: {found[-1]['p50_s']:.3f} s", file=sys.stderr)
    print(decide_table(found))
    if args.json:
        _merge_json(args.out, {"decide": found})
    return 0


IDENTITY = ("trace", "model", "load", "policy", "placement", "window", "skip", "gpus",
            "max_duration_s", "estimate_factor", "queued", "seed", "reserve_after_s")  # fmt: skip


def merge_entries(old: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> list[Any]:
    """``old`` with each entry that ``new`` measures again replaced, then the rest of ``new``."""
    key = lambda e: tuple(e.get(k) for k in IDENTITY)  # noqa: E731
    fresh = {key(e) for e in new}
    return [e for e in old if key(e) not in fresh] + list(new)


def _reserve_json(reserve_after: float, policy: str) -> float | None:
    """``reserve_after`` as the JSON says it: ``null`` for never (and for the baselines)."""
    return None if policy != "gpupool" or math.isinf(reserve_after) else reserve_after


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
    entries, code = [], commit()
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
            outcomes, runs = [], {}
            for policy in policies:
                placement = args.placement if policy == "gpupool" else BASELINE_PLACEMENT
                ledger = build_pool(inventory, jobs, placement)
                gangs = {j.id: HeadCounts() for j in jobs if j.count > 1}
                step = step_for(policy, args.reserve_after)
                if policy == "gpupool" and args.gangs:
                    step = functools.partial(
                        gpupool_step, watch=watch_gangs(gangs), reserve_after=args.reserve_after
                    )
                run = simulate(ledger, jobs, step)
                o = outcome(model, load, policy, jobs, run, capacity)
                if policy == "gpupool" and args.gangs:
                    print(gang_table(jobs, run, gangs))
                outcomes.append(o)
                runs[policy] = run
                entries.append(
                    {"trace": name, "seed": seed, "commit": code, "window": len(window),
                     "skip": args.skip,
                     "gpus": gpus, "max_duration_s": args.max_duration,
                     "estimate_factor": args.estimate_factor,
                     "reserve_after_s": _reserve_json(args.reserve_after, policy),
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
            if args.gangs:
                print()
                print(floor_table(jobs, runs), flush=True)
    if args.json:
        _merge_json(args.out, {"replay": entries})
    return 0


if __name__ == "__main__":
    sys.exit(main())
