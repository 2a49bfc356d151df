"""Nodes come and go (issue 26): a node that is not ready is left out of the pool, a notebook whose
pod was evicted from a lost node is reported stopped and its devices released, and a multi-node
job that loses a node fails with the node's reason instead of holding its GPUs to its deadline.

The stand-in (:mod:`tests.deploy.kube_api`) does what the control plane does when a node is lost:
the node lifecycle controller's ``Ready`` condition and taints, the ``DefaultTolerationSeconds``
tolerations admission gives every pod, taint eviction after ``tolerationSeconds``, and pods that
stay Terminating because the lost node's kubelet never confirms their deletion.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from gpupool.core import Ledger, NoCapacity, Request, Team
from gpupool.core.ledger import Allocation
from gpupool.kube.jobs import KubeJobBackend
from gpupool.kube.manifests import job_name
from gpupool.kube.nodes import inventory_from_nodes, not_ready_reason
from gpupool.pool import Pool
from gpupool_spawner.mixin import UnknownExit
from tests.conftest import h100_node
from tests.deploy.kube_api import Served, StandIn, served
from tests.deploy.kube_fixtures import (
    IMAGE,
    NS,
    OFFERS,
    PROFILE_NS,
    a_job,
    pooled_cluster,
    profile_spawner,
    start,
    started,
    stop,
)

LOST = "dgx-h100-2"
UNKNOWN = "is not ready (Ready=Unknown, NodeStatusUnknown: Kubelet stopped posting node status.)"


def user_node(name: str) -> dict[str, Any]:
    """An H100 node labelled as a z2jh user node (notebook pods select those)."""
    node = h100_node(name)
    node["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
    return node


def two_nodes() -> StandIn:
    api = StandIn()
    for name in ("dgx-h100-1", LOST):
        api.add_node(user_node(name))
    return api


def nodes_of(api: StandIn) -> list[dict[str, Any]]:
    with api.lock:
        return copy.deepcopy(list(api.nodes.values()))


# -- the stand-in behaves as the control plane does -------------------------------------------
def test_a_lost_nodes_pods_are_evicted_after_their_toleration_and_stay_terminating() -> None:
    api = two_nodes()
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "jupyter-ada"},
        "spec": {"nodeName": LOST, "containers": [{"name": "notebook", "image": IMAGE}]},
    }
    patient = copy.deepcopy(body)
    patient["metadata"]["name"] = "daemon"
    patient["spec"]["tolerations"] = [
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists"}
    ]
    for pod in (body, patient):
        assert api.create("pods", NS, pod)[0] == 201
        assert api.schedule(NS, pod["metadata"]["name"]) == "Running"
    pod = api.objects["pods"][NS, "jupyter-ada"]
    # DefaultTolerationSeconds: both lifecycle taints, 300 s; not for a pod tolerating one
    assert {(t["key"], t.get("tolerationSeconds")) for t in pod["spec"]["tolerations"]} == {
        ("node.kubernetes.io/not-ready", 300),
        ("node.kubernetes.io/unreachable", 300),
    }
    daemon = api.objects["pods"][NS, "daemon"]
    assert [t["key"] for t in daemon["spec"]["tolerations"]] == [
        "node.kubernetes.io/unreachable",
        "node.kubernetes.io/not-ready",
    ]

    api.lose_node(LOST)
    node = api.nodes[LOST]
    assert not_ready_reason(node) == UNKNOWN
    assert {(t["key"], t["effect"]) for t in node["spec"]["taints"]} >= {
        ("node.kubernetes.io/unreachable", "NoSchedule"),
        ("node.kubernetes.io/unreachable", "NoExecute"),
    }
    ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
    assert (pod["status"]["phase"], ready["Ready"]) == ("Running", "False")

    assert api.evict(299) == []
    assert api.evict(300) == ["jupyter-ada"]  # the daemon tolerates it for ever
    assert pod["metadata"]["deletionTimestamp"] and pod["status"]["phase"] == "Running"
    (disruption,) = [c for c in pod["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert disruption["reason"] == "DeletionByTaintManager"
    assert api.delete("pods", NS, "jupyter-ada")[0] == 200  # again: still no kubelet
    assert (NS, "jupyter-ada") in api.objects["pods"]

    # a new pod bound there waits on the NoSchedule taint
    fresh = copy.deepcopy(body)
    fresh["metadata"]["name"] = "jupyter-bob"
    del fresh["spec"]["nodeName"]
    fresh["spec"]["tolerations"] = [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    fresh["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [LOST]}]}
                ]
            }
        }
    }
    api.create("pods", NS, fresh)
    assert api.schedule(NS, "jupyter-bob") == "Unschedulable"
    message = api.objects["pods"][NS, "jupyter-bob"]["status"]["conditions"][0]["message"]
    assert "1 node(s) had untolerated taint {node.kubernetes.io/unreachable: }" in message

    api.recover_node(LOST)  # the kubelet is back: it kills the pod and confirms
    assert (NS, "jupyter-ada") not in api.objects["pods"]
    assert (NS, "daemon") in api.objects["pods"]
    assert not_ready_reason(api.nodes[LOST]) is None


# -- the inventory ---------------------------------------------------------------------------------
@pytest.mark.parametrize("ready", ["Unknown", "False"])
def test_a_node_that_is_not_ready_is_left_out_with_the_reason(ready: str) -> None:
    api = two_nodes()
    api.lose_node(LOST, ready)
    inventory = inventory_from_nodes(nodes_of(api))
    assert [n.name for n in inventory.nodes] == ["dgx-h100-1"]
    why = not_ready_reason(api.nodes[LOST])
    assert why is not None and why.startswith(f"is not ready (Ready={ready}")
    assert f"node {LOST} {why}; left out" in inventory.notes
    assert not any("toleration" in note for note in inventory.notes)
    ledger = Ledger(inventory, OFFERS, {"vision": Team("vision", 16000)})
    ledger.allocate(Request("ada", "vision", "h100", 4, "notebook", "a"), "a")
    ledger.allocate(Request("bob", "vision", "h100", 4, "notebook", "b"), "b")
    with pytest.raises(NoCapacity):  # never placed on the lost node's GPUs
        ledger.allocate(Request("cy", "vision", "h100", 1, "notebook", "c"), "c")


def test_a_lifecycle_taint_alone_leaves_a_node_out_and_condition_taints_are_not_to_tolerate() -> (
    None
):
    gone = h100_node(LOST)
    gone["spec"]["taints"].append(
        {"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}
    )
    pressed = h100_node("dgx-h100-1")
    pressed["spec"]["taints"].append(
        {"key": "node.kubernetes.io/memory-pressure", "effect": "NoSchedule"}
    )
    inventory = inventory_from_nodes([gone, pressed])
    assert [n.name for n in inventory.nodes] == ["dgx-h100-1"]
    assert (
        f"node {LOST} is not ready (taint node.kubernetes.io/out-of-service:NoExecute); left out"
        in inventory.notes
    )
    (note,) = [n for n in inventory.notes if "memory-pressure" in n]
    assert "do not tolerate it" in note and "gpu_tolerations" not in note


# -- notebooks: KubeSpawner's poll ------------------------------------------------------------
@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Served, Pool]]:
    """The stand-in with two H100 user nodes, and the hub's pool over them."""
    nodes = [user_node(name) for name in ("dgx-h100-1", LOST)]
    teams = {"vision": Team("vision", 16000)}
    everyone = Team("everyone", offers=frozenset({"cpu"}))
    with pooled_cluster(tmp_path, monkeypatch, nodes, OFFERS, teams, everyone) as made:
        yield made


