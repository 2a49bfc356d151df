"""The Kubernetes node-capacity reader: node objects shaped like the API's JSON, to an inventory.

The node objects below follow what ``kubectl get node -o json`` shows on GPU-operator clusters:
GPU feature discovery labels, the device plugin's ``nvidia.com/gpu`` and (``mixed`` MIG strategy)
``nvidia.com/mig-<profile>`` resources in ``status.allocatable``, taints and ``unschedulable``.
``read_nodes`` (and the pool's ``load_inventory``) are exercised against a local HTTP server, on
its own thread, that answers ``GET /api/v1/nodes`` the way the API server does (paging and label
selectors included), through a real kubeconfig and ``kubernetes_asyncio``.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.core import Inventory, Ledger, NoCapacity, Offer, Request, Team
from gpupool.core.mig import GEOMETRIES
from gpupool.declarations import ConfigError
from gpupool.kube.api import load_kubernetes_inventory, read_nodes
from gpupool.kube.nodes import (
    inventory_from_nodes,
    mig_profile_name,
    pack_instances,
    product_model,
)
from gpupool.pool import load_inventory
from tests.conftest import a100_mixed_node, h100_node, kubeconfig, node

A100 = GEOMETRIES["A100-80GB"]

# all-balanced on an A100-80GB (mig-parted's default config): 2× 1g.10gb, 1× 2g.20gb, 1× 3g.40gb
BALANCED = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}


def cordoned_node() -> dict[str, Any]:
    taint = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
    cordoned = h100_node("dgx-h100-2")
    cordoned["spec"]["unschedulable"] = True
    cordoned["spec"]["taints"].append(taint)
    return cordoned


def cpu_node() -> dict[str, Any]:
    return node("cpu-1", {}, {}, taints=[])


def instances_of(inventory: Any) -> Counter[str]:
    return Counter(i.profile for g in inventory.gpus for i in g.instances)


# -- whole GPUs -----------------------------------------------------------------------------------
def test_h100_node_gives_whole_gpus_with_stable_ids() -> None:
    inv = inventory_from_nodes([h100_node()])
    assert (inv.source, inv.simulated, inv.label) == ("kubernetes", False, "8 GPUs (kubernetes)")
    (n,) = inv.nodes
    assert n.name == "dgx-h100-1"
    assert [g.uuid for g in n.gpus] == [f"k8s-dgx-h100-1-gpu{i}" for i in range(8)]
    assert [g.index for g in n.gpus] == list(range(8))
    assert {(g.model, g.memory_mib, g.mig_mode, g.instances) for g in n.gpus} == {
        ("H100-80GB", 81559, "off", ())
    }
    assert all(g.product_name == "NVIDIA-H100-80GB-HBM3" for g in n.gpus)
    assert inventory_from_nodes([h100_node()]) == inv  # pure: same objects, same inventory


@pytest.mark.parametrize(
    ("product", "memory", "model"),
    [
        ("NVIDIA-H100-80GB-HBM3", 81559, "H100-80GB"),
        ("NVIDIA-A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA-A100-SXM4-40GB", 40960, "A100-40GB"),
        ("A100-SXM4-40GB", 40536, "A100-40GB"),  # older drivers: no NVIDIA- prefix
        ("NVIDIA-H200", 143771, "H200-141GB"),
        ("NVIDIA-H100-NVL", 95830, "H100-94GB"),
        ("NVIDIA-L40S", 46068, "L40S-48GB"),
        ("Tesla-V100-SXM2-32GB", 32768, "V100-32GB"),
        ("NVIDIA-H100-80GB-HBM3-SHARED", 81559, "H100-80GB"),  # time-slicing rename
        ("NVIDIA-A100-SXM4-80GB", None, "A100-80GB"),  # no memory label: size from the name
    ],
)
def test_dashed_product_labels_give_model_keys(
    product: str, memory: int | None, model: str
) -> None:
    assert product_model(product, memory)[0] == model


# -- MIG, mixed strategy --------------------------------------------------------------------------
def test_a100_mixed_node_packs_mig_resources_onto_the_mig_gpus() -> None:
    inv = inventory_from_nodes([a100_mixed_node()])
    (n,) = inv.nodes
    whole = [g for g in n.gpus if g.mig_mode == "off"]
    mig = [g for g in n.gpus if g.mig_mode == "fixed"]
    assert [g.uuid for g in whole] == ["k8s-dgx-a100-1-gpu0"]
    assert len(mig) == 7  # gpu.count 8 minus one whole GPU
    assert instances_of(inv) == {"1g.10gb": 14, "2g.20gb": 7, "3g.40gb": 7}
    for g in mig:
        assert g.model == "A100-80GB" and g.mig_capable
        placed = [(A100.by_name[i.profile], i.start) for i in g.instances]
        assert A100.fit([], placed) == []  # valid starts, no slot taken twice
        assert Counter(i.profile for i in g.instances) == BALANCED  # the even share, as mig-parted
        assert all(i.uuid == f"{g.uuid}-mig{i.start}" for i in g.instances)


def test_all_mig_node_without_count_label_uses_the_fewest_gpus() -> None:
    obj = a100_mixed_node("dgx-a100-2")
    del obj["metadata"]["labels"]["nvidia.com/gpu.count"]
    obj["status"]["allocatable"] |= {
        "nvidia.com/gpu": "0",
        "nvidia.com/mig-1g.10gb": "16",
        "nvidia.com/mig-2g.20gb": "8",
        "nvidia.com/mig-3g.40gb": "8",
    }
    inv = inventory_from_nodes([obj])
    assert [g.mig_mode for g in inv.gpus] == ["fixed"] * 8
    assert instances_of(inv) == {"1g.10gb": 16, "2g.20gb": 8, "3g.40gb": 8}


def test_media_extension_resources_are_plus_me_profiles() -> None:
    assert mig_profile_name("nvidia.com/mig-1g.10gb.me") == "1g.10gb+me"
    assert mig_profile_name("nvidia.com/mig-3g.40gb") == "3g.40gb"
    obj = a100_mixed_node()
    obj["status"]["allocatable"] = {"nvidia.com/gpu": "0", "nvidia.com/mig-1g.10gb.me": "2"}
    obj["metadata"]["labels"]["nvidia.com/gpu.count"] = "2"
    assert instances_of(inventory_from_nodes([obj])) == {"1g.10gb+me": 2}


def test_mig_resources_that_do_not_fit_the_gpu_count_are_left_out_with_a_note() -> None:
    obj = a100_mixed_node()
    obj["metadata"]["labels"]["nvidia.com/gpu.count"] = "2"  # 1 whole + 1 MIG GPU: too few
    inv = inventory_from_nodes([obj])
    assert [g.mig_mode for g in inv.gpus] == ["off"]
    assert any("do not fit 1 MIG GPU(s)" in note for note in inv.notes)


def test_pack_instances_finds_layouts_first_fit_decreasing_misses() -> None:
    # 7× 3g first-fit puts two on one GPU and strands the 1g slices; the search does not
    counts = Counter({A100.by_name["3g.40gb"]: 7, A100.by_name["2g.20gb"]: 7})
    counts[A100.by_name["1g.10gb"]] = 14
    layouts = pack_instances(A100, counts, 7)
    assert layouts is not None and len(layouts) == 7
    assert all(A100.fit([], layout) == [] for layout in layouts)
    assert pack_instances(A100, Counter({A100.by_name["7g.80gb"]: 9}), 8) is None
    assert pack_instances(A100, Counter({A100.by_name["7g.80gb"]: 9})) is not None


# -- nodes left out -------------------------------------------------------------------------------
def test_unschedulable_and_cpu_nodes_are_skipped() -> None:
    inv = inventory_from_nodes([cordoned_node(), cpu_node(), h100_node()])
    assert [n.name for n in inv.nodes] == ["dgx-h100-1"]
    assert any("dgx-h100-2 is cordoned" in note for note in inv.notes)
    assert not any("cpu-1" in note for note in inv.notes)


def test_single_strategy_nodes_are_left_out_with_a_note() -> None:
    obj = a100_mixed_node()
    labels = obj["metadata"]["labels"]
    labels |= {
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
        "nvidia.com/gpu.count": "56",
    }
    obj["status"]["allocatable"] = {"nvidia.com/gpu": "56"}
    inv = inventory_from_nodes([obj])
    assert inv.nodes == () and "'single' strategy" in inv.notes[0]


def test_one_replica_is_not_sharing() -> None:
    obj = h100_node()
    obj["metadata"]["labels"] |= {
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
    }
    assert len(inventory_from_nodes([obj]).gpus) == 8


def test_foreign_taints_are_noted_not_judged() -> None:
    obj = h100_node()
    obj["spec"]["taints"].append({"key": "dedicated", "value": "ml", "effect": "NoSchedule"})
    inv = inventory_from_nodes([obj])
    assert len(inv.gpus) == 8
    assert any("taint dedicated=ml:NoSchedule" in note for note in inv.notes)


# -- the ledger over a Kubernetes inventory -------------------------------------------------------
def test_ledger_allocates_every_resource_the_nodes_offer_and_no_more() -> None:
    inv = inventory_from_nodes([h100_node(), a100_mixed_node(), cordoned_node()])
    offers = {
        "h100": Offer("h100", "gpu", model="H100-80GB", max_count=8),
        "a100": Offer("a100", "gpu", model="A100-80GB", max_count=8),
        "mig-1g.10gb": Offer("mig-1g.10gb", "mig", model="A100-80GB", profile="1g.10gb"),
        "mig-2g.20gb": Offer("mig-2g.20gb", "mig", profile="2g.20gb"),
        "mig-3g.40gb": Offer("mig-3g.40gb", "mig", profile="3g.40gb"),
    }
    ledger = Ledger(inv, offers, {"big": Team("big", 100_000)})
    asks = [("h100", 8), ("a100", 1)] + [("mig-1g.10gb", 1)] * 14
    asks += [("mig-2g.20gb", 1)] * 7 + [("mig-3g.40gb", 1)] * 7
    for i, (offer, count) in enumerate(asks):
        ledger.allocate(Request("u", "big", offer, count), f"a{i}")
        ledger.check_invariants()
    for offer, count in (("h100", 1), ("a100", 1), ("mig-1g.10gb", 1), ("mig-3g.40gb", 1)):
        with pytest.raises(NoCapacity):
            ledger.allocate(Request("u", "big", offer, count), f"more-{offer}")
    held = Counter(d.profile or "whole" for a in ledger.allocations.values() for d in a.devices)
    assert held == {"whole": 9, "1g.10gb": 14, "2g.20gb": 7, "3g.40gb": 7}
    mig_devices = [d for a in ledger.allocations.values() for d in a.devices if d.profile]
    assert all(d.instance == f"{d.gpu}-mig{d.start}" for d in mig_devices)


# -- the pool's source setting --------------------------------------------------------------------
@pytest.mark.parametrize("value", ["kubernetes", "kubernetes:nvidia.com/gpu.present=true"])
def test_config_accepts_kubernetes_sources(value: str) -> None:
    config = Config()
    config.GPUPool.inventory = value
    assert GPUPool(config=config).inventory == value


def test_config_rejects_unknown_sources_naming_kubernetes() -> None:
    config = Config()
    config.GPUPool.inventory = "k8s"
    with pytest.raises(ConfigError, match=r"GPUPool.inventory: .*kubernetes"):
        GPUPool(config=config)


# -- reading nodes from an API server -------------------------------------------------------------
class FakeAPIServer:
    """Answers ``GET /api/v1/nodes`` like the API server: a ``NodeList``, ``limit``/``continue``
    paging and ``labelSelector`` equality matching; counts the requests it served."""

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.nodes = nodes
        self.requests: list[dict[str, str]] = []

    async def list_nodes(self, request: web.Request) -> web.Response:
        query = dict(request.query)
        self.requests.append(query)
        items = self.nodes
        if "labelSelector" in query:
            key, _, value = query["labelSelector"].partition("=")
            items = [n for n in items if n["metadata"]["labels"].get(key) == value]
        start = int(query.get("continue") or 0)
        limit = int(query.get("limit") or len(items) or 1)
        page, rest = items[start : start + limit], start + limit < len(items)
        body = {
            "kind": "NodeList",
            "apiVersion": "v1",
            "metadata": {
                "resourceVersion": "4242",
                **({"continue": str(start + limit)} if rest else {}),
            },
            "items": page,
        }
        return web.json_response(body)


class ServedAPI:
    """A :class:`FakeAPIServer` on its own thread and event loop (as a real API server is
    elsewhere), with ``KUBECONFIG`` pointing at it."""

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        self.api = FakeAPIServer(nodes)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(
            10
        )

    async def _start(self) -> tuple[web.AppRunner, int]:
        app = web.Application()
        app.router.add_get("/api/v1/nodes", self.api.list_nodes)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., FakeAPIServer]]:
    """``serve(nodes)`` starts an API server for ``nodes`` and points ``KUBECONFIG`` at it."""
    served: list[ServedAPI] = []

    def start(nodes: list[dict[str, Any]]) -> FakeAPIServer:
        server = ServedAPI(nodes)
        served.append(server)
        url = f"http://127.0.0.1:{server.port}"
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", url)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        return server.api

    yield start
    for server in served:
        server.close()


def test_read_nodes_through_kubernetes_asyncio_round_trips_node_json(
    serve: Callable[..., FakeAPIServer],
) -> None:
    many = [h100_node(f"dgx-h100-{i:03d}") for i in range(600)] + [a100_mixed_node(), cpu_node()]
    api = serve(many)
    read = asyncio.run(read_nodes())
    assert len(api.requests) == 2  # two pages of up to 500
    assert [n["metadata"]["name"] for n in read] == [n["metadata"]["name"] for n in many]
    assert inventory_from_nodes(read) == inventory_from_nodes(many)
    assert read[-2]["status"]["allocatable"]["nvidia.com/mig-3g.40gb"] == "7"


def test_read_nodes_passes_the_label_selector(serve: Callable[..., FakeAPIServer]) -> None:
    api = serve([h100_node(), a100_mixed_node(), cpu_node()])
    selector = "nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB"
    read = asyncio.run(read_nodes(selector))
    assert [n["metadata"]["name"] for n in read] == ["dgx-a100-1"]
    assert api.requests[0]["labelSelector"] == selector


def test_pool_loads_a_kubernetes_inventory_from_within_the_hubs_event_loop(
    serve: Callable[..., FakeAPIServer],
) -> None:
    api = serve([h100_node(), a100_mixed_node(), cordoned_node(), cpu_node()])

    async def in_the_hub() -> Inventory:
        return load_inventory("kubernetes:nvidia.com/gpu.present=true")[0]  # sync, loop running

    inv = asyncio.run(in_the_hub())
    assert [n.name for n in inv.nodes] == ["dgx-a100-1", "dgx-h100-1"]
    assert (inv.source, len(inv.gpus)) == ("kubernetes", 16)
    assert api.requests[0]["labelSelector"] == "nvidia.com/gpu.present=true"


def test_sync_loader_works_inside_a_running_event_loop() -> None:
    nodes = [copy.deepcopy(h100_node())]

    async def reader(selector: str | None) -> list[dict[str, Any]]:
        await asyncio.sleep(0)
        return nodes

    async def in_the_hub() -> Any:
        return load_kubernetes_inventory(None, reader=reader)  # sync call inside a loop

    assert len(asyncio.run(in_the_hub()).gpus) == 8


def test_unreachable_cluster_fails_with_a_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "config", "http://127.0.0.1:9")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(RuntimeError, match=r"GPUPool.inventory = 'kubernetes'.*KUBECONFIG"):
        load_kubernetes_inventory(timeout=20)
