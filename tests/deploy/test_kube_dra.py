"""Issue 26 §4: Dynamic Resource Allocation behind ``device_allocation = "dra"``: a notebook's GPUs
are a ResourceClaim (``resource.k8s.io/v1``) pinning the ledger's GPUs by UUID for NVIDIA's DRA
driver, the allocation is read back from the claim's status, the claim goes with the pod, and a
claim nothing can satisfy fails the spawn at once with the scheduler's message.

The stand-in (:mod:`tests.deploy.kube_dra`) serves claims and slices and allocates as the
scheduler's DRA plugin and structured allocator do."""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from kubespawner import KubeSpawner
from tornado import web
from traitlets.config import Config

from gpupool.core import Team
from gpupool.declarations import ConfigError
from gpupool.kube.claims import node_gpus, slice_devices
from gpupool.kube.jobs import check_kube_settings
from gpupool.pool import Pool
from gpupool_spawner.kube import KubeGPUSpawner
from tests.conftest import a100_mixed_node, h100_node
from tests.deploy.chart_fixtures import CHART, merge, render_all
from tests.deploy.kube_api import Served
from tests.deploy.kube_dra import gpu_slice
from tests.deploy.kube_dra_fixtures import uuid_claim
from tests.deploy.kube_fixtures import OFFERS, PROFILE_NS, pooled_cluster, profile_spawner, stop

NODE = "dgx-h100-1"
PRODUCT = "NVIDIA H100 80GB HBM3"
UUIDS = [f"GPU-{i:08x}-1111-2222-3333-444455556666" for i in range(8)]
"""The node's GPUs by device name (``gpu-<minor>``); their PCI bus order is reversed (below)."""


def h100_slice() -> dict[str, Any]:
    """The node's slice, its devices ``gpu-0``…``gpu-7`` on buses in the opposite order: the
    node's first GPU (NVML index 0, the ledger's ``gpu0``) is ``gpu-7``, so an allocator that
    is not pinned (it takes the first free device, ``gpu-0``) would give another GPU."""
    body = gpu_slice(NODE, [(u, PRODUCT) for u in UUIDS])
    for i, device in enumerate(body["spec"]["devices"]):
        device["attributes"]["pcieBusID"]["string"] = f"0000:{8 - i:x}0:00.0"
    return body


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Served, Pool]]:
    nodes = [h100_node(NODE), a100_mixed_node()]
    teams = {"vision": Team("vision", 8000)}
    everyone = Team("everyone", offers=frozenset({"cpu"}))
    with pooled_cluster(tmp_path, monkeypatch, nodes, OFFERS, teams, everyone) as (server, pool):
        server.api.dra.add_slice(h100_slice())
        yield server, pool


def dra_spawner(pool: Pool, offer: str = "h100", count: int = 1) -> KubeGPUSpawner:
    s = profile_spawner(pool, None, device_allocation="dra")
    s.user_options = {"offer": offer, "count": count, "team": "vision"}
    return s


def refused_start(pool: Pool, offer: str = "h100") -> web.HTTPError:
    """The error a DRA start of ``offer`` is refused with before any pod (the start must fail)."""

    async def go() -> web.HTTPError:
        s = dra_spawner(pool, offer=offer)
        try:
            with pytest.raises(web.HTTPError) as e:
                await s.start()
            return e.value
        finally:
            await KubeSpawner._stop_all_reflectors()

    return asyncio.run(go())


async def until_pod(server: Served, s: KubeGPUSpawner, task: asyncio.Future[Any]) -> None:
    """Until the start has made its pod (a start refused before raises here)."""
    key = (PROFILE_NS, s.pod_name)
    while key not in server.api.objects["pods"]:
        if task.done():
            await task
            raise AssertionError("the start ended without making a pod")
        await asyncio.sleep(0.02)


def claims(server: Served) -> dict[tuple[str, str], dict[str, Any]]:
    with server.api.lock:
        return copy.deepcopy(server.api.objects["resourceclaims"])


