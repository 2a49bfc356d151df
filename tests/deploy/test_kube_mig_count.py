"""Several MIG instances on Kubernetes: the notebook pod and the job pod request
``nvidia.com/mig-<profile>: N``; the job runs N ranks per pod with gloo, each taking its own
instance from the device plugin's ``NVIDIA_VISIBLE_DEVICES`` (gpupool_lab.rank_log)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpupool.core import Ledger, Offer, Request, Team
from gpupool.kube.manifests import configmap_name, make_job
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.pool import Pool
from gpupool_lab.allocation import allocation_info
from gpupool_lab.rank_log import rank_device
from tests.conftest import a100_mixed_node, h100_node
from tests.deploy.kube_fixtures import (
    NS,
    a_job,
    container,
    job_env,
    job_nvidia,
    manifest,
    notebook_env,
    notebook_nvidia,
    notebook_pod,
    pod_of,
    spawner,
    validate,
)

OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", model="A100-80GB", profile="3g.40gb", max_count=2),
}
MIG = {"nvidia.com/mig-3g.40gb": "2"}
UUIDS = "MIG-1b7c7e8a-0000-5000-8000-000000000001,MIG-1b7c7e8a-0000-5000-8000-000000000002"


def ledger() -> Ledger:
    inventory = inventory_from_nodes([h100_node(), a100_mixed_node()])
    everyone = Team("everyone", offers=frozenset({"cpu"}))
    return Ledger(inventory, OFFERS, {"vision": Team("vision", 8000)}, everyone)


@pytest.fixture
def pool_offers() -> dict[str, Offer]:
    return OFFERS


def test_a_notebook_pod_requests_both_instances(pool: Pool) -> None:
    async def go() -> dict[str, Any]:
        return await manifest(spawner(pool), pool, "mig-3g.40gb", 2)

    pod = asyncio.run(go())
    validate(pod)
    assert notebook_nvidia(pod) == {"limits": MIG, "requests": MIG}
    (allocation,) = pool.ledger.allocations.values()
    assert len(allocation.devices) == 2 and allocation.cost_milli == 1000
    assert "NVIDIA_VISIBLE_DEVICES" not in notebook_env(pod)  # the device plugin's to set


def job_object(gpus: int) -> dict[str, Any]:
    job = a_job("mig-3g.40gb", gpus=gpus)
    allocations = [
        ledger().allocate(Request("alice", "vision", "mig-3g.40gb", gpus, "job", job.id), "a0")
    ]
    return make_job(
        job,
        allocations,
        pod_template=notebook_pod(),
        namespace=NS,
        script_configmap=configmap_name(job),
        offer=OFFERS["mig-3g.40gb"],
    )


def test_a_job_pod_runs_a_rank_per_instance_with_gloo() -> None:
    obj = job_object(2)
    validate(obj)
    validate(pod_of(obj))
    assert job_nvidia(obj) == {"limits": MIG, "requests": MIG}
    args = container(obj)["args"]
    assert args[args.index("--nproc-per-node") + 1] == "2"
    env = job_env(obj)
    assert env["GPUPOOL_RANK_DEVICES"] == "NVIDIA_VISIBLE_DEVICES"
    assert env["GPUPOOL_DDP_BACKEND"] == "gloo"
    names = [e["name"] for e in container(obj)["env"]]
    assert len(names) == len(set(names))
    one = job_env(job_object(1))
    assert "GPUPOOL_RANK_DEVICES" not in one and "GPUPOOL_DDP_BACKEND" not in one


def test_a_rank_in_a_pod_takes_its_own_instance_from_the_device_plugins_list() -> None:
    pod = {"GPUPOOL_RANK_DEVICES": "NVIDIA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES": UUIDS}
    first, second = UUIDS.split(",")
    assert rank_device({**pod, "LOCAL_RANK": "0"})[0] == first
    device, said = rank_device({**pod, "LOCAL_RANK": "1"})
    assert device == second
    assert said == f"gpupool: local rank 1 runs on {second} (CUDA_VISIBLE_DEVICES)"
    assert rank_device({"GPUPOOL_RANK_DEVICES": UUIDS, "LOCAL_RANK": "1"})[0] == second
    assert rank_device({"LOCAL_RANK": "1"}) == (None, "")
    for listed in ("all", "0:1,0:2", "/var/run/nvidia-container-devices", ""):
        device, said = rank_device({**pod, "NVIDIA_VISIBLE_DEVICES": listed, "LOCAL_RANK": "1"})
        assert device is None
        assert said.startswith("gpupool: local rank 1 has no device of its own in ")
        assert "a process sees only the first MIG instance" in said
    assert rank_device({**pod, "LOCAL_RANK": "2"})[0] is None  # more ranks than instances


def test_jupyterlab_labels_a_server_on_two_instances_with_its_count() -> None:
    lines = [
        {"name": "mig-1g", "kind": "mig", "label": f"MIG 1g.10gb ×{n}", "count": n} for n in (1, 2)
    ]
    offers = {"simulated": False, "teams": [{"team": "nlp", "offers": lines}]}
    pod = {"GPUPOOL_OFFER": "mig-1g", "GPUPOOL_TEAM": "nlp"}
    two = allocation_info({**pod, "NVIDIA_VISIBLE_DEVICES": UUIDS}, offers)
    assert two["label"] == "MIG 1g.10gb ×2 · nlp"
    one = allocation_info({**pod, "CUDA_VISIBLE_DEVICES": UUIDS.split(",")[0]}, offers)
    assert one["label"] == "MIG 1g.10gb ×1 · nlp"
