"""What each policy's churn refusals were, counted along the replay's own runs.

Run as ``python -m benchmarks.refusals [--model mig|sharing|all] [--seeds 1-5] [--churn 2000]
[--traces DIR] [--pods PATH --nodes PATH] [--trace-seed S] [--json] [--out PATH]`` (defaults: both
models, seeds 1 to 5, 2,000 steps). The trace is found as :mod:`benchmarks.replay` finds it
(``--traces``, ``$GPUPOOL_TRACES``, ``../shared/traces``; without one, the synthetic trace, and the
table and the JSON say so). For each model and each policy of :mod:`benchmarks.replay` it runs
:func:`benchmarks.replay.run_policy` once per seed (the fill, then ``--churn`` steps), watching
the run (a :class:`benchmarks.replay.Replay` subclass passed as ``make_run``: it only reads the
ledger, so every decision is the replay's own), and sorts every refused churn offer into exactly
one of four parts. It prints a table (sums over the seeds; under it a line per row: the
refusals per seed, the churn steps of the A refusals, the shapes of the rest and of the pods that
took a free node, and the supply by kind of pod) and writes the JSON (totals and, per
seed, the parts) to ``--out`` (default ``benchmarks/results/refusals.json``); ``--json`` prints
the JSON instead of the table.

Vocabulary
- *8-GPU node*: a node of exactly 8 GPUs; *fully free*: all 8 whole-free (no whole-GPU pod, MIG
  instance or share on any of them). An 8-GPU pod fits only on a fully free 8-GPU node.
- *whole-free GPU*: a GPU a 1-GPU (whole) pod could take now.
- *supply*: the fully free 8-GPU nodes the churn had to offer: those fully free when the churn
  begins (after the fill) plus one per release that left an 8-GPU node fully free (``supply_by``:
  by what kind of pod that release was, or ``fill end``).
- *the greedy matching*: the churn's 8-GPU offers in order; each takes one node of the supply
  made so far that no earlier 8-GPU offer took, when there is one (*matched*), else it is *beyond
  the supply*. (Any node of the supply so far can serve any later 8-GPU offer, so matching in
  order matches as many as possible.)

Columns (sums over the seeds; the JSON has them per seed too)
- ``offers``: churn offers (steps × seeds). ``refused``: churn offers refused
  (:class:`NoCapacity`), as counted here; the JSON's ``replay_refused`` is ``run_policy``'s own
  count (``churn_refused_share`` × steps): the command stops with an error if the two, or the
  parts' sum, differ.
- ``A none whole-free``: 1-GPU (whole) pods refused while not one GPU of the pool was whole-free.
- ``B beyond supply``: 8-GPU pods refused that the greedy matching left beyond the supply.
- ``C node taken``: 8-GPU pods refused although the matching had a node for them: a node of the
  supply had gone to another pod (see *took a free node*).
- ``rest``: every other refusal (the JSON's ``rest_by_shape`` names the shapes): pods that found
  room nowhere, e.g. 4-GPU pods, large shares. A + B + C + rest = refused.
- ``8-GPU offers``, ``supply`` (by 8-GPU pods / by any other pod, fill end included).
- ``took a free node (forced / choice)``: placements of pods other than 8-GPU pods that left a
  fully free 8-GPU node not fully free; *forced* when the pod fitted on no other node at that
  moment (checked with first-fit, every fully free 8-GPU node avoided), *by choice* otherwise.
  Each can cost a later 8-GPU pod (a C refusal).
- ``bound``: A + B (+ any 8-GPU offer beyond the supply that was placed all the same, JSON
  ``beyond_placed``): what a policy that kept every fully free 8-GPU node for 8-GPU pods and
  placed everything else that fitted would still have refused at these moments of this run.

This is an empirical breakdown along each policy's own run, not a proof over all policies:
releases follow ``rng.randrange(len(placed))``, so once two policies' refusals differ their runs
part, and the bound holds the rest of the run (which pods are placed where) as it was.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import trace as traces
from benchmarks.replay import (
    GPU_MILLI,
    MAX_WHOLE,
    MODELS,
    Replay,
    Shape,
    add_trace_arguments,
    fill_length,
    gpu_shapes,
    load_trace,
    run_policy,
)
from benchmarks.text import align
from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Allocation
from gpupool.core.placement import POLICIES, Demand, FirstFit

RESULTS = Path(__file__).resolve().parent / "results" / "refusals.json"
FILL_END = "fill end"


def shape_label(offer: str, count: int) -> str:
    """``4×GPU`` for whole GPUs, else the offer's name (``mig-7g.80gb``, ``share-810``)."""
    return f"{count}×GPU" if offer == "gpu" else offer


