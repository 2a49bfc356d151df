"""Issue 26 §4: a job's GPUs under ``device_allocation = "dra"``: an Indexed Job's pods share one
template, so the job gets a ResourceClaimTemplate (owned by the Job) whose selector lists the
UUIDs the ledger pinned on every node of the job; Kubernetes' resourceclaim controller makes each
pod its own claim, and the scheduler's DRA plugin gives each pod its node's pinned GPUs.

The stand-in: :mod:`tests.deploy.kube_dra` (claims, templates, slices, the DRA plugin)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from gpupool.core import Ledger
from gpupool.core.errors import InvalidRequest
from gpupool.core.jobs import JobSpec
from gpupool.kube.jobs import KubeError
from gpupool.kube.manifests import job_name
from tests.deploy.kube_api import Served
from tests.deploy.kube_dra import uuids_of
from tests.deploy.kube_dra_fixtures import NODES, dra_backend, dra_nodes, two_nodes, uuid_claim
from tests.deploy.kube_fixtures import NS, a_job, started


@pytest.fixture
def cluster() -> Iterator[tuple[Served, Ledger]]:
    with dra_nodes() as (server, ledger):
        yield server, ledger


def pinned_on(node: str) -> list[str]:
    """The node's first two GPUs in PCI order: ``gpu-7`` and ``gpu-6``."""
    return [uuids_of(node)[7], uuids_of(node)[6]]


def claim_of(server: Served, pod: dict[str, Any]) -> dict[str, Any]:
    """The claim made for ``pod`` (owned by it)."""
    (claim,) = [
        c
        for c in server.api.objects["resourceclaims"].values()
        if c["metadata"]["ownerReferences"][0]["uid"] == pod["metadata"]["uid"]
    ]
    return claim


def test_each_job_pod_gets_the_gpus_the_ledger_pinned_on_its_node(
    cluster: tuple[Served, Ledger],
) -> None:
    server, ledger = cluster
    allocations = two_nodes(ledger)
    assert {a.node for a in allocations} == set(NODES)
    job = a_job("h100", gpus=2, nodes=2)
    name = job_name(job)
    b = dra_backend(server, ledger)

    async def go() -> None:
        started(job, await b.start(job, allocations))

    asyncio.run(go())
    api = server.api
    obj = api.job(name, NS)
    template = api.objects["resourceclaimtemplates"][NS, f"{name}-gpus"]
    assert template["metadata"]["ownerReferences"][0]["uid"] == obj["metadata"]["uid"]
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["count"] == 2
    expression = request["exactly"]["selectors"][0]["cel"]["expression"]
    for node in NODES:
        for uuid in pinned_on(node):
            assert f"'{uuid}'" in expression
    pod_spec = obj["spec"]["template"]["spec"]
    assert pod_spec["resourceClaims"] == [
        {"name": "gpus", "resourceClaimTemplateName": f"{name}-gpus"}
    ]
    for container in pod_spec["containers"]:
        limits = (container.get("resources") or {}).get("limits") or {}
        assert not [k for k in limits if k.startswith("nvidia.com/")]

    api.create_pods(name, NS)
    api.run_pods(name, NS)
    pods = api.pods_of(name, NS)
    assert {p["status"]["phase"] for p in pods.values()} == {"Running"}
    for pod in pods.values():
        claim = claim_of(server, pod)
        assert claim["metadata"]["ownerReferences"][0]["controller"] is True
        results = claim["status"]["allocation"]["devices"]["results"]
        node = pod["spec"]["nodeName"]
        # pinned: gpu-7 and gpu-6 (the ledger's gpu0 and gpu1), not the first free gpu-0, gpu-1
        assert sorted(r["device"] for r in results) == ["gpu-6", "gpu-7"]
        assert {r["pool"] for r in results} == {node}

    # cancelled: the Job takes its template, its pods and their claims along
    api.delete("jobs", NS, name, "Background")
    assert api.objects["resourceclaimtemplates"] == {}
    assert api.objects["resourceclaims"] == {}


def test_a_job_pod_whose_pinned_gpu_is_taken_waits_with_the_schedulers_reason(
    cluster: tuple[Served, Ledger],
) -> None:
    server, ledger = cluster
    allocations = two_nodes(ledger)
    taken = pinned_on(NODES[0])[0]  # another tenant's claim holds it
    claim = uuid_claim(taken)
    with server.api.lock:
        assert server.api.create("resourceclaims", "ml", claim)[0] == 201
        server.api.objects["resourceclaims"]["ml", "train-gpu"]["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "gpu.nvidia.com",
                            "pool": NODES[0],
                            "device": "gpu-7",
                        }
                    ]
                }
            }
        }
    job = a_job("h100", gpus=2, nodes=2)
    name = job_name(job)
    b = dra_backend(server, ledger)

    async def go() -> str:
        j = started(job, await b.start(job, allocations))
        server.api.create_pods(name, NS)
        server.api.run_pods(name, NS)
        return (await b.check(j)).reason

    reason = asyncio.run(go())
    assert "cannot allocate all claims" in reason, reason


def test_a_node_without_the_drivers_slices_fails_the_job_before_anything_is_made(
    cluster: tuple[Served, Ledger],
) -> None:
    server, ledger = cluster
    allocations = two_nodes(ledger)
    server.api.dra.remove_slice(server.api.dra.slices[0]["metadata"]["name"])
    b = dra_backend(server, ledger)
    with pytest.raises(KubeError, match=r"publishes 0 GPU\(s\) of driver gpu\.nvidia\.com"):
        asyncio.run(b.start(a_job("h100", gpus=2, nodes=2), allocations))
    assert server.api.objects["jobs"] == {}


def test_jobs_on_mig_instances_are_refused_under_dra_with_the_reason(
    cluster: tuple[Served, Ledger],
) -> None:
    server, ledger = cluster
    b = dra_backend(server, ledger)
    with pytest.raises(InvalidRequest, match=r"Dynamic Resource Allocation.*whole GPUs only"):
        b.validate(JobSpec(script="print(1)", offer="mig-3g.40gb", gpus=1))
    b.validate(JobSpec(script="print(1)", offer="h100", gpus=2))  # whole GPUs run
