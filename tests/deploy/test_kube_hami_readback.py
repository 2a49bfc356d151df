"""HAMi's allocations read back (issue 26, section 3): other tenants' HAMi pods take the memory
HAMi gave them on the GPU it gave them, and gpupool's own share pods are checked against the
ledger's GPU.

The stand-in runs HAMi as :mod:`tests.deploy.kube_hami` models it from HAMi's source: its
scheduler writes ``hami.io/vgpu-devices-allocated`` (``EncodePodSingleDevice`` in
``pkg/device/devices.go``) on the pods it places, and refuses a GPU without the memory a pod
asks (``CardInsufficientMemory``, ``Fit`` in ``pkg/device/nvidia/device.go``) whatever the
pod's namespace, since it counts every pod's allocation on the node (``getNodesUsage`` in
``pkg/scheduler/scheduler.go``)."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

from gpupool.core import Ledger, Offer, Team
from gpupool.kube.api import ClusterAPI
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.pods import ShareRequests, apply_allocation
from gpupool.kube.reconcile import KubeReconciler, plan_drift
from gpupool.kube.tenants import digest, tenant_use
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import hami_node
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import api_cluster, spawner_pod, until
from tests.deploy.kube_hami import ALLOCATED_ANNOTATION, USE_UUID, allocated

NS = "jhub"
TEAM = {"gpupool.io/team": "big"}
OFFERS = {"share-40gb": Offer("share-40gb", "share", share_mib=40960)}
HAMI_UUIDS = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(2)]
"""The UUIDs of the two 45 GiB L40S of :func:`tests.conftest.hami_node` (GPU A, GPU B)."""


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with api_cluster(tmp_path, monkeypatch) as server:
        server.api.add_node(hami_node())
        server.api.schedulers.install_hami()
        yield server


def hami_pod(name: str, gib: int, gpu: str = "") -> dict[str, Any]:
    """A pod of another namespace asking HAMi for one virtual GPU of ``gib`` GiB (on ``gpu``
    when given, as a user may pin one), for the default scheduler (HAMi's webhook routes it)."""
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                    "resources": {
                        "limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(gib * 1024)}
                    },
                }
            ],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        },
    }
    if gpu:
        body["metadata"]["annotations"] = {USE_UUID: gpu}
    return body


def run(server: Served, namespace: str, body: dict[str, Any]) -> str:
    with server.api.lock:
        code, reply = server.api.create("pods", namespace, copy.deepcopy(body))
        assert code == 201, reply
        return server.api.schedule(namespace, body["metadata"]["name"])


def pod(server: Served, namespace: str, name: str) -> dict[str, Any]:
    with server.api.lock:
        return copy.deepcopy(server.api.objects["pods"][namespace, name])


def hami_pool(server: Served, tmp_path: Path) -> Pool:
    with server.api.lock:
        nodes = list(server.api.nodes.values())
    ledger = Ledger(inventory_from_nodes(nodes), OFFERS, {"big": Team("big", 1_000_000)})
    return Pool(ledger, Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))


async def share_pod_body(pool: Pool, user: str, offer: str) -> tuple[dict[str, Any], list[str]]:
    """Allocate ``offer`` for ``user`` and build its pod as the spawner does (team label, HAMi's
    scheduler, the pin); returns the pod and the ledger's GPUs."""
    alloc = pool.allocate(user, ["big"], offer, 1, team="big", ref=f"{user}/")
    shares = ShareRequests.of(pool.inventory)
    built = apply_allocation(spawner_pod(user), alloc, OFFERS[offer], shares=shares)
    async with ApiClient() as api:
        body = dict(api.sanitize_for_serialization(built))
    body["metadata"]["labels"].update(TEAM)
    body["metadata"]["labels"]["gpupool.io/allocation"] = alloc.id
    return body, [d.gpu for d in alloc.devices]