@dataclass
class Counts:
    """One policy's churn refusals, sorted into parts (one run, or the sum of several)."""

    offers: int = 0
    refused: int = 0
    replay_refused: int = 0
    none_whole_free: int = 0
    beyond_supply: int = 0
    node_taken: int = 0
    rest_by_shape: Counter[str] = field(default_factory=Counter)
    x8_offers: int = 0
    beyond_placed: int = 0
    supply_by: Counter[str] = field(default_factory=Counter)
    took_forced: Counter[str] = field(default_factory=Counter)
    took_choice: Counter[str] = field(default_factory=Counter)
    none_whole_free_steps: list[int] = field(default_factory=list)

    @property
    def rest(self) -> int:
        return sum(self.rest_by_shape.values())

    @property
    def supply(self) -> int:
        return sum(self.supply_by.values())

    @property
    def bound(self) -> int:
        return self.none_whole_free + self.beyond_supply + self.beyond_placed

    def __add__(self, other: Counts) -> Counts:
        return Counts(
            offers=self.offers + other.offers,
            refused=self.refused + other.refused,
            replay_refused=self.replay_refused + other.replay_refused,
            none_whole_free=self.none_whole_free + other.none_whole_free,
            beyond_supply=self.beyond_supply + other.beyond_supply,
            node_taken=self.node_taken + other.node_taken,
            rest_by_shape=self.rest_by_shape + other.rest_by_shape,
            x8_offers=self.x8_offers + other.x8_offers,
            beyond_placed=self.beyond_placed + other.beyond_placed,
            supply_by=self.supply_by + other.supply_by,
            took_forced=self.took_forced + other.took_forced,
            took_choice=self.took_choice + other.took_choice,
            none_whole_free_steps=self.none_whole_free_steps + other.none_whole_free_steps,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "offers": self.offers,
            "refused": self.refused,
            "replay_refused": self.replay_refused,
            "none_whole_free": self.none_whole_free,
            "beyond_supply": self.beyond_supply,
            "node_taken": self.node_taken,
            "rest": self.rest,
            "rest_by_shape": dict(sorted(self.rest_by_shape.items())),
            "bound": self.bound,
            "x8_offers": self.x8_offers,
            "beyond_placed": self.beyond_placed,
            "supply": self.supply,
            "supply_by": dict(sorted(self.supply_by.items())),
            "took_forced": dict(sorted(self.took_forced.items())),
            "took_choice": dict(sorted(self.took_choice.items())),
        }


