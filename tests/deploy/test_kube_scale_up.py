"""Autoscaled node pools at zero: a job only a new node could hold queues with the reason, its
scale-up request pod asks the autoscaler for that node (Pending with kube-scheduler's words, as
the cluster autoscaler sees it), and once the node is in the inventory the job is granted there
and the request is withdrawn. Against the API stand-in (``tests/deploy/kube_api.py``)."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Team
from gpupool.core.inventory import Inventory
from gpupool.core.queue import ScaleUp
from gpupool.discovery.node_pools import parse_node_pools
from gpupool.jobs.manager import JobManager
from gpupool.kube.api import ClusterAPI
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.reconcile import KubeReconciler
from gpupool.kube.scale_up import make_scale_up_pod, plan_scale_up_pods
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import gpu_node_labels, h100_node, kubeconfig, node
from tests.deploy.kube_api import StandIn, served

NS = "gpupool"
OFFERS = {
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=8),
    "a100": Offer("a100", "gpu", model="A100-80GB", max_count=8),
}
TEAMS = {"vision": Team("vision", 64000)}
POOLS = parse_node_pools(
    {
        "a100": {
            "node": "8x A100-80GB",
            "max_nodes": 2,
            "node_selector": {"cloud.google.com/gke-nodepool": "a100"},
        }
    }
)
SCRIPT = {"script": "print(1)\n", "offer": "a100", "gpus": 8}


def a100_node(name: str) -> dict[str, Any]:
    labels = gpu_node_labels("NVIDIA-A100-SXM4-80GB", "81920", 8, "all-disabled")
    labels |= {"cloud.google.com/gke-nodepool": "a100", "hub.jupyter.org/node-purpose": "user"}
    return node(name, labels, {"nvidia.com/gpu": "8"})


def inventory(*nodes: dict[str, Any]) -> Inventory:
    return replace(inventory_from_nodes(list(nodes)), node_pools=POOLS)


def request_pods(api: StandIn) -> dict[str, dict[str, Any]]:
    return {
        name: pod
        for (ns, name), pod in api.objects["pods"].items()
        if ns == NS and "gpupool.io/scale-up" in pod["metadata"].get("labels", {})
    }


def test_a_job_for_a_node_pool_at_zero_asks_for_a_node_and_runs_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole path: queued with the reason, a request pod Pending as the autoscaler sees it,
    the node added to the cluster, seen by the node watch, the job granted there by the pass
    the new inventory triggers, the request withdrawn, the job's pod running on the new node."""
    h100 = copy.deepcopy(h100_node("h1"))
    h100["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
    with served() as server:
        api = server.api
        api.add_node(h100)
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", server.url)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        c = Config()
        c.JobManager.schedule_interval = 3600  # only events start passes: submit, new nodes
        c.JobManager.backend_class = "gpupool.kube.jobs.KubeJobBackend"
        c.KubeJobBackend.namespace = NS
        c.KubeJobBackend.image = "quay.io/jupyter/pytorch-notebook:cuda12-2025-06-02"
        pool = Pool(Ledger(inventory(h100), OFFERS, TEAMS), Store(f"sqlite:///{tmp_path}/p.db"))
        m = JobManager(pool, config=c)
        watcher = KubeReconciler(pool, ClusterAPI(NS), grace=0.0, period=0.2, retry=0.1)

        def pods() -> dict[str, dict[str, Any]]:
            with api.lock:
                return copy.deepcopy(request_pods(api))

        async def scenario() -> None:
            await m.start()
            watcher.start()
            try:
                job = m.submit("alice", ["vision"], SCRIPT)
                await until(lambda: bool(pods()))
                assert m.jobs[job.id].state == "queued"
                assert m.jobs[job.id].reason.endswith(
                    "node pool a100 has to add a node first (it is autoscaled)"
                )
                (name, pod) = next(iter(pods().items()))
                assert name == "gpupool-scale-up-a100-0"
                assert kubernetes_validate.validate(pod, "1.33", strict=True) == "1.33"
                container = pod["spec"]["containers"][0]
                assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
                assert pod["spec"]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "a100"}
                assert "nodeName" not in pod["spec"] and "affinity" in pod["spec"]
                # what the cluster autoscaler acts on: unschedulable on every present node
                with api.lock:
                    assert api.schedule(NS, name) == "Unschedulable"
                    message = api.objects["pods"][NS, name]["status"]["conditions"][0]["message"]
                assert message.startswith("0/1 nodes are available")

                with api.lock:  # the autoscaler adds the node
                    api.add_node(a100_node("a1"))
                await until(lambda: m.jobs[job.id].state != "queued" and not pods())
                granted = m.jobs[job.id]
                assert granted.state in ("starting", "running"), granted.reason
                assert [pool.ledger.allocations[a].node for a in granted.allocations] == ["a1"]
                await until(lambda: bool(m.jobs[job.id].handle))  # the Indexed Job exists
                with api.lock:
                    api.create_pods(f"gpupool-{job.id}", NS)
                    api.run_pods(f"gpupool-{job.id}", NS)
                    placed = api.pods_of(f"gpupool-{job.id}", NS)
                assert [p["spec"]["nodeName"] for p in placed.values()] == ["a1"]
            finally:
                await watcher.stop()
                await m.stop()

        asyncio.run(scenario())


