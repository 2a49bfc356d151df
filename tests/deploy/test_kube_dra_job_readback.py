"""Issue 26 §4: a DRA job's claims read back. Each job pod's claim (made from the job's
ResourceClaimTemplate by the resourceclaim controller, owned by the pod) is allocated by the
scheduler's DRA plugin (``status.allocation.devices.results``); once the job runs, the hub reads
them back and records the real UUIDs on the job's ledger devices, as a notebook's start does. A
claim holding GPUs other than the pinned ones fails the job with the reason.

The stand-in: :mod:`tests.deploy.kube_dra` (claims, templates, slices, the DRA plugin)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Configurable

from gpupool.core.jobs import Job
from gpupool.core.ledger import Allocation
from gpupool.kube.jobs import KubeJobBackend
from gpupool.kube.manifests import job_name
from gpupool.pool import Pool
from gpupool.store import Store
from tests.deploy.kube_api import Served
from tests.deploy.kube_dra import uuids_of
from tests.deploy.kube_dra_fixtures import dra_nodes
from tests.deploy.kube_fixtures import NS, a_job, backend, started


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Served, Pool]]:
    with dra_nodes() as (server, ledger):
        store = Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}")
        try:
            yield server, Pool(ledger, store)
        finally:
            store.close()


def two_nodes(pool: Pool) -> list[Allocation]:
    first = pool.allocate("alice", ["vision"], "h100", 2, team="vision", kind="job", ref="j1")
    second = pool.allocate(
        "alice",
        ["vision"],
        "h100",
        2,
        team="vision",
        kind="job",
        ref="j1",
        avoid_nodes=[first.node or ""],
    )
    return [first, second]


def dra_backend(server: Served, pool: Pool) -> KubeJobBackend:
    holder = Configurable()
    holder.pool = pool  # type: ignore[attr-defined]
    return backend(server, device_allocation="dra", parent=holder)


def running_job(server: Served, pool: Pool) -> tuple[KubeJobBackend, Job, list[Allocation]]:
    allocations = two_nodes(pool)
    job = a_job("h100", gpus=2, nodes=2)
    b = dra_backend(server, pool)
    job = started(job, asyncio.run(b.start(job, allocations)))
    job = replace(job, state="running", allocations=tuple(a.id for a in allocations))
    server.api.create_pods(job_name(job), NS)
    server.api.run_pods(job_name(job), NS)
    return b, job, allocations


def pinned_on(node: str) -> list[str]:
    """The node's first two GPUs in PCI order (the ledger's gpu0, gpu1): ``gpu-7``, ``gpu-6``."""
    return [uuids_of(node)[7], uuids_of(node)[6]]


def test_a_running_jobs_claims_are_read_back_and_its_uuids_recorded(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster
    b, job, allocations = running_job(server, pool)
    seen = asyncio.run(b.check(job))
    assert seen.state == "running", seen
    for a in allocations:
        held = pool.ledger.allocations[a.id]
        assert [d.instance for d in held.devices] == pinned_on(a.node or "")
        assert held.visible_devices == ",".join(pinned_on(a.node or ""))
    stored = {a.id: a for a in pool.store.load()}
    for a in allocations:
        assert [d.instance for d in stored[a.id].devices] == pinned_on(a.node or "")


def test_a_claim_given_other_gpus_fails_the_job_with_the_reason(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster
    b, job, allocations = running_job(server, pool)
    # a driver or allocator that does not honour the selector: the claim holds gpu-0
    api = server.api
    with api.lock:
        claim: dict[str, Any] = next(
            c for c in api.objects["resourceclaims"].values() if c.get("status")
        )
        results = claim["status"]["allocation"]["devices"]["results"]
        results[0]["device"] = "gpu-0"
        api._touch(claim)
    seen = asyncio.run(b.check(job))
    assert "not the ones the pool holds" in seen.reason, seen
    assert uuids_of(results[0]["pool"])[0] in seen.reason
    assert api.objects["jobs"] == {}  # the Job is deleted, so its GPUs can be released
    for a in allocations:
        assert [d.instance for d in pool.ledger.allocations[a.id].devices] == [None, None]
