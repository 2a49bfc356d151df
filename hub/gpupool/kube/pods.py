"""Pod manifests for gpupool allocations: pure functions over KubeSpawner's ``V1Pod``.

Vocabulary
- *GPU resource*: the extended resource the NVIDIA device plugin offers: ``nvidia.com/gpu``
  (whole GPUs) or, under the ``mixed`` MIG strategy, ``nvidia.com/mig-<profile>`` (one MIG
  instance; a ``+me`` profile is spelt ``.me``, as resource names allow no ``+``).
- *share request*: what a pod asks for one share of a GPU the platform shares out (its
  inventory *share resource*, see :mod:`gpupool.kube.nodes`): one replica of the device
  plugin's time-slicing or MPS (``nvidia.com/gpu.shared: 1``, or ``nvidia.com/gpu: 1`` where the
  plugin does not rename the resource), or under HAMi one virtual GPU with the share's memory
  (``nvidia.com/gpu: 1``, ``nvidia.com/gpumem: <MiB>``: the share's thousandths of the GPU's
  memory, rounded down; with a ``cores`` resource configured also ``nvidia.com/gpucores: <%>``,
  the share's thousandths in percent, rounded up). :class:`ShareRequests` holds the shared GPUs
  by UUID and the HAMi resource names (:data:`DEFAULT_HAMI_RESOURCES`, HAMi's own defaults). A
  share of a GPU it does not know (an inventory that is not the cluster's) asks for one
  ``nvidia.com/gpu``, as before shares existed.
- *HAMi share pod*: a pod holding a share of a GPU HAMi shares out. It goes to HAMi's scheduler
  (:attr:`ShareRequests.hami_scheduler`, ``hami-scheduler`` by default) whatever scheduler the
  spawner or ``gpu_scheduler_name`` names: HAMi's webhook routes a pod only while its scheduler
  is the default one (``Handle`` in HAMi's ``pkg/scheduler/webhook.go`` lets any other through
  as "pod already has different scheduler assigned"), and z2jh's user-scheduler, which z2jh
  4.4.0 sets on every user pod, cannot place ``nvidia.com/gpumem`` (no node advertises it). It
  is pinned to the ledger's GPU by HAMi's UUID: the annotation ``nvidia.com/use-gpuuuid``
  (:data:`HAMI_USE_UUID`; ``CheckUUID`` in HAMi's ``pkg/device/devices.go``), since HAMi's
  default ``spread`` GPU policy would otherwise choose another GPU than the one the ledger
  counted (:func:`share_annotations`). GPUs whose UUIDs are the inventory's own (synthetic)
  are not pinned.
- *product label*: the node label ``nvidia.com/gpu.product`` that GPU feature discovery sets
  from NVML's product name with dashes (``NVIDIA-H100-80GB-HBM3``). An offer's model key
  (``H100-80GB``) becomes a required node affinity ``nvidia.com/gpu.product In [values]``
  through a mapping from model keys to label values (:data:`DEFAULT_PRODUCT_LABELS`).
- *node binding*: a GPU pod's required node affinity on the node(s) the ledger chose
  (``Allocation.node``: the inventory's node names are the Nodes' ``metadata.name``), as
  ``matchFields: [{key: metadata.name, operator: In, values: [node]}]`` (what the DaemonSet
  controller uses: the node's name itself, where the ``kubernetes.io/hostname`` label can differ
  from it under ``--hostname-override`` or a cloud provider). A field requirement takes exactly
  one value, so a pod allowed on several nodes gets one term per node (terms are ORed), each with
  the other requirements repeated. Without it kube-scheduler may put the pod on another node
  with free devices of the same model than the one the ledger counted, and a later pod the
  ledger sent to that node stays Pending on ``Insufficient nvidia.com/gpu``. CPU pods are not
  bound.
- *GPU tolerations*: tolerations only GPU pods get, for taints that keep other pods off GPU
  nodes (by default ``nvidia.com/gpu`` ``Exists`` ``NoSchedule``).
- *gpupool labels*: ``gpupool.io/team``, ``gpupool.io/offer``, ``gpupool.io/allocation`` on every
  pod, and on GPU pods the Kueue label ``kueue.x-k8s.io/queue-name`` when a queue template (such
  as ``"{team}"``) is configured, so a Kueue ``LocalQueue`` can take over the team's quota.
- *hardening*: the security context fields of :data:`HARDENING` (those the restricted Pod
  Security Standard asks for): ``runAsNonRoot: true``, ``allowPrivilegeEscalation: false``,
  ``capabilities: {drop: [ALL]}``, ``seccompProfile: {type: RuntimeDefault}``. A job container
  always gets all of them over whatever its template says (:func:`hardened_context`, which also
  takes away ``privileged`` and added capabilities); the notebook container gets the configured
  ones where the admin's settings leave them unset (:func:`harden_notebook`): a field the
  container's securityContext sets, or for the fields a pod may set for all its containers
  (:data:`POD_LEVEL_FIELDS`) the pod's, is the admin's, and so is ``runAsNonRoot`` where the
  container is set to run as user 0 (the kubelet would refuse to start it).

- *one representation*: the GPU parts of a pod (its ``nvidia.com/*`` resources, node affinity,
  tolerations, gpupool and Kueue labels) are built here, once, as ``kubernetes_asyncio`` models,
  the representation KubeSpawner's ``V1Pod`` has. The objects gpupool writes itself (a job's
  Indexed Job, :mod:`gpupool.kube.manifests`; a scale-up request pod, :mod:`gpupool.kube.scale_up`)
  are API JSON and take those parts from here through :func:`to_model` and :func:`to_json`; no
  other module spells a GPU resource, affinity or toleration.

Contract: no I/O and no spawner: :func:`apply_allocation` returns a deep copy of the pod
KubeSpawner built, never touching its input, and gpupool owns everything GPU-specific in it.
Whatever the spawner's traits hold (a ``kubespawner_override`` left behind by an earlier, failed
GPU spawn is the known pitfall), the notebook container ends up with exactly the allocation's GPU
resources, as equal limits and requests, and nothing else under ``nvidia.com/``; the
``nvidia.com/gpu.product`` constraint, the node binding, GPU tolerations, gpupool labels and the
Kueue label are the allocation's too. A CPU-only pod (no allocation, a ``cpu`` offer, or no
devices) gets none of these (no node binding either), plus ``NVIDIA_VISIBLE_DEVICES=void`` so
that an image built for CUDA sees no GPU even on a GPU node whose default runtime is NVIDIA's.
GPU pods keep the device plugin's choice of device (a HAMi share pod: HAMi's, pinned to the
ledger's GPU): the spawner's ``NVIDIA_VISIBLE_DEVICES``/``CUDA_VISIBLE_DEVICES`` are dropped.
gpupool owns the node labels ``nvidia.com/gpu.product`` (expressions, and ``nodeSelector``), the
annotation ``nvidia.com/use-gpuuuid`` and the ``metadata.name`` field in required node terms:
those already in the pod (an earlier spawn's, or those of the notebook pod a job is made from)
are dropped first; restrict nodes with other labels.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes_asyncio.client import (
    V1Affinity,
    V1Container,
    V1EnvVar,
    V1NodeAffinity,
    V1NodeSelector,
    V1NodeSelectorRequirement,
    V1NodeSelectorTerm,
    V1Pod,
    V1ResourceRequirements,
    V1SecurityContext,
    V1Toleration,
)
from kubernetes_asyncio.client import models as k8s_models
from kubespawner.slugs import is_valid_label, safe_slug
from kubespawner.utils import get_k8s_model

from gpupool.core.inventory import GPU, Inventory
from gpupool.core.ledger import Allocation, Device
from gpupool.core.mig import GEOMETRIES
from gpupool.core.offers import Offer
from gpupool.core.units import GPU_MILLI
from gpupool.kube.nodes import SYNTHETIC_PREFIX

NVIDIA_PREFIX = "nvidia.com/"
GPU_RESOURCE = "nvidia.com/gpu"
SHARED_RESOURCE = "nvidia.com/gpu.shared"
HAMI = "hami"
HAMI_USE_UUID = "nvidia.com/use-gpuuuid"
"""HAMi's pod annotation naming the GPUs (comma-separated UUIDs) its scheduler may give."""
DEFAULT_HAMI_SCHEDULER = "hami-scheduler"
"""HAMi's scheduler name (its chart's ``schedulerName``)."""
HAMI_KEYS = ("count", "memory", "cores")
DEFAULT_HAMI_RESOURCES: dict[str, str] = {
    "count": "nvidia.com/gpu",
    "memory": "nvidia.com/gpumem",
}
"""HAMi's resource names (its ``resourceCountName``, ``resourceMemoryName``; ``cores``, its
``resourceCoreName`` ``nvidia.com/gpucores``, only when configured)."""
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
PRODUCT_LABEL = "nvidia.com/gpu.product"
HOSTNAME_LABEL = "kubernetes.io/hostname"
NODE_NAME_FIELD = "metadata.name"
TEAM_LABEL = "gpupool.io/team"
OFFER_LABEL = "gpupool.io/offer"
ALLOCATION_LABEL = "gpupool.io/allocation"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
GPUPOOL_LABEL_PREFIX = "gpupool.io/"
NOTEBOOK_CONTAINER = "notebook"
VISIBILITY_ENV = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
QUEUE_FIELDS = ("team", "offer", "user")
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
EXTENDED_RESOURCE = DNS_SUBDOMAIN + r"/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"