async def until(what: Callable[[], bool], timeout: float = 20.0) -> None:
    """Poll ``what`` on the loop (the watches and the queue run meanwhile)."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def test_requests_follow_what_the_queue_waits_for() -> None:
    """A changed wish replaces a pod (deleted now, created by a later call once gone); one no
    longer wanted is deleted; a multi-node wish is one pod per node."""
    two = ScaleUp("a100", "a100", 8, 2)

    def pod(name: str, key: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "annotations": {"gpupool.io/scale-up-for": key}}}

    create, delete = plan_scale_up_pods([two], [])
    assert [(w.node_pool, i) for w, i in create] == [("a100", 0), ("a100", 1)] and delete == []
    have = [pod("gpupool-scale-up-a100-0", "8x a100"), pod("gpupool-scale-up-a100-1", "4x a100")]
    create, delete = plan_scale_up_pods([two], have)
    assert create == [] and delete == ["gpupool-scale-up-a100-1"]
    assert plan_scale_up_pods([], have) == ([], sorted(p["metadata"]["name"] for p in have))


def test_a_hub_started_without_a_node_pool_withdraws_its_old_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node pool removed from the config (or a hub restarted with none): the request pods an
    earlier run left would keep a node in the cluster for nothing; the first pass deletes them."""
    h100 = copy.deepcopy(h100_node("h1"))
    with served() as server:
        api = server.api
        api.add_node(h100)
        old = make_scale_up_pod(ScaleUp("a100", "a100", 8, 1), 0, NS, OFFERS["a100"], POOLS[0])
        assert api.create("pods", NS, old)[0] == 201
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", server.url)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        c = Config()
        c.JobManager.schedule_interval = 3600
        c.JobManager.backend_class = "gpupool.kube.jobs.KubeJobBackend"
        c.KubeJobBackend.namespace = NS
        c.KubeJobBackend.image = "quay.io/jupyter/pytorch-notebook:cuda12-2025-06-02"
        no_pools = inventory_from_nodes([h100])
        assert no_pools.node_pools == ()
        pool = Pool(Ledger(no_pools, OFFERS, TEAMS), Store(f"sqlite:///{tmp_path}/p.db"))
        m = JobManager(pool, config=c)

        def pods() -> dict[str, dict[str, Any]]:
            with api.lock:
                return copy.deepcopy(request_pods(api))

        async def scenario() -> None:
            assert list(pods()) == ["gpupool-scale-up-a100-0"]
            await m.start()
            try:
                await until(lambda: not pods())  # no job at all: the start's own pass
            finally:
                await m.stop()

        asyncio.run(scenario())
