"""KubeGPUSpawner's pod manifests: real KubeSpawner pods, real allocations, Kubernetes schemas.

Each test builds the real :class:`KubeGPUSpawner` (KubeSpawner's ``_mock=True`` test mode, a
kubeconfig that is never contacted), lets a real pool (a :class:`Ledger` over
``inventory_from_nodes`` of realistic node objects, persisted to SQLite) allocate, takes the pod
from ``get_pod_manifest()``, serialises it as the API client would and validates it strictly
against the Kubernetes schemas ``kubernetes_validate`` ships.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_asyncio.config.kube_config as kube_config
import kubernetes_validate
import pytest
from kubernetes_asyncio.client import ApiClient, V1Pod
from kubernetes_validate.utils import major_minor
from kubespawner import KubeSpawner
from kubespawner.clients import load_config
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Team
from gpupool.hub.objects import SETTINGS_KEY, build
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.pods import (
    DEFAULT_PRODUCT_LABELS,
    allocation_resources,
    apply_allocation,
    gpu_resources,
    mig_resource,
    product_affinity,
)
from gpupool.pool import Pool
from gpupool.store import Store
from gpupool_spawner.kube import KubeGPUSpawner
from tests.accounts import shared_mode
from tests.conftest import a100_mixed_node, h100_node, kubeconfig

K8S_VERSIONS = ("1.33", major_minor(kubernetes_validate.latest_version()))
OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=4),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", model="A100-80GB", profile="3g.40gb"),
}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@dataclass
class Group:
    name: str


@dataclass
class User:
    """The parts of JupyterHub's ``User`` the spawners read (as KubeSpawner's tests mock it)."""

    name: str
    groups: list[Group] = field(default_factory=list)
    id: int = 1
    url: str = "/user/alice/"
    settings: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Pool]:
    """The hub's pool over a Kubernetes inventory; a dummy kubeconfig for KubeSpawner."""
    path = kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443")
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    load_config.cache_clear()
    inventory = inventory_from_nodes([h100_node(), a100_mixed_node()])
    teams = {"vision": Team("vision", 8000)}
    ledger = Ledger(inventory, OFFERS, teams, Team("everyone", offers=frozenset({"cpu"})))
    store = Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}")
    pool = Pool(ledger, store)
    yield pool
    store.close()
    load_config.cache_clear()


def spawner(pool: Pool, **traits: Any) -> KubeGPUSpawner:
    """A real KubeGPUSpawner for alice of team vision, handed the hub objects over ``pool`` as
    JupyterHub hands them (the user's settings); call inside a running event loop."""
    config = Config()
    for key, value in traits.items():
        config.KubeGPUSpawner[key] = value
    shared_mode(config)  # the job manager's local backend never runs user code as root
    settings = {SETTINGS_KEY: build(pool, config, logging.getLogger("test"))}
    user = User("alice", [Group("vision")], settings=settings)
    return KubeGPUSpawner(_mock=True, user=user, config=config)


async def manifest(s: KubeGPUSpawner, pool: Pool, offer: str, count: int = 1) -> dict[str, Any]:
    """Allocate as the mixin's ``start`` does, then the pod as the API would receive it."""
    allocation = pool.allocate("alice", ["vision"], offer, count, ref=s.gpupool_ref)
    s.gpupool_allocation_id = allocation.id
    return await serialise(await s.get_pod_manifest())


async def serialise(pod: V1Pod) -> dict[str, Any]:
    """The pod's JSON, as ``kubernetes_asyncio`` sends it to the API server."""
    async with ApiClient() as api:
        data: dict[str, Any] = api.sanitize_for_serialization(pod)
        return data


def validate(pod: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        assert kubernetes_validate.validate(pod, version, strict=True) == version


def notebook(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "notebook"]
    return container


def nvidia(pod: dict[str, Any]) -> dict[str, dict[str, str]]:
    resources = notebook(pod).get("resources", {})
    return {
        kind: {k: v for k, v in resources.get(kind, {}).items() if k.startswith("nvidia.com/")}
        for kind in ("limits", "requests")
    }


def product_terms(pod: dict[str, Any]) -> list[list[str]]:
    node = pod["spec"].get("affinity", {}).get("nodeAffinity", {})
    terms = node.get("requiredDuringSchedulingIgnoredDuringExecution", {}).get(
        "nodeSelectorTerms", []
    )
    return [
        e["values"]
        for t in terms
        for e in t.get("matchExpressions", [])
        if e["key"] == "nvidia.com/gpu.product"
    ]


def env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in notebook(pod).get("env", [])}


