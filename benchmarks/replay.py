"""Replay the Alibaba GPU trace (FGD, ATC'23) through the real ledger, once per placement policy.

Run as ``python -m benchmarks.replay --policy all [--model mig|sharing] [--json]
[--churn STEPS --seed S] [--traces DIR]``. The trace is found as :mod:`benchmarks.trace` says
(``--traces``, ``$GPUPOOL_TRACES``, ``../shared/traces``); without one the replay runs on a
synthetic trace of the same columns and shape and says so (``trace: synthetic`` in the table and
the JSON).

Vocabulary
- *trace pod*: one row of ``openb_pod_list_default.csv``: ``num_gpu`` GPUs of ``gpu_milli``
  thousandths each, created at ``creation_time``.
- *model*: ``mig`` (the default: dynamic MIG) or ``sharing`` (the FGD paper's own: fractional
  shares of GPUs without MIG); see below.
- *shape*: what the replay asks the ledger for on a pod's behalf: ``count`` whole GPUs (offer
  ``gpu``), one MIG instance (offer ``mig-<profile>``, MIG model) or one share (offer
  ``share-<gpu_milli>``, sharing model), plus the pod's *demand* ``num_gpu * gpu_milli`` in
  thousandths of a GPU.
- *capacity*: the pool's GPU count (in thousandths where compared with demand).
- *offered* / *placed* / *refused*: pods handed to :meth:`Ledger.allocate`; granted; refused with
  :class:`NoCapacity`.
- *placed demand ratio*: summed demand of the placed pods over capacity: the headline, comparable
  to FGD's GPU allocation rate. *Blocked ratio*: summed ``cost_milli`` of the live allocations over
  capacity: what the allocations take away from everyone else (for MIG more than the demand,
  since a 0.46-GPU pod holds a 4g.40gb = 0.5 GPU-eq).

The MIG model (``--model mig``, the default), exactly
- Every GPU is an H100-80GB with dynamic MIG (``mig_mode="flex"``): it takes a whole-GPU request
  while no MIG instance is on it, or MIG instances while it is not held whole. Nodes come from the
  node file in file order, each with its ``gpu`` count of GPUs.
- Pods come in ``creation_time`` order (a stable sort, so ties keep file order; file order when the
  file has no times); GPU-less pods are skipped; there are no departures.
- ``gpu_milli == 1000``: ``num_gpu`` whole GPUs on one node. ``num_gpu == 1`` with
  ``gpu_milli < 1000``: one instance of the smallest of 1g.10gb, 2g.20gb, 3g.40gb, 4g.40gb,
  7g.80gb whose compute fraction (1/7, 2/7, 3/7, 4/7, 1) covers ``gpu_milli / 1000``. Any other
  combination has no shape in this model and is rejected with ``ValueError`` (the Alibaba trace
  has none).
- The fill offers pods until the summed demand of the offered pods reaches the capacity, or the
  trace ends (the default trace holds 97.99% of the default pool's capacity, so it ends first).
- Placement is the real :class:`gpupool.core.ledger.Ledger` with one team whose guarantee is so
  large that quotas never bind; offers ``gpu`` (kind ``gpu``, ``max_count`` 8) and one
  ``mig-<profile>`` per profile; policies from :func:`gpupool.core.placement.make_policy`.

The sharing model (``--model sharing``), exactly: the FGD paper's setting, GPU only
- Every GPU of the node list is a GPU without MIG (an L40S-48GB with MIG ``off``) of 1000 milli.
- ``gpu_milli == 1000``: ``num_gpu`` fully free GPUs on one node (offer ``gpu``). ``num_gpu == 1``
  with ``gpu_milli < 1000``: a share of that many milli of one GPU (offer ``share-<gpu_milli>``,
  kind ``share``, ``share_milli = gpu_milli``). Any other combination is rejected with
  ``ValueError``. Ordering, fill, churn, the team and the policies are as in the MIG model; the
  blocked ratio is the allocated milli over capacity (a share costs exactly its milli, so it
  equals the placed demand ratio).

Both models
- Churn (``--churn STEPS --seed S``): after the fill, STEPS times: release one placed pod,
  ``placed.pop(rng.randrange(len(placed)))`` with ``rng = random.Random(S)`` and ``placed`` in
  placement order, then offer the next pod of the cycle. Reported: the mean over steps of the
  placed demand ratio (measured after each step) and the share of churn offers refused.
- *Decision time*: the wall time of each :meth:`Ledger.allocate` call (granted or refused), by
  ``time.perf_counter_ns``, over the fill (and separately over the churn).

Contract: the loading, ordering and mapping functions are pure (apart from reading the CSV);
:func:`run_policy` runs one policy and returns a :class:`ReplayResult`. Nothing is copied from the
trace into the repository.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import trace as traces
from benchmarks.stats import mean, percentile
from benchmarks.text import align
from gpupool.core.errors import NoCapacity
from gpupool.core.inventory import GPU, Inventory, Node
from gpupool.core.ledger import Ledger
from gpupool.core.mig import geometry_for
from gpupool.core.offers import Offer, Request
from gpupool.core.placement import POLICIES, make_policy
from gpupool.core.quota import Team

MODEL = "H100-80GB"
MEMORY_MIB = 81559
PRODUCT = "NVIDIA H100 80GB HBM3"
MIG_PROFILES: tuple[str, ...] = ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
MAX_WHOLE = 8
TEAM = "replay"
GPU_MILLI = 1000
MODELS: tuple[str, ...] = ("mig", "sharing")
SHARE_MODEL = "L40S-48GB"
SHARE_MEMORY_MIB = 46068
SHARE_PRODUCT = "NVIDIA L40S"


# -- trace data -----------------------------------------------------------------------------
@dataclass(frozen=True)
class TracePod:
    """One row of the pod file."""

    name: str
    num_gpu: int
    gpu_milli: int
    creation_time: int | None = None


@dataclass(frozen=True)
class Shape:
    """What the replay offers the ledger for one pod."""

    name: str
    offer: str
    count: int
    demand_milli: int


def read_pods(path: Path) -> list[TracePod]:
    """The pod file's rows, in file order. ``creation_time`` is ``None`` where empty or absent."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    pods = []
    for row in rows:
        created = (row.get("creation_time") or "").strip()
        pods.append(
            TracePod(
                name=row["name"],
                num_gpu=int(row["num_gpu"]),
                gpu_milli=int(row["gpu_milli"]),
                creation_time=int(created) if created else None,
            )
        )
    return pods


