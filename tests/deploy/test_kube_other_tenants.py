"""Issue 26 §2: GPU pods gpupool did not make (another namespace's, another release's) take GPUs
on the pool's nodes; the hub counts them as *outside use* (:mod:`gpupool.kube.tenants`).

The stand-in schedules as kube-scheduler's NodeResourcesFit does: a pod fits a node only in its
allocatable less the requests of every pod bound there, whatever its namespace."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpupool.core import NoCapacity, Offer
from gpupool.kube.api import ClusterAPI
from gpupool.kube.reconcile import KubeReconciler
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import a100_mixed_node, gpu_node_labels, node, shared_node
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import api_cluster, served_ledger, until

NS = "jhub"
OFFERS = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=8)}


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with api_cluster(tmp_path, monkeypatch) as server:
        yield server


def four_h100(name: str) -> dict[str, Any]:
    labels = gpu_node_labels("NVIDIA-H100-80GB-HBM3", "81559", 4, "all-disabled")
    return node(name, labels, {"nvidia.com/gpu": "4"})


def gpu_pod(
    server: Served,
    namespace: str,
    name: str,
    gpus: int,
    labels: dict[str, str],
    on: str,
    resource: str = "nvidia.com/gpu",
) -> str:
    """A pod asking ``gpus`` of ``resource``, pinned to node ``on`` by node affinity (as gpupool
    pins its pods), given to the stand-in's scheduler; returns what became of it."""
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                    "resources": {"limits": {resource: str(gpus)}},
                }
            ],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchFields": [
                                    {"key": "metadata.name", "operator": "In", "values": [on]}
                                ]
                            }
                        ]
                    }
                }
            },
        },
    }
    with server.api.lock:
        code, reply = server.api.create("pods", namespace, body)
        assert code == 201, reply
        return server.api.schedule(namespace, name)


def test_another_namespaces_gpu_pod_closes_its_gpus_to_placement(
    cluster: Served, tmp_path: Path
) -> None:
    cluster.api.add_node(four_h100("gpu-a"))
    assert gpu_pod(cluster, "ml", "train", 2, {"app": "train"}, "gpu-a") == "Running"
    ledger = served_ledger(cluster, OFFERS)
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))
    reconciler = KubeReconciler(
        pool, ClusterAPI(NS), namespace=NS, grace=0.0, period=0.2, retry=0.1
    )
    team = {"gpupool.io/team": "big"}

    async def main() -> None:
        reconciler.start()
        try:
            await until(lambda: "tenants" in reconciler.synced)
            # today's main granted all 4 GPUs, and the pod asking them waited:
            # "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
            with pytest.raises(NoCapacity, match=r"k8s-gpu-a-gpu\d is used outside gpupool"):
                pool.allocate("ada", ["big"], "h100", 4, team="big", ref="ada/")
            assert all(  # the pod's name is for admins (test_kube_outside_pods_view)
                why.endswith("is used by pod ml/train (2 GPUs on gpu-a)")
                for why in reconciler.outside_detail.values()
            )
            a = pool.allocate("ada", ["big"], "h100", 2, team="big", ref="ada/")
            assert gpu_pod(cluster, NS, "jupyter-ada", 2, team, "gpu-a") == "Running"
            assert len(pool.ledger.outside) == 2  # gpupool's own pod is the ledger's, not outside
            assert not {d.gpu for d in a.devices} & set(pool.ledger.outside)

            with cluster.api.lock:  # the other tenant's pod ends: its GPUs are free again
                cluster.api.delete("pods", "ml", "train")
            await until(lambda: not pool.ledger.outside)
            b = pool.allocate("bob", ["big"], "h100", 2, team="big", ref="bob/")
            assert gpu_pod(cluster, NS, "jupyter-bob", 2, team, "gpu-a") == "Running"
            assert b.node == "gpu-a"
        finally:
            await reconciler.stop()

    asyncio.run(main())


def test_a_pod_asking_more_than_a_node_has_left_waits_whatever_its_namespace(
    cluster: Served,
) -> None:
    """The stand-in as NodeResourcesFit: the other namespace's requests count on the node."""
    cluster.api.add_node(four_h100("gpu-a"))
    assert gpu_pod(cluster, "ml", "train", 2, {}, "gpu-a") == "Running"
    assert gpu_pod(cluster, NS, "jupyter-ada", 4, {"gpupool.io/team": "big"}, "gpu-a") == (
        "Unschedulable"
    )
    with cluster.api.lock:
        pod = cluster.api.objects["pods"][NS, "jupyter-ada"]
    message = pod["status"]["conditions"][0]["message"]
    assert message == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."