# -- whole GPUs, MIG, CPU -------------------------------------------------------------------------
def test_whole_gpu_pod_requests_n_gpus_on_the_model_with_priority_and_scheduler(pool: Pool) -> None:
    async def go() -> dict[str, Any]:
        s = spawner(
            pool,
            gpu_priority_class_name="gpu-interactive",
            gpu_scheduler_name="kai-scheduler",
            kueue_priority_class="gp-notebook",  # no queue: Kueue would ignore the label
        )
        return await manifest(s, pool, "h100", 2)

    pod = asyncio.run(go())
    validate(pod)
    assert nvidia(pod) == {"limits": {"nvidia.com/gpu": "2"}, "requests": {"nvidia.com/gpu": "2"}}
    assert product_terms(pod) == [list(DEFAULT_PRODUCT_LABELS["H100-80GB"])]
    assert "NVIDIA-H100-80GB-HBM3" in product_terms(pod)[0]
    assert GPU_TOLERATION in pod["spec"]["tolerations"]
    assert pod["spec"]["priorityClassName"] == "gpu-interactive"
    assert pod["spec"]["schedulerName"] == "kai-scheduler"
    (allocation,) = pool.ledger.allocations.values()
    labels = pod["metadata"]["labels"]
    assert labels["gpupool.io/team"] == "vision" and labels["gpupool.io/offer"] == "h100"
    assert labels["gpupool.io/allocation"] == allocation.id
    assert "kueue.x-k8s.io/queue-name" not in labels  # no template configured
    assert "kueue.x-k8s.io/priority-class" not in labels  # nor a priority without a queue
    assert env(pod)["GPUPOOL_ALLOCATION"] == allocation.id and env(pod)["GPUPOOL_TEAM"] == "vision"
    assert "NVIDIA_VISIBLE_DEVICES" not in env(pod)  # the device plugin's to set


def test_mig_pod_requests_one_instance_and_names_the_team_queue(pool: Pool) -> None:
    async def go() -> dict[str, Any]:
        s = spawner(pool, kueue_queue_template="{team}-gpu", kueue_priority_class="gp-notebook")
        return await manifest(s, pool, "mig-3g.40gb")

    pod = asyncio.run(go())
    validate(pod)
    mig = {"nvidia.com/mig-3g.40gb": "1"}
    assert nvidia(pod) == {"limits": mig, "requests": mig}
    assert "NVIDIA-A100-SXM4-80GB" in product_terms(pod)[0]
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "vision-gpu"
    assert pod["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "gp-notebook"
    assert pod["metadata"]["labels"]["gpupool.io/team"] == "vision"
    assert GPU_TOLERATION in pod["spec"]["tolerations"]


def test_cpu_pod_has_nothing_gpu_specific(pool: Pool) -> None:
    async def go() -> dict[str, Any]:
        s = spawner(
            pool,
            gpu_priority_class_name="gpu-interactive",
            kueue_queue_template="{team}",
            kueue_priority_class="gp-notebook",
        )
        return await manifest(s, pool, "cpu")

    pod = asyncio.run(go())
    validate(pod)
    assert nvidia(pod) == {"limits": {}, "requests": {}}
    assert product_terms(pod) == []
    assert "tolerations" not in pod["spec"]
    assert "priorityClassName" not in pod["spec"]
    assert "kueue.x-k8s.io/queue-name" not in pod["metadata"]["labels"]
    assert "kueue.x-k8s.io/priority-class" not in pod["metadata"]["labels"]
    assert pod["metadata"]["labels"]["gpupool.io/offer"] == "cpu"
    assert env(pod)["NVIDIA_VISIBLE_DEVICES"] == "void"  # a CUDA image on a GPU node sees none


# -- the KubeSpawner pitfall ----------------------------------------------------------------------
def test_cpu_spawn_after_a_failed_gpu_spawn_inherits_no_gpu(pool: Pool) -> None:
    """One spawner object: a GPU spawn that fails after its manifest was built (leaving, as a
    ``kubespawner_override`` would, GPU traits on the spawner), then a CPU spawn."""

    async def go() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        s = spawner(pool)
        gpu = await manifest(s, pool, "h100", 2)
        s.gpupool_release()  # the failed start gives its devices back
        s.extra_resource_limits = {"nvidia.com/gpu": "2"}
        s.extra_resource_guarantees = {"nvidia.com/gpu": "2"}
        s.tolerations = [GPU_TOLERATION]
        s.node_affinity_required = [
            {
                "matchExpressions": [
                    {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["x"]}
                ]
            }
        ]
        plain = await serialise(
            await KubeSpawner.get_pod_manifest(s)
        )  # what KubeSpawner would send
        cpu = await manifest(s, pool, "cpu")
        assert s.extra_resource_limits == {"nvidia.com/gpu": "2"}  # traits left as they were
        return gpu, plain, cpu

    gpu, plain, cpu = asyncio.run(go())
    assert nvidia(gpu)["limits"] == {"nvidia.com/gpu": "2"}
    assert nvidia(plain)["limits"] == {"nvidia.com/gpu": "2"}  # the pitfall is real
    validate(cpu)
    assert nvidia(cpu) == {"limits": {}, "requests": {}}
    assert "tolerations" not in cpu["spec"]
    assert product_terms(cpu) == []
    assert cpu["metadata"]["labels"]["gpupool.io/offer"] == "cpu"


def test_mig_spawn_after_a_whole_gpu_spawn_requests_only_the_instance(pool: Pool) -> None:
    async def go() -> dict[str, Any]:
        s = spawner(pool)
        await manifest(s, pool, "h100", 4)
        s.gpupool_release()
        s.extra_resource_limits = {"nvidia.com/gpu": "4"}
        return await manifest(s, pool, "mig-3g.40gb")

    pod = asyncio.run(go())
    validate(pod)
    assert nvidia(pod)["limits"] == {"nvidia.com/mig-3g.40gb": "1"}
    assert len(product_terms(pod)) == 1 and "NVIDIA-A100-SXM4-80GB" in product_terms(pod)[0]


# -- the pure functions ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("offer", "count", "expected"),
    [
        ("h100", 2, {"nvidia.com/gpu": "2"}),
        ("mig-3g.40gb", 1, {"nvidia.com/mig-3g.40gb": "1"}),
        ("cpu", 1, {}),
    ],
)
def test_gpu_resources_match_what_the_allocation_holds(
    pool: Pool, offer: str, count: int, expected: dict[str, str]
) -> None:
    allocation = pool.allocate("alice", ["vision"], offer, count)
    assert gpu_resources(OFFERS[offer], count) == expected
    assert allocation_resources(allocation) == expected


