"""Allocation and release latency of the ledger as the pool grows, for each placement policy.

Run as ``python -m benchmarks.allocator [--json]``.

Vocabulary
- *pool size*: 64, 512 and 4,096 H100-80GB GPUs in nodes of 8. Nodes repeat an 8-node pattern:
  5 whole-GPU nodes (MIG ``off``), 2 dynamic-MIG nodes (a quarter of the GPUs; the policy picks
  the start slot) and 1 fixed-layout MIG node whose GPUs carry pre-created
  :class:`~gpupool.core.inventory.MigInstance` layouts (3g+3g, 3g+2g+1g, 3×2g+1g, 7×1g).
  Then 65,536 GPUs *with shares*: the same pattern, whole-GPU nodes also taking shares.
- *request mix*: 20% whole GPUs (1, 2, 4 or 8 with weights 50/25/15/10) and 80% one MIG instance
  (1g.10gb, 2g.20gb, 3g.40gb with weights 40/35/25), charged to one of four teams (traffic
  40/30/20/10%). *With shares*: 20% whole GPUs, 40% MIG instances and 40% shares of a GPU with
  MIG off (by fraction: 1/8, 1/4, 1/2, 0.3 with weights 30/30/20/10; by size: 10 GB, 20 GB with
  weights 5/5; both weights within the 40%). Team limits (guarantee + borrowing) are 30, 40, 25
  and 10% of the pool, so the busiest team runs into its quota at 80% load; one team also has a
  4 GPU-eq per-user cap.
- *fill*: allocate from the request stream until the live allocations block 80% of the pool.
- *steady state*: ``STEPS`` steps, each releasing one random live allocation when the pool is at
  or above 80% and then making one allocation attempt. Latencies are measured here only.
- *alloc latency*: wall time of one :meth:`Ledger.allocate` call, granted or refused
  (:class:`QuotaExceeded` or :class:`NoCapacity`); *release latency*: one :meth:`Ledger.release`.
  Both by ``time.perf_counter_ns``; p50 and p99 are nearest-rank, in µs. *whole* / *MIG*: the
  attempts for whole GPUs and for MIG instances on their own.
- *offers*: ``gpu`` (1 to 8 whole H100-80GB on one node) and ``mig-<profile>``, all naming the
  model ``H100-80GB`` (see :func:`build_offers` for why).

Contract: every policy at one size sees the same seeded request stream and release RNG (the
release choices diverge once the policies' outcomes do). Each run ends with
:meth:`Ledger.check_invariants`, outside the timing. No I/O besides printing.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from benchmarks.stats import mean, percentile
from benchmarks.text import align
from gpupool.core.errors import NoCapacity, QuotaExceeded
from gpupool.core.inventory import GPU, Inventory, MigInstance, MigMode, Node
from gpupool.core.ledger import Ledger
from gpupool.core.offers import Offer, Request
from gpupool.core.placement import POLICIES, make_policy
from gpupool.core.quota import Team

MODEL = "H100-80GB"
MEMORY_MIB = 81559
GPUS_PER_NODE = 8
SIZES: tuple[int, ...] = (64, 512, 4096)
SHARE_SIZES: tuple[int, ...] = (65536,)
TARGET = 0.80
STEPS = 3000
SEED = 20231

NodeKind = Literal["whole", "dynamic", "fixed"]
NODE_PATTERN: tuple[NodeKind, ...] = (
    "whole",
    "dynamic",
    "whole",
    "fixed",
    "whole",
    "dynamic",
    "whole",
    "whole",
)
FIXED_LAYOUTS: tuple[tuple[tuple[str, int], ...], ...] = (
    (("3g.40gb", 0), ("3g.40gb", 4)),
    (("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)),
    (("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)),
    tuple(("1g.10gb", s) for s in range(7)),
)
MIG_PROFILES: tuple[str, ...] = ("1g.10gb", "2g.20gb", "3g.40gb")

# (offer, count), weight: 20% whole GPUs, 80% MIG instances
REQUEST_MIX: tuple[tuple[tuple[str, int], float], ...] = (
    (("gpu", 1), 0.20 * 0.50),
    (("gpu", 2), 0.20 * 0.25),
    (("gpu", 4), 0.20 * 0.15),
    (("gpu", 8), 0.20 * 0.10),
    (("mig-1g.10gb", 1), 0.80 * 0.40),
    (("mig-2g.20gb", 1), 0.80 * 0.35),
    (("mig-3g.40gb", 1), 0.80 * 0.25),
)

SHARE_OFFERS: dict[str, tuple[int | None, int | None]] = {
    # name: (share_milli, share_mib)
    "share-eighth": (125, None),
    "share-quarter": (250, None),
    "share-half": (500, None),
    "share-0.3": (300, None),
    "share-10gb": (None, 10240),
    "share-20gb": (None, 20480),
}
REQUEST_MIX_SHARES: tuple[tuple[tuple[str, int], float], ...] = (
    (("gpu", 1), 0.20 * 0.50),
    (("gpu", 2), 0.20 * 0.25),
    (("gpu", 4), 0.20 * 0.15),
    (("gpu", 8), 0.20 * 0.10),
    (("mig-1g.10gb", 1), 0.40 * 0.40),
    (("mig-2g.20gb", 1), 0.40 * 0.35),
    (("mig-3g.40gb", 1), 0.40 * 0.25),
    (("share-eighth", 1), 0.40 * 0.30),
    (("share-quarter", 1), 0.40 * 0.30),
    (("share-half", 1), 0.40 * 0.20),
    (("share-0.3", 1), 0.40 * 0.10),
    (("share-10gb", 1), 0.40 * 0.05),
    (("share-20gb", 1), 0.40 * 0.05),
)

USERS_PER_TEAM = 8


@dataclass(frozen=True)
class TeamSpec:
    name: str
    traffic: float
    guarantee: float  # share of the pool
    borrow: float  # share of the pool
    user_cap_milli: int | None = None


TEAMS: tuple[TeamSpec, ...] = (
    TeamSpec("vision", 0.40, 0.25, 0.05),
    TeamSpec("nlp", 0.30, 0.25, 0.15),
    TeamSpec("speech", 0.20, 0.15, 0.10, user_cap_milli=4000),
    TeamSpec("theory", 0.10, 0.10, 0.00),
)


# -- the pool -------------------------------------------------------------------------------
def build_inventory(gpus: int) -> Inventory:
    """``gpus`` H100-80GB in nodes of 8, node kinds repeating :data:`NODE_PATTERN`."""
    nodes = []
    for n in range(gpus // GPUS_PER_NODE):
        kind = NODE_PATTERN[n % len(NODE_PATTERN)]
        mode: MigMode = "off" if kind == "whole" else kind
        devices = []
        for i in range(GPUS_PER_NODE):
            uuid = f"GPU-{n:04d}-{i}"
            instances: tuple[MigInstance, ...] = ()
            if kind == "fixed":
                layout = FIXED_LAYOUTS[(n * GPUS_PER_NODE + i) % len(FIXED_LAYOUTS)]
                instances = tuple(MigInstance(p, s, f"MIG-{n:04d}-{i}-{s}") for p, s in layout)
            devices.append(
                GPU(
                    uuid, i, MODEL, MEMORY_MIB, mig_capable=True, mig_mode=mode, instances=instances
                )
            )
        nodes.append(Node(f"node-{n:04d}", tuple(devices)))
    return Inventory(tuple(nodes), source="allocator benchmark", simulated=True)


def build_offers() -> dict[str, Offer]:
    # MIG offers name the model: without it the quota check prices 1g.10gb as the A100-40GB
    # profile of that name (2 slots, 0.25 GPU-eq) while the allocation costs 0.125.
    offers = {"gpu": Offer("gpu", "gpu", model=MODEL, max_count=8)}
    for p in MIG_PROFILES:
        offers[f"mig-{p}"] = Offer(f"mig-{p}", "mig", model=MODEL, profile=p)
    for name, (milli, mib) in SHARE_OFFERS.items():
        offers[name] = Offer(name, "share", model=MODEL, share_milli=milli, share_mib=mib)
    return offers


def build_teams(gpus: int) -> dict[str, Team]:
    capacity = gpus * 1000
    return {
        t.name: Team(
            t.name,
            guarantee_milli=round(t.guarantee * capacity),
            borrow_limit_milli=round(t.borrow * capacity),
            user_cap_milli=t.user_cap_milli,
        )
        for t in TEAMS
    }


def request_stream(seed: int, shares: bool = False) -> Iterator[Request]:
    """An endless, reproducible request stream from :data:`REQUEST_MIX` (or, with ``shares``,
    :data:`REQUEST_MIX_SHARES`) and :data:`TEAMS`."""
    rng = random.Random(seed)
    mix = REQUEST_MIX_SHARES if shares else REQUEST_MIX
    shapes = [s for s, _ in mix]
    weights = [w for _, w in mix]
    teams = [t.name for t in TEAMS]
    traffic = [t.traffic for t in TEAMS]
    for i in itertools.count():
        offer, count = rng.choices(shapes, weights)[0]
        team = rng.choices(teams, traffic)[0]
        user = f"{team}-{rng.randrange(USERS_PER_TEAM)}"
        kind: Literal["notebook", "job"] = "job" if count > 1 else "notebook"
        yield Request(user, team, offer, count, kind, f"r{i}")


# -- one run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Latency:
    count: int
    p50_us: float
    p99_us: float
    mean_us: float

    @classmethod
    def of(cls, ns: Sequence[int]) -> Latency:
        return cls(
            len(ns), percentile(ns, 0.5) / 1000, percentile(ns, 0.99) / 1000, mean(ns) / 1000
        )


@dataclass(frozen=True)
class AllocatorResult:
    gpus: int
    policy: str
    fill_allocations: int
    granted: int
    quota_refused: int
    capacity_refused: int
    mean_blocked_ratio: float
    alloc: Latency
    alloc_granted: Latency
    alloc_refused: Latency
    alloc_whole: Latency
    alloc_mig: Latency
    release: Latency
    shares: bool = False
    alloc_share: Latency | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def run_one(
    gpus: int, policy: str, steps: int = STEPS, seed: int = SEED, shares: bool = False
) -> AllocatorResult:
    """Fill a ``gpus``-GPU pool to :data:`TARGET` under ``policy``, then time ``steps`` steps
    (with ``shares``, share requests in the mix)."""
    inventory = build_inventory(gpus)
    ledger = Ledger(inventory, build_offers(), build_teams(gpus), policy=make_policy(policy))
    capacity = gpus * 1000
    target = TARGET * capacity
    stream = request_stream(seed, shares)
    release_rng = random.Random(seed + 1)
    live: list[str] = []
    blocked = 0
    next_id = 0

    def attempt(request: Request) -> tuple[bool, str, int]:
        nonlocal blocked, next_id
        alloc_id = f"a{next_id}"
        next_id += 1
        t0 = time.perf_counter_ns()
        try:
            allocation = ledger.allocate(request, alloc_id)
        except QuotaExceeded:
            return False, "quota", time.perf_counter_ns() - t0
        except NoCapacity:
            return False, "capacity", time.perf_counter_ns() - t0
        dt = time.perf_counter_ns() - t0
        live.append(alloc_id)
        blocked += allocation.cost_milli
        return True, "", dt

    # fill: until 80% is blocked (giving up after 40 attempts per GPU)
    fill = 0
    for _ in range(40 * gpus):
        if blocked >= target:
            break
        fill += attempt(next(stream))[0]
    gc.collect()

    granted_ns: list[int] = []
    refused_ns: list[int] = []
    by_kind: dict[str, list[int]] = {"gpu": [], "mig": [], "share": []}
    release_ns: list[int] = []
    refused = {"quota": 0, "capacity": 0}
    blocked_samples: list[float] = []
    for _ in range(steps):
        if blocked >= target and live:
            alloc_id = live.pop(release_rng.randrange(len(live)))
            t0 = time.perf_counter_ns()
            allocation = ledger.release(alloc_id)
            release_ns.append(time.perf_counter_ns() - t0)
            blocked -= allocation.cost_milli
        request = next(stream)
        ok, why, dt = attempt(request)
        by_kind[request.offer.split("-")[0]].append(dt)
        if ok:
            granted_ns.append(dt)
        else:
            refused_ns.append(dt)
            refused[why] += 1
        blocked_samples.append(blocked / capacity)
    ledger.check_invariants()
    return AllocatorResult(
        gpus=gpus,
        policy=policy,
        fill_allocations=fill,
        granted=len(granted_ns),
        quota_refused=refused["quota"],
        capacity_refused=refused["capacity"],
        mean_blocked_ratio=mean(blocked_samples),
        alloc=Latency.of(granted_ns + refused_ns),
        alloc_granted=Latency.of(granted_ns),
        alloc_refused=Latency.of(refused_ns),
        alloc_whole=Latency.of(by_kind["gpu"]),
        alloc_mig=Latency.of(by_kind["mig"]),
        release=Latency.of(release_ns),
        shares=shares,
        alloc_share=Latency.of(by_kind["share"]) if shares else None,
    )


# -- output ---------------------------------------------------------------------------------
def format_table(results: Sequence[AllocatorResult]) -> str:
    header = [
        "GPUs",
        "policy",
        "allocs",
        "granted",
        "quota-refused",
        "no-capacity",
        "load",
        "alloc p50 µs",
        "alloc p99 µs",
        "whole p50 µs",
        "MIG p50 µs",
        "share p50 µs",
        "refused p99 µs",
        "release p50 µs",
        "release p99 µs",
    ]
    rows = [header]
    for r in results:
        rows.append(
            [
                f"{r.gpus:,}" + (" +shares" if r.shares else ""),
                r.policy,
                f"{r.alloc.count:,}",
                f"{r.granted:,}",
                f"{r.quota_refused:,}",
                f"{r.capacity_refused:,}",
                f"{r.mean_blocked_ratio:.0%}",
                f"{r.alloc.p50_us:.1f}",
                f"{r.alloc.p99_us:.1f}",
                f"{r.alloc_whole.p50_us:.1f}",
                f"{r.alloc_mig.p50_us:.1f}",
                f"{r.alloc_share.p50_us:.1f}" if r.alloc_share else "-",
                f"{r.alloc_refused.p99_us:.1f}",
                f"{r.release.p50_us:.1f}",
                f"{r.release.p99_us:.1f}",
            ]
        )
    return align(rows, left=(1,))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.allocator",
        description="Allocation and release latency of the ledger at 64, 512 and 4,096 GPUs, "
        "and at 65,536 GPUs with shares in the mix.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--steps", type=int, default=STEPS, help="steady-state steps per run")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--sizes",
        default="all",
        choices=["all", "mig", "shares"],
        help="the MIG sizes, the share size, or both (default)",
    )
    args = parser.parse_args(argv)
    runs = [(g, False) for g in SIZES] if args.sizes != "shares" else []
    runs += [(g, True) for g in SHARE_SIZES] if args.sizes != "mig" else []
    results = [run_one(g, p, args.steps, args.seed, s) for g, s in runs for p in POLICIES]
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
        return 0
    print(
        f"steady state at {TARGET:.0%} load, {args.steps:,} steps per run (seed {args.seed}); "
        "nodes of 8 H100-80GB: 5/8 whole (with shares: whole or shares), 2/8 dynamic MIG, "
        "1/8 fixed MIG layouts"
    )
    print()
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