def read_nodes(path: Path) -> list[tuple[str, int]]:
    """``(name, gpu count)`` per row of the node file, in file order."""
    with path.open(newline="") as f:
        return [(row["sn"], int(row["gpu"])) for row in csv.DictReader(f)]


def order_pods(pods: Sequence[TracePod]) -> list[TracePod]:
    """Pods by ``creation_time``, ties in file order; file order if any pod has no time."""
    if any(p.creation_time is None for p in pods):
        return list(pods)
    return sorted(pods, key=lambda p: p.creation_time or 0)  # sorted() is stable


def mig_profile_for(gpu_milli: int) -> str:
    """The smallest H100-80GB profile whose compute fraction covers ``gpu_milli / 1000``.

    ``k/7 >= gpu_milli/1000`` is checked as ``1000 k >= 7 gpu_milli`` (exact): 142 → 1g.10gb,
    143 → 2g.20gb, 571 → 4g.40gb, 572 → 7g.80gb (there is no 5g or 6g).
    """
    if not 0 < gpu_milli <= GPU_MILLI:
        raise ValueError(f"gpu_milli {gpu_milli} is not a share of one GPU")
    geo = geometry_for(MODEL)
    assert geo is not None
    for name in MIG_PROFILES:
        p = geo.by_name[name]
        if p.compute_slices * GPU_MILLI >= gpu_milli * geo.compute_slices:
            return name
    raise AssertionError("7g.80gb covers every share")  # pragma: no cover


def shape_of(pod: TracePod, model: str = "mig") -> Shape | None:
    """The shape the replay offers for ``pod`` in ``model``; ``None`` for a GPU-less pod.

    ``ValueError`` for a pod this model has no shape for: several fractional GPUs, more whole
    GPUs than one offer takes, or a ``gpu_milli`` outside (0, 1000].
    """
    if pod.num_gpu == 0:
        return None
    demand = pod.num_gpu * pod.gpu_milli
    if pod.gpu_milli == GPU_MILLI:
        if not 1 <= pod.num_gpu <= MAX_WHOLE:
            raise ValueError(f"{pod.name}: {pod.num_gpu} whole GPUs; the model takes 1 to 8")
        return Shape(pod.name, "gpu", pod.num_gpu, demand)
    if pod.num_gpu == 1 and model == "sharing":
        if not 0 < pod.gpu_milli < GPU_MILLI:
            raise ValueError(f"{pod.name}: gpu_milli {pod.gpu_milli} is not a share of one GPU")
        return Shape(pod.name, f"share-{pod.gpu_milli}", 1, demand)
    if pod.num_gpu == 1:
        return Shape(pod.name, f"mig-{mig_profile_for(pod.gpu_milli)}", 1, demand)
    raise ValueError(
        f"{pod.name}: {pod.num_gpu} GPUs of {pod.gpu_milli} thousandths each has no shape in "
        "this model (one MIG or share offer is one instance or share)"
    )