def test_a_notebooks_gpus_are_a_claim_pinning_the_ledgers_gpus_by_uuid(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster

    async def go() -> None:
        s = dra_spawner(pool, count=2)
        task = asyncio.ensure_future(s.start())
        try:
            await until_pod(server, s, task)
            (claim,) = claims(server).values()
            with server.api.lock:
                pod = copy.deepcopy(server.api.objects["pods"][PROFILE_NS, s.pod_name])
            # created before the pod
            posts = [p for m, p, _ in server.api.requests if m == "POST"]
            assert posts == [
                f"/apis/resource.k8s.io/v1/namespaces/{PROFILE_NS}/resourceclaims",
                f"/api/v1/namespaces/{PROFILE_NS}/pods",
            ]
            (request,) = claim["spec"]["devices"]["requests"]
            # the ledger's gpu0 and gpu1 are the node's first two GPUs in PCI order
            expected = [UUIDS[7], UUIDS[6]]
            assert request["exactly"] == {
                "deviceClassName": "gpu.nvidia.com",
                "allocationMode": "ExactCount",
                "count": 2,
                "selectors": [
                    {
                        "cel": {
                            "expression": "device.attributes['gpu.nvidia.com'].uuid in "
                            f"['{expected[0]}', '{expected[1]}']"
                        }
                    }
                ],
            }
            (container,) = pod["spec"]["containers"]
            assert container["resources"]["claims"] == [{"name": "gpus"}]
            limits = container["resources"].get("limits") or {}
            assert not [k for k in limits if k.startswith("nvidia.com/")]
            assert pod["spec"]["resourceClaims"] == [
                {"name": "gpus", "resourceClaimName": claim["metadata"]["name"]}
            ]

            assert server.api.schedule(PROFILE_NS, s.pod_name) == "Running"
            await asyncio.wait_for(task, 30)
            (claim,) = claims(server).values()
            results = claim["status"]["allocation"]["devices"]["results"]
            # pinned: gpu-7 and gpu-6, not the first free devices gpu-0 and gpu-1
            assert sorted(r["device"] for r in results) == ["gpu-6", "gpu-7"]
            assert all(r["pool"] == NODE and r["driver"] == "gpu.nvidia.com" for r in results)
            assert sorted(s.gpupool_dra_uuids) == sorted(expected)
            (allocation,) = pool.ledger.allocations.values()
            assert [d.gpu for d in allocation.devices] == [f"k8s-{NODE}-gpu0", f"k8s-{NODE}-gpu1"]
            # read back into the ledger (and its database): the devices name the real GPUs
            assert allocation.visible_devices == ",".join(expected)
            (stored,) = pool.store.load()
            assert [d.instance for d in stored.devices] == expected
            # owned by the pod, so the garbage collector deletes it with the pod
            uid = server.api.objects["pods"][PROFILE_NS, s.pod_name]["metadata"]["uid"]
            assert claim["metadata"]["ownerReferences"] == [
                {"apiVersion": "v1", "kind": "Pod", "name": s.pod_name, "uid": uid}
            ]

            await stop(s)
            assert claims(server) == {}
            # the stop deletes it itself too (a real garbage collector is not immediate)
            path = f"/apis/resource.k8s.io/v1/namespaces/{PROFILE_NS}/resourceclaims/"
            assert ("DELETE", path + claim["metadata"]["name"]) in [
                (m, p) for m, p, _ in server.api.requests
            ]
            assert pool.ledger.allocations == {}
        finally:
            if not task.done():
                task.cancel()
            await KubeSpawner._stop_all_reflectors()

    asyncio.run(go())


def test_the_claim_goes_with_its_pod(cluster: tuple[Served, Pool]) -> None:
    """A pod deleted by anyone (the hub gone) takes its claim: the garbage collector."""
    server, pool = cluster

    async def go() -> None:
        s = dra_spawner(pool)
        task = asyncio.ensure_future(s.start())
        try:
            await until_pod(server, s, task)
            assert server.api.schedule(PROFILE_NS, s.pod_name) == "Running"
            await asyncio.wait_for(task, 30)
            (name,) = [n for _, n in claims(server)]
            with server.api.lock:
                server.api.delete("pods", PROFILE_NS, s.pod_name)
            assert claims(server) == {}
            assert ("resourceclaims", name, "gc") in server.api.deletions
        finally:
            if not task.done():
                task.cancel()
            await KubeSpawner._stop_all_reflectors()

    asyncio.run(go())


def another_tenants_claim(server: Served, uuid: str) -> None:
    """A pod of namespace ``ml`` holding the GPU ``uuid`` through its own claim."""
    claim = uuid_claim(uuid)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train"},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "train-gpu"}],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
        },
    }
    with server.api.lock:
        assert server.api.create("resourceclaims", "ml", claim)[0] == 201
        assert server.api.create("pods", "ml", pod)[0] == 201
        assert server.api.schedule("ml", "train") == "Running"


def test_a_claim_nothing_can_satisfy_fails_the_spawn_at_once_with_the_schedulers_reason(
    cluster: tuple[Served, Pool],
) -> None:
    """Another tenant's claim holds the GPU the ledger thought free: the pod cannot be scheduled
    (the DRA plugin: ``cannot allocate all claims``) and the spawn fails now, not at
    ``start_timeout``, with the scheduler's message; nothing is left held or made."""
    server, pool = cluster
    another_tenants_claim(server, UUIDS[7])  # the node's first GPU: the ledger's gpu0

    async def go() -> web.HTTPError:
        s = dra_spawner(pool)
        s.start_timeout = 600
        task = asyncio.ensure_future(s.start())
        try:
            await until_pod(server, s, task)
            assert server.api.schedule(PROFILE_NS, s.pod_name) == "Unschedulable"
            with pytest.raises(web.HTTPError) as e:
                await asyncio.wait_for(task, 30)
            return e.value
        finally:
            if not task.done():
                task.cancel()
            await KubeSpawner._stop_all_reflectors()

    error = asyncio.run(go())
    assert error.status_code == 503
    assert "0/2 nodes are available: 1 cannot allocate all claims" in error.log_message
    assert UUIDS[7] in error.log_message
    assert pool.ledger.allocations == {}
    assert (PROFILE_NS, "jupyter-alice") not in server.api.objects["pods"]
    assert [ns for ns, _ in claims(server)] == ["ml"]