def test_mig_resource_names_follow_the_device_plugin() -> None:
    assert mig_resource("3g.40gb") == "nvidia.com/mig-3g.40gb"
    assert mig_resource("mig-1g.10gb+me") == "nvidia.com/mig-1g.10gb.me"


def test_apply_allocation_copies_and_keeps_other_affinity(pool: Pool) -> None:
    allocation_node = ""

    async def go() -> tuple[str, str, dict[str, Any]]:
        nonlocal allocation_node
        s = spawner(pool)
        s.node_affinity_required = [
            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
        ]
        pod: V1Pod = await KubeSpawner.get_pod_manifest(s)
        before = json.dumps(await serialise(pod), sort_keys=True)
        allocation = pool.allocate("alice", ["vision"], "h100", 1)
        allocation_node = str(allocation.node)
        out = await serialise(apply_allocation(pod, allocation, OFFERS["h100"]))
        return before, json.dumps(await serialise(pod), sort_keys=True), out

    before, after, out = asyncio.run(go())
    assert after == before  # the input pod is untouched
    node = out["spec"]["affinity"]["nodeAffinity"]
    (term,) = node["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [e["key"] for e in term["matchExpressions"]] == ["zone", "nvidia.com/gpu.product"]
    # bound to the node the ledger chose, by name
    assert term["matchFields"] == [
        {"key": "metadata.name", "operator": "In", "values": [allocation_node]}
    ]
    validate(out)


def test_models_without_product_labels_say_which_setting_to_set() -> None:
    with pytest.raises(ValueError, match=r"gpu_product_labels = \{'B200-180GB'"):
        product_affinity("B200-180GB", DEFAULT_PRODUCT_LABELS)
    assert product_affinity(None, DEFAULT_PRODUCT_LABELS) is None


def test_inventory_products_extend_the_label_table(pool: Pool) -> None:
    async def go() -> dict[str, tuple[str, ...]]:
        return spawner(pool, gpu_product_labels={"A100-40GB": ["my-a100"]}).gpupool_product_labels()

    labels = asyncio.run(go())
    assert labels["A100-40GB"] == ("my-a100",)  # configured: replaces the default
    assert labels["H100-80GB"] == DEFAULT_PRODUCT_LABELS["H100-80GB"]


def test_spawn_page_is_gpupools_form(pool: Pool) -> None:
    async def go() -> str:
        form = spawner(pool).options_form
        assert callable(form)
        return str(form(None))

    assert "h100" in asyncio.run(go())


def test_pod_for_a_copy_of_the_spawner_state_is_stable(pool: Pool) -> None:
    """Two manifests for the same allocation are the same (no hidden state in the spawner)."""

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        s = spawner(pool)
        first = await manifest(s, pool, "h100", 1)
        return first, await serialise(await s.get_pod_manifest())

    first, second = asyncio.run(go())
    assert first == copy.deepcopy(second)


def test_a_bad_kueue_priority_class_is_refused_naming_the_setting(pool: Pool) -> None:
    from gpupool.declarations import ConfigError

    async def go() -> None:
        spawner(pool, kueue_priority_class="Notebook_High")

    with pytest.raises(ConfigError, match=r"KubeGPUSpawner\.kueue_priority_class"):
        asyncio.run(go())