def gpu_shapes(pods: Iterable[TracePod], model: str = "mig") -> list[Shape]:
    """Ordered shapes of the GPU pods in ``model`` (GPU-less pods skipped)."""
    shapes = (shape_of(p, model) for p in order_pods(list(pods)))
    return [s for s in shapes if s is not None]


def fill_length(shapes: Sequence[Shape], capacity_milli: int) -> int:
    """How many offers the fill makes: the first ``n`` of ``shapes`` whose summed demand reaches
    ``capacity_milli`` (the pod that reaches it is offered), or all of them if none does."""
    total = n = 0
    while total < capacity_milli and n < len(shapes):
        total += shapes[n].demand_milli
        n += 1
    return n


# -- the pool -------------------------------------------------------------------------------
def _gpu(name: str, i: int, model: str) -> GPU:
    if model == "sharing":
        return GPU(
            uuid=f"GPU-{name}-{i}",
            index=i,
            model=SHARE_MODEL,
            memory_mib=SHARE_MEMORY_MIB,
            product_name=SHARE_PRODUCT,
        )
    return GPU(
        uuid=f"GPU-{name}-{i}",
        index=i,
        model=MODEL,
        memory_mib=MEMORY_MIB,
        mig_capable=True,
        mig_mode="flex",
        product_name=PRODUCT,
    )


def build_inventory(nodes: Sequence[tuple[str, int]], model: str = "mig") -> Inventory:
    """Per GPU of each node (nodes in the given order) a flex-MIG H100-80GB (MIG model) or an
    L40S-48GB without MIG (sharing model)."""
    return Inventory(
        nodes=tuple(
            Node(name, tuple(_gpu(name, i, model) for i in range(count))) for name, count in nodes
        ),
        source="alibaba-gpu-v2023 replay",
        simulated=True,
    )


def build_offers(shapes: Iterable[Shape] = ()) -> dict[str, Offer]:
    """``gpu``, one ``mig-<profile>`` per profile and one ``share-<milli>`` per share in
    ``shapes``."""
    offers = {"gpu": Offer("gpu", "gpu", max_count=MAX_WHOLE)}
    for p in MIG_PROFILES:
        offers[f"mig-{p}"] = Offer(f"mig-{p}", "mig", profile=p)
    for s in shapes:
        if s.offer.startswith("share-") and s.offer not in offers:
            milli = int(s.offer.removeprefix("share-"))
            offers[s.offer] = Offer(s.offer, "share", share_milli=milli)
    return offers


def build_ledger(inventory: Inventory, policy: str, shapes: Iterable[Shape] = ()) -> Ledger:
    """The real ledger over ``inventory``: one team whose quota never binds."""
    team = Team(TEAM, guarantee_milli=10**15)
    return Ledger(inventory, build_offers(shapes), {TEAM: team}, policy=make_policy(policy))


# -- one run --------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplayResult:
    """What one policy did with the trace. All but the ``churn_*`` fields describe the fill."""

    policy: str
    gpus: int
    offered: int
    placed: int
    refused: int
    offered_demand_ratio: float
    placed_demand_ratio: float
    blocked_ratio: float
    decision_us_mean: float
    decision_us_p99: float
    churn_steps: int = 0
    churn_mean_placed_demand: float | None = None
    churn_refused_share: float | None = None
    churn_decision_us_mean: float | None = None
    churn_decision_us_p99: float | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "policy": self.policy,
            "placed": self.placed,
            "refused": self.refused,
            "placed_demand_ratio": self.placed_demand_ratio,
            "blocked_ratio": self.blocked_ratio,
            "decision_us_mean": self.decision_us_mean,
            "decision_us_p99": self.decision_us_p99,
            "gpus": self.gpus,
            "offered": self.offered,
            "offered_demand_ratio": self.offered_demand_ratio,
        }
        if self.churn_steps:
            out |= {
                "churn_steps": self.churn_steps,
                "churn_mean_placed_demand": self.churn_mean_placed_demand,
                "churn_refused_share": self.churn_refused_share,
                "churn_decision_us_mean": self.churn_decision_us_mean,
                "churn_decision_us_p99": self.churn_decision_us_p99,
            }
        return out


