"""Kueue and the hub agree on quota: what the hub grants with Kueue on, Kueue admits.

The chart is rendered (:mod:`tests.deploy.chart_fixtures`); the hub's settings come from its
rendered config, and the stand-in's Kueue (:mod:`tests.deploy.kube_kueue`) from its rendered
ClusterQueues, LocalQueues and resource transformations, so both read the teams' declarations
once. Kueue lets a team borrow only what its cohort leaves unused, counts its quota resource in
whole units, and never admits a Workload asking for a resource its ClusterQueue does not cover.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from gpupool.config import GPUPool
from gpupool.core import Ledger, Request
from gpupool.core.jobs import Job
from gpupool.jobs.manager import JobManager
from gpupool.kube.jobs import KubeJobBackend
from gpupool.kube.manifests import job_name
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.pods import ShareRequests, allocation_resources
from gpupool.kube.settings import kueue_cohort, kueue_warnings
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import h100_node, hami_node
from tests.deploy.chart_fixtures import CHART, NAMESPACE, RELEASE, merge, render_all
from tests.deploy.kube_api import served
from tests.deploy.kube_fixtures import IMAGE, user_nodes
from tests.deploy.kube_kueue import Kueue
from tests.deploy.kueue_fixtures import hub_config, kueue_cluster, refused_start

NO_DEPENDENCY = {"jupyterhub": {"enabled": False}}
H100 = {"kind": "gpu", "model": "H100-80GB", "max_count": 8}
VALUES: dict[str, Any] = {
    **NO_DEPENDENCY,
    "gpupool": {
        "inventory": "kubernetes",
        "offers": {"cpu": {"kind": "cpu"}, "h100": H100},
        "teams": {
            "nlp": {"guarantee": 1, "offers": ["cpu", "h100"]},
            "vision": {"guarantee": 2, "borrow_limit": 4, "offers": ["cpu", "h100"]},
        },
    },
    "kueue": {"enabled": True},
}


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def resource(chart: helm.Chart) -> str:
    """The ClusterQueues' quota resource (the chart's ``kueue.resource``)."""
    return str(chart.merge_values(VALUES)["kueue"]["resource"])


class SteppedBackend(KubeJobBackend):
    """The Kubernetes backend whose watch looks once, then waits for the test."""

    async def wait(self, job: Job, timeout: float) -> None:
        await asyncio.Event().wait()


def test_the_hub_grants_no_gpu_kueues_cohort_would_not_admit(
    chart: helm.Chart, tmp_path: Path
) -> None:
    """nlp (guarantee 1) and vision (guarantee 2, borrow limit 4) on one 8-GPU node: their
    ClusterQueues' cohort has 3 GPUs of nominal quota. Once nlp holds 1 and vision 2, the hub's
    own limits leave vision 4 more, but Kueue admits vision's next Job only from quota the
    cohort leaves unused: none. On main the hub started that Job and it waited for Kueue's
    admission, holding a GPU, until its deadline; now it waits in the hub's queue, saying why,
    and starts (and Kueue admits it) once nlp's job ends."""
    objects = render_all(chart, VALUES)
    kueue = Kueue.from_chart(objects)
    c = hub_config(objects, tmp_path)
    settings = GPUPool(config=c).settings()
    with served() as server:
        node = copy.deepcopy(h100_node("m1"))
        server.api.add_node(node)
        c.JobManager.backend_class = SteppedBackend
        c.KubeJobBackend.namespace = NAMESPACE
        c.KubeJobBackend.image = IMAGE
        c.KubeJobBackend.api_client_factory = lambda: ApiClient(Configuration(host=server.url))
        inventory = inventory_from_nodes([node])
        ledger = Ledger(
            inventory, settings.offers, settings.teams, settings.everyone, cohort=kueue_cohort(c)
        )
        store = Store(f"sqlite:///{tmp_path / 'pool.sqlite'}")
        m = JobManager(Pool(ledger, store), config=c)
        spec = {"script": "print(1)\n", "offer": "h100", "nodes": 1}

        async def go() -> None:
            nlp = m.submit("nina", ["nlp"], {**spec, "gpus": 1})
            vision = m.submit("vic", ["vision"], {**spec, "gpus": 2})
            third = m.submit("vic", ["vision"], {**spec, "gpus": 1})
            await m.schedule_pass()
            kueue.schedule(server.api)
            started = [j for j in (nlp, vision, third) if m.jobs[j.id].state != "queued"]
            for job in started:  # every Job the hub made, Kueue admits
                key = (NAMESPACE, job_name(job))
                assert key in kueue.admitted, kueue.pending.get(key)
            assert m.jobs[third.id].state == "queued"
            assert (
                "needs 1 GPU-eq but Kueue's cohort gpupool: 3 of 3 GPU-eq nominal quota in use; "
                "vision may borrow only what others leave unused."
            ) in m.jobs[third.id].reason
            # nlp's job ends: its quota is unused again, vision may borrow it
            m.pool.release(next(a for a in ledger.allocations.values() if a.ref == nlp.id).id)
            kueue.finish(NAMESPACE, job_name(nlp))
            await m.schedule_pass()
            assert m.jobs[third.id].state == "starting"
            kueue.schedule(server.api)
            assert (NAMESPACE, job_name(third)) in kueue.admitted

        asyncio.run(go())


