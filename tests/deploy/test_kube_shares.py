"""Shares on Kubernetes (issue 16, section 2): notebook and job pods for a share of a GPU the
device plugin shares (time-slicing or MPS) or HAMi shares out.

Notebook starts are real ones (the real :class:`KubeGPUSpawner`, KubeSpawner's own start, the
API stand-in of :mod:`tests.deploy.kube_api` served over HTTP, whose scheduler counts extended
resources as kube-scheduler does: a pod asking for ``nvidia.com/gpu.shared`` fits only a node
that has free ones). Jobs go through the real :class:`JobManager` and ``KubeJobBackend``. Every
manifest is validated against the Kubernetes schemas (kubernetes-validate).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient
from traitlets import TraitError
from traitlets.config import Config

from gpupool.core import Ledger, NoCapacity, Offer, Request, Team
from gpupool.declarations import ConfigError
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.pods import (
    DEFAULT_HAMI_RESOURCES,
    ShareRequests,
    allocation_resources,
    apply_allocation,
    gpu_equivalents,
)
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import h100_node, hami_node, shared_node
from tests.deploy.kube_api import Served, served
from tests.deploy.kube_fixtures import NS as JOB_NS
from tests.deploy.kube_fixtures import PROFILE_NS as NS
from tests.deploy.kube_fixtures import (
    bound_to,
    hostnames,
    job_config,
    one_job,
    pooled_cluster,
    run_job_pods,
    spawner_pod,
    start,
    stop,
    user_nodes,
    validate,
)
from tests.deploy.kube_fixtures import gpu_quantities as nvidia
from tests.deploy.kube_fixtures import profile_spawner as spawner
from tests.deploy.kube_fixtures import serialise_now as serialise

OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=8),
    "t4-quarter": Offer("t4-quarter", "share", model="T4-16GB", share_milli=250),
    "share-3gb": Offer("share-3gb", "share", share_mib=3072),
    "share-8gb": Offer("share-8gb", "share", share_mib=8192),
}
TEAMS = {"vision": Team("vision", 16000)}
EVERYONE = Team("everyone", offers=frozenset({"cpu"}))


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Served, Pool]]:
    """The stand-in with an H100 node and a T4 node shared into 4 replicas per GPU (renamed to
    ``nvidia.com/gpu.shared`` or not, as the test's ``renamed`` parameter says), and the hub's
    pool over the same nodes."""
    renamed = getattr(request, "param", True)
    nodes = user_nodes(h100_node(), shared_node(renamed=renamed, strategy="mps"))
    with pooled_cluster(tmp_path, monkeypatch, nodes, OFFERS, TEAMS, EVERYONE) as cluster:
        yield cluster


def start_share(server: Served, pool: Pool, offer: str = "t4-quarter") -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        s = spawner(pool, None)
        s.user_options = {"offer": offer}
        try:
            pod = await start(server, s)
            validate(as_json(await s.get_pod_manifest()))
            return pod
        finally:
            await stop(s)

    return asyncio.run(go())


def as_json(pod: Any) -> dict[str, Any]:
    body = ApiClient().sanitize_for_serialization(pod)
    return dict(body)


# -- notebooks ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cluster", "resource"),
    [(True, "nvidia.com/gpu.shared"), (False, "nvidia.com/gpu")],
    indirect=["cluster"],
)
def test_a_share_notebook_asks_for_one_replica_and_runs_on_the_shared_node(
    cluster: tuple[Served, Pool], resource: str
) -> None:
    server, pool = cluster
    pod = start_share(server, pool)
    assert nvidia(pod) == nvidia(pod, "requests") == {resource: "1"}
    assert bound_to(pod) == {"t4-shared"} and pod["spec"]["nodeName"] == "t4-shared"
    assert pod["metadata"]["labels"]["gpupool.io/offer"] == "t4-quarter"
    assert pool.ledger.allocations == {}  # released by the stop


def test_shares_fill_the_replicas_the_device_plugin_publishes(
    cluster: tuple[Served, Pool],
) -> None:
    """Sixteen share servers run at once on the T4 node's sixteen replicas: the ledger and the
    scheduler agree on every one; the seventeenth is refused by the pool, not left Pending."""
    server, pool = cluster
    users = [f"u{i}" for i in range(16)]
    for user in users:
        pool.allocate(user, ["vision"], "t4-quarter")
    assert pool.ledger.placeable(OFFERS["t4-quarter"]) == 0
    for alloc in pool.ledger.allocations.values():
        body = serialise(
            apply_allocation(
                spawner_pod(alloc.user),
                alloc,
                OFFERS["t4-quarter"],
                shares=ShareRequests.of(pool.inventory),
            )
        )
        validate(body)
        server.api.create("pods", NS, body)
        assert server.api.schedule(NS, f"jupyter-{alloc.user}") == "Running"
    # one more pod asking for a replica would wait: the pool said no before making it
    with pytest.raises(NoCapacity, match="No 25% share of T4-16GB free"):
        pool.allocate("late", ["vision"], "t4-quarter")


def test_a_share_too_large_for_a_replica_is_refused_with_the_reason(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster
    from tornado import web

    async def go() -> web.HTTPError:
        s = spawner(pool, None)
        s.user_options = {"offer": "share-8gb"}
        try:
            with pytest.raises(web.HTTPError) as e:
                await s.start()
            return e.value
        finally:
            await stop(s)

    error = asyncio.run(go())
    assert "larger than one replica of the shared T4-16GB GPUs (3.75 GB each)" in str(
        error.log_message
    )
    assert pool.ledger.allocations == {} and server.api.objects["pods"] == {}


def test_whole_gpu_notebooks_never_go_to_the_shared_node(cluster: tuple[Served, Pool]) -> None:
    _server, pool = cluster
    for i in range(8):
        a = pool.allocate(f"w{i}", ["vision"], "h100")
        assert a.node == "dgx-h100-1"
    with pytest.raises(NoCapacity, match="No 1× H100-80GB on one node free"):
        pool.allocate("w8", ["vision"], "h100")


# -- jobs -----------------------------------------------------------------------------------------
def test_a_job_with_a_share_runs_on_the_shared_node(tmp_path: Path) -> None:
    nodes = user_nodes(h100_node(), shared_node(renamed=True))
    with served() as server:
        for obj in copy.deepcopy(nodes):
            server.api.add_node(obj)
        c = job_config(server)
        ledger = Ledger(inventory_from_nodes(nodes), OFFERS, TEAMS, EVERYONE)
        pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}"))
        spec = {"script": "print(1)\n", "offer": "share-3gb", "gpus": 1, "nodes": 1}
        job = one_job(pool, c, spec)
        (alloc,) = [pool.ledger.allocations[a] for a in job.allocations]
        assert alloc.node == "t4-shared" and alloc.cost_milli == 250
        code, obj = server.api.get("jobs", JOB_NS, f"gpupool-{job.id}")
        assert code == 200, obj
        validate({k: v for k, v in obj.items() if k != "status"})
        template = obj["spec"]["template"]["spec"]
        (container,) = template["containers"]
        gpu = {k: v for k, v in container["resources"]["limits"].items() if "nvidia" in k}
        assert gpu == {"nvidia.com/gpu.shared": "1"}
        assert hostnames(template) == [["t4-shared"]]
        pods = run_job_pods(server.api, f"gpupool-{job.id}")
        assert [p["spec"]["nodeName"] for p in pods.values()] == ["t4-shared"]
        assert all(p["status"]["phase"] == "Running" for p in pods.values())


# -- HAMi -----------------------------------------------------------------------------------------
def test_a_share_on_a_hami_node_asks_for_a_virtual_gpu_with_its_memory() -> None:
    ledger = Ledger(inventory_from_nodes([hami_node()]), OFFERS, TEAMS, EVERYONE)
    alloc = ledger.allocate(Request("ada", "vision", "share-8gb"), "a1")
    shares = ShareRequests.of(ledger.inventory)
    milli = alloc.devices[0].share_milli or 0
    memory = milli * 46068 // 1000
    assert memory >= 8192  # never less than the share asked for
    assert allocation_resources(alloc, shares) == {
        "nvidia.com/gpu": "1",
        "nvidia.com/gpumem": str(memory),
    }
    with_cores = ShareRequests.of(
        ledger.inventory, {**DEFAULT_HAMI_RESOURCES, "cores": "nvidia.com/gpucores"}
    )
    body = serialise(
        apply_allocation(spawner_pod("ada"), alloc, OFFERS["share-8gb"], shares=with_cores)
    )
    validate(body)
    (container,) = body["spec"]["containers"]
    for kind in ("limits", "requests"):  # extended resources: requests equal limits
        assert {k: v for k, v in container["resources"][kind].items() if "nvidia" in k} == {
            "nvidia.com/gpu": "1",
            "nvidia.com/gpumem": str(memory),
            "nvidia.com/gpucores": str(-(-milli // 10)),
        }
    assert hostnames(body["spec"]) == [["l40s-hami"]]


@pytest.mark.parametrize(
    "value",
    [
        {"count": "nvidia.com/gpu"},  # no memory resource
        {"count": "nvidia.com/gpu", "memory": "nvidia.com/gpumem", "mem": "x"},
        {"count": "nvidia.com/gpu", "memory": "gpumem in MB"},
    ],
)
def test_a_bad_hami_setting_stops_the_hub_naming_the_key(value: Any, tmp_path: Path) -> None:
    ledger = Ledger(inventory_from_nodes([hami_node()]), OFFERS, TEAMS, EVERYONE)
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}"))

    async def go() -> None:
        spawner(pool, None, hami_resources=value)

    with pytest.raises(ConfigError, match=r"KubeGPUSpawner\.hami_resources"):
        asyncio.run(go())
    from gpupool.kube.jobs import KubeJobBackend

    with pytest.raises(ConfigError, match=r"KubeJobBackend\.hami_resources"):
        KubeJobBackend(hami_resources=value)
    c = Config()
    c.KubeGPUSpawner.hami_resources = value
    with pytest.raises(ConfigError, match=r"KubeGPUSpawner\.hami_resources"):
        KubeJobBackend(config=c).hami_resources  # noqa: B018  (the default reads the spawner's)


def test_a_hami_setting_that_is_not_a_dict_is_refused_naming_it(tmp_path: Path) -> None:
    ledger = Ledger(inventory_from_nodes([hami_node()]), OFFERS, TEAMS, EVERYONE)
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}"))

    async def go() -> None:
        spawner(pool, None, hami_resources="nvidia.com/gpumem")

    with pytest.raises(TraitError, match=r"'hami_resources' trait of a KubeGPUSpawner"):
        asyncio.run(go())


def test_the_job_backend_takes_the_spawners_hami_setting() -> None:
    from gpupool.kube.jobs import KubeJobBackend

    cores = {**DEFAULT_HAMI_RESOURCES, "cores": "nvidia.com/gpucores"}
    c = Config()
    c.KubeGPUSpawner.hami_resources = cores
    assert KubeJobBackend(config=c).hami_resources == cores
    assert KubeJobBackend().hami_resources == DEFAULT_HAMI_RESOURCES


# -- Kueue ----------------------------------------------------------------------------------------
def test_a_replica_costs_what_the_ledger_charges_for_a_share_there() -> None:
    assert gpu_equivalents("T4-16GB", replicas=4)["nvidia.com/gpu.shared"] == 250
    assert gpu_equivalents("T4-16GB", replicas=3)["nvidia.com/gpu.shared"] == 333
    assert "nvidia.com/gpu.shared" not in gpu_equivalents("T4-16GB")  # the chart's table
    ledger = Ledger(inventory_from_nodes([shared_node(replicas=3)]), OFFERS, TEAMS, EVERYONE)
    alloc = ledger.allocate(Request("ada", "vision", "share-3gb"), "a1")
    assert alloc.cost_milli == gpu_equivalents("T4-16GB", 3)["nvidia.com/gpu.shared"]


def test_setup_checks_the_hami_setting(tmp_path: Path) -> None:
    """The check runs where a bad key must stop the hub: in ``setup(c)``, before anything runs."""
    from gpupool.hub import setup

    c = Config()
    c.GPUPool.inventory = "simulated:n: 2x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"cpu": {"kind": "cpu"}}
    c.JupyterHub.db_url = f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}"
    c.KubeJobBackend.hami_resources = {"count": "nvidia.com/gpu", "memory": "nvidia.com/gpumem"}
    c.KubeGPUSpawner.hami_resources = {"count": "nvidia.com/gpu"}
    with pytest.raises(ConfigError, match=r"^KubeGPUSpawner\.hami_resources: missing"):
        setup(c)
