"""HAMi as it is (issue 26, section 3): its webhook, its scheduler and its GPU policy, against
gpupool's share pods under z2jh's defaults.

The API stand-in (:mod:`tests.deploy.kube_api`) runs the schedulers a test names and HAMi as
:mod:`tests.deploy.kube_hami` models it from HAMi's source: a pod naming a scheduler that does not
run stays Pending; HAMi's webhook routes pods asking for ``nvidia.com/gpu`` to ``hami-scheduler``
only when their scheduler is the default one; z2jh's user-scheduler (kube-scheduler) refuses
``nvidia.com/gpumem``, which no node advertises; HAMi's scheduler picks a GPU by its ``spread``
policy unless the pod names one (``nvidia.com/use-gpuuuid``) and writes its choice on the pod.
Notebook starts are real ones (:class:`KubeGPUSpawner`, KubeSpawner's start over HTTP); jobs go
through the real :class:`JobManager` and ``KubeJobBackend``.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Request, Team
from gpupool.core.inventory import Inventory
from gpupool.declarations import ConfigError
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.pods import ShareRequests, apply_allocation
from gpupool.kube.settings import KubeGPUSettings, notebook_settings
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import h100_node, hami_node
from tests.deploy.chart_fixtures import RELEASE, render_all, z2jh_chart
from tests.deploy.kube_api import Served, served
from tests.deploy.kube_fixtures import (
    IMAGE,
    job_config,
    one_job,
    pooled_cluster,
    run_job_pods,
    spawner_pod,
    stop,
    user_nodes,
    validate,
)
from tests.deploy.kube_fixtures import PROFILE_NS as NS
from tests.deploy.kube_fixtures import profile_spawner as spawner
from tests.deploy.kube_fixtures import serialise_now as serialise
from tests.deploy.kube_hami import ALLOCATED_ANNOTATION, USE_UUID, allocated

USER_SCHEDULER = f"{RELEASE}-user-scheduler"
"""z2jh's user-scheduler as the chart names it and sets ``c.KubeSpawner.scheduler_name`` to
(:func:`test_the_chart_names_z2jhs_user_scheduler_for_user_pods`)."""
OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=8),
    "share-8gb": Offer("share-8gb", "share", share_mib=8192),
    "share-22gb": Offer("share-22gb", "share", share_mib=22528),
    "share-40gb": Offer("share-40gb", "share", share_mib=40960),
}
TEAMS = {"vision": Team("vision", 16000)}
EVERYONE = Team("everyone", offers=frozenset({"cpu"}))
HAMI_UUIDS = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(2)]
"""The UUIDs of the L40S GPUs in :func:`tests.conftest.hami_node`'s annotation."""


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Served, Pool]]:
    """The stand-in with an H100 node and a HAMi node of two L40S, HAMi installed with its
    chart's defaults and z2jh's user-scheduler running; the hub's pool over the same nodes."""
    nodes = user_nodes(h100_node(), hami_node())
    with pooled_cluster(tmp_path, monkeypatch, nodes, OFFERS, TEAMS, EVERYONE) as (server, pool):
        server.api.schedulers.running.add(USER_SCHEDULER)
        server.api.schedulers.install_hami()
        yield server, pool


