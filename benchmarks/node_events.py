"""What one node watch event costs the hub: before irrelevant changes were skipped, before a
relevant change rebuilt only its node, and now.

Run as ``python -m benchmarks.node_events [--json] [--nodes N] [--allocations N] [--events N]``.

Vocabulary
- *cluster*: ``--nodes`` GPU nodes (default 1,000) as the API server sends them: nine in ten are
  A100-80GB nodes under the ``mixed`` MIG strategy (one whole GPU, seven GPUs in the
  ``all-balanced`` layout: 2×1g.10gb, 1×2g.20gb, 1×3g.40gb each), one in ten eight whole
  H100-80GBs. Every node carries GPU Feature Discovery's labels and the kubelet's ``Ready``
  condition.
- *allocations*: ``--allocations`` (default 10,000) one-instance MIG allocations (1g.10gb,
  2g.20gb, 3g.40gb, cycling) granted on the A100 nodes before the events.
- *irrelevant event*: a ``MODIFIED`` node whose only change is GFD's ``nvidia.com/gfd.timestamp``
  label (GFD rewrites it every 60 s on every node).
- *relevant event*: a ``MODIFIED`` H100 node whose ``nvidia.com/gpu`` goes 8 -> 7 -> 8 (a GPU
  falls off the bus and comes back): the inventory changes and every allocation is restored
  onto the new one.
- *before*: the reconciler's watch handler as it was (commit 4961726): cache the object, then
  :meth:`KubeReconciler.apply_nodes` over every node (a new effective inventory under the pool's
  lock, every allocation restored) and :meth:`KubeReconciler.apply_tenants` (the tenants' devices
  under it), for every event. *skip*: the handler at 6cf11cc: :func:`gpupool.kube.nodes.
  inventory_view` of the object, compared with the cached view; only a changed view goes on to
  the two calls, the first still over every node. *after*: the handler now: the same skip, then
  ``apply_nodes([name])``: only the changed node's part of the inventory is built and only its
  allocations restored (:meth:`gpupool.core.ledger.Ledger.replace_nodes`). All are the calls the
  reflector makes (``KubeReconciler.reflect``), without the HTTP watch around them.
- *cost per event*: wall time (``time.perf_counter``) of the handler, mean and the largest, in ms.

Contract: no I/O besides printing and a temporary SQLite file the pool needs (nothing is
written to it: allocations are granted in the ledger before the pool is made). Each run ends
with :meth:`Ledger.check_invariants`, outside the timing.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.text import align
from gpupool.core.ledger import Ledger
from gpupool.core.offers import Offer, Request
from gpupool.core.quota import Team
from gpupool.kube.nodes import inventory_from_nodes, inventory_view
from gpupool.kube.reconcile import KubeReconciler
from gpupool.pool import Pool
from gpupool.store import Store

PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb")


def gfd_labels(product: str, memory: str, count: int, layout: str) -> dict[str, str]:
    return {
        "kubernetes.io/os": "linux",
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/gfd.timestamp": "1718000000",
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.memory": memory,
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.config": layout,
        "nvidia.com/mig.config.state": "success",
        "nvidia.com/mig.strategy": "mixed",
    }


def node_object(name: str, labels: dict[str, str], nvidia: dict[str, str]) -> dict[str, Any]:
    base = {"cpu": "255", "memory": "2113309416Ki", "pods": "110"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "resourceVersion": "1",
            "labels": {"kubernetes.io/hostname": name, **labels},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {"taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {
            "capacity": {**base, **nvidia},
            "allocatable": {**base, **nvidia},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "lastHeartbeatTime": "2025-01-01T00:00:00Z",
                    "lastTransitionTime": "2025-01-01T00:00:00Z",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                }
            ],
            "images": [{"names": [f"registry.example/image-{i}:v1"]} for i in range(20)],
        },
    }


def cluster(nodes: int) -> list[dict[str, Any]]:
    out = []
    for i in range(nodes):
        if i % 10 == 9:
            labels = gfd_labels("NVIDIA-H100-80GB-HBM3", "81559", 8, "all-disabled")
            out.append(node_object(f"h100-{i:05d}", labels, {"nvidia.com/gpu": "8"}))
            continue
        labels = gfd_labels("NVIDIA-A100-SXM4-80GB", "81920", 8, "balanced-7-whole-1")
        resources = {
            "nvidia.com/gpu": "1",
            "nvidia.com/mig-1g.10gb": "14",
            "nvidia.com/mig-2g.20gb": "7",
            "nvidia.com/mig-3g.40gb": "7",
        }
        out.append(node_object(f"a100-{i:05d}", labels, resources))
    return out


@dataclass(frozen=True)
class Result:
    nodes: int
    allocations: int
    event: str
    handler: str
    events: int
    recomputed: int
    mean_ms: float
    max_ms: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def build(nodes: int, allocations: int, db: Path) -> tuple[KubeReconciler, list[dict[str, Any]]]:
    objects = cluster(nodes)
    offers = {f"mig-{p}": Offer(f"mig-{p}", "mig", model="A100-80GB", profile=p) for p in PROFILES}
    ledger = Ledger(inventory_from_nodes(objects), offers, {"all": Team("all", 10**9)})
    for i in range(allocations):
        offer = f"mig-{PROFILES[i % 3]}"
        ledger.allocate(Request(f"u{i}", "all", offer, 1), alloc_id=f"a{i}")
    logger = logging.getLogger("benchmarks.node_events")
    logger.setLevel(logging.ERROR)
    pool = Pool(ledger, Store(f"sqlite:///{db}"), logger=logger)
    reconciler = KubeReconciler(pool, api=object(), namespace="jhub", log=logger)  # type: ignore[arg-type]
    reconciler.nodes = {o["metadata"]["name"]: o for o in objects}
    reconciler.synced = {"nodes", "pods", "tenants"}
    return reconciler, objects


def before(reconciler: KubeReconciler, obj: dict[str, Any]) -> bool:
    """The handler at 4961726: every event recomputes."""
    reconciler.nodes[obj["metadata"]["name"]] = obj
    reconciler.apply_nodes()
    reconciler.apply_tenants()
    return True


def skip(reconciler: KubeReconciler, obj: dict[str, Any]) -> bool:
    """The handler at 6cf11cc: an unchanged view is skipped, a changed one rebuilds all."""
    name, kept = obj["metadata"]["name"], inventory_view(obj)
    if reconciler.nodes.get(name) == kept:
        return False
    reconciler.nodes[name] = kept
    reconciler.apply_nodes()
    reconciler.apply_tenants()
    return True


def after(reconciler: KubeReconciler, obj: dict[str, Any]) -> bool:
    """The handler now (``KubeReconciler.reflect``): an unchanged view is skipped, a changed
    one rebuilds its node only."""
    name, kept = obj["metadata"]["name"], inventory_view(obj)
    if reconciler.nodes.get(name) == kept:
        return False
    reconciler.nodes[name] = kept
    reconciler.apply_nodes([name])
    reconciler.apply_tenants()
    return True


def events(kind: str, objects: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    h100 = [o for o in objects if o["metadata"]["name"].startswith("h100-")]
    out = []
    for i in range(n):
        obj = copy.deepcopy(
            h100[i % len(h100)] if kind == "relevant" else objects[i % len(objects)]
        )
        obj["metadata"]["resourceVersion"] = str(2 + i)
        if kind == "irrelevant":
            obj["metadata"]["labels"]["nvidia.com/gfd.timestamp"] = str(1718000060 + i)
        elif (i // len(h100)) % 2 == 0:  # 8 -> 7, then back to 8 on the next round
            obj["status"]["allocatable"]["nvidia.com/gpu"] = "7"
        out.append(obj)
    return out


def run_one(
    nodes: int, allocations: int, kind: str, name: str, handler: Callable[..., bool], n: int
) -> Result:
    with tempfile.TemporaryDirectory() as tmp:
        reconciler, objects = build(nodes, allocations, Path(tmp) / "pool.sqlite")
        if handler is not before:  # the cache holds views, as the reflector's does
            reconciler.nodes = {k: inventory_view(v) for k, v in reconciler.nodes.items()}
        reconciler.apply_nodes()  # the list: every node's part built (no change: no swap)
        feed = events(kind, objects, n)
        times, recomputed = [], 0
        for obj in feed:
            t0 = time.perf_counter()
            recomputed += handler(reconciler, obj)
            times.append(time.perf_counter() - t0)
        ledger = reconciler.pool.ledger
        ledger.check_invariants()
        assert len(ledger.allocations) == allocations
        sizes = {len(node.gpus) for node in ledger.inventory.nodes if node.name.startswith("h")}
        assert (7 in sizes) == (kind == "relevant"), sizes
    return Result(
        nodes,
        allocations,
        kind,
        name,
        n,
        recomputed,
        round(1000 * sum(times) / len(times), 4),
        round(1000 * max(times), 4),
    )


def format_table(results: Sequence[Result]) -> str:
    rows = [
        ["nodes", "allocations", "event", "handler", "events", "recomputed", "mean ms", "max ms"]
    ]
    for r in results:
        rows.append(
            [
                f"{r.nodes:,}",
                f"{r.allocations:,}",
                r.event,
                r.handler,
                str(r.events),
                str(r.recomputed),
                f"{r.mean_ms:.3f}",
                f"{r.max_ms:.3f}",
            ]
        )
    return align(rows, left=(2, 3))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.node_events",
        description="Cost of one node watch event: before, skipping irrelevant ones, and now.",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--nodes", type=int, default=1000, help="GPU nodes (default 1000)")
    parser.add_argument(
        "--allocations", type=int, default=10_000, help="MIG allocations held (default 10000)"
    )
    parser.add_argument(
        "--events",
        type=int,
        default=2,
        help="events timed where each recomputes (default 2); skipped ones get 100 times more",
    )
    args = parser.parse_args(argv)
    results = []
    for kind in ("irrelevant", "relevant"):
        handlers = [("before", before), ("skip", skip), ("after", after)]
        if kind == "irrelevant":  # skip and after skip the same way
            handlers = [("before", before), ("after", after)]
        for name, handler in handlers:
            n = args.events * 100 if (kind, name) == ("irrelevant", "after") else args.events
            results.append(run_one(args.nodes, args.allocations, kind, name, handler, n))
            if not args.json:
                print(format_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