class Replay:
    """The mutable state of one run: the ledger, the placed pods and the cycle position.

    :func:`run_policy` drives it (``offer_next`` for every offer, ``release`` for every churn
    release); an analysis may pass a subclass that watches those calls (``make_run``)."""

    def __init__(self, policy: str, shapes: Sequence[Shape], inventory: Inventory) -> None:
        self.ledger = build_ledger(inventory, policy, shapes)
        self.shapes = shapes
        self.next = 0  # position in the cycle over shapes; also makes allocation ids unique
        self.placed: list[tuple[str, int]] = []  # (allocation id, demand), in placement order
        self.placed_demand = 0
        self.offered_demand = 0

    def offer_next(self, timings: list[int]) -> bool:
        shape = self.shapes[self.next % len(self.shapes)]
        alloc_id = f"{shape.name}#{self.next}"
        self.next += 1
        self.offered_demand += shape.demand_milli
        request = Request("replay", TEAM, shape.offer, shape.count, "notebook", shape.name)
        t0 = time.perf_counter_ns()
        try:
            self.ledger.allocate(request, alloc_id)
        except NoCapacity:
            timings.append(time.perf_counter_ns() - t0)
            return False
        timings.append(time.perf_counter_ns() - t0)
        self.placed.append((alloc_id, shape.demand_milli))
        self.placed_demand += shape.demand_milli
        return True

    def release(self, index: int) -> None:
        alloc_id, demand = self.placed.pop(index)
        self.ledger.release(alloc_id)
        self.placed_demand -= demand

    def blocked_milli(self) -> int:
        return sum(a.cost_milli for a in self.ledger.allocations.values())


def run_policy(
    policy: str,
    shapes: Sequence[Shape],
    nodes: Sequence[tuple[str, int]],
    churn_steps: int = 0,
    seed: int = 0,
    model: str = "mig",
    make_run: Callable[[str, Sequence[Shape], Inventory], Replay] = Replay,
) -> ReplayResult:
    """Fill the pool of ``model`` with ``shapes`` under ``policy``, then churn ``churn_steps``
    times. ``make_run`` builds the run's :class:`Replay` (a subclass may watch it)."""
    inventory = build_inventory(nodes, model)
    gpus = len(inventory.gpus)
    capacity = gpus * GPU_MILLI
    run = make_run(policy, shapes, inventory)
    gc.collect()
    fill_ns: list[int] = []
    placed = refused = 0
    for _ in range(fill_length(shapes, capacity)):
        if run.offer_next(fill_ns):
            placed += 1
        else:
            refused += 1
    ratio = (lambda milli: milli / capacity) if capacity else (lambda milli: 0.0)
    result = ReplayResult(
        policy=policy,
        gpus=gpus,
        offered=placed + refused,
        placed=placed,
        refused=refused,
        offered_demand_ratio=ratio(run.offered_demand),
        placed_demand_ratio=ratio(run.placed_demand),
        blocked_ratio=ratio(run.blocked_milli()),
        decision_us_mean=mean(fill_ns) / 1000,
        decision_us_p99=percentile(fill_ns, 0.99) / 1000,
    )
    if churn_steps <= 0 or not shapes:
        return result
    rng = random.Random(seed)
    churn_ns: list[int] = []
    samples: list[float] = []
    churn_refused = 0
    for _ in range(churn_steps):
        if run.placed:
            run.release(rng.randrange(len(run.placed)))
        if not run.offer_next(churn_ns):
            churn_refused += 1
        samples.append(ratio(run.placed_demand))
    return replace(
        result,
        churn_steps=churn_steps,
        churn_mean_placed_demand=mean(samples),
        churn_refused_share=churn_refused / churn_steps,
        churn_decision_us_mean=mean(churn_ns) / 1000,
        churn_decision_us_p99=percentile(churn_ns, 0.99) / 1000,
    )


# -- output ---------------------------------------------------------------------------------
def format_table(results: Sequence[ReplayResult]) -> str:
    """A plain aligned text table, one row per policy."""
    churn = any(r.churn_steps for r in results)
    header = [
        "policy",
        "placed",
        "refused",
        "placed demand",
        "blocked",
        "µs/decision",
        "p99 µs",
    ]
    if churn:
        header += ["churn placed demand", "churn refused", "churn µs", "churn p99 µs"]
    rows = [header]
    for r in results:
        row = [
            r.policy,
            f"{r.placed:,}",
            f"{r.refused:,}",
            f"{r.placed_demand_ratio:.2%}",
            f"{r.blocked_ratio:.2%}",
            f"{r.decision_us_mean:.1f}",
            f"{r.decision_us_p99:.1f}",
        ]
        if churn:
            row += [
                f"{r.churn_mean_placed_demand or 0:.2%}",
                f"{r.churn_refused_share or 0:.2%}",
                f"{r.churn_decision_us_mean or 0:.1f}",
                f"{r.churn_decision_us_p99 or 0:.1f}",
            ]
        rows.append(row)
    return align(rows, left=(0,))


