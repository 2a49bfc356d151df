"""Issue 26 §2: node changes the pool does not read do not recompute the inventory.

On a real cluster every GPU node is rewritten all the time: NVIDIA GPU Feature Discovery
relabels it every ``sleep-interval`` (60 s) with a fresh ``nvidia.com/gfd.timestamp``, and the
kubelet posts its NodeStatus (the ``Ready`` condition's ``lastHeartbeatTime``) every
``nodeStatusUpdateFrequency`` (10 s) or at least every ``nodeStatusReportFrequency`` (5 min).
Each is a ``MODIFIED`` watch event; only a change in what :func:`inventory_from_nodes` reads
(:func:`gpupool.kube.nodes.inventory_view`) may take the pool's lock."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupool.core import Ledger, Offer
from gpupool.kube.api import ClusterAPI
from gpupool.kube.nodes import inventory_from_nodes, inventory_view
from gpupool.kube.reconcile import KubeReconciler
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import a100_mixed_node, h100_node, hami_node, shared_node
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import api_cluster, served_ledger, until

NS = "jhub"
OFFERS = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=8)}


class CountingPool(Pool):
    """A pool that counts how often its lock is taken to decide (:meth:`Pool.deciding`)."""

    decisions = 0

    def deciding(self, decide: Callable[[Ledger], object]) -> object:
        self.decisions += 1
        return super().deciding(decide)


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with api_cluster(tmp_path, monkeypatch) as server:
        yield server


def gfd_relabel(stamp: int) -> Callable[[dict[str, Any]], None]:
    """GFD's periodic rewrite: the same labels, a new ``nvidia.com/gfd.timestamp``."""

    def change(node: dict[str, Any]) -> None:
        node["metadata"]["labels"]["nvidia.com/gfd.timestamp"] = str(stamp)

    return change


def heartbeat(stamp: int) -> Callable[[dict[str, Any]], None]:
    """The kubelet's NodeStatus update: the same conditions, a new ``lastHeartbeatTime``."""

    def change(node: dict[str, Any]) -> None:
        for c in node["status"]["conditions"]:
            c["lastHeartbeatTime"] = (
                f"2025-01-01T{stamp // 3600 % 24:02d}:{stamp // 60 % 60:02d}:00Z"
            )

    return change


def test_timestamp_labels_and_heartbeats_do_not_take_the_pools_lock(
    cluster: Served, tmp_path: Path
) -> None:
    """100 GFD relabels and 100 kubelet heartbeats on a watched node: before, each took the
    pool's lock twice (a new inventory under it, then the tenants' devices), 400 times in all;
    now none does. A GPU count change still does, and the inventory follows it."""
    cluster.api.add_node(h100_node("gpu-a"))
    cluster.api.add_node(h100_node("gpu-b"))
    pool = CountingPool(
        served_ledger(cluster, OFFERS), Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}")
    )
    reconciler = KubeReconciler(
        pool, ClusterAPI(NS), namespace=NS, grace=0.0, period=3600.0, retry=0.1
    )

    def caught_up() -> bool:
        with cluster.api.lock:
            latest = max(int(n["metadata"]["resourceVersion"]) for n in cluster.api.nodes.values())
        return int(reconciler.versions.get("nodes") or 0) >= latest

    def by_nodes() -> int:
        """Lock takings other than the checker's passes (each takes it once, synchronously)."""
        return pool.decisions - reconciler.passes

    async def main() -> None:
        reconciler.start()
        try:
            await until(lambda: {"nodes", "pods", "tenants"} <= reconciler.synced)
            await until(caught_up)
            before, inventory = by_nodes(), pool.ledger.inventory
            for i in range(100):
                cluster.api.update_node("gpu-a", gfd_relabel(1718000060 + 60 * i))
                cluster.api.update_node("gpu-b", heartbeat(10 * i))
            await until(caught_up)
            assert by_nodes() - before == 0
            assert pool.ledger.inventory is inventory

            def fewer(node: dict[str, Any]) -> None:  # a GPU fell off the bus
                node["status"]["allocatable"]["nvidia.com/gpu"] = "7"
                node["status"]["capacity"]["nvidia.com/gpu"] = "7"

            cluster.api.update_node("gpu-b", fewer)
            await until(caught_up)
            assert by_nodes() - before >= 1
            assert [len(n.gpus) for n in pool.ledger.inventory.nodes] == [8, 7]
        finally:
            await reconciler.stop()

    asyncio.run(main())


@pytest.mark.parametrize(
    "make", [h100_node, a100_mixed_node, shared_node, hami_node], ids=lambda f: f.__name__
)
def test_the_inventory_view_keeps_what_the_inventory_reads(make: Callable[[], Any]) -> None:
    """The inventory of a node is its view's (so a change outside the view cannot change it),
    and the view of a relabelled, heartbeating node is the same."""
    obj = make()
    assert inventory_from_nodes([inventory_view(obj)]) == inventory_from_nodes([obj])
    churned = copy.deepcopy(obj)
    gfd_relabel(1718009999)(churned)
    heartbeat(4242)(churned)
    churned["metadata"]["resourceVersion"] = "999999"
    churned["metadata"]["annotations"]["hami.io/node-handshake"] = "Reported 2025-01-01 00:00"
    assert inventory_view(churned) == inventory_view(obj)
    cordoned = copy.deepcopy(obj)
    cordoned["spec"]["unschedulable"] = True
    assert inventory_view(cordoned) != inventory_view(obj)
