"""The ledger names the GPUs the node really gave (issue 26, section 4): the NVIDIA device plugin
chooses a pod's GPUs (:mod:`tests.deploy.kube_devices`, not in the ledger's lowest-index-first
order), dcgm-exporter maps them to the pod (through the kubelet's PodResources API), and the
hub reads that back through Prometheus (:mod:`gpupool.kube.readback`) and re-keys the ledger:
its allocation then holds the GPUs of the indexes the node reports, named by their UUIDs, and the
ledger's free GPUs are the node's free GPUs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Request, Team
from gpupool.core.ledger import Allocation
from gpupool.hub import _kube_reconciler
from gpupool.hub.pages_view import gpu_view
from gpupool.hub.reconcile import Reconciler
from gpupool.kube.api import ClusterAPI
from gpupool.kube.manifests import job_name
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.readback import parse_seen, seen_by_allocation
from gpupool.kube.reconcile import KubeReconciler
from gpupool.monitors.activity import DeviceSample
from gpupool.monitors.dcgm import DCGMSource, by_ledger_device
from gpupool.pool import Pool
from gpupool.readback import Seen, plan_readback
from gpupool.store import Store
from tests.conftest import a100_mixed_node, h100_node, kubeconfig
from tests.deploy.kube_api import Served, served
from tests.deploy.kube_devices import DevicePlugin, node_devices
from tests.deploy.kube_fixtures import a_job, api_cluster, build_job, served_ledger
from tests.prometheus import Prometheus

NS = "jhub"
NODE = "dgx-h100-1"
OFFERS = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=8)}


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with served() as server:
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", server.url)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        node = h100_node(NODE)
        node["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"  # z2jh's
        with server.api.lock:
            server.api.add_node(node)
            server.api.device_plugin = DevicePlugin()
        yield server


@pytest.fixture
def prometheus() -> Iterator[Prometheus]:
    prom = Prometheus()
    yield prom
    prom.close()


def start_pod(server: Served, a: Allocation, name: str = "") -> str:
    """The notebook pod KubeSpawner makes for ``a`` (its GPUs, bound to its node), started."""
    name = name or f"jupyter-{a.user}-{a.id[:6]}"
    gpus = {"nvidia.com/gpu": str(len(a.devices))}
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"gpupool.io/team": a.team, "gpupool.io/allocation": a.id},
        },
        "spec": {
            "nodeName": a.node,
            "containers": [
                {
                    "name": "notebook",
                    "image": "quay.io/jupyter/pytorch-notebook",
                    "resources": {"limits": gpus, "requests": gpus},
                }
            ],
        },
    }
    with server.api.lock:
        code, reply = server.api.create("pods", NS, body)
        assert code == 201, reply
        assert server.api.schedule(NS, name) == "Running"
    return name


def node_given(server: Served, pod: str) -> list[int]:
    """The indexes of the GPUs the device plugin gave ``pod``."""
    plugin = server.api.device_plugin
    assert plugin is not None
    return sorted(d.index for d in plugin.devices_of(NS, pod))


def scrape(server: Served, prom: Prometheus) -> None:
    """Prometheus scrapes dcgm-exporter on every node: its series as the node has them now."""
    plugin = server.api.device_plugin
    assert plugin is not None
    with server.api.lock:
        series = plugin.dcgm_series(server.api.nodes.values(), server.api._bound_pods())
    with prom._lock:
        prom.series = series


def indexes(pool: Pool, a: Allocation) -> list[int]:
    gpus = {g.uuid: g.index for n in pool.inventory.nodes for g in n.gpus}
    return sorted(gpus[d.gpu] for d in pool.ledger.allocations[a.id].devices)


def free_indexes(pool: Pool) -> set[int]:
    held = {d.gpu for a in pool.ledger.allocations.values() for d in a.devices}
    return {g.index for n in pool.inventory.nodes for g in n.gpus if g.uuid not in held}


class Hub:
    def __init__(self, server: Served, tmp_path: Path, prom: Prometheus) -> None:
        self.server = server
        ledger = served_ledger(server, OFFERS)
        self.pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))
        self.reconciler = KubeReconciler(
            self.pool,
            ClusterAPI(NS),
            namespace=NS,
            grace=1000.0,
            period=0.2,
            watch_timeout=1,
            retry=0.1,
            dcgm=DCGMSource(prom.url, 5.0),
        )

    def grant(self, count: int, user: str = "ada") -> Allocation:
        return self.pool.allocate(user, ["big"], "h100", count, team="big", ref=f"{user}/")

    async def settled(self) -> None:
        """The reconciler's watch has every pod of the stand-in, and a whole checker pass has
        run after that."""
        deadline = time.monotonic() + 10
        with self.server.api.lock:
            names = {k for k in self.server.api.objects["pods"] if k[0] == NS}
        while not names <= set(self.reconciler.pods):
            assert time.monotonic() < deadline, "the watch is behind"
            await asyncio.sleep(0.02)
        n = self.reconciler.passes
        while self.reconciler.passes < n + 2:
            self.reconciler.nudge()
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.02)


def run(hub: Hub, body: Callable[[], Awaitable[None]]) -> None:
    async def main() -> None:
        hub.reconciler.start()
        try:
            deadline = time.monotonic() + 10
            while hub.reconciler.synced != {"nodes", "pods", "tenants"}:
                assert time.monotonic() < deadline, "not synced"
                await asyncio.sleep(0.02)
            await body()
        finally:
            await hub.reconciler.stop()

    asyncio.run(main())


# -- the stand-in's device plugin, as the node behaves -------------------------------------------
def test_the_device_plugin_chooses_other_gpus_than_the_ledger(cluster: Served) -> None:
    """A pod for the ledger's first two GPUs gets two others: the plugin's choice."""
    ledger = Ledger(inventory_from_nodes([h100_node(NODE)]), OFFERS, {"big": Team("big", 99000)})
    a = ledger.allocate(Request("ada", "big", "h100", 2, "notebook", "ada/"), "a1")
    gpus = {g.uuid: g.index for n in ledger.inventory.nodes for g in n.gpus}
    assert sorted(gpus[d.gpu] for d in a.devices) == [0, 1]
    pod = start_pod(cluster, a)
    assert node_given(cluster, pod) == [6, 7]
    plugin = cluster.api.device_plugin
    assert plugin is not None
    listed = plugin.pod_resources(NODE, cluster.api._bound_pods())["pod_resources"]
    (entry,) = listed
    (container,) = entry["containers"]
    ((device,),) = [container["devices"]]
    assert device["resource_name"] == "nvidia.com/gpu"
    assert sorted(device["device_ids"]) == sorted(d.id for d in plugin.devices_of(NS, pod))
    assert all(i.startswith("GPU-") for i in device["device_ids"])
    # the GPU Operator's CDI default: no device list in the container's environment
    assert plugin.container_env(NS, pod, "notebook") == {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert len(plugin.cdi_devices(NS, pod, "notebook")) == 2


def test_dcgm_maps_the_given_gpus_to_the_pod(cluster: Served) -> None:
    plugin = cluster.api.device_plugin
    assert plugin is not None
    ledger = Ledger(inventory_from_nodes([h100_node(NODE)]), OFFERS, {"big": Team("big", 99000)})
    a = ledger.allocate(Request("ada", "big", "h100", 2, "notebook", "ada/"), "a1")
    pod = start_pod(cluster, a)
    series = plugin.dcgm_series(cluster.api.nodes.values(), cluster.api._bound_pods())
    payload = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": m, "value": [0, "1"]} for m, _ in series],
        },
    }
    seen = parse_seen(payload)
    assert sorted(s.index for _, s in seen[NS, pod]) == [6, 7]
    pods = [cluster.api.objects["pods"][NS, pod]]
    found = seen_by_allocation(ledger, pods, seen)
    assert [s.index for s in found["a1"]] == [6, 7]
    plan = plan_readback(ledger, "a1", found["a1"])
    (after,) = plan
    gpus = {g.uuid: g.index for n in ledger.inventory.nodes for g in n.gpus}
    assert sorted(gpus[d.gpu] for d in after.devices) == [6, 7]
    uuids = {d.index: d.gpu_uuid for d in node_devices(cluster.api.nodes[NODE])}
    assert sorted(d.visible_id for d in after.devices) == sorted([uuids[6], uuids[7]])


# -- the hub reads it back -------------------------------------------------------------------
def test_the_ledger_names_the_gpus_the_node_gave(
    cluster: Served, prometheus: Prometheus, tmp_path: Path
) -> None:
    """Without the read-back the ledger says GPUs 0 and 1, the node 6 and 7, and the admin page,
    metrics and the reconciler name GPUs the pod does not hold."""
    hub = Hub(cluster, tmp_path, prometheus)
    uuids = {d.index: d.gpu_uuid for d in node_devices(cluster.api.nodes[NODE])}

    async def body() -> None:
        a = hub.grant(2)
        assert indexes(hub.pool, a) == [0, 1]
        pod = start_pod(cluster, a)
        assert node_given(cluster, pod) == [6, 7]
        scrape(cluster, prometheus)
        await hub.settled()
        after = hub.pool.ledger.allocations[a.id]
        assert indexes(hub.pool, a) == [6, 7]
        assert sorted(after.visible_devices.split(",")) == sorted([uuids[6], uuids[7]])
        assert free_indexes(hub.pool) == {0, 1, 2, 3, 4, 5}
        # persisted: a restart finds the same
        (stored,) = [s for s in hub.pool.store.load() if s.id == a.id]
        assert stored.devices == after.devices
        # the next grant: the ledger and the node agree once more after the next read-back
        b = hub.grant(3, user="bo")
        pod_b = start_pod(cluster, b)
        scrape(cluster, prometheus)
        await hub.settled()
        assert indexes(hub.pool, b) == node_given(cluster, pod_b)
        held = {g for x in hub.pool.ledger.allocations.values() for g in indexes(hub.pool, x)}
        given = set(node_given(cluster, pod)) | set(node_given(cluster, pod_b))
        assert held == given

    run(hub, body)


def test_an_allocation_on_a_gpu_the_node_gave_another_pod_is_moved_off_it(
    cluster: Served, prometheus: Prometheus, tmp_path: Path
) -> None:
    """The ledger put A on GPUs 0-6 and B on GPU 7; the node gave A GPUs 1-7 and B GPU 0. A is
    re-keyed to 1-7 and B, displaced, to the GPU A left (0), which is where its pod runs."""
    hub = Hub(cluster, tmp_path, prometheus)

    async def body() -> None:
        a = hub.grant(7)
        pod_a = start_pod(cluster, a)
        b = hub.grant(1, user="bo")
        assert indexes(hub.pool, a) == [0, 1, 2, 3, 4, 5, 6] and indexes(hub.pool, b) == [7]
        pod_b = start_pod(cluster, b)
        assert node_given(cluster, pod_a) == [1, 2, 3, 4, 5, 6, 7]
        assert node_given(cluster, pod_b) == [0]
        scrape(cluster, prometheus)
        await hub.settled()
        assert indexes(hub.pool, a) == [1, 2, 3, 4, 5, 6, 7]
        assert indexes(hub.pool, b) == [0]
        assert all(d.instance for d in hub.pool.ledger.allocations[b.id].devices)
        hub.pool.ledger.check_invariants()

    run(hub, body)


def test_a_job_pod_is_read_back_too(
    cluster: Served, prometheus: Prometheus, tmp_path: Path
) -> None:
    """A DDP job's pod (its Job's, labelled with the job) is matched by job and node."""
    hub = Hub(cluster, tmp_path, prometheus)
    uuids = {d.index: d.gpu_uuid for d in node_devices(cluster.api.nodes[NODE])}

    async def body() -> None:
        job = a_job("h100", gpus=2)
        a = hub.pool.allocate("alice", ["big"], "h100", 2, team="big", kind="job", ref=job.id)
        obj = build_job(job, [a], namespace=NS, offer=OFFERS["h100"])
        obj["spec"]["suspend"] = False
        with cluster.api.lock:
            code, reply = cluster.api.create("jobs", NS, obj)
            assert code == 201, reply
            cluster.api.create_pods(job_name(job), NS)
            cluster.api.run_pods(job_name(job), NS)
            (pod,) = cluster.api.pods_of(job_name(job), NS).values()
        assert node_given(cluster, pod["metadata"]["name"]) == [6, 7]
        assert indexes(hub.pool, a) == [0, 1]
        scrape(cluster, prometheus)
        await hub.settled()
        assert indexes(hub.pool, a) == [6, 7]
        after = hub.pool.ledger.allocations[a.id]
        assert sorted(d.visible_id for d in after.devices) == sorted([uuids[6], uuids[7]])

    run(hub, body)


def test_a_failing_prometheus_changes_nothing(
    cluster: Served, prometheus: Prometheus, tmp_path: Path
) -> None:
    hub = Hub(cluster, tmp_path, prometheus)

    async def body() -> None:
        a = hub.grant(2)
        start_pod(cluster, a)
        with prometheus._lock:
            prometheus.error = (503, "unavailable", "down for maintenance")
        await hub.settled()
        assert indexes(hub.pool, a) == [0, 1]
        assert hub.reconciler.dcgm is not None and hub.reconciler.dcgm.failing

    run(hub, body)


def test_gpu_use_goes_to_the_gpu_read_back() -> None:
    """Once read back, a GPU's DCGM sample is the one of its own UUID, whatever the order."""
    one, two = DeviceSample("GPU-b", 90, 0, 0, ()), DeviceSample("GPU-a", 5, 0, 0, ())
    got = by_ledger_device(["GPU-b", "k8s-n-gpu3"], {"GPU-b": one, "GPU-a": two})
    assert got == {"GPU-b": one, "k8s-n-gpu3": two}