HARDENING: dict[str, Any] = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""A hardened container's securityContext fields (see *hardening*)."""
POD_LEVEL_FIELDS = (
    "runAsNonRoot",
    "runAsUser",
    "runAsGroup",
    "seccompProfile",
    "seLinuxOptions",
    "appArmorProfile",
    "windowsOptions",
)
"""Fields of a pod's securityContext that hold for each container which does not set its own."""
GRANTING_FIELDS = ("privileged", "procMount")
"""Container securityContext fields that grant more than a hardened container may have."""

DEFAULT_GPU_TOLERATIONS: tuple[dict[str, str], ...] = (
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
)
"""Tolerations GPU pods get unless configured otherwise (the GPU operator's usual taint)."""


def _products(*names: str) -> tuple[str, ...]:
    """Each NVML product name as GFD labels it: dashes, with and without the ``NVIDIA-`` prefix
    older drivers left out."""
    out: list[str] = []
    for name in names:
        label = name.replace(" ", "-")
        out += [label, label.removeprefix("NVIDIA-")] if label.startswith("NVIDIA-") else [label]
    return tuple(dict.fromkeys(out))


DEFAULT_PRODUCT_LABELS: dict[str, tuple[str, ...]] = {
    "A100-40GB": _products("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"),
    "A100-80GB": _products("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"),
    "H100-80GB": _products("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe"),
    "H100-94GB": _products("NVIDIA H100 NVL"),
    "H200-141GB": _products("NVIDIA H200", "NVIDIA H200 NVL"),
    "A30-24GB": _products("NVIDIA A30"),
    "A10-24GB": _products("NVIDIA A10"),
    "A40-48GB": _products("NVIDIA A40"),
    "L4-24GB": _products("NVIDIA L4"),
    "L40-48GB": _products("NVIDIA L40"),
    "L40S-48GB": _products("NVIDIA L40S"),
    "T4-16GB": _products("Tesla T4"),
    "V100-16GB": _products("Tesla V100-SXM2-16GB", "Tesla V100-PCIE-16GB"),
    "V100-32GB": _products("Tesla V100-SXM2-32GB", "Tesla V100-PCIE-32GB"),
}
"""``nvidia.com/gpu.product`` values by gpupool model key, for the usual SXM and PCIe boards."""


