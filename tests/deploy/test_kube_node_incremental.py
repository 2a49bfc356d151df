"""Issue 26 §2: a real change to one node costs that node, not the cluster.

On a large cluster some node changes for real every few seconds: a GPU falls off the bus
(the device plugin's ``ListAndWatch`` reports it unhealthy and the kubelet lowers
``status.allocatable``), an admin cordons a node, a node goes NotReady. Each is one ``MODIFIED``
watch event for that node. Before, each rebuilt the inventory of every node and restored every
allocation, twice, under the pool's lock (seconds at 1,000 nodes, ``benchmarks.node_events``);
now only the changed node's part of the inventory is built and only its allocations are
re-checked. Counted here, never timed: the node parses (:func:`gpupool.kube.nodes._node`, one
per node built) and the allocation re-checks (:meth:`Ledger._picks_for`, one per allocation
restored, on a trial ledger or the new one), each through a counting wrapper around the real
function.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import gpupool.kube.nodes as nodes_module
from gpupool.core import Ledger, Offer, Request
from gpupool.kube.api import ClusterAPI
from gpupool.kube.reconcile import KubeReconciler, effective_inventory
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import h100_node
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import api_cluster, served_ledger, until

NS = "jhub"
NODES = 200
OFFERS = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=8)}


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with api_cluster(tmp_path, monkeypatch) as server:
        yield server


def counting(work: Counter[str], what: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        work[what] += 1
        return real(*args, **kwargs)

    return counted


@pytest.mark.parametrize("change", ["gpu lost", "cordoned"])
def test_one_node_change_rebuilds_one_node_and_rechecks_its_allocations_only(
    cluster: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """200 nodes of eight H100s, 400 two-GPU notebooks on them. The node of the first loses a
    GPU (the device plugin reports it unhealthy; its allocations still fit the seven left) or is
    cordoned (they do not: it drains): one node is built, and only its allocations are
    re-checked, twice (the trial, the new ledger). Before: 200 nodes built and 800 re-checks.
    The result is what the full rebuild from every node gives."""
    for i in range(NODES):
        cluster.api.add_node(h100_node(f"gpu-{i:03d}"))
    ledger = served_ledger(cluster, OFFERS)
    for i in range(2 * NODES):
        ledger.allocate(Request(f"u{i}", "big", "h100", 2), alloc_id=f"a{i:03d}")
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))
    reconciler = KubeReconciler(
        pool, ClusterAPI(NS), namespace=NS, grace=3600.0, period=3600.0, retry=0.1
    )
    target = ledger.allocations["a000"].node
    assert target is not None
    on_target = {a.id for a in ledger.allocations.values() if a.node == target}
    work: Counter[str] = Counter()
    monkeypatch.setattr(nodes_module, "_node", counting(work, "nodes built", nodes_module._node))
    monkeypatch.setattr(
        Ledger, "_picks_for", counting(work, "allocations re-checked", Ledger._picks_for)
    )

    def caught_up() -> bool:
        with cluster.api.lock:
            latest = max(int(n["metadata"]["resourceVersion"]) for n in cluster.api.nodes.values())
        return int(reconciler.versions.get("nodes") or 0) >= latest

    def lose_a_gpu(node: dict[str, Any]) -> None:
        node["status"]["allocatable"]["nvidia.com/gpu"] = "7"
        node["status"]["capacity"]["nvidia.com/gpu"] = "7"

    async def main() -> None:
        reconciler.start()
        try:
            await until(lambda: {"nodes", "pods", "tenants"} <= reconciler.synced, 60.0)
            await until(caught_up, 60.0)
            held = pool.ledger
            work.clear()
            if change == "gpu lost":
                cluster.api.update_node(target, lose_a_gpu)
            else:
                cluster.api.cordon(target)
            await until(caught_up, 60.0)
            assert dict(work) == {
                "nodes built": 1,
                "allocations re-checked": 2 * len(on_target),
            }
            # the same as the full rebuild from every node gives
            with cluster.api.lock:
                objects = list(cluster.api.nodes.values())
            inventory, draining = effective_inventory(objects, held)
            assert pool.ledger.inventory == inventory and reconciler.draining == draining
            assert pool.ledger.allocations == held.allocations
            uses = {d.gpu for a in held.allocations.values() if a.node == target for d in a.devices}
            drains = change == "cordoned" or f"k8s-{target}-gpu7" in uses
            assert draining == ({target: "changed"} if drains else {})
            gpus = {n.name: len(n.gpus) for n in inventory.nodes}
            assert gpus[target] == (len(uses) if drains else 7)
            pool.ledger.check_invariants()
        finally:
            await reconciler.stop()

    asyncio.run(main())