def load_trace(
    parser: argparse.ArgumentParser, args: argparse.Namespace, tmp: Path
) -> tuple[str, list[TracePod], list[tuple[str, int]]]:
    """``(trace name, pods, nodes)``: the real files (the name is the pod file's path) or, when
    none is found, a synthetic trace written under ``tmp`` (the name is ``synthetic``)."""
    try:
        source = traces.locate(args.traces)
    except FileNotFoundError as e:
        parser.error(str(e))
    if source.folder is not None:
        pods = args.pods or source.pods
        nodes = args.nodes or source.nodes
    elif args.pods and args.nodes:
        pods, nodes = args.pods, args.nodes
    elif args.pods or args.nodes:
        parser.error(f"--pods and --nodes go together when no trace folder is found ({source.why})")
    else:
        print(traces.notice(source), file=sys.stderr)
        folder = traces.write_synthetic_trace(tmp, args.trace_seed)
        return (
            traces.SYNTHETIC,
            read_pods(folder / traces.POD_FILE),
            read_nodes(folder / traces.NODE_FILE),
        )
    return traces.label(pods), read_pods(pods), read_nodes(nodes)


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that say which trace to read (``--traces``, ``--pods``, ``--nodes``,
    ``--trace-seed``), as :func:`load_trace` takes them."""
    parser.add_argument(
        "--traces",
        type=Path,
        metavar="DIR",
        help=f"folder holding {traces.SUBDIR}/ (default: ${traces.ENV}, else ../shared/traces "
        "beside the repository; without a trace, a synthetic one)",
    )
    parser.add_argument("--pods", type=Path, help="pod list CSV (default: the trace folder's)")
    parser.add_argument("--nodes", type=Path, help="node list CSV (default: the trace folder's)")
    parser.add_argument(
        "--trace-seed", type=int, default=0, metavar="S", help="seed of the synthetic trace"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.replay",
        description="Replay the Alibaba GPU trace through the ledger with each placement policy.",
    )
    add_trace_arguments(parser)
    parser.add_argument("--policy", choices=[*POLICIES, "all"], default="all")
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="mig",
        help="mig: flex-MIG H100s, fractions as MIG instances (default); sharing: GPUs without "
        "MIG, fractions as shares of milli (the FGD paper's model)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead")
    parser.add_argument("--churn", type=int, default=0, metavar="STEPS")
    parser.add_argument("--seed", type=int, default=0, metavar="S")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="gpupool-trace-") as tmp:
        name, trace, nodes = load_trace(parser, args, Path(tmp))
    synthetic = name == traces.SYNTHETIC
    shapes = gpu_shapes(trace, args.model)
    policies = list(POLICIES) if args.policy == "all" else [args.policy]
    results = [run_policy(p, shapes, nodes, args.churn, args.seed, args.model) for p in policies]
    if args.json:
        about: dict[str, Any] = {"trace": name, "model": args.model}
        if synthetic:
            about["trace_seed"] = args.trace_seed
        print(json.dumps([about | r.to_json() for r in results], indent=2))
        return 0
    gpus = sum(n for _, n in nodes)
    first = results[0]
    seeded = f" (seed {args.trace_seed})" if synthetic else ""
    print(
        f"trace: {name}{seeded}: {len(trace):,} pods, {len(shapes):,} with GPUs "
        f"({len(trace) - len(shapes):,} GPU-less skipped); pool: {len(nodes):,} nodes, "
        + (
            f"{gpus:,} {SHARE_MODEL} (MIG off, shares of 1000 milli)"
            if args.model == "sharing"
            else f"{gpus:,} {MODEL} (flex MIG)"
        )
    )
    wrapped = f", wrapping around after {len(shapes):,}" if first.offered > len(shapes) else ""
    print(
        f"fill: {first.offered:,} pods offered{wrapped}, demand "
        f"{first.offered_demand_ratio:.2%} of capacity"
    )
    if args.churn:
        print(f"churn: {args.churn:,} steps, seed {args.seed}")
    print()
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