def test_the_admin_page_names_the_gpu_read_back() -> None:
    """The admin page's cell of a held GPU carries the UUID the node reported, not the ledger's
    bookkeeping name."""
    ledger = Ledger(inventory_from_nodes([h100_node(NODE)]), OFFERS, {"big": Team("big", 99000)})
    a = ledger.allocate(Request("ada", "big", "h100", 1, "notebook", "ada/"), "a1")
    (gpu,) = [g for n in ledger.inventory.nodes for g in n.gpus if g.uuid == a.devices[0].gpu]
    read = replace(a, devices=(replace(a.devices[0], instance="GPU-5a8e"),))
    (cell,) = gpu_view(gpu, [(read.devices[0], read)], {"big": 0})["cells"]
    assert cell["uuid"] == "GPU-5a8e"
    (cell,) = gpu_view(gpu, [(a.devices[0], a)], {"big": 0})["cells"]
    assert cell["uuid"] == gpu.uuid  # not read back (yet): the ledger's name


def test_on_a_mixed_node_the_uuid_is_recorded_without_re_keying() -> None:
    """Where the node's GPU index is not a whole GPU of the inventory (the hub packs a mixed
    node's whole GPUs first, the node numbers them as they are), the UUID is recorded on the
    allocation's own GPU and nothing moves."""
    offers = {"a100": Offer("a100", "gpu", model="A100-80GB")}
    ledger = Ledger(inventory_from_nodes([a100_mixed_node()]), offers, {"big": Team("big", 9000)})
    a = ledger.allocate(Request("ada", "big", "a100", 1, "notebook", "ada/"), "a1")
    node = a100_mixed_node()
    (whole,) = [d for d in node_devices(node) if d.resource == "nvidia.com/gpu"]
    assert whole.index == 7  # the stand-in's node: its MIG GPUs first
    (after,) = plan_readback(ledger, "a1", [Seen(whole.index, whole.gpu_uuid)])
    assert [d.gpu for d in after.devices] == [d.gpu for d in a.devices]
    assert after.visible_devices == whole.gpu_uuid


