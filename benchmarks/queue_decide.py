"""The cost of deciding: one pass of gpupool's :func:`gpupool.core.queue.schedule` on a large,
nearly full pool with a long queue (``python -m benchmarks.queue --decide``).

Contract: :func:`decide_cost` builds the pool and the queue from a seed and returns wall times;
the only clock read is around each pass.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import trace as traces
from benchmarks.queue_gpupool import as_queued, grant
from benchmarks.queue_jobs import SimJob, build_pool, shape_class, team_of
from benchmarks.replay import GPU_MILLI, TracePod, build_inventory, shape_of
from benchmarks.stats import percentile
from benchmarks.text import align
from gpupool.core.ledger import Ledger
from gpupool.core.queue import Running, schedule


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


def decide_table(found: Sequence[dict[str, Any]]) -> str:
    """One row per measured size (:func:`decide_cost` results)."""
    rows = [["GPUs", "queued", "running", "pool used", "passes", "p50 s", "p99 s", "clones",
             "starts", "preempts"]]  # fmt: skip
    for r in found:
        rows.append(
            [f"{r['gpus']:,}", f"{r['queued']:,}", f"{r['running']:,}", f"{r['pool_used']:.1%}",
             str(r["passes"]), f"{r['p50_s']:.3f}", f"{r['p99_s']:.3f}",
             f"{r['clones_per_pass']:.0f}", str(r["plan_starts"]), str(r["plan_preempts"])]
        )  # fmt: skip
    return align(rows, left=())