class WatchedRun(Replay):
    """A :class:`Replay` that sorts its churn refusals into :class:`Counts` as they happen.

    It reads the ledger before and after each churn release and offer and decides nothing: the
    run is the one :func:`run_policy` makes without it."""

    def __init__(self, policy: str, shapes: Sequence[Shape], inventory: Inventory) -> None:
        super().__init__(policy, shapes, inventory)
        self.fill_offers = fill_length(shapes, len(inventory.gpus) * GPU_MILLI)
        self.counts = Counts()
        self.unmatched = 0  # supply no 8-GPU offer has taken yet (the greedy matching)
        self.churning = False
        self.probe = FirstFit()
        occ = self.ledger.occ
        self.eight = [len(gpus) == MAX_WHOLE for gpus in occ.node_gpus]

    # -- what the pool looks like ----------------------------------------------------------
    def fully_free(self) -> frozenset[int]:
        """The fully free 8-GPU nodes."""
        occ = self.ledger.occ
        return frozenset(
            n
            for (_model, free), bucket in occ.node_buckets.items()
            if free == MAX_WHOLE
            for n in bucket
            if self.eight[n]
        )

    def any_whole_free(self) -> bool:
        return any(
            free > 0 and bucket for (_, free), bucket in self.ledger.occ.node_buckets.items()
        )

    def fits_elsewhere(self, shape: Shape, avoid: frozenset[int]) -> bool:
        """Whether ``shape`` fits now on a node outside ``avoid`` (first-fit, nothing taken)."""
        offer = self.ledger.offers[shape.offer]
        return self.probe.place(self.ledger.occ, Demand.of(offer, shape.count, avoid)) is not None

    # -- the watched calls -----------------------------------------------------------------
    def begin_churn(self) -> None:
        if not self.churning:
            self.churning = True
            free = len(self.fully_free())
            if free:
                self.counts.supply_by[FILL_END] += free
            self.unmatched += free

    def release(self, index: int) -> None:
        self.begin_churn()
        occ = self.ledger.occ
        allocation: Allocation = self.ledger.allocations[self.placed[index][0]]
        nodes = {occ.node_of[occ.ordinal[d.gpu]] for d in allocation.devices}
        super().release(index)
        for n in sorted(nodes):
            if self.eight[n] and occ.node_whole_free(n) == MAX_WHOLE:
                self.counts.supply_by[shape_label(allocation.offer, len(allocation.devices))] += 1
                self.unmatched += 1

    def offer_next(self, timings: list[int]) -> bool:
        if self.next < self.fill_offers:
            return super().offer_next(timings)
        self.begin_churn()
        c = self.counts
        step = self.next - self.fill_offers
        shape = self.shapes[self.next % len(self.shapes)]
        label = shape_label(shape.offer, shape.count)
        x8 = shape.offer == "gpu" and shape.count == MAX_WHOLE
        none_free = shape.offer == "gpu" and shape.count == 1 and not self.any_whole_free()
        free_before = frozenset() if x8 else self.fully_free()
        room = bool(free_before) and self.fits_elsewhere(shape, free_before)
        matched = False
        if x8:
            c.x8_offers += 1
            if self.unmatched:
                self.unmatched -= 1
                matched = True
        c.offers += 1
        placed = super().offer_next(timings)
        if placed:
            if x8 and not matched:
                c.beyond_placed += 1
            elif free_before and free_before - self.fully_free():
                (c.took_choice if room else c.took_forced)[label] += 1
            return True
        c.refused += 1
        if none_free:
            c.none_whole_free += 1
            c.none_whole_free_steps.append(step)
        elif x8:
            if matched:
                c.node_taken += 1
            else:
                c.beyond_supply += 1
        else:
            c.rest_by_shape[label] += 1
        return False


def breakdown(
    policy: str,
    shapes: Sequence[Shape],
    nodes: Sequence[tuple[str, int]],
    churn_steps: int,
    seed: int,
    model: str = "mig",
) -> Counts:
    """One run of :func:`run_policy` (fill, then ``churn_steps`` steps with ``seed``), watched;
    ``replay_refused`` is the run's own count of churn refusals."""
    runs: list[WatchedRun] = []

    def make_run(policy: str, shapes: Sequence[Shape], inventory: Inventory) -> Replay:
        runs.append(WatchedRun(policy, shapes, inventory))
        return runs[-1]

    result = run_policy(policy, shapes, nodes, churn_steps, seed, model, make_run=make_run)
    [run] = runs
    run.counts.replay_refused = round((result.churn_refused_share or 0.0) * result.churn_steps)
    return run.counts


@dataclass
class Row:
    """One model and policy: the sum over seeds, and each seed's counts."""

    model: str
    policy: str
    seeds: list[int]
    per_seed: list[Counts]

    @property
    def total(self) -> Counts:
        total = Counts()
        for c in self.per_seed:
            total = total + c
        return total

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "policy": self.policy,
            "seeds": self.seeds,
            **self.total.to_json(),
            "per_seed": [
                {"seed": s} | c.to_json() | {"none_whole_free_steps": c.none_whole_free_steps}
                for s, c in zip(self.seeds, self.per_seed, strict=True)
            ],
        }


def run_rows(
    shapes_by_model: dict[str, list[Shape]],
    nodes: Sequence[tuple[str, int]],
    seeds: Sequence[int],
    churn_steps: int,
) -> list[Row]:
    rows = []
    for model, shapes in shapes_by_model.items():
        for policy in POLICIES:
            per_seed = [breakdown(policy, shapes, nodes, churn_steps, s, model) for s in seeds]
            for s, c in zip(seeds, per_seed, strict=True):
                parts = c.none_whole_free + c.beyond_supply + c.node_taken + c.rest
                if not c.refused == c.replay_refused == parts:
                    raise RuntimeError(
                        f"{model} {policy} seed {s}: the parts ({parts}) or the replay's count "
                        f"({c.replay_refused}) differ from the refusals counted ({c.refused})"
                    )
            rows.append(Row(model, policy, list(seeds), per_seed))
    return rows