def test_the_hub_reads_back_where_it_reads_dcgm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reconciler the hub builds for a Kubernetes inventory reads back through the
    Prometheus of ``IdleReclaimer.dcgm_prometheus_url``, and without it reads nothing back."""
    with api_cluster(tmp_path, monkeypatch) as cluster:  # the hub claims its nodes at start
        cluster.api.add_node(h100_node(NODE))
        hub_reconcilers(tmp_path)


def hub_reconcilers(tmp_path: Path) -> None:
    ledger = Ledger(inventory_from_nodes([h100_node(NODE)]), OFFERS, {"big": Team("big", 9000)})
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))
    c = Config()
    c.KubeReconciler.namespace = NS
    log = logging.getLogger("test")
    without = _kube_reconciler(pool, "kubernetes", Reconciler(pool, "sqlite://", config=c), c, log)
    assert without is not None and without.dcgm is None
    c.IdleReclaimer.dcgm_prometheus_url = "http://prometheus-operated.monitoring:9090"
    c.IdleReclaimer.dcgm_timeout = 2.0
    made = _kube_reconciler(pool, "kubernetes", Reconciler(pool, "sqlite://", config=c), c, log)
    assert made is not None and made.dcgm is not None
    assert (made.dcgm.url, made.dcgm.timeout) == ("http://prometheus-operated.monitoring:9090", 2.0)
