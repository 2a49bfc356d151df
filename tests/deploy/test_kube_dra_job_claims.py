"""Issue 26 §4: a DRA job pod the scheduler cannot give its pinned GPUs (another pod's claim
holds them) stays Pending with the DRA plugin's ``cannot allocate all claims`` (``Filter`` in
``pkg/scheduler/framework/plugins/dynamicresources/dynamicresources.go``, Unschedulable and
Unresolvable); the job fails at once with the scheduler's message and its Job is deleted,
rather than holding its GPUs until the start timeout.

The stand-in: :mod:`tests.deploy.kube_dra` (claims, templates, slices, the DRA plugin)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from gpupool.core import Ledger
from gpupool.kube.manifests import job_name
from tests.deploy.kube_api import Served
from tests.deploy.kube_dra_fixtures import dra_backend, dra_nodes, two_nodes
from tests.deploy.kube_fixtures import NS, a_job, started


@pytest.fixture
def cluster() -> Iterator[tuple[Served, Ledger]]:
    with dra_nodes() as (server, ledger):
        yield server, ledger


def test_a_job_pod_whose_pinned_gpus_another_claim_holds_fails_the_job_at_once(
    cluster: tuple[Served, Ledger],
) -> None:
    server, ledger = cluster
    allocations = two_nodes(ledger)
    job = a_job("h100", gpus=2, nodes=2)
    name = job_name(job)
    b = dra_backend(server, ledger)
    job = started(job, asyncio.run(b.start(job, allocations)))
    api = server.api
    # another tenant's claim already holds gpu-7 (the ledger's gpu0) of the second node
    other = allocations[1].node or ""
    with api.lock:
        api.objects["resourceclaims"]["other", "theirs"] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "theirs", "namespace": "other", "uid": "u-theirs"},
            "spec": {"devices": {"requests": []}},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {
                                "request": "gpus",
                                "driver": "gpu.nvidia.com",
                                "pool": other,
                                "device": "gpu-7",
                            }
                        ]
                    }
                }
            },
        }
    api.create_pods(name, NS)
    verdicts = [api.schedule(NS, p["metadata"]["name"]) for p in api.pods_of(name, NS).values()]
    assert "Unschedulable" in verdicts, verdicts

    seen = asyncio.run(b.check(job))
    assert seen.state == "failed", seen
    assert "cannot allocate all claims" in seen.reason
    assert "ResourceClaim pins GPUs another pod holds" in seen.reason
    assert NS + "/" + name not in {f"{ns}/{n}" for ns, n in api.objects["jobs"]}
