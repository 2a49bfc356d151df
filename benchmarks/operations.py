"""What operations cost the hub: one ``/hub/metrics`` scrape of gpupool's collector, and one
idle-reclaim pass, as the pool grows.

Run as ``python -m benchmarks.operations [--json] [--repeat N]``.

Vocabulary
- *pool*: a simulated inventory of 64, 512 or 4,096 H100-80GB GPUs in nodes of 8; on every node
  GPUs 0-5 are whole and GPUs 6-7 have MIG on with 3g.40gb + 2g.20gb + 1g.10gb instances, so a
  node has 6 whole GPUs and 6 MIG devices to read. Read through the simulated NVML, which answers
  the same calls as NVML (real NVML calls cost more: this measures gpupool's own work).
- *load*: notebooks allocated (one whole GPU or one MIG instance each, alternating) until half
  the GPU-equivalents are held, spread over four teams.
- *scrape*: ``generate_latest`` of a registry holding only gpupool's :class:`PoolCollector`
  (pool, teams, per-device utilisation and memory); *pass*: one :meth:`IdleReclaimer.look`
  outside a running hub (no kernel calls: the servers' kernels need a hub), all notebooks idle.
- Times are medians of ``--repeat`` runs (default 5), in milliseconds, by ``time.perf_counter``.

Contract: no network, no database file (SQLite in memory); nothing asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from statistics import median
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from traitlets.config import Config

from benchmarks.text import align
from gpupool.config import GPUPool
from gpupool.core.errors import PoolError
from gpupool.hub.collector import PoolCollector
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.pool import Pool

SIZES = (64, 512, 4096)
TEAMS = ("a", "b", "c", "d")


def build_pool(gpus: int) -> Pool:
    nodes = gpus // 8
    spec = "; ".join(f"n{i}: 8x H100-80GB, mig=2:3g.40gb+2g.20gb+1g.10gb" for i in range(nodes))
    c = Config()
    c.GPUPool.inventory = f"simulated:{spec}"
    c.GPUPool.db_url = "sqlite://"
    c.GPUPool.offers = {"h100": {"model": "H100-80GB"}, "mig-1g.10gb": {"model": "H100-80GB"}}
    c.GPUPool.teams = {t: {"guarantee": gpus / 4, "borrow_limit": gpus / 4} for t in TEAMS}
    pool = Pool.from_config(GPUPool(config=c))
    held, i = 0, 0
    while held < gpus * 500:  # half the pool, in thousandths
        offer = "h100" if i % 2 == 0 else "mig-1g.10gb"
        try:
            a = pool.allocate(f"u{i}", [TEAMS[i % 4]], offer, ref=f"u{i}/")
        except PoolError:
            break
        held += a.cost_milli
        i += 1
    return pool


def timed(fn: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append((time.perf_counter() - began) * 1000)
    return median(times)


def measure(gpus: int, repeat: int) -> dict[str, Any]:
    pool = build_pool(gpus)
    registry = CollectorRegistry()
    reclaimer = IdleReclaimer(pool, config=Config())
    registry.register(PoolCollector(pool, idle=reclaimer.idle))
    text = generate_latest(registry)
    return {
        "gpus": gpus,
        "notebooks": len(pool.ledger.allocations),
        "scrape_ms": round(timed(lambda: generate_latest(registry), repeat), 2),
        "scrape_bytes": len(text),
        "pass_ms": round(timed(lambda: asyncio.run(reclaimer.look()), repeat), 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--repeat", type=int, default=5, help="runs per figure (median)")
    args = parser.parse_args(argv)
    results = [measure(n, args.repeat) for n in SIZES]
    if args.json:
        json.dump({"repeat": args.repeat, "results": results}, sys.stdout, indent=2)
        print()
        return
    rows = [["GPUs", "notebooks", "scrape ms", "scrape kB", "reclaim pass ms"]]
    rows += [
        [
            f"{r['gpus']:,}",
            f"{r['notebooks']:,}",
            f"{r['scrape_ms']:.1f}",
            f"{r['scrape_bytes'] / 1000:.0f}",
            f"{r['pass_ms']:.1f}",
        ]
        for r in results
    ]
    print(align(rows))


if __name__ == "__main__":
    main()