# -- resources ----------------------------------------------------------------------------------
def mig_resource(profile: str) -> str:
    """The device plugin's resource for a MIG profile: ``3g.40gb`` is ``nvidia.com/mig-3g.40gb``,
    ``1g.10gb+me`` is ``nvidia.com/mig-1g.10gb.me``."""
    name = profile.strip().lower().removeprefix("mig-")
    return MIG_RESOURCE_PREFIX + name.replace("+", ".")


def gpu_equivalents(model: str, replicas: int = 0) -> dict[str, int]:
    """What one unit of each device-plugin resource costs on ``model``, in thousandths of a
    GPU-equivalent: ``nvidia.com/gpu`` is 1000, ``nvidia.com/mig-3g.40gb`` 500 on an H100-80GB;
    with ``replicas`` (GPUs shared by time-slicing or MPS into that many) ``nvidia.com/gpu.shared``
    is one replica, ``1000 // replicas``, what the ledger charges for a share there. The Helm
    chart's Kueue resource transformations are generated from this without replicas (one source
    of truth with the hub's own quota arithmetic; a replica count is a node's, not a model's)."""
    out = {GPU_RESOURCE: GPU_MILLI}
    geometry = GEOMETRIES.get(model)
    if geometry is not None:
        for profile in geometry.profiles:
            out[mig_resource(profile.name)] = geometry.cost_milli(profile)
    if replicas > 1:
        out[SHARED_RESOURCE] = GPU_MILLI // replicas
    return out