def share_pod(user: str, gib: int, scheduler: str = "") -> dict[str, Any]:
    """A pod asking HAMi for one virtual GPU with ``gib`` GiB, as a user would write it."""
    body = serialise(spawner_pod(user))
    container = body["spec"]["containers"][0]
    container["resources"]["limits"] = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(gib * 1024)}
    body["spec"]["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    if scheduler:
        body["spec"]["schedulerName"] = scheduler
    return body


def devices_of(pod: dict[str, Any]) -> list[str]:
    """The GPUs HAMi's scheduler gave the pod (its allocation annotation)."""
    return [uuid for uuid, _mib, _cores in allocated(pod)]


# -- z2jh's defaults, rendered ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_chart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[helm.Chart]:
    with z2jh_chart(tmp_path_factory) as loaded:
        yield loaded


def test_the_chart_names_z2jhs_user_scheduler_for_user_pods(full_chart: helm.Chart) -> None:
    """z2jh 4.4.0 runs its user-scheduler by default (``scheduling.userScheduler.enabled``) and
    its ``jupyterhub_config.py`` then sets ``c.KubeSpawner.scheduler_name`` to the scheduler's
    name: a kube-scheduler profile without HAMi's extender, for every user pod."""
    values = full_chart.merge_values({})["jupyterhub"]
    assert values["scheduling"]["userScheduler"]["enabled"] is True
    objects = render_all(full_chart, {})
    (hub,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "hub"]
    assert hub["data"]["user-scheduler"] == USER_SCHEDULER  # get_name("user-scheduler")
    assert (
        'if get_config("scheduling.userScheduler.enabled"):\n'
        '    c.KubeSpawner.scheduler_name = get_name("user-scheduler")'
    ) in hub["data"]["jupyterhub_config.py"]
    (config,) = [
        yaml.safe_load(o["data"]["config.yaml"])
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "user-scheduler"
    ]
    assert [p["schedulerName"] for p in config["profiles"]] == [USER_SCHEDULER]
    assert "extenders" not in config  # no HAMi extender: kube-scheduler's filters alone


# -- the stand-in behaves as the cluster does ---------------------------------------------------
def test_a_pod_for_a_scheduler_that_does_not_run_stays_pending_without_a_word() -> None:
    with served() as server:
        server.api.add_node(hami_node())
        server.api.create("pods", NS, share_pod("ada", 8, scheduler="hami-scheduler"))
        assert server.api.schedule(NS, "jupyter-ada") == "Pending"
        pod = server.api.objects["pods"][NS, "jupyter-ada"]
        assert pod["status"] == {"phase": "Pending", "qosClass": "Burstable"}
        assert server.api.events == []


def test_hamis_webhook_routes_default_scheduler_pods_and_leaves_z2jhs_alone(
    cluster: tuple[Served, Pool],
) -> None:
    server, _pool = cluster
    hami = server.api.schedulers.hami
    assert hami is not None
    server.api.create("pods", NS, share_pod("ada", 8))
    ada = server.api.objects["pods"][NS, "jupyter-ada"]
    assert ada["spec"]["schedulerName"] == "hami-scheduler"
    assert server.api.schedule(NS, "jupyter-ada") == "Running"
    assert ada["spec"]["nodeName"] == "l40s-hami" and devices_of(ada) == [HAMI_UUIDS[1]]

    server.api.create("pods", NS, share_pod("bob", 8, scheduler=USER_SCHEDULER))
    bob = server.api.objects["pods"][NS, "jupyter-bob"]
    assert bob["spec"]["schedulerName"] == USER_SCHEDULER
    assert hami.log[-1] == f"{NS}/jupyter-bob - Pod already has different scheduler assigned"
    # z2jh's user-scheduler is kube-scheduler: no node advertises nvidia.com/gpumem
    assert server.api.schedule(NS, "jupyter-bob") == "Unschedulable"
    (condition,) = bob["status"]["conditions"]
    assert "Insufficient nvidia.com/gpumem" in condition["message"]


def test_hamis_scheduler_spreads_shares_and_honours_a_pinned_gpu(
    cluster: tuple[Served, Pool],
) -> None:
    server, _pool = cluster
    for user in ("ada", "bob"):
        server.api.create("pods", NS, share_pod(user, 22))
        assert server.api.schedule(NS, f"jupyter-{user}") == "Running"
    pods = server.api.objects["pods"]
    # spread: the least used GPU each time (the last of a tie first)
    assert devices_of(pods[NS, "jupyter-ada"]) == [HAMI_UUIDS[1]]
    assert devices_of(pods[NS, "jupyter-bob"]) == [HAMI_UUIDS[0]]
    server.api.create("pods", NS, share_pod("cy", 40))
    assert server.api.schedule(NS, "jupyter-cy") == "Unschedulable"
    message = pods[NS, "jupyter-cy"]["status"]["conditions"][0]["message"]
    assert "1 2/2 CardInsufficientMemory" in message
    # a pin is honoured, and a pinned GPU that is full is refused as HAMi refuses it
    pinned = share_pod("dee", 4)
    pinned["metadata"]["annotations"] = {USE_UUID: HAMI_UUIDS[1]}
    server.api.create("pods", NS, pinned)
    assert server.api.schedule(NS, "jupyter-dee") == "Running"
    assert devices_of(pods[NS, "jupyter-dee"]) == [HAMI_UUIDS[1]]
    full = share_pod("eve", 20)
    full["metadata"]["annotations"] = {USE_UUID: HAMI_UUIDS[1]}
    server.api.create("pods", NS, full)
    assert server.api.schedule(NS, "jupyter-eve") == "Unschedulable"
    message = pods[NS, "jupyter-eve"]["status"]["conditions"][0]["message"]
    assert "1/2 CardInsufficientMemory, 1/2 CardUuidMismatch" in message


# -- gpupool's share pods under z2jh's defaults -------------------------------------------------
def test_a_hami_share_notebook_runs_under_z2jhs_user_scheduler(
    cluster: tuple[Served, Pool],
) -> None:
    """z2jh sets ``c.KubeSpawner.scheduler_name`` to its user-scheduler; HAMi's webhook then
    leaves the pod alone, and the user-scheduler cannot place ``nvidia.com/gpumem``."""
    server, pool = cluster

    async def go() -> str:
        s = spawner(pool)
        s.scheduler_name = USER_SCHEDULER  # what z2jh's jupyterhub_config.py sets
        s.user_options = {"offer": "share-22gb"}
        task = asyncio.ensure_future(s.start())
        try:
            while (NS, s.pod_name) not in server.api.objects["pods"]:
                assert not task.done(), task
                await asyncio.sleep(0.02)
            result = server.api.schedule(NS, s.pod_name)
            if result == "Running":
                await asyncio.wait_for(task, 30)
            return result
        finally:
            if not task.done():
                task.cancel()
            await stop(s)

    assert asyncio.run(go()) == "Running", [e["message"] for e in server.api.events]
    pod = server.api.objects["pods"].get((NS, "jupyter-alice"))
    assert pod is None  # stopped; what it was is in the events and the webhook's log
    scheduled = [e for e in server.api.events if e["reason"] == "Scheduled"]
    assert [e["message"] for e in scheduled] == [
        f"Successfully assigned {NS}/jupyter-alice to l40s-hami"
    ]


def test_the_ledgers_gpu_is_the_one_hami_gives(cluster: tuple[Served, Pool]) -> None:
    """Two 8 GiB shares then a 40 GiB one on two 45 GiB L40S: the ledger (its default policy)
    packs the first two on one GPU and counts the other free; HAMi's ``spread`` would put them
    on both GPUs and leave the 40 GiB share nowhere to go (``CardInsufficientMemory``, Pending
    until the start timeout). Each pod is pinned to the ledger's GPU, by HAMi's UUID, and
    HAMi's allocation names the GPU the ledger holds."""
    server, pool = cluster
    shares = KubeGPUSettings().share_requests_for(pool.inventory)
    placed = {}
    for user, offer in (("ada", "share-8gb"), ("bob", "share-8gb"), ("cy", "share-40gb")):
        alloc = pool.allocate(user, ["vision"], offer)
        body = serialise(apply_allocation(spawner_pod(user), alloc, OFFERS[offer], shares=shares))
        validate(body)
        server.api.create("pods", NS, body)
        placed[user] = (server.api.schedule(NS, f"jupyter-{user}"), alloc)
    assert [result for result, _ in placed.values()] == ["Running"] * 3, server.api.events[-1][
        "message"
    ]
    for user, (_result, alloc) in placed.items():
        pod = server.api.objects["pods"][NS, f"jupyter-{user}"]
        assert devices_of(pod) == [d.gpu for d in alloc.devices]
    held = {d.gpu for a in pool.ledger.allocations.values() for d in a.devices}
    assert held == set(HAMI_UUIDS)  # the ledger's GPUs are HAMi's, by UUID


def test_a_hami_share_job_runs_under_z2jhs_user_scheduler(tmp_path: Path) -> None:
    """Job pods are made from the notebook's pod template, which names z2jh's user-scheduler."""
    nodes = user_nodes(h100_node(), hami_node())
    with served() as server:
        for obj in copy.deepcopy(nodes):
            server.api.add_node(obj)
        server.api.schedulers.running.add(USER_SCHEDULER)
        server.api.schedulers.install_hami()
        c = job_config(server)
        c.KubeJobBackend.use_notebook_pod = False
        c.KubeJobBackend.pod_template = {
            "schedulerName": USER_SCHEDULER,
            "containers": [{"name": "notebook", "image": IMAGE}],
        }
        ledger = Ledger(inventory_from_nodes(nodes), OFFERS, TEAMS, EVERYONE)
        pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}"))
        spec = {"script": "print(1)\n", "offer": "share-22gb", "gpus": 1, "nodes": 1}
        job = one_job(pool, c, spec)
        (alloc,) = [pool.ledger.allocations[a] for a in job.allocations]
        pods = run_job_pods(server.api, f"gpupool-{job.id}")
        assert [p["status"]["phase"] for p in pods.values()] == ["Running"], [
            e["message"] for e in server.api.events
        ]
        (pod,) = pods.values()
        assert pod["spec"]["schedulerName"] == "hami-scheduler"
        assert devices_of(pod) == [d.gpu for d in alloc.devices]