def test_a_second_release_on_the_same_nodes_is_named_and_its_gpus_left_out(
    cluster: Served, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another gpupool release (namespace ``jhub2``) runs a notebook on this pool's node: its
    GPUs are other tenants' here, and the hub says two releases manage the same nodes."""
    cluster.api.add_node(four_h100("gpu-a"))
    labels = {"gpupool.io/team": "big", "gpupool.io/allocation": "0123abcd"}
    assert gpu_pod(cluster, "jhub2", "jupyter-eve", 3, labels, "gpu-a") == "Running"
    ledger = served_ledger(cluster, OFFERS)
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))
    reconciler = KubeReconciler(
        pool, ClusterAPI(NS), namespace=NS, grace=0.0, period=0.2, retry=0.1
    )

    async def main() -> None:
        reconciler.start()
        try:
            await until(lambda: len(pool.ledger.outside) == 3)
            with pytest.raises(NoCapacity, match="used outside gpupool"):
                pool.allocate("ada", ["big"], "h100", 2, team="big", ref="ada/")
            assert all(
                "used by pod jhub2/jupyter-eve" in why for why in reconciler.outside_detail.values()
            )
        finally:
            await reconciler.stop()

    asyncio.run(main())
    # gpupool's own errors: the stand-in's server may log a watch its client closed at stop
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "ERROR" and r.name.startswith("gpupool")
    ]
    assert errors == [
        "gpupool: another gpupool release (namespace jhub2) runs GPU pods on this pool's "
        "node(s) gpu-a: two releases must not manage the same nodes; its pods' GPUs are left "
        "out here, but give each release its own nodes (gpupool.inventory: "
        "kubernetes:<node label selector>)"
    ]


def reconciled_pool(cluster: Served, tmp_path: Path, offers: dict[str, Offer]) -> Pool:
    return Pool(served_ledger(cluster, offers), Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))


def reconciling(pool: Pool, body: Callable[[], Awaitable[None]]) -> None:
    """``body()`` while the hub's reconciler follows the cluster for ``pool``."""
    reconciler = KubeReconciler(
        pool, ClusterAPI(NS), namespace=NS, grace=0.0, period=0.2, retry=0.1
    )

    async def main() -> None:
        reconciler.start()
        try:
            await body()
        finally:
            await reconciler.stop()

    asyncio.run(main())


def test_another_namespaces_mig_pod_closes_the_instances_of_its_profile(
    cluster: Served, tmp_path: Path
) -> None:
    """A pod of namespace ``ml`` asking all seven ``nvidia.com/mig-3g.40gb`` of a mixed A100
    node takes them (NodeResourcesFit counts every pod's MIG requests): no 3g.40gb instance is
    left to grant, while the node's 1g.10gb instances stay open."""
    cluster.api.add_node(a100_mixed_node("a100"))
    mig = "nvidia.com/mig-3g.40gb"
    assert gpu_pod(cluster, "ml", "finetune", 7, {}, "a100", resource=mig) == "Running"
    offers = {
        "mig-3g": Offer("mig-3g", "mig", model="A100-80GB", profile="3g.40gb"),
        "mig-1g": Offer("mig-1g", "mig", model="A100-80GB", profile="1g.10gb"),
    }
    pool = reconciled_pool(cluster, tmp_path, offers)

    async def body() -> None:
        await until(lambda: len(pool.ledger.outside) == 7)
        assert all(why.endswith("is used outside gpupool") for why in pool.ledger.outside.values())
        with pytest.raises(NoCapacity, match=r"used outside gpupool"):
            pool.allocate("ada", ["big"], "mig-3g", 1, team="big", ref="ada/")
        a = pool.allocate("ada", ["big"], "mig-1g", 1, team="big", ref="ada/")
        assert a.node == "a100"
        assert (
            gpu_pod(
                cluster,
                NS,
                "jupyter-ada",
                1,
                {"gpupool.io/team": "big"},
                "a100",
                resource="nvidia.com/mig-1g.10gb",
            )
            == "Running"
        )

    reconciling(pool, body)


def test_another_namespaces_share_pod_closes_a_shared_gpu(cluster: Served, tmp_path: Path) -> None:
    """A node whose four T4s the device plugin time-slices into four replicas each, renamed
    to ``nvidia.com/gpu.shared``: a pod of namespace ``ml`` holding one replica takes a GPU
    the ledger would give shares of (which replica is the plugin's choice: the ledger closes
    one whole GPU), so the ledger's shares go to the other three."""
    cluster.api.add_node(shared_node("t4", renamed=True))
    shared = "nvidia.com/gpu.shared"
    assert gpu_pod(cluster, "ml", "infer", 1, {}, "t4", resource=shared) == "Running"
    offers = {"t4-quarter": Offer("t4-quarter", "share", model="T4-16GB", share_milli=250)}
    pool = reconciled_pool(cluster, tmp_path, offers)

    async def body() -> None:
        await until(lambda: len(pool.ledger.outside) == 1)
        ((gpu, why),) = pool.ledger.outside.items()
        assert why == f"{gpu} is used outside gpupool"  # the pod's name: for admins only
        granted = [
            pool.allocate(u, ["big"], "t4-quarter", 1, team="big", ref=f"{u}/")
            for u in ("u0", "u1", "u2")
        ]
        assert gpu not in {d.gpu for a in granted for d in a.devices}

    reconciling(pool, body)
