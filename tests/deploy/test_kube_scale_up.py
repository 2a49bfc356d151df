"""Autoscaled node pools at zero: a job only a new node could hold queues with the reason, its
scale-up request pod asks the autoscaler for that node (Pending with kube-scheduler's words, as
the cluster autoscaler sees it), and once the node is in the inventory the job is granted there
and the request is withdrawn. Against the API stand-in (``tests/deploy/kube_api.py``)."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import kubernetes_validate
from kubernetes_asyncio.client import ApiClient, Configuration
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Team
from gpupool.core.inventory import Inventory
from gpupool.core.queue import ScaleUp
from gpupool.discovery.kubernetes import inventory_from_nodes
from gpupool.discovery.node_pools import parse_node_pools
from gpupool.jobs.kube_scale_up import plan_scale_up_pods
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import gpu_node_labels, h100_node, node
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


def test_a_job_for_a_node_pool_at_zero_asks_for_a_node_and_runs_there(tmp_path: Path) -> None:
    h100 = copy.deepcopy(h100_node("h1"))
    h100["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
    with served() as server:
        api = server.api
        api.add_node(h100)
        c = Config()
        c.JobManager.backend_class = "gpupool.jobs.kube.KubeJobBackend"
        c.KubeJobBackend.namespace = NS
        c.KubeJobBackend.image = "quay.io/jupyter/pytorch-notebook:cuda12-2025-06-02"
        c.KubeJobBackend.api_client_factory = lambda: ApiClient(Configuration(host=server.url))
        pool = Pool(Ledger(inventory(h100), OFFERS, TEAMS), Store(f"sqlite:///{tmp_path}/p.db"))
        m = JobManager(pool, config=c)

        async def submitted() -> str:
            job = m.submit("alice", ["vision"], SCRIPT)
            await m.schedule_pass()
            return job.id

        job_id = asyncio.run(submitted())
        job = m.jobs[job_id]
        assert (job.state, job.reason) == (
            "queued",
            "node pool a100 has to add a node first (it is autoscaled)",
        )
        (name, pod) = next(iter(request_pods(api).items()))
        assert name == "gpupool-scale-up-a100-0"
        assert kubernetes_validate.validate(pod, "1.33", strict=True) == "1.33"
        container = pod["spec"]["containers"][0]
        assert container["resources"]["limits"] == {"nvidia.com/gpu": "8"}
        assert pod["spec"]["nodeSelector"] == {"cloud.google.com/gke-nodepool": "a100"}
        assert "nodeName" not in pod["spec"] and "affinity" in pod["spec"]
        # what the cluster autoscaler acts on: Pending, unschedulable on every present node
        assert api.schedule(NS, name) == "Unschedulable"
        message = pod["status"]["conditions"][0]["message"]
        assert message.startswith("0/1 nodes are available")

        # the autoscaler adds the node; the node watch brings it into the inventory
        api.add_node(a100_node("a1"))
        pool.ledger = Ledger(inventory(h100, a100_node("a1")), OFFERS, TEAMS)
        asyncio.run(m.schedule_pass())
        job = m.jobs[job_id]
        assert job.state in ("starting", "running"), job.reason
        assert [pool.ledger.allocations[a].node for a in job.allocations] == ["a1"]
        assert request_pods(api) == {}  # withdrawn in the same pass
        name = f"gpupool-{job_id}"
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        assert [p["spec"]["nodeName"] for p in api.pods_of(name, NS).values()] == ["a1"]


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