def test_a_notebook_kueue_would_leave_gated_is_refused_at_once(
    chart: helm.Chart, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same cohort for a notebook: vision's third GPU. On main KubeSpawner made the pod,
    Kueue kept it gated (its cohort's quota in use) and the start ran into its timeout; now the
    start is refused at once with the cohort's reason, and no pod is made."""
    objects = render_all(chart, VALUES)
    kueue = Kueue.from_chart(objects)
    c = hub_config(objects, tmp_path)
    with kueue_cluster(c, tmp_path, monkeypatch, user_nodes(h100_node("m1"))) as (server, pool):
        pool.allocate("nina", ["nlp"], "h100", 1)
        pool.allocate("vic", ["vision"], "h100", 2)
        for team in ("nlp", "vision"):  # what Kueue admitted for them
            queue = kueue.queues[f"{RELEASE}-{team}"]
            queue.usage[resource_of(objects)] = pool.ledger.team_used[team]
        template = c.KubeGPUSpawner.kueue_queue_template
        refused, key, pod_left = asyncio.run(refused_start(server, pool, kueue, template, "h100"))
        assert "Kueue's cohort gpupool: 3 of 3 GPU-eq nominal quota in use" in str(refused), (
            refused,
            kueue.pending.get(key),
        )
        assert not pod_left


def resource_of(objects: list[dict[str, Any]]) -> str:
    """The quota resource of the rendered ClusterQueues (besides cpu and memory)."""
    queue = next(o for o in objects if o["kind"] == "ClusterQueue")
    (group,) = queue["spec"]["resourceGroups"]
    return next(r for r in group["coveredResources"] if r not in ("cpu", "memory"))


def test_kueue_counts_the_quota_as_the_hub_does(
    chart: helm.Chart, resource: str, tmp_path: Path
) -> None:
    """Kueue counts its quota resource in whole units, a fraction rounded up; in GPU-eq, a
    3g.40gb instance (0.5) would be 1 and a 1.5 GPU guarantee 2. In thousandths they agree."""
    values = merge(
        VALUES,
        {
            "gpupool": {
                "offers": {"mig-3g.40gb": {"kind": "mig", "profile": "3g.40gb"}},
                "teams": {"nlp": {"guarantee": 1.5, "offers": ["cpu", "h100", "mig-3g.40gb"]}},
            }
        },
    )
    objects = render_all(chart, values)
    kueue = Kueue.from_chart(objects)
    settings = GPUPool(config=hub_config(objects, tmp_path)).settings()
    for team in settings.teams.values():
        assert kueue.queues[f"{RELEASE}-{team.name}"].nominal[resource] == team.guarantee_milli
    pod = {"containers": [{"resources": {"limits": {"nvidia.com/mig-3g.40gb": "1"}}}]}
    assert kueue.pod_requests(pod) == {resource: 500}


def hami_values(**hami: Any) -> dict[str, Any]:
    share = {"kind": "share", "memory": "8GB"}
    return merge(
        VALUES,
        {
            "gpupool": {
                "offers": {"share-8gb": share},
                "teams": {"vision": {"offers": ["cpu", "h100", "share-8gb"]}},
            },
            "kueue": {"hami": {"enabled": True, **hami}},
        },
    )


def test_kueue_charges_a_hami_share_its_fraction(
    chart: helm.Chart, resource: str, tmp_path: Path
) -> None:
    """A share pod on a HAMi node asks for HAMi's count and memory resources. The chart's
    ClusterQueues did not cover nvidia.com/gpumem, so Kueue never admitted such a pod, and its
    nvidia.com/gpu: 1 was a whole GPU-eq. With kueue.hami the hub asks for HAMi's own count
    resource (charged nothing) and Kueue charges the memory its fraction of the GPU, never more
    than the hub charges."""
    objects = render_all(chart, hami_values(gpuMemoryMiB=46068))
    kueue = Kueue.from_chart(objects)
    c = hub_config(objects, tmp_path)
    settings = GPUPool(config=c).settings()
    hami = dict(c.KubeGPUSpawner.hami_resources)
    assert hami == dict(c.KubeJobBackend.hami_resources)
    assert hami == {"count": "nvidia.com/vgpu", "memory": "nvidia.com/gpumem"}
    node = hami_node()  # HAMi with resourceCountName nvidia.com/vgpu
    allocatable = node["status"]["allocatable"]
    allocatable["nvidia.com/vgpu"] = allocatable.pop("nvidia.com/gpu")
    node["status"]["capacity"] = dict(allocatable)
    inventory = inventory_from_nodes([node])
    assert len(inventory.gpus) == 2
    ledger = Ledger(inventory, settings.offers, settings.teams, settings.everyone)
    shares = ShareRequests.of(inventory, hami)
    for i in range(4):
        alloc = ledger.allocate(Request("vic", "vision", "share-8gb"), f"s{i}")
        limits = allocation_resources(alloc, shares)
        assert set(limits) == {"nvidia.com/vgpu", "nvidia.com/gpumem"}
        requests = kueue.pod_requests({"containers": [{"resources": {"limits": limits}}]})
        assert requests == {resource: alloc.cost_milli}
        assert kueue.fits(f"{RELEASE}-vision", requests) == ""


def test_a_larger_memory_setting_makes_kueue_charge_less_never_more(
    chart: helm.Chart, resource: str
) -> None:
    kueue = Kueue.from_chart(render_all(chart, hami_values()))  # 81920 MiB
    limits = {"nvidia.com/vgpu": "1", "nvidia.com/gpumem": str(275 * 46068 // 1000)}
    requests = kueue.pod_requests({"containers": [{"resources": {"limits": limits}}]})
    assert 0 < requests[resource] <= 275
    exact = {"nvidia.com/vgpu": "1", "nvidia.com/gpumem": str(275 * 81920 // 1000)}
    assert kueue.pod_requests({"containers": [{"resources": {"limits": exact}}]}) == {
        resource: 275
    }  # the per-MiB factor is cut to nano and rounded down: never 276


def test_a_share_pod_kueue_cannot_price_is_inadmissible(chart: helm.Chart) -> None:
    """Without kueue.hami the ClusterQueues cover no HAMi memory: Kueue never admits the pod."""
    kueue = Kueue.from_chart(render_all(chart, VALUES))
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8192"}
    requests = kueue.pod_requests({"containers": [{"resources": {"limits": limits}}]})
    assert kueue.fits(f"{RELEASE}-vision", requests) == (
        "resource nvidia.com/gpumem unavailable in ClusterQueue"
    )


def test_hami_counting_as_a_whole_gpu_is_refused(chart: helm.Chart) -> None:
    with pytest.raises(Exception, match=r"kueue.hami.countResource: nvidia.com/gpu is also"):
        render_all(chart, hami_values(countResource="nvidia.com/gpu"))


def test_the_hub_follows_the_charts_cohort(chart: helm.Chart, tmp_path: Path) -> None:
    values = merge(VALUES, {"kueue": {"cohort": "research"}})
    assert kueue_cohort(hub_config(render_all(chart, values), tmp_path)) == "research"
    off = merge(VALUES, {"kueue": {"enabled": False}})
    assert kueue_cohort(hub_config(render_all(chart, off), tmp_path)) == ""
    assert json.dumps(values)  # the values are plain data


def test_hami_shares_kueue_would_charge_whole_are_named_at_start(
    chart: helm.Chart, tmp_path: Path
) -> None:
    inventory = inventory_from_nodes([hami_node()])  # HAMi's count is nvidia.com/gpu
    c = hub_config(render_all(chart, VALUES), tmp_path)
    (warning,) = kueue_warnings(c, inventory)
    assert warning.startswith("KubeGPUSpawner.hami_resources: HAMi's count is nvidia.com/gpu")
    with_hami = hub_config(render_all(chart, hami_values()), tmp_path)
    assert kueue_warnings(with_hami, inventory) == []
    off = merge(VALUES, {"kueue": {"enabled": False}})
    assert kueue_warnings(hub_config(render_all(chart, off), tmp_path), inventory) == []
