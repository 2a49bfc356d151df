"""Issue 26 §4: under ``device_allocation = "dra"`` the pool's GPUs are NVIDIA's DRA driver's
ResourceSlices' devices. Where the DRA driver runs, the device plugin does not, so the nodes
publish no ``nvidia.com/gpu`` (the stand-in's :func:`tests.deploy.kube_dra.dra_only`): an
inventory read from node capacity finds no GPU at all. The slices are listed and watched as
nodes are; only a pool's newest generation counts, as in the scheduler's structured allocator
(:func:`tests.deploy.kube_dra.current`)."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Team
from gpupool.hub import setup
from gpupool.kube.api import ClusterAPI
from gpupool.kube.dra_inventory import current_slices, inventory_from_slices, slice_view
from gpupool.kube.reconcile import KubeReconciler
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import h100_node
from tests.deploy.chart_fixtures import CHART, render_all
from tests.deploy.kube_api import Served
from tests.deploy.kube_dra import dra_only, reversed_slice, uuids_of
from tests.deploy.kube_fixtures import api_cluster, kube_hub_config

NS = "jhub"
NODE = "dgx-h100-1"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with api_cluster(tmp_path, monkeypatch) as server:
        yield server


@pytest.fixture
def jupyterhub_log() -> Iterator[logging.Logger]:
    """JupyterHub's logger, without the shutdown watches a test's ``setup(c)`` leaves on it."""
    logger = logging.getLogger("JupyterHub")
    filters = list(logger.filters)
    yield logger
    for f in logger.filters:
        if f not in filters:
            logger.removeFilter(f)


def hub_config(tmp_path: Path) -> Config:
    """A hub on the stand-in's nodes whose GPUs are given through DRA."""
    c = kube_hub_config(tmp_path, NS)
    c.KubeGPUSettings.device_allocation = "dra"
    return c


async def until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def gpus_on(pool: Pool, node: str) -> list[str]:
    return [g.uuid for n in pool.inventory.nodes if n.name == node for g in n.gpus]


def test_a_dra_only_node_publishes_no_device_plugin_gpus() -> None:
    node = dra_only(h100_node(NODE))
    assert not [k for k in node["status"]["allocatable"] if k.startswith("nvidia.com/")]
    assert not [k for k in node["status"]["capacity"] if k.startswith("nvidia.com/")]


def test_setup_under_dra_counts_the_drivers_gpus_by_uuid_and_follows_the_slices(
    cluster: Served, tmp_path: Path, jupyterhub_log: logging.Logger
) -> None:
    cluster.api.add_node(dra_only(h100_node(NODE)))
    cluster.api.dra.add_slice(reversed_slice(NODE))
    c = hub_config(tmp_path)

    async def main() -> None:
        hub = setup(c)
        kube = hub.kube
        assert isinstance(kube, KubeReconciler)
        try:
            # at start: the node's eight GPUs, by UUID, in PCI bus order (gpu-7 first)
            assert gpus_on(hub.pool, NODE) == uuids_of(NODE)[::-1]
            (gpu, *_) = hub.pool.inventory.nodes[0].gpus
            assert (gpu.model, gpu.product_name) == ("H100-80GB", "NVIDIA-H100-80GB-HBM3")
            assert gpu.memory_mib == 81559
            a = hub.pool.allocate("ada", ["big"], "h100", 2, team="big", ref="ada/")
            assert [d.gpu for d in a.devices] == uuids_of(NODE)[::-1][:2]
            await until(lambda: {"nodes", "resourceslices"} <= kube.synced)

            # a second DRA-only node: its GPUs come with its driver's slice, not before
            cluster.api.add_node(dra_only(h100_node("dgx-h100-2")))
            await until(lambda: cluster.api.nodes.get("dgx-h100-2") is not None)
            cluster.api.dra.add_slice(reversed_slice("dgx-h100-2"))
            await until(lambda: len(gpus_on(hub.pool, "dgx-h100-2")) == 8)

            # the driver rewrites the pool as a new generation without one GPU; while the old
            # generation's slice is still there, only the new one counts
            newer = reversed_slice("dgx-h100-2")
            newer["metadata"]["name"] += "-2"
            newer["spec"]["pool"]["generation"] = 2
            newer["spec"]["devices"] = newer["spec"]["devices"][1:]  # gpu-0 gone
            cluster.api.dra.add_slice(newer)
            await until(lambda: len(gpus_on(hub.pool, "dgx-h100-2")) == 7)
            assert uuids_of("dgx-h100-2")[0] not in gpus_on(hub.pool, "dgx-h100-2")
            cluster.api.dra.remove_slice(reversed_slice("dgx-h100-2")["metadata"]["name"])

            # the driver's slices gone (its plugin removed): the node's GPUs go
            cluster.api.dra.remove_slice(newer["metadata"]["name"])
            await until(lambda: gpus_on(hub.pool, "dgx-h100-2") == [])
            assert len(gpus_on(hub.pool, NODE)) == 8  # the allocation's node stays
        finally:
            await kube.stop()
            await hub.jobs.stop()
            await hub.reclaimer.stop()

    asyncio.run(main())