# -- the setting ----------------------------------------------------------------------------------
def test_a_bad_hami_scheduler_name_stops_the_hub_naming_the_key() -> None:
    c = Config()
    c.KubeGPUSpawner.hami_scheduler_name = "HAMi Scheduler"
    with pytest.raises(ConfigError, match=r"^KubeGPUSpawner\.hami_scheduler_name: "):
        notebook_settings(c)


def test_without_a_hami_scheduler_name_the_pods_scheduler_is_left_as_it_is(
    cluster: tuple[Served, Pool],
) -> None:
    """``hami_scheduler_name = ""``: the admin's choice (HAMi's webhook sets it on pods of the
    default scheduler); with z2jh's user-scheduler that leaves the pod Pending, as documented."""
    server, pool = cluster
    c = Config()
    c.KubeGPUSettings.hami_scheduler_name = ""
    shares = notebook_settings(c).share_requests_for(pool.inventory)
    alloc = pool.allocate("ada", ["vision"], "share-22gb")
    pod = apply_allocation(spawner_pod("ada"), alloc, OFFERS["share-22gb"], shares=shares)
    body = serialise(pod)
    assert "schedulerName" not in body["spec"]
    assert body["metadata"]["annotations"] == {USE_UUID: alloc.devices[0].gpu}
    server.api.create("pods", NS, body)
    assert server.api.schedule(NS, "jupyter-ada") == "Running"  # the webhook routed it
    assert (
        ALLOCATED_ANNOTATION
        in server.api.objects["pods"][NS, "jupyter-ada"]["metadata"]["annotations"]
    )


