"""A job Kueue preempts gives its GPUs back to the hub's ledger, and is granted again only through
the pool's own admission.

The stand-in (:mod:`tests.deploy.kube_api`) preempts as Kueue does (:meth:`StandIn.kueue_preempt`:
``spec.suspend: true``, ``startTime`` cleared, pods deleted, ``Suspended`` as at creation, the
Workload ``Evicted``); the job manager runs :class:`KubeJobBackend` against it, its watch stepped by
the test (:func:`look`).
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

from kubernetes_asyncio.client import ApiClient, Configuration
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Team
from gpupool.core.jobs import Job
from gpupool.jobs.manager import JobManager
from gpupool.kube.job_status import observe_objects
from gpupool.kube.jobs import KubeJobBackend
from gpupool.kube.manifests import job_name
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import h100_node
from tests.deploy.kube_api import Served, served
from tests.deploy.kube_fixtures import IMAGE, NS

PREEMPTED = (
    "Preempted to accommodate a workload (UID: 1b2c) due to prioritization in the ClusterQueue"
)
SPEC = {"script": "print(1)\n", "offer": "h100", "gpus": 4, "nodes": 1}


class SteppedBackend(KubeJobBackend):
    """The Kubernetes backend whose watch looks once, then waits for the test (:func:`look`)."""

    async def wait(self, job: Job, timeout: float) -> None:
        await asyncio.Event().wait()


def manager(server: Served, tmp_path: Path) -> JobManager:
    node = copy.deepcopy(h100_node("m1"))
    node["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
    server.api.add_node(node)
    c = Config()
    c.JobManager.backend_class = SteppedBackend
    c.KubeJobBackend.namespace = NS
    c.KubeJobBackend.image = IMAGE
    c.KubeJobBackend.kueue_queue_template = "{team}-gpu"
    c.KubeJobBackend.api_client_factory = lambda: ApiClient(Configuration(host=server.url))
    offers = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=8)}
    teams = {"vision": Team("vision", 64000)}
    ledger = Ledger(inventory_from_nodes([node]), offers, teams)
    return JobManager(Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}")), config=c)


async def look(m: JobManager, job_id: str) -> Job:
    """One look of the job's watch (the watch task's own, after its first, never comes)."""
    await m._observed(job_id, await m.backend.check(m.jobs[job_id]))
    return m.jobs[job_id]


def held(m: JobManager, job_id: str) -> int:
    """The GPUs the ledger holds for the job."""
    return sum(len(a.devices) for a in m.pool.ledger.allocations.values() if a.ref == job_id)


async def admitted_and_running(m: JobManager, server: Served, max_restarts: int) -> Job:
    job = m.submit("alice", ["vision"], {**SPEC, "max_restarts": max_restarts})
    await m.schedule_pass()
    assert (await look(m, job.id)).state == "starting"  # waiting for Kueue
    name = job_name(job)
    server.api.kueue_admit(name, NS)
    server.api.create_pods(name, NS)
    server.api.run_pods(name, NS)
    job = await look(m, job.id)
    assert job.state == "running" and held(m, job.id) == 4
    return job


def test_a_job_kueue_preempts_releases_its_gpus_and_is_granted_again(tmp_path: Path) -> None:
    """Kueue preempts the running job: the hub deletes its Job, releases its 4 GPUs and requeues
    it with Kueue's reason. A notebook takes the node meanwhile: the job waits in the pool's queue
    (no Job, no GPUs); once the notebook ends, the pool grants it again and its new Job waits for
    Kueue's admission. On main the preempted job kept its GPUs "waiting for Kueue"."""
    with served() as server:
        m = manager(server, tmp_path)
        name = ""

        async def go() -> None:
            nonlocal name
            job = await admitted_and_running(m, server, max_restarts=1)
            name = job_name(job)
            server.api.kueue_preempt(name, NS, PREEMPTED)
            assert server.api.workloads[NS, name][0]["reason"] == "Preempted"
            job = await look(m, job.id)
            assert held(m, job.id) == 0, job.reason
            assert job.state == "queued" and job.restarts == 1
            assert job.reason.startswith("preempted by Kueue (queue vision-gpu)"), job.reason
            assert job.reason.endswith("; requeued")
            assert (NS, name) not in server.api.objects["jobs"]  # nothing left to run unaccounted
            notebook = m.pool.allocate("carol", ["vision"], "h100", 8)
            await m.schedule_pass()
            job = m.jobs[job.id]
            assert job.state == "queued" and held(m, job.id) == 0
            assert job.reason != "queued" and "preempted" not in job.reason  # the pool's wait
            assert (NS, name) not in server.api.objects["jobs"]
            m.pool.release(notebook.id)
            await m.schedule_pass()
            job = m.jobs[job.id]
            assert job.state == "starting" and held(m, job.id) == 4
            assert server.api.job(name, NS)["spec"]["suspend"] is True  # Kueue admits it anew
            seen = await m.backend.check(job)
            assert seen.reason == "waiting for Kueue to admit it (queue vision-gpu)"

        asyncio.run(go())


def test_a_job_out_of_restarts_fails_when_kueue_preempts_it(tmp_path: Path) -> None:
    with served() as server:
        m = manager(server, tmp_path)

        async def go() -> None:
            job = await admitted_and_running(m, server, max_restarts=0)
            server.api.kueue_preempt(job_name(job), NS, PREEMPTED)
            job = await look(m, job.id)
            assert (job.state, held(m, job.id)) == ("failed", 0)
            assert job.reason.endswith("; out of restarts (0)"), job.reason

        asyncio.run(go())


def test_only_a_job_seen_admitted_is_taken_back() -> None:
    """A suspended Job with a queue looks the same before admission and after preemption (Kueue
    clears ``startTime``, the Job controller sets the same ``Suspended``): ``admitted`` decides."""
    job: dict[str, Any] = {
        "metadata": {"labels": {"kueue.x-k8s.io/queue-name": "vision-gpu"}},
        "spec": {"suspend": True},
        "status": {"conditions": [{"type": "Suspended", "status": "True"}]},
    }
    assert observe_objects(job, [], 1).state == "starting"
    assert observe_objects(job, [], 1, admitted=True).state == "queued"
    del job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]  # suspended by someone else
    assert observe_objects(job, [], 1, admitted=True).state == "starting"