def test_node_facts_still_come_from_the_node() -> None:
    cordoned = dra_only(h100_node(NODE))
    cordoned["spec"] = {"unschedulable": True}
    found = inventory_from_slices([cordoned], [reversed_slice(NODE)])
    assert found.nodes == ()
    assert any("cordoned" in n for n in found.notes)
    # a device-plugin node without slices is left out, saying why
    found = inventory_from_slices([h100_node("dgx-h100-2")], [])
    assert found.nodes == ()
    assert any("no ResourceSlice of gpu.nvidia.com" in n for n in found.notes)


def test_only_a_pools_newest_generation_counts_and_an_incomplete_pool_is_noted() -> None:
    old = reversed_slice(NODE)
    new = copy.deepcopy(old)
    new["metadata"]["name"] += "-2"
    new["spec"]["pool"] |= {"generation": 2, "resourceSliceCount": 2}
    new["spec"]["devices"] = new["spec"]["devices"][:4]
    notes: list[str] = []
    assert current_slices([old, new], notes) == [new]
    assert notes and "incomplete (1 of its 2" in notes[0]


def test_a_slice_change_the_inventory_does_not_read_leaves_the_view_alone() -> None:
    before = reversed_slice(NODE)
    after: dict[str, Any] = copy.deepcopy(before)
    after["metadata"] |= {"resourceVersion": "99", "labels": {"x": "y"}}
    after["metadata"]["managedFields"] = [{"manager": "kubelet-plugin"}]
    assert slice_view(after) == slice_view(before)
    after["spec"]["devices"][0]["attributes"]["uuid"]["string"] = "GPU-other"
    assert slice_view(after) != slice_view(before)


class CountingPool(Pool):
    """A pool that counts how often its lock is taken to decide (:meth:`Pool.deciding`)."""

    decisions = 0

    def deciding(self, decide: Callable[[Ledger], object]) -> object:
        self.decisions += 1
        return super().deciding(decide)


def test_a_slice_rewrite_the_inventory_does_not_read_does_not_take_the_pools_lock(
    cluster: Served, tmp_path: Path
) -> None:
    """50 rewrites of a watched slice that change only what the inventory does not read
    (labels, managed fields, the resourceVersion) take the pool's lock no time; a device that
    goes does, and the inventory follows it."""
    cluster.api.add_node(dra_only(h100_node(NODE)))
    cluster.api.dra.add_slice(reversed_slice(NODE))
    with cluster.api.lock:
        nodes, slices = list(cluster.api.nodes.values()), cluster.api.dra.slices
    offers = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=8)}
    ledger = Ledger(inventory_from_slices(nodes, slices), offers, {"big": Team("big", 10**6)})
    pool = CountingPool(ledger, Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))
    reconciler = KubeReconciler(
        pool, ClusterAPI(NS), namespace=NS, grace=0.0, period=3600.0, retry=0.1, dra=True
    )

    def caught_up() -> bool:
        with cluster.api.lock:
            latest = max(int(s["metadata"]["resourceVersion"]) for s in cluster.api.dra.slices)
        return int(reconciler.versions.get("resourceslices") or 0) >= latest

    async def main() -> None:
        reconciler.start()
        try:
            await until(lambda: {"nodes", "resourceslices", "tenants"} <= reconciler.synced)
            await until(caught_up)
            before, inventory = pool.decisions - reconciler.passes, pool.ledger.inventory
            for i in range(50):
                body = reversed_slice(NODE)
                body["metadata"]["labels"] = {"rewrite": str(i)}
                body["metadata"]["managedFields"] = [{"manager": "gpu-kubelet-plugin"}]
                cluster.api.dra.add_slice(body)
            await until(caught_up)
            assert pool.decisions - reconciler.passes == before
            assert pool.ledger.inventory is inventory

            body = reversed_slice(NODE)
            body["spec"]["devices"] = body["spec"]["devices"][1:]  # gpu-0 fell off the bus
            cluster.api.dra.add_slice(body)
            await until(lambda: len(gpus_on(pool, NODE)) == 7)
        finally:
            await reconciler.stop()

    asyncio.run(main())


def test_the_charts_cluster_role_lets_the_hub_list_and_watch_slices_under_dra() -> None:
    """The reconciler's ``resourceslices`` reflector lists and watches them cluster-wide."""
    values = {
        "jupyterhub": {"enabled": False},
        "rbac": {"hubServiceAccount": "hub"},
        "gpupool": {"deviceAllocation": "dra"},
    }
    with helm.Chart.load(CHART) as chart:
        objects = render_all(chart, values)
    (role,) = [
        o for o in objects if o["kind"] == "ClusterRole" and "gpupool" in o["metadata"]["name"]
    ]
    verbs = {
        verb
        for rule in role["rules"]
        if "resource.k8s.io" in rule["apiGroups"] and "resourceslices" in rule["resources"]
        for verb in rule["verbs"]
    }
    assert {"list", "watch"} <= verbs