# -- output ---------------------------------------------------------------------------------
def _share(n: int, of: int) -> str:
    return f"{n / of:.2%}" if of else "-"


def _shapes(counter: Counter[str]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(counter.items())) or "none"


def format_table(rows: Sequence[Row]) -> str:
    """The parts per model and policy (sums over seeds), then a line of details per row."""
    header = [
        "model",
        "policy",
        "offers",
        "refused",
        "A none whole-free",
        "B beyond supply",
        "C node taken",
        "rest",
        "8-GPU offers",
        "supply (8-GPU / other)",
        "took a free node (forced / choice)",
        "bound A+B",
        "refused %",
        "bound %",
    ]
    table = [header]
    for r in rows:
        t = r.total
        by8 = t.supply_by[shape_label("gpu", MAX_WHOLE)]
        table.append(
            [
                r.model,
                r.policy,
                f"{t.offers:,}",
                f"{t.refused:,}",
                f"{t.none_whole_free:,}",
                f"{t.beyond_supply:,}",
                f"{t.node_taken:,}",
                f"{t.rest:,}",
                f"{t.x8_offers:,}",
                f"{t.supply:,} ({by8:,} / {t.supply - by8:,})",
                f"{t.took_forced.total():,} / {t.took_choice.total():,}",
                f"{t.bound:,}",
                _share(t.refused, t.offers),
                _share(t.bound, t.offers),
            ]
        )
    lines = [align(table, left=(0, 1)), ""]
    for r in rows:
        t = r.total
        steps = t.none_whole_free_steps
        at = f" at churn steps {min(steps)}–{max(steps)}" if steps else ""
        lines.append(
            f"{r.model} {r.policy}: refused per seed "
            + ", ".join(str(c.refused) for c in r.per_seed)
            + f"; A{at}; rest: {_shapes(t.rest_by_shape)}; took a free node, forced: "
            f"{_shapes(t.took_forced)}, by choice: {_shapes(t.took_choice)}; supply by: "
            f"{_shapes(t.supply_by)}"
        )
    return "\n".join(lines)


def parse_seeds(text: str) -> list[int]:
    """``1-5`` → 1..5; ``1,3,7`` → those; ``4`` → [4]."""
    seeds: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            seeds.extend(range(int(first), int(last) + 1) if dash else [int(first)])
        except ValueError:
            raise argparse.ArgumentTypeError(f"not seeds: {text!r} (e.g. 1-5 or 1,3,7)") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"no seeds in {text!r}")
    return seeds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.refusals",
        description="Sort each placement policy's churn refusals on the trace into their causes.",
    )
    add_trace_arguments(parser)
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("1-5"), metavar="1-5")
    parser.add_argument("--churn", type=int, default=2000, metavar="STEPS")
    parser.add_argument("--json", action="store_true", help="print the JSON instead of a table")
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        metavar="PATH",
        help="where to write the JSON (default: benchmarks/results/refusals.json)",
    )
    args = parser.parse_args(argv)
    if args.churn <= 0:
        parser.error("--churn must be positive: the breakdown is of churn refusals")

    with tempfile.TemporaryDirectory(prefix="gpupool-trace-") as tmp:
        name, trace, nodes = load_trace(parser, args, Path(tmp))
    models = list(MODELS) if args.model == "all" else [args.model]
    rows = run_rows({m: gpu_shapes(trace, m) for m in models}, nodes, args.seeds, args.churn)
    about: dict[str, Any] = {"trace": name}
    if name == traces.SYNTHETIC:
        about["trace_seed"] = args.trace_seed
    about["churn_steps"] = args.churn
    document = [about | r.to_json() for r in rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if args.json:
        print(json.dumps(document, indent=2, ensure_ascii=False))
        return 0
    seeded = f" (seed {args.trace_seed})" if name == traces.SYNTHETIC else ""
    seeds = ", ".join(map(str, args.seeds))
    print(f"trace: {name}{seeded}: {len(trace):,} pods; pool: {len(nodes):,} nodes")
    print(f"churn: {args.churn:,} steps after the fill, seeds {seeds}; sums over the seeds")
    print()
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
