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
from typing import Any

import pytest
from kubernetes_asyncio.client import V1Pod
from kubespawner import KubeSpawner

from gpupool.kube.pods import (
    DEFAULT_PRODUCT_LABELS,
    allocation_resources,
    apply_allocation,
    gpu_resources,
    mig_resource,
    product_affinity,
)
from gpupool.pool import Pool
from tests.deploy.kube_fixtures import (
    GPU_TOLERATION,
    OFFERS,
    manifest,
    serialise,
    spawner,
    validate,
)
from tests.deploy.kube_fixtures import (
    notebook_env as env,
)
from tests.deploy.kube_fixtures import (
    notebook_nvidia as nvidia,
)


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