@pytest.mark.parametrize("taken", [0, 1], ids=["on-gpu-a", "on-gpu-b"])
def test_another_namespaces_hami_pod_takes_its_memory_on_its_gpu(
    cluster: Served, tmp_path: Path, taken: int
) -> None:
    """Another namespace's 30 GiB HAMi pod on one of two 45 GiB L40S: the 40 GiB share goes on
    the other GPU and runs. Today's main counted no HAMi tenant pod (its GPUs' share resource is
    HAMi's, not ``nvidia.com/gpu``): with the pod on GPU A the ledger placed the share on A too,
    pinned it there, and HAMi's scheduler refused it (``1/2 CardInsufficientMemory, 1/2
    CardUuidMismatch``) until the start timeout."""
    assert run(cluster, "ml", hami_pod("infer", 30, HAMI_UUIDS[taken])) == "Running"
    assert allocated(pod(cluster, "ml", "infer")) == [(HAMI_UUIDS[taken], 30720, 0)]
    pool = hami_pool(cluster, tmp_path)
    reconciler = KubeReconciler(
        pool, ClusterAPI(NS), namespace=NS, grace=0.0, period=0.2, retry=0.1
    )

    async def main() -> None:
        reconciler.start()
        try:
            await until(lambda: "tenants" in reconciler.synced)
            body, gpus = await share_pod_body(pool, "ada", "share-40gb")
            result = await asyncio.to_thread(run, cluster, NS, body)
            events = [e["message"] for e in cluster.api.events]
            assert result == "Running", events
            assert gpus == [HAMI_UUIDS[1 - taken]]
            given = allocated(pod(cluster, NS, "jupyter-ada"))
            assert [uuid for uuid, _mib, _cores in given] == [HAMI_UUIDS[1 - taken]]
            assert pool.ledger.outside_shares == {
                HAMI_UUIDS[taken]: (
                    30720,
                    f"30 GB of {HAMI_UUIDS[taken]} is used by pod ml/infer (30 GB on l40s-hami)",
                )
            }
            assert not pool.ledger.outside  # no GPU closed whole
            pool.ledger.check_invariants()
            # the tenant's pod ends: its memory is the ledger's to hand out again
            with cluster.api.lock:
                cluster.api.delete("pods", "ml", "infer")
            await until(lambda: not pool.ledger.outside_shares)
            pool.ledger.check_invariants()
        finally:
            await reconciler.stop()

    asyncio.run(main())


def test_a_hami_pod_not_yet_placed_by_hami_closes_a_gpu_whole(tmp_path: Path) -> None:
    """Bound, but without HAMi's annotation (placed by a scheduler without HAMi's extender):
    which GPU and how much is unknown, so a GPU is closed whole, as for any tenant pod."""
    ledger = Ledger(inventory_from_nodes([hami_node()]), OFFERS, {"big": Team("big", 1000)})
    bare = hami_pod("infer", 30)
    bare["metadata"]["namespace"] = "ml"
    bare["spec"]["nodeName"] = "l40s-hami"
    bare["status"] = {"phase": "Running"}
    (closed,) = tenant_use([digest(bare)], ledger, NS, "gpupool.io/team")  # main: none
    assert closed in HAMI_UUIDS
    from gpupool.kube.tenants import tenant_shares  # new with the read-back

    assert tenant_shares([digest(bare)], ledger, NS, "gpupool.io/team") == {}
    placed = copy.deepcopy(bare)
    placed["metadata"]["annotations"] = {ALLOCATED_ANNOTATION: f"{HAMI_UUIDS[0]},NVIDIA,30720,0:;"}
    assert tenant_use([digest(placed)], ledger, NS, "gpupool.io/team") == {}
    assert set(tenant_shares([digest(placed)], ledger, NS, "gpupool.io/team")) == {HAMI_UUIDS[0]}


def test_a_share_pod_hami_placed_elsewhere_is_drift_naming_both_gpus(
    cluster: Served, tmp_path: Path
) -> None:
    """A HAMi that ignores ``nvidia.com/use-gpuuuid`` (the stand-in's pin taken off, as an older
    HAMi's webhook would leave it unread) spreads the share to the last GPU of a tie, GPU B,
    while the ledger holds GPU A: the reconciler reports ``unexpected_gpu`` naming both."""
    pool = hami_pool(cluster, tmp_path)

    async def build() -> tuple[dict[str, Any], list[str]]:
        return await share_pod_body(pool, "ada", "share-40gb")

    body, gpus = asyncio.run(build())
    assert gpus == [HAMI_UUIDS[0]]
    body["metadata"]["annotations"].pop(USE_UUID)
    assert run(cluster, NS, body) == "Running"
    placed = pod(cluster, NS, "jupyter-ada")
    assert [uuid for uuid, _mib, _cores in allocated(placed)] == [HAMI_UUIDS[1]]
    findings = pool.deciding(lambda ledger: plan_drift(ledger, [placed], [], 0.0, 0.0))
    assert [(f.kind, f.action) for f in findings] == [("unexpected_gpu", "report")]  # type: ignore[attr-defined]
    (finding,) = findings  # type: ignore[misc]
    assert f"HAMi gave it GPU {HAMI_UUIDS[1]}, but the ledger holds {HAMI_UUIDS[0]}" in (
        finding.message
    )
    # with the pin honoured, no drift
    pinned = copy.deepcopy(placed)
    pinned["metadata"]["annotations"][ALLOCATED_ANNOTATION] = f"{HAMI_UUIDS[0]},NVIDIA,40960,0:;"
    assert pool.deciding(lambda ledger: plan_drift(ledger, [pinned], [], 0.0, 0.0)) == []