async def poll_until_stopped(s: Any, timeout: float = 10.0) -> int:
    """``poll`` until it reports the server stopped (KubeSpawner's pod reflector catches up)."""
    deadline = time.monotonic() + timeout
    while (status := await s.poll()) is None:
        assert time.monotonic() < deadline, "the server still counts as running"
        await asyncio.sleep(0.02)
    return status


def test_a_notebook_evicted_from_a_lost_node_is_reported_stopped_and_released(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster

    async def go() -> Any:
        s = profile_spawner(pool)
        s.user_options = {"offer": "h100", "count": 2}
        try:
            pod = await start(server, s)
            node = pod["spec"]["nodeName"]
            (held,) = pool.ledger.allocations.values()
            assert held.node == node
            server.api.lose_node(node)
            assert await s.poll() is None  # lost, not evicted yet: it may come back
            assert s.gpupool_allocation_id == held.id
            assert server.api.evict(300) == [pod["metadata"]["name"]]
            status = await poll_until_stopped(s)
            # the pod is still there, Terminating: KubeSpawner alone would say it runs
            stored = server.api.objects["pods"][PROFILE_NS, pod["metadata"]["name"]]
            assert stored["metadata"]["deletionTimestamp"]
            return status
        finally:
            await stop(s)

    status = asyncio.run(go())
    assert isinstance(status, UnknownExit) and status == 0
    assert "is being deleted on node dgx-h100-" in str(status) and UNKNOWN in str(status)
    assert pool.ledger.allocations == {}


def test_a_pod_being_deleted_on_a_ready_node_still_runs(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster

    async def go() -> Any:
        s = profile_spawner(pool)
        s.user_options = {"offer": "h100", "count": 1}
        try:
            pod = await start(server, s)
            key = (PROFILE_NS, pod["metadata"]["name"])
            with server.api.lock:  # a graceful delete the kubelet has not confirmed yet
                stored = server.api.objects["pods"][key]
                stored["metadata"]["deletionTimestamp"] = "2025-01-01T00:10:00Z"
                server.api._touch(stored)
            deadline = time.monotonic() + 10
            while (
                not (s.pod_reflector.pods.get(f"{key[0]}/{key[1]}") or {})
                .get("metadata", {})
                .get("deletionTimestamp")
            ):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            return await s.poll(), len(pool.ledger.allocations)
        finally:
            await stop(s)

    assert asyncio.run(go()) == (None, 1)


# -- jobs ------------------------------------------------------------------------------------------
def job_allocations(count: int, gpus: int) -> list[Allocation]:
    """A job's allocations, one on each H100 node."""
    inventory = inventory_from_nodes([user_node("dgx-h100-1"), user_node(LOST)])
    ledger = Ledger(inventory, OFFERS, {"vision": Team("vision", 16000)})
    out = []
    for node in ("dgx-h100-1", LOST)[:count]:
        a = ledger.allocate(Request("alice", "vision", "h100", gpus, "job", "j1"), f"a-{node}")
        out.append(replace(a, node=node))
    return out


def job_backend(server: Served) -> KubeJobBackend:
    return KubeJobBackend(
        namespace=NS,
        offers=OFFERS,
        image=IMAGE,
        api_client_factory=lambda: ApiClient(Configuration(host=server.url)),
    )


@pytest.fixture
def kube_nodes() -> Iterator[Served]:
    with served() as server:
        for name in ("dgx-h100-1", LOST):
            server.api.add_node(user_node(name))
        yield server


def test_a_job_that_loses_a_node_fails_with_the_reason_once_the_pod_is_evicted(
    kube_nodes: Served,
) -> None:
    api, b = kube_nodes.api, job_backend(kube_nodes)
    job = a_job("h100", gpus=1, nodes=2)
    name = job_name(job)

    async def go() -> None:
        j = started(job, await b.start(job, job_allocations(2, 1)))
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        pods = api.pods_of(name, NS)
        assert sorted(p["spec"]["nodeName"] for p in pods.values()) == ["dgx-h100-1", LOST]
        assert (await b.check(j)).state == "running"
        api.lose_node(LOST)
        seen = await b.check(j)  # within its tolerationSeconds the node may come back
        assert seen.state == "running" and not seen.ended
        assert name in {n for _, n in api.objects["jobs"]}
        (lost_pod,) = [
            p["metadata"]["name"] for p in pods.values() if p["spec"]["nodeName"] == LOST
        ]
        assert api.evict(300) == [lost_pod]
        seen = await b.check(j)
        assert (seen.state, seen.reason) == (
            "failed",
            f"node {LOST} {UNKNOWN}: the job cannot go on, so it was stopped",
        )
        assert ("jobs", name, "Background") in api.deletions
        # the healthy node's pod is gone; the lost one stays Terminating until the node returns
        assert [k[1] for k in api.objects["pods"]] == [lost_pod]
        assert (await b.check(j)).state == "failed"  # and so it stays (a restarted hub too)

    asyncio.run(go())


def test_a_job_whose_node_is_lost_before_its_pod_starts_fails_at_once(kube_nodes: Served) -> None:
    api, b = kube_nodes.api, job_backend(kube_nodes)
    job = a_job("h100", gpus=1, nodes=2)
    name = job_name(job)

    async def go() -> None:
        j = started(job, await b.start(job, job_allocations(2, 1)))
        api.lose_node(LOST)
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        states = sorted(p["status"]["phase"] for p in api.pods_of(name, NS).values())
        assert states == ["Pending", "Running"]
        seen = await b.check(j)
        assert seen.state == "failed" and seen.reason.startswith(f"node {LOST} {UNKNOWN}")
        assert not api.objects["jobs"] and not api.objects["pods"]

    asyncio.run(go())