# -- the inventory names HAMi's GPUs as HAMi does ------------------------------------------------
def test_the_inventory_takes_hamis_uuids_and_says_when_it_cannot() -> None:
    assert [g.uuid for g in inventory_from_nodes([hami_node()]).gpus] == HAMI_UUIDS
    old = hami_node()
    old["metadata"]["annotations"]["hami.io/node-nvidia-register"] = (
        "GPU-a,10,46068,100,NVIDIA-NVIDIA L40S,0,true:GPU-b,10,46068,100,NVIDIA-NVIDIA L40S,0,true:"
    )
    assert [g.uuid for g in inventory_from_nodes([old]).gpus] == ["GPU-a", "GPU-b"]
    nameless = hami_node()
    devices = json.loads(nameless["metadata"]["annotations"]["hami.io/node-nvidia-register"])
    for d in devices:
        d["id"] = ""
    nameless["metadata"]["annotations"]["hami.io/node-nvidia-register"] = json.dumps(devices)
    inv = inventory_from_nodes([nameless])
    assert [g.uuid for g in inv.gpus] == ["k8s-l40s-hami-gpu0", "k8s-l40s-hami-gpu1"]
    assert any("cannot be pinned" in n for n in inv.notes)
    # two nodes claiming the same GPUs: the second's are the inventory's own names, unpinned
    inv = inventory_from_nodes([hami_node(), hami_node("l40s-twin")])
    assert [g.uuid for g in inv.gpus] == [*HAMI_UUIDS, "k8s-l40s-twin-gpu0", "k8s-l40s-twin-gpu1"]
    assert any("l40s-twin reports GPU UUIDs another node has" in n for n in inv.notes)
    twin = Inventory((inv.nodes[1],))
    alloc = Ledger(twin, OFFERS, TEAMS, EVERYONE).allocate(
        Request("ada", "vision", "share-8gb"), "a"
    )
    assert alloc.node == "l40s-twin"
    body = serialise(
        apply_allocation(
            spawner_pod("ada"), alloc, OFFERS["share-8gb"], shares=ShareRequests.of(twin)
        )
    )
    assert body["spec"]["schedulerName"] == "hami-scheduler"
    assert "annotations" not in body["metadata"]


# -- the pod builder ----------------------------------------------------------------------------
def test_a_hami_share_pod_gets_hamis_scheduler_and_the_pin_and_nothing_else_does() -> None:
    ledger = Ledger(inventory_from_nodes([hami_node(), h100_node()]), OFFERS, TEAMS, EVERYONE)
    shares = KubeGPUSettings().share_requests_for(ledger.inventory)
    share = ledger.allocate(Request("ada", "vision", "share-8gb"), "a1")
    stale = spawner_pod("ada")
    stale.metadata.annotations = {USE_UUID: "GPU-gone", "keep": "me"}
    body = serialise(
        apply_allocation(
            stale, share, OFFERS["share-8gb"], shares=shares, scheduler_name="kai-scheduler"
        )
    )
    assert body["spec"]["schedulerName"] == "hami-scheduler"  # HAMi's, over gpu_scheduler_name
    assert body["metadata"]["annotations"] == {USE_UUID: share.devices[0].gpu, "keep": "me"}
    whole = ledger.allocate(Request("bob", "vision", "h100"), "a2")
    pinned = spawner_pod("bob")
    pinned.metadata.annotations = {USE_UUID: HAMI_UUIDS[0]}
    body = serialise(
        apply_allocation(
            pinned, whole, OFFERS["h100"], shares=shares, scheduler_name="kai-scheduler"
        )
    )
    assert body["spec"]["schedulerName"] == "kai-scheduler"
    assert "annotations" not in body["metadata"]  # an earlier spawn's pin is gpupool's: gone
    cpu = serialise(apply_allocation(spawner_pod("cy"), None, OFFERS["cpu"], shares=shares))
    assert "schedulerName" not in cpu["spec"] and "annotations" not in cpu["metadata"]