def test_a_mig_instance_under_dra_is_refused_with_the_reason(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster

    error = refused_start(pool, offer="mig-3g.40gb")
    assert error.status_code == 400
    assert "MIG instances (3g.40gb) cannot be given through DRA" in error.log_message
    assert pool.ledger.allocations == {}
    assert server.api.objects["pods"] == {} and claims(server) == {}


def test_a_node_without_the_drivers_slices_is_refused_before_any_pod(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster
    with server.api.lock:
        for item in server.api.dra.slices:
            server.api.dra.remove_slice(item["metadata"]["name"])

    error = refused_start(pool)
    assert error.status_code == 503
    assert f"node {NODE} publishes 0 GPU(s) of driver gpu.nvidia.com" in error.log_message
    assert pool.ledger.allocations == {}
    assert server.api.objects["pods"] == {} and claims(server) == {}


def test_the_device_plugin_path_is_unchanged_by_default(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster

    async def go() -> None:
        s = profile_spawner(pool, None)
        s.user_options = {"offer": "h100", "count": 1, "team": "vision"}
        task = asyncio.ensure_future(s.start())
        try:
            await until_pod(server, s, task)
            pod = server.api.objects["pods"][PROFILE_NS, s.pod_name]
            assert "resourceClaims" not in pod["spec"]
            limits = pod["spec"]["containers"][0]["resources"]["limits"]
            assert limits["nvidia.com/gpu"] == "1"
            assert claims(server) == {}
        finally:
            task.cancel()
            await KubeSpawner._stop_all_reflectors()

    asyncio.run(go())


# -- the setting -----------------------------------------------------------------------------------
@pytest.mark.parametrize("section", ["KubeGPUSettings", "KubeGPUSpawner", "KubeJobBackend"])
def test_a_bad_device_allocation_stops_the_hub_naming_the_key(section: str) -> None:
    config = Config()
    config[section]["device_allocation"] = "nvlink"
    with pytest.raises(ConfigError, match=rf"{section}\.device_allocation.*'nvlink'"):
        check_kube_settings(config)


# -- the stand-in ----------------------------------------------------------------------------------
def test_a_claim_with_an_unknown_field_is_invalid_as_the_api_server_says(
    cluster: tuple[Served, Pool],
) -> None:
    server, _ = cluster
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "bad"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "deviceClassName": "gpu.nvidia.com", "count": 1}]
            }
        },
    }
    with server.api.lock:
        code, reply = server.api.create("resourceclaims", "ml", body)
    assert code == 422, reply
    assert reply["reason"] == "Invalid"


def test_the_slices_read_back_name_the_nodes_gpus_in_pci_order() -> None:
    devices = slice_devices([h100_slice()])
    assert [d.name for d in node_gpus(devices, NODE)][:2] == ["gpu-7", "gpu-6"]
    assert {d.product for d in devices} == {PRODUCT}


# -- the chart ----------------------------------------------------------------------------------
def chart_objects(values: dict[str, Any]) -> list[dict[str, Any]]:
    base = {"jupyterhub": {"enabled": False}, "rbac": {"hubServiceAccount": "hub"}}
    with helm.Chart.load(CHART) as chart:
        return render_all(chart, merge(base, values))


def rules(objects: list[dict[str, Any]], kind: str) -> dict[str, list[str]]:
    """Verbs by resource of the gpupool hub's Role or ClusterRole (``kind``)."""
    (role,) = [o for o in objects if o["kind"] == kind and "gpupool" in o["metadata"]["name"]]
    return {r: sorted(rule["verbs"]) for rule in role["rules"] for r in rule["resources"]}


def test_the_charts_roles_allow_claims_and_slices_only_with_dra() -> None:
    objects = chart_objects({"gpupool": {"deviceAllocation": "dra"}})
    role, cluster_role = rules(objects, "Role"), rules(objects, "ClusterRole")
    # what gpupool_spawner.kube_dra does: create, read back, own (patch), delete; list slices
    assert {"create", "get", "list", "watch", "patch", "delete"} <= set(role["resourceclaims"])
    assert {"create", "delete"} <= set(role["resourceclaimtemplates"])
    assert {"list"} <= set(cluster_role["resourceslices"])
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap"]
    config = json.loads(configmap["data"]["gpupool.json"])
    assert config["KubeGPUSpawner"]["device_allocation"] == "dra"
    assert config["KubeJobBackend"]["device_allocation"] == "dra"
    check_kube_settings(Config(config))  # the hub starts with it

    plain = chart_objects({})
    assert "resourceclaims" not in rules(plain, "Role")
    assert "resourceslices" not in rules(plain, "ClusterRole")


def test_the_chart_refuses_a_bad_device_allocation() -> None:
    with pytest.raises(helm.HelmValuesError, match="deviceAllocation"):
        chart_objects({"gpupool": {"deviceAllocation": "nvlink"}})