@dataclass(frozen=True)
class ShareRequests:
    """What a pod asks for one share of each GPU the platform shares out (see *share request*)."""

    gpus: Mapping[str, GPU] = field(default_factory=dict)
    """The shared GPUs by UUID."""
    hami: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_HAMI_RESOURCES))
    hami_scheduler: str = DEFAULT_HAMI_SCHEDULER
    """The scheduler of *HAMi share pods* (``""``: leave the pod's)."""

    @classmethod
    def of(
        cls,
        inventory: Inventory | None,
        hami: Mapping[str, str] | None = None,
        hami_scheduler: str = DEFAULT_HAMI_SCHEDULER,
    ) -> ShareRequests:
        gpus = {g.uuid: g for g in inventory.gpus if g.share_resource} if inventory else {}
        return cls(gpus, dict(hami or DEFAULT_HAMI_RESOURCES), hami_scheduler)

    def hami_gpus(self, allocation: Allocation | None) -> list[str]:
        """The UUIDs of the HAMi GPUs ``allocation`` holds shares of (distinct, in order)."""
        found = [
            d.gpu
            for d in (allocation.devices if allocation else ())
            if d.share_milli is not None
            and (gpu := self.gpus.get(d.gpu)) is not None
            and gpu.share_resource == HAMI
        ]
        return list(dict.fromkeys(found))

    def resources(self, device: Device) -> dict[str, int]:
        """The extended resources of one share ``device``."""
        gpu = self.gpus.get(device.gpu)
        milli = device.share_milli or 0
        if gpu is None or not gpu.share_resource:
            return {GPU_RESOURCE: 1}
        if gpu.share_resource != HAMI:
            return {gpu.share_resource: 1}
        out = {self.hami["count"]: 1, self.hami["memory"]: milli * gpu.memory_mib // GPU_MILLI}
        if self.hami.get("cores"):
            out[self.hami["cores"]] = min(100, max(1, -(-milli // 10)))
        return out


NO_SHARES = ShareRequests()


def check_hami_resources(value: Any, key: str) -> dict[str, str]:
    """``value`` if it maps ``count`` and ``memory`` (and optionally ``cores``) to extended
    resource names, else a :class:`gpupool.declarations.ConfigError` naming ``key``."""
    from gpupool.declarations import ConfigError

    example = '{"count": "nvidia.com/gpu", "memory": "nvidia.com/gpumem"}'
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a dict like {example}, got {value!r}")
    unknown = sorted(set(map(str, value)) - set(HAMI_KEYS))
    missing = [k for k in ("count", "memory") if k not in value]
    if unknown or missing:
        what = f"unknown keys {unknown}" if unknown else f"missing {missing}"
        raise ConfigError(key, f"{what}: use {', '.join(HAMI_KEYS)}, e.g. {example}")
    for k, name in value.items():
        if not isinstance(name, str) or not re.fullmatch(EXTENDED_RESOURCE, name):
            raise ConfigError(
                f"{key}[{k!r}]", f"{name!r} is not a resource name like 'nvidia.com/gpumem'"
            )
    return {str(k): str(v) for k, v in value.items()}


def share_annotations(
    allocations: Sequence[Allocation | None], shares: ShareRequests = NO_SHARES
) -> dict[str, str]:
    """The pod annotations pinning *HAMi share pods* of ``allocations`` (one pod's, or a job's
    whose pods share one template) to the ledger's GPUs: ``{"nvidia.com/use-gpuuuid":
    "GPU-…[,GPU-…]"}``, or ``{}`` (no HAMi share, or only synthetic UUIDs)."""
    uuids = [
        u for a in allocations for u in shares.hami_gpus(a) if not u.startswith(SYNTHETIC_PREFIX)
    ]
    return {HAMI_USE_UUID: ",".join(dict.fromkeys(uuids))} if uuids else {}


def check_scheduler_name(value: str, key: str) -> str:
    """``value`` if it is empty or a scheduler name a pod may carry (a DNS subdomain), else a
    :class:`gpupool.declarations.ConfigError` naming ``key``."""
    from gpupool.declarations import ConfigError

    if value and not (len(value) <= 253 and re.fullmatch(DNS_SUBDOMAIN, value)):
        raise ConfigError(
            key,
            f"{value!r} is not a scheduler name (lowercase letters, digits, '-' and '.'), "
            f"e.g. {DEFAULT_HAMI_SCHEDULER!r}",
        )
    return value


def gpu_resources(offer: Offer | None, count: int = 1) -> dict[str, str]:
    """The extended resources ``count`` of ``offer`` need: ``{"nvidia.com/gpu": "2"}``,
    ``{"nvidia.com/mig-3g.40gb": "1"}``, or ``{}`` for a ``cpu`` offer (or none)."""
    if offer is None or offer.kind == "cpu" or count < 1:
        return {}
    if offer.kind == "gpu":
        return {GPU_RESOURCE: str(count)}
    if not offer.profile:
        raise ValueError(f"MIG offer {offer.name!r} names no profile")
    return {mig_resource(offer.profile): str(count)}


def allocation_resources(
    allocation: Allocation | None, shares: ShareRequests = NO_SHARES
) -> dict[str, str]:
    """The extended resources that an allocation's devices are: what the pod must request (a
    share: its *share request*)."""
    counts: Counter[str] = Counter()
    for device in allocation.devices if allocation else ():
        if device.share_milli is not None:
            counts.update(shares.resources(device))
        else:
            counts[GPU_RESOURCE if device.profile is None else mig_resource(device.profile)] += 1
    return {name: str(n) for name, n in sorted(counts.items())}


def with_resources(
    resources: V1ResourceRequirements | None, gpu: Mapping[str, str]
) -> V1ResourceRequirements:
    """A copy of ``resources`` whose ``nvidia.com/*`` limits and requests are exactly ``gpu``
    (extended resources may not be overcommitted: requests equal limits)."""
    limits = _without_nvidia((resources.limits if resources else None) or {})
    requests = _without_nvidia((resources.requests if resources else None) or {})
    limits.update(gpu)
    requests.update(gpu)
    return V1ResourceRequirements(
        limits=limits or None,
        requests=requests or None,
        claims=copy.deepcopy(resources.claims) if resources else None,
    )


def _without_nvidia(quantities: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in quantities.items() if not k.startswith(NVIDIA_PREFIX)}


# -- node affinity ------------------------------------------------------------------------------
def product_values(model: str, product_labels: Mapping[str, Sequence[str]]) -> list[str]:
    """The ``nvidia.com/gpu.product`` values of a model key; ``ValueError`` naming the setting
    to fix when the mapping has none."""
    values = list(dict.fromkeys(product_labels.get(model, ())))
    if not values:
        raise ValueError(
            f"no {PRODUCT_LABEL} values known for GPU model {model!r}; set "
            f"c.KubeGPUSettings.gpu_product_labels = {{{model!r}: ['NVIDIA-…']}} "
            "(see `kubectl get nodes -L nvidia.com/gpu.product`)"
        )
    return values


def product_labels_in_force(
    inventory: Inventory | None, overrides: Mapping[str, Sequence[str]]
) -> dict[str, tuple[str, ...]]:
    """Model key → ``nvidia.com/gpu.product`` values: :data:`DEFAULT_PRODUCT_LABELS`, plus the
    products a Kubernetes ``inventory`` saw on the nodes, with ``overrides`` (the
    ``gpu_product_labels`` setting) replacing both per model."""
    labels = {model: list(values) for model, values in DEFAULT_PRODUCT_LABELS.items()}
    if inventory is not None and inventory.source == "kubernetes":
        for gpu in inventory.gpus:
            if gpu.product_name and gpu.product_name not in labels.get(gpu.model, []):
                labels.setdefault(gpu.model, []).append(gpu.product_name)
    for model, values in overrides.items():
        labels[model] = [values] if isinstance(values, str) else list(values)
    return {model: tuple(values) for model, values in labels.items()}


def check_product_labels(value: Any, key: str) -> dict[str, list[str]]:
    """``value`` as model key → label values (a single string becomes a list of one) if each
    entry is one or more non-empty strings, else a :class:`gpupool.declarations.ConfigError`
    naming ``key`` and the model."""
    from gpupool.declarations import ConfigError

    out: dict[str, list[str]] = {}
    for model, labels in value.items():
        values = [labels] if isinstance(labels, str) else labels
        if not isinstance(values, list | tuple) or not all(
            isinstance(v, str) and v for v in values
        ):
            raise ConfigError(
                f"{key}[{model!r}]",
                f"must be a list of label values like ['NVIDIA-H100-80GB-HBM3'], got {labels!r}",
            )
        out[str(model)] = list(values)
    return out


def product_requirement(
    model: str, product_labels: Mapping[str, Sequence[str]]
) -> V1NodeSelectorRequirement:
    """``nvidia.com/gpu.product In [values]`` for a model key."""
    return V1NodeSelectorRequirement(
        key=PRODUCT_LABEL, operator="In", values=product_values(model, product_labels)
    )


def node_name_requirement(node: str) -> V1NodeSelectorRequirement:
    """``metadata.name In [node]``: a node field requirement (one value only)."""
    return V1NodeSelectorRequirement(key=NODE_NAME_FIELD, operator="In", values=[node])


def product_affinity(
    model: str | None,
    product_labels: Mapping[str, Sequence[str]] = DEFAULT_PRODUCT_LABELS,
    base: V1Affinity | None = None,
    nodes: Sequence[str] = (),
) -> V1Affinity | None:
    """``base`` (copied) with its required node terms constrained to ``model``'s GPU products
    and, with ``nodes``, bound to those nodes.

    Any ``nvidia.com/gpu.product`` expression and ``metadata.name`` field requirement already in
    ``base`` is dropped first (gpupool owns them); the model's requirement is then ANDed into
    every required term (or becomes the one term), and with ``nodes`` each term becomes one term
    per node, with that node's ``metadata.name`` requirement. ``model=None`` and no ``nodes``
    only drops. Returns ``None`` when nothing is left.
    """
    affinity = copy.deepcopy(base) or V1Affinity()
    node = affinity.node_affinity or V1NodeAffinity()
    terms = _terms_without_owned(node.required_during_scheduling_ignored_during_execution)
    if model is not None or nodes:
        added = [product_requirement(model, product_labels)] if model is not None else []
        terms = [
            V1NodeSelectorTerm(
                match_expressions=[*(t.match_expressions or []), *copy.deepcopy(added)] or None,
                match_fields=[*copy.deepcopy(t.match_fields or []), *fields] or None,
            )
            for t in terms or [V1NodeSelectorTerm()]
            for fields in ([[node_name_requirement(n)] for n in dict.fromkeys(nodes)] or [[]])
        ]
    selector = V1NodeSelector(node_selector_terms=terms) if terms else None
    # (the client's models type their fields without None, which is how a field is unset: the
    # ignores below say so to mypy)
    node.required_during_scheduling_ignored_during_execution = selector  # type: ignore[assignment]
    has_node = node.required_during_scheduling_ignored_during_execution or (
        node.preferred_during_scheduling_ignored_during_execution
    )
    affinity.node_affinity = node if has_node else None  # type: ignore[assignment]
    if not (affinity.node_affinity or affinity.pod_affinity or affinity.pod_anti_affinity):
        return None
    return affinity


def _terms_without_owned(selector: V1NodeSelector | None) -> list[V1NodeSelectorTerm]:
    """The selector's terms without product expressions and node name fields; terms left empty
    are dropped (a term made of gpupool's constraints alone was gpupool's, or an earlier spawn's),
    and so are repeats (one term per node of an earlier binding)."""
    out = []
    for term in selector.node_selector_terms if selector else []:
        # KubeSpawner converts only the outer objects of its config: nested ones may be dicts
        term = get_k8s_model(V1NodeSelectorTerm, term)
        expressions = [
            get_k8s_model(V1NodeSelectorRequirement, e) for e in term.match_expressions or []
        ]
        fields = [get_k8s_model(V1NodeSelectorRequirement, f) for f in term.match_fields or []]
        kept = [e for e in expressions if e.key != PRODUCT_LABEL]
        kept_fields = [f for f in fields if f.key != NODE_NAME_FIELD]
        if kept or kept_fields:
            left = V1NodeSelectorTerm(
                match_expressions=kept or None, match_fields=kept_fields or None
            )
            if left not in out:
                out.append(left)
    return out


def bound_nodes(allocations: Sequence[Allocation | None]) -> list[str]:
    """The nodes GPU pods of these allocations must run on (distinct, in order); empty when any
    allocation has no devices or no node (a CPU pod, or an inventory without node names)."""
    if not allocations or any(a is None or not a.devices or not a.node for a in allocations):
        return []
    return list(dict.fromkeys(a.node for a in allocations if a is not None and a.node))


# -- labels and tolerations ---------------------------------------------------------------------
def label_value(text: str) -> str:
    """``text`` if it is a valid label value, else KubeSpawner's safe slug of it."""
    return text if is_valid_label(text) else safe_slug(text, is_valid=is_valid_label)


def queue_name(template: str, allocation: Allocation) -> str:
    """The Kueue ``LocalQueue`` name for an allocation: ``template`` with ``{team}``,
    ``{offer}`` and ``{user}`` filled in, made a valid label value."""
    return label_value(
        template.format(team=allocation.team, offer=allocation.offer, user=allocation.user)
    )


def gpu_labels(
    allocation: Allocation | None, kueue_queue_template: str = "", kueue_priority_class: str = ""
) -> dict[str, str]:
    """gpupool's labels for an allocation's pod; the Kueue queue label only on GPU pods and only
    with a template (a CPU pod waiting on a GPU team's queue would be a spawn that hangs), and
    the Kueue priority class label only beside a queue label (Kueue ignores it otherwise)."""
    if allocation is None:
        return {}
    labels = {
        TEAM_LABEL: label_value(allocation.team),
        OFFER_LABEL: label_value(allocation.offer),
        ALLOCATION_LABEL: label_value(allocation.id),
    }
    if kueue_queue_template and allocation.devices:
        labels[KUEUE_QUEUE_LABEL] = queue_name(kueue_queue_template, allocation)
        if kueue_priority_class:
            labels[KUEUE_PRIORITY_LABEL] = kueue_priority_class
    return labels


def tolerations_for(
    base: Sequence[V1Toleration] | None,
    gpu_tolerations: Sequence[Mapping[str, Any] | V1Toleration],
    gpu: bool,
) -> list[V1Toleration] | None:
    """``base`` without any toleration for a GPU toleration's key, plus (on GPU pods) the GPU
    tolerations themselves."""
    wanted = [get_k8s_model(V1Toleration, t) for t in gpu_tolerations]
    keys = {t.key for t in wanted}
    base_models = [get_k8s_model(V1Toleration, t) for t in base or []]
    kept = [copy.deepcopy(t) for t in base_models if t.key not in keys]
    result = kept + (wanted if gpu else [])
    return result or None


def check_tolerations(value: Any, key: str) -> list[dict[str, Any]]:
    """``value`` if it is a list of tolerations (API JSON maps of Toleration fields, camelCase),
    else a :class:`gpupool.declarations.ConfigError` naming ``key``."""
    from gpupool.declarations import ConfigError

    mapping = V1Toleration.attribute_map  # type: ignore[attr-defined]
    known = {*mapping, *mapping.values()}  # camelCase, as the API; snake_case, as the client
    for i, toleration in enumerate(value):
        if not isinstance(toleration, Mapping) or not set(map(str, toleration)) <= known:
            raise ConfigError(
                f"{key}[{i}]",
                f"{toleration!r} is not a toleration like {dict(DEFAULT_GPU_TOLERATIONS[0])} "
                f"(fields: {', '.join(sorted(mapping.values()))})",
            )
    return [dict(t) for t in value]


# -- the pod ------------------------------------------------------------------------------------
def notebook_container(pod: V1Pod) -> V1Container:
    """The container JupyterLab runs in (KubeSpawner names it ``notebook``)."""
    containers = pod.spec.containers if pod.spec else None
    if not containers:
        raise ValueError("the pod has no containers")
    return next((c for c in containers if c.name == NOTEBOOK_CONTAINER), containers[0])


def apply_allocation(
    pod: V1Pod,
    allocation: Allocation | None,
    offer: Offer | None,
    *,
    tolerations: Sequence[Mapping[str, Any] | V1Toleration] = DEFAULT_GPU_TOLERATIONS,
    priority_class_name: str = "",
    scheduler_name: str = "",
    product_labels: Mapping[str, Sequence[str]] = DEFAULT_PRODUCT_LABELS,
    kueue_queue_template: str = "",
    kueue_priority_class: str = "",
    bind_to_node: bool = True,
    nodes: Sequence[str] | None = None,
    shares: ShareRequests = NO_SHARES,
) -> V1Pod:
    """A copy of ``pod`` made to carry ``allocation`` (see the module's contract).

    The GPU resources come from the allocation's devices (what the pool accounted), the model
    constraint from the offer's ``model``, the node binding from ``allocation.node`` (or
    ``nodes``, for a job whose pods share one template; ``bind_to_node=False`` leaves it out);
    priority class and scheduler name are set on GPU pods when given, and otherwise left as
    KubeSpawner made them. ``shares`` says what a share asks for (see *share request*), and a
    *HAMi share pod* goes to HAMi's scheduler, pinned to the ledger's GPU.
    """
    out = copy.deepcopy(pod)
    resources = allocation_resources(allocation, shares)
    gpu = bool(resources)
    container = notebook_container(out)
    container.resources = with_resources(container.resources, resources)
    container.env = _visibility_env(container.env, gpu)  # type: ignore[assignment]
    spec, meta = out.spec, out.metadata
    model = offer.model if gpu and offer is not None else None
    bound: list[str] = []
    if gpu and bind_to_node:
        bound = list(nodes) if nodes is not None else bound_nodes([allocation])
    spec.affinity = product_affinity(model, product_labels, spec.affinity, bound)  # type: ignore[assignment]
    if spec.node_selector:
        selector = {k: v for k, v in spec.node_selector.items() if k != PRODUCT_LABEL}
        spec.node_selector = selector or None  # type: ignore[assignment]
    spec.tolerations = tolerations_for(spec.tolerations, tolerations, gpu)  # type: ignore[assignment]
    if gpu and priority_class_name:
        spec.priority_class_name = priority_class_name
    if gpu and scheduler_name:
        spec.scheduler_name = scheduler_name
    if shares.hami_gpus(allocation) and shares.hami_scheduler:
        spec.scheduler_name = shares.hami_scheduler
    stale = (GPUPOOL_LABEL_PREFIX, KUEUE_QUEUE_LABEL, KUEUE_PRIORITY_LABEL)
    labels = {k: v for k, v in (meta.labels or {}).items() if not k.startswith(stale)}
    labels.update(gpu_labels(allocation, kueue_queue_template, kueue_priority_class))
    meta.labels = labels
    annotations = {k: v for k, v in (meta.annotations or {}).items() if k != HAMI_USE_UUID}
    annotations.update(share_annotations([allocation], shares))
    meta.annotations = annotations or None  # type: ignore[assignment]
    return out


# -- hardening ----------------------------------------------------------------------------------
def run_as_user(container: Mapping[str, Any] | None, pod: Mapping[str, Any] | None) -> int | None:
    """The user a container is set to run as (its own ``runAsUser``, else the pod's); None
    where neither says (the image's ``USER`` decides)."""
    for context in (container or {}, pod or {}):
        if context.get("runAsUser") is not None:
            return int(context["runAsUser"])
    return None


def hardened_context(container: Mapping[str, Any] | None) -> dict[str, Any]:
    """A job container's securityContext: ``container``'s (user, groups, SELinux, read-only
    root...) with :data:`HARDENING` over it, without :data:`GRANTING_FIELDS`; capabilities are
    all dropped, none added."""
    out = {k: copy.deepcopy(v) for k, v in (container or {}).items() if k not in GRANTING_FIELDS}
    return out | copy.deepcopy(HARDENING)


def hardened_pod_context(pod: Mapping[str, Any] | None) -> dict[str, Any]:
    """A job pod's securityContext: ``pod``'s (fsGroup, supplemental groups, user...) with the
    pod-level fields of :data:`HARDENING` over it."""
    forced = {k: v for k, v in HARDENING.items() if k in POD_LEVEL_FIELDS}
    return copy.deepcopy(dict(pod or {})) | copy.deepcopy(forced)


def filled_context(
    container: Mapping[str, Any] | None,
    pod: Mapping[str, Any] | None,
    fields: Mapping[str, Any] = HARDENING,
) -> dict[str, Any]:
    """A notebook container's securityContext: ``container``'s, plus each of ``fields`` that
    neither it nor (for :data:`POD_LEVEL_FIELDS`) ``pod`` sets (see *hardening*)."""
    out = copy.deepcopy(dict(container or {}))
    pod = pod or {}
    for key, value in fields.items():
        if value is None:
            continue  # dropped (as a profile's override drops a key)
        if out.get(key) is not None or (key in POD_LEVEL_FIELDS and pod.get(key) is not None):
            continue  # the admin's
        if key == "runAsNonRoot" and run_as_user(out, pod) == 0:
            continue  # the admin's too: root, said outright
        out[key] = copy.deepcopy(value)
    return out


def harden_notebook(pod: V1Pod, fields: Mapping[str, Any] = HARDENING) -> V1Pod:
    """A copy of ``pod`` whose notebook container has ``fields`` filled in
    (:func:`filled_context`); init and other containers are left as they are (z2jh's
    ``block-cloud-metadata`` must run as root)."""
    out = copy.deepcopy(pod)
    container = notebook_container(out)
    context = filled_context(
        to_json(container.security_context), to_json(out.spec.security_context), fields
    )
    container.security_context = context or None  # type: ignore[assignment]  # as KubeSpawner
    return out


def check_hardening(value: Any, key: str) -> dict[str, Any]:
    """``value`` if it is a map of container securityContext fields (camelCase), else a
    :class:`gpupool.declarations.ConfigError` naming ``key``."""
    from gpupool.declarations import ConfigError

    known = set(V1SecurityContext.attribute_map.values())  # type: ignore[attr-defined]
    if not isinstance(value, Mapping):
        raise ConfigError(key, f"must be a map of securityContext fields, got {value!r}")
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise ConfigError(
            key,
            f"{', '.join(unknown)}: no securityContext field (camelCase, such as runAsNonRoot "
            "or seccompProfile)",
        )
    return dict(value)


def to_json(obj: Any) -> Any:
    """``kubernetes_asyncio`` models (or plain API JSON, or a mix, as KubeSpawner leaves them)
    as API JSON (what ``ApiClient.sanitize_for_serialization`` sends), without an
    ``ApiClient``."""
    if obj is None or isinstance(obj, str | int | float | bool):
        return obj
    if isinstance(obj, list | tuple):
        return [to_json(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    return {
        obj.attribute_map[attr]: to_json(getattr(obj, attr))
        for attr in obj.openapi_types
        if getattr(obj, attr) is not None
    }


_PRIMITIVE = {"str", "int", "float", "bool", "object", "date", "datetime"}


def to_model(klass: type | str, data: Any) -> Any:
    """API JSON as ``kubernetes_asyncio`` models (``klass`` a model class or the client's type
    string, such as ``"list[V1Toleration]"``); keys the model does not know are left out."""
    if data is None:
        return None
    if isinstance(klass, str):
        if klass.startswith("list["):
            return [to_model(klass[5:-1], item) for item in data]
        if klass.startswith("dict("):
            value_type = klass[5:-1].split(", ", 1)[1]
            return {k: to_model(value_type, v) for k, v in data.items()}
        if klass in _PRIMITIVE:
            return data
    model: Any = getattr(k8s_models, klass) if isinstance(klass, str) else klass
    if not hasattr(model, "openapi_types"):
        return data
    attrs = {key: attr for attr, key in model.attribute_map.items()}
    return model(
        **{
            attrs[k]: to_model(model.openapi_types[attrs[k]], v)
            for k, v in data.items()
            if k in attrs
        }
    )


def _visibility_env(env: Sequence[V1EnvVar] | None, gpu: bool) -> list[V1EnvVar] | None:
    kept = [e for e in env or [] if e.name not in VISIBILITY_ENV]
    if not gpu:
        kept += [
            V1EnvVar(name="NVIDIA_VISIBLE_DEVICES", value="void"),
            V1EnvVar(name="CUDA_VISIBLE_DEVICES", value=""),
        ]
    return kept or None


def check_queue_template(value: str, key: str) -> str:
    """``value`` if it is a Kueue queue-name template using only :data:`QUEUE_FIELDS`, else a
    :class:`gpupool.declarations.ConfigError` naming ``key``."""
    from gpupool.declarations import ConfigError

    try:
        value.format(**dict.fromkeys(QUEUE_FIELDS, "x"))
    except (KeyError, IndexError, ValueError) as e:
        fields = ", ".join("{" + f + "}" for f in QUEUE_FIELDS)
        raise ConfigError(key, f"{value!r} may use only {fields} ({e!r})") from None
    return value


def check_cohort_name(value: str, key: str) -> str:
    """``value`` if it is a Kueue cohort name (a DNS subdomain), else a
    :class:`gpupool.declarations.ConfigError` naming ``key``."""
    from gpupool.declarations import ConfigError

    if not re.fullmatch(DNS_SUBDOMAIN, value) or len(value) > 253:
        raise ConfigError(
            key, f"{value!r} is not a Kueue cohort name (a DNS subdomain), e.g. 'gpupool'"
        )
    return value


def check_priority_class(value: str, key: str) -> str:
    """``value`` if it is empty or a valid Kueue ``WorkloadPriorityClass`` name to put in a label
    (a DNS subdomain that is also a label value: at most 63 characters), else a
    :class:`gpupool.declarations.ConfigError` naming ``key``."""
    from gpupool.declarations import ConfigError

    if value and not (is_valid_label(value) and re.fullmatch(DNS_SUBDOMAIN, value)):
        raise ConfigError(
            key,
            f"{value!r} is not a WorkloadPriorityClass name (lowercase letters, digits, '-' "
            "and '.', at most 63 characters), e.g. 'gpupool-job'",
        )
    return value
