"""``KubeGPUSpawner`` (``gpupool-kube``): KubeSpawner with GPUs from the pool.

Vocabulary
- *accounting ledger*: on Kubernetes the pool decides *whether* a server gets a GPU (team quota,
  allowed offers, capacity read from the nodes' ``allocatable``, see
  :mod:`gpupool.discovery.kubernetes`); the NVIDIA device plugin decides *which* device. The
  allocation's devices are the pool's bookkeeping, not device IDs to hand to CUDA.
- *manifest*: the ``V1Pod`` KubeSpawner builds (``get_pod_manifest``), which
  :func:`gpupool.podspec.apply_allocation` turns into one carrying the allocation:
  GPU resources, the model's ``nvidia.com/gpu.product`` affinity, the node binding
  (a required node affinity on ``metadata.name``: the node the ledger counted the devices on),
  GPU tolerations, priority class, scheduler name, and gpupool and Kueue labels (queue name and
  Kueue priority class).
- *product labels*: model key to ``nvidia.com/gpu.product`` values: the built-in table, plus the
  products the Kubernetes inventory saw on the nodes, with ``gpu_product_labels`` overriding both.

Contract: :class:`GPUSpawnerMixin` allocates before KubeSpawner starts, so the manifest is built
for the allocation of this start, never from spawner traits: a CPU-only server gets no
``nvidia.com/*`` resource whatever an earlier (failed) GPU spawn or a ``kubespawner_override``
left in ``extra_resource_limits``. No spawner trait is changed by gpupool. An offer whose model
has no product labels is refused before any pod is made. The server's environment carries
``GPUPOOL_ALLOCATION``, ``GPUPOOL_OFFER``, ``GPUPOOL_TEAM`` and ``GPUPOOL_SIMULATED``, as the local
spawner's does; ``CUDA_VISIBLE_DEVICES`` is left to the device plugin.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio.client import V1Pod
from kubespawner import KubeSpawner
from traitlets import Bool, Dict, List, Unicode, validate

from gpupool.core.ledger import Allocation
from gpupool.hub.errors import refuse
from gpupool.podspec import (
    DEFAULT_GPU_TOLERATIONS,
    DEFAULT_PRODUCT_LABELS,
    apply_allocation,
    check_priority_class,
    check_queue_template,
    product_values,
)
from gpupool.settings import ConfigError

from .mixin import GPUSpawnerMixin


class KubeGPUSpawner(GPUSpawnerMixin, KubeSpawner):
    gpu_tolerations = List(
        [dict(t) for t in DEFAULT_GPU_TOLERATIONS],
        config=True,
        help="""Tolerations added to GPU and MIG pods only (Kubernetes JSON, as
        ``KubeSpawner.tolerations``); CPU-only pods lose any toleration with these keys.
        Example::

            c.KubeGPUSpawner.gpu_tolerations = [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
            ]
        """,
    )

    gpu_priority_class_name = Unicode(
        "",
        config=True,
        help="""PriorityClass of GPU and MIG pods (empty: KubeSpawner's ``priority_class_name``).
        Example: ``c.KubeGPUSpawner.gpu_priority_class_name = "gpu-interactive"``""",
    )

    gpu_scheduler_name = Unicode(
        "",
        config=True,
        help="""Scheduler of GPU and MIG pods (empty: KubeSpawner's ``scheduler_name``).
        Example: ``c.KubeGPUSpawner.gpu_scheduler_name = "kai-scheduler"``""",
    )

    gpu_product_labels = Dict(
        {},
        config=True,
        help="""``nvidia.com/gpu.product`` values by gpupool model key, for offers with a
        ``model``; overrides the built-in table (and what the node inventory saw) per model.
        Example::

            c.KubeGPUSpawner.gpu_product_labels = {
                "H100-80GB": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"],
            }
        """,
    )

    bind_to_node = Bool(
        True,
        config=True,
        help="""Bind GPU and MIG pods to the node the pool's ledger chose for them (a required node
        affinity on the node's name), so that kube-scheduler cannot put them on
        another node than the one the pool counted. Turn off only when the pool's inventory is
        not the cluster's nodes (a simulated inventory in a test cluster). Example:
        ``c.KubeGPUSpawner.bind_to_node = False``""",
    )

    kueue_queue_template = Unicode(
        "",
        config=True,
        help="""When set, GPU and MIG pods get the label ``kueue.x-k8s.io/queue-name`` with this
        template filled in (``{team}``, ``{offer}``, ``{user}``), so a Kueue ``LocalQueue`` per
        team can admit them. Empty (the default): no Kueue label. Example:
        ``c.KubeGPUSpawner.kueue_queue_template = "{team}-gpu"``""",
    )

    kueue_priority_class = Unicode(
        "",
        config=True,
        help="""Kueue ``WorkloadPriorityClass`` of GPU and MIG pods: the label
        ``kueue.x-k8s.io/priority-class``, set only with ``kueue_queue_template`` (Kueue reads it
        on queued workloads only). A notebook should rank above every job
        (``KubeJobBackend.kueue_priority_class``), so that Kueue never preempts it for one.
        Empty (the default): no label, Kueue's default priority. The Helm chart sets
        ``<release>-notebook``. Example:
        ``c.KubeGPUSpawner.kueue_priority_class = "gpupool-notebook"``""",
    )

    @validate("gpu_product_labels")
    def _valid_product_labels(self, proposal: dict[str, Any]) -> dict[str, list[str]]:
        value = proposal["value"]
        out: dict[str, list[str]] = {}
        for model, labels in value.items():
            values = [labels] if isinstance(labels, str) else labels
            if not isinstance(values, list | tuple) or not all(
                isinstance(v, str) and v for v in values
            ):
                raise ConfigError(
                    f"KubeGPUSpawner.gpu_product_labels[{model!r}]",
                    f"must be a list of label values like ['NVIDIA-H100-80GB-HBM3'], "
                    f"got {labels!r}",
                )
            out[str(model)] = list(values)
        return out

    @validate("kueue_queue_template")
    def _valid_queue_template(self, proposal: dict[str, Any]) -> str:
        return check_queue_template(str(proposal["value"]), "KubeGPUSpawner.kueue_queue_template")

    @validate("kueue_priority_class")
    def _valid_priority_class(self, proposal: dict[str, Any]) -> str:
        return check_priority_class(str(proposal["value"]), "KubeGPUSpawner.kueue_priority_class")

    # -- product labels -----------------------------------------------------------------------
    def gpupool_product_labels(self) -> dict[str, tuple[str, ...]]:
        """The model → ``nvidia.com/gpu.product`` mapping in force (see the module docstring)."""
        labels = {model: list(values) for model, values in DEFAULT_PRODUCT_LABELS.items()}
        inventory = self.gpupool.inventory
        if inventory.source == "kubernetes":
            for gpu in inventory.gpus:
                if gpu.product_name and gpu.product_name not in labels.get(gpu.model, []):
                    labels.setdefault(gpu.model, []).append(gpu.product_name)
        labels.update(self.gpu_product_labels)
        return {model: tuple(values) for model, values in labels.items()}

    # -- the mixin's hook and KubeSpawner's manifest -------------------------------------------
    def gpupool_check_allocation(self, allocation: Allocation) -> None:
        offer = self.gpupool.ledger.offers.get(allocation.offer)
        if allocation.devices and offer is not None and offer.model:
            try:
                product_values(offer.model, self.gpupool_product_labels())
            except ValueError as e:
                raise refuse(503, f"Offer {offer.name} cannot be scheduled: {e}.") from None

    async def get_pod_manifest(self) -> V1Pod:
        pod: V1Pod = await super().get_pod_manifest()
        return apply_allocation(
            pod,
            self.gpupool_allocation,
            self.gpupool_offer,
            tolerations=self.gpu_tolerations,
            priority_class_name=self.gpu_priority_class_name,
            scheduler_name=self.gpu_scheduler_name,
            product_labels=self.gpupool_product_labels(),
            kueue_queue_template=self.kueue_queue_template,
            kueue_priority_class=self.kueue_priority_class,
            bind_to_node=self.bind_to_node,
        )
