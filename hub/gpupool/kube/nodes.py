"""GPU discovery on Kubernetes: node capacity (``status.allocatable``) as an Inventory.

Vocabulary
- *node object*: one Node as the Kubernetes API's JSON has it (``metadata.name``,
  ``metadata.labels``, ``spec.unschedulable``, ``spec.taints``, ``status.allocatable``), e.g.
  ``ApiClient().sanitize_for_serialization(node)`` of a ``kubernetes_asyncio`` ``V1Node``.
- *GFD labels*: what NVIDIA GPU feature discovery puts on GPU nodes: ``nvidia.com/gpu.product``
  (the NVML product name with dashes, ``NVIDIA-H100-80GB-HBM3``), ``nvidia.com/gpu.count``
  (physical GPUs), ``nvidia.com/gpu.memory`` (MiB per GPU), ``nvidia.com/mig.strategy``
  (``none``, ``single`` or ``mixed``) and ``nvidia.com/mig.config`` (the mig-parted layout name).
- *device-plugin resources*: ``nvidia.com/gpu`` counts whole GPUs; under the ``mixed`` MIG strategy
  ``nvidia.com/mig-<profile>`` counts the node's MIG instances of one profile (a ``+me`` profile
  shows as ``.me``: ``nvidia.com/mig-1g.10gb.me``).
- *shared node*: a node whose GPUs the device plugin shares (time-slicing or MPS): GFD labels
  ``nvidia.com/gpu.replicas=N`` (N above 1), ``nvidia.com/gpu.sharing-strategy`` (``time-slicing``
  or ``mps``) and, unless the plugin renames the resource, a ``-SHARED`` product. Its replicas are
  the resource ``nvidia.com/gpu.shared`` (``renameByDefault: true``; ``nvidia.com/gpu`` is then
  0) or ``nvidia.com/gpu`` itself (``renameByDefault: false``): ``gpu.count × N`` of them. Each of
  its GPUs becomes a GPU with MIG ``off`` that takes *shares only* (never a whole-GPU request: the
  plugin cannot give one), split into N *replicas* of ``gpu.memory / N`` MiB each; a share there
  takes one whole replica (costs ``1000 // N`` milli) and fits only within one (the plugin cannot
  promise two replicas on one GPU: ``failRequestsGreaterThanOne``, and MPS allows one per pod).
  The GPU's *share resource* is the resource a pod requests one of.
- *HAMi node*: a node whose device plugin is HAMi's (annotation ``hami.io/node-nvidia-register``,
  where ``nvidia.com/gpu`` counts ``deviceSplitCount`` virtual GPUs per GPU). Its GPUs take shares
  only, by memory (HAMi caps each pod's memory), at most ``deviceSplitCount`` of them each (the
  GPU's *share slots*: the annotation's ``count``, else ``nvidia.com/gpu`` over the GPUs); their
  share resource is ``hami``: a pod asks for ``nvidia.com/gpu: 1`` and
  ``nvidia.com/gpumem: <MiB>`` (:mod:`gpupool.kube.pods`). Its GPUs' UUIDs are HAMi's own, the
  ``id`` of each device in the annotation (the NVML UUID, ``GPU-…``), so that a share's pod can
  name the ledger's GPU to HAMi's scheduler (``nvidia.com/use-gpuuuid``); where the annotation
  gives no distinct ids (or another node already has one), they are synthetic, with a note.
- *packing*: the node says how many instances of each profile it has, not which GPU holds which.
  :func:`pack_instances` rebuilds one valid layout with :meth:`Geometry.fit`, on ``gpu.count``
  minus the whole GPUs when the label is there, else on the fewest GPUs that hold them.

Contract: :func:`inventory_from_nodes` is pure: the same node objects give the same inventory,
with synthetic, stable UUIDs (``k8s-<node>-gpu<i>``, ``k8s-<node>-gpu<i>-mig<start>``; HAMi
nodes' GPUs: HAMi's UUIDs, see above) and gpupool's own GPU indexes (the device plugin, not
gpupool, picks the physical device; HAMi picks the one a pod names). Whole GPUs have MIG mode
``off`` and share resource ``""`` (the device plugin gives them only whole: they take no
shares); GPUs holding MIG resources are ``fixed`` with their packed instances. GPUs of shared
and HAMi nodes take shares only (see above), with a note per node saying how it is shared; a
shared node whose replicas cannot be made sense of (no product or memory label, a replica count
that does not divide its resource, MIG resources shared too) is left out with a note saying why.
Nodes that are not ready (:func:`not_ready_reason`, with a note saying why), unschedulable
(cordoned) nodes and nodes without NVIDIA resources are left out. Nodes under the ``single`` MIG
strategy are left out with a note (their ``nvidia.com/gpu`` are MIG devices, which gpupool's
offers cannot name). Other taints are not judged here, only noted: the spawner's tolerations
decide, except for Kubernetes' own condition taints (``node.kubernetes.io/*``), noted as passing,
never to be tolerated. No I/O here: reading the nodes from the API server (and listing and
watching them for the reconciler) is :mod:`gpupool.kube.api`.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

from gpupool.core.inventory import GPU, Inventory, MigInstance, Node, model_key
from gpupool.core.mig import GEOMETRIES, Geometry, Profile

GPU_RESOURCE = "nvidia.com/gpu"
SHARED_RESOURCE = "nvidia.com/gpu.shared"
HAMI = "hami"
HAMI_ANNOTATION = "hami.io/node-nvidia-register"
SYNTHETIC_PREFIX = "k8s-"
"""How the inventory's own (synthetic) GPU UUIDs start; a device plugin's real ones do not."""
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
MEMORY_LABEL = "nvidia.com/gpu.memory"
MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
SHARING_LABEL = "nvidia.com/gpu.sharing-strategy"
SHARED_SUFFIX = "-SHARED"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
OUT_OF_SERVICE_TAINT = "node.kubernetes.io/out-of-service"
LOST_TAINTS = (NOT_READY_TAINT, UNREACHABLE_TAINT, OUT_OF_SERVICE_TAINT)
"""Taints of a node that cannot run pods: the node lifecycle controller's, put on with a Ready
condition ``False`` (``not-ready``) or ``Unknown`` (``unreachable``), ``NoSchedule`` and
``NoExecute`` (``pkg/controller/nodelifecycle/node_lifecycle_controller.go``), and the one an admin
puts on a node that is shut down (``out-of-service``, non-graceful node shutdown)."""
CONDITION_TAINT_PREFIX = "node.kubernetes.io/"
MAX_GPUS_PER_NODE = 64

Layout = list[tuple[Profile, int]]


# -- pure: node objects to an inventory ------------------------------------------------------
def inventory_from_nodes(nodes: Iterable[Mapping[str, Any]]) -> Inventory:
    """The pool's inventory from node objects (see the module docstring), nodes by name."""
    return assemble(node_part(obj) for obj in sorted(nodes, key=_name))


@dataclass(frozen=True)
class NodePart:
    """What one node gives the inventory, built from that node alone (:func:`node_part`): its
    GPUs (``None``: left out) and its notes, and whether it is ready (:func:`not_ready_reason`).
    A node watch event rebuilds the changed node's part only; :func:`assemble` joins them."""

    name: str
    node: Node | None
    notes: tuple[str, ...]
    ready: bool


def node_part(obj: Mapping[str, Any]) -> NodePart:
    """The :class:`NodePart` of one node object (its :func:`inventory_view` is what is read)."""
    view = inventory_view(obj)
    notes: list[str] = []
    node = _node(view, notes)
    return NodePart(_name(view), node, tuple(notes), not_ready_reason(view) is None)


def assemble(parts: Iterable[NodePart]) -> Inventory:
    """The inventory of nodes' parts, given in name order: the nodes and their notes, then the
    renaming of GPU UUIDs a node shares with an earlier one (the only rule across nodes)."""
    parts = list(parts)
    notes = [note for p in parts for note in p.notes]
    built = _distinct_uuids([p.node for p in parts], notes)
    return Inventory(
        tuple(n for n in built if n is not None),
        source="kubernetes",
        simulated=False,
        notes=tuple(notes),
    )


INVENTORY_LABELS = (
    PRODUCT_LABEL,
    COUNT_LABEL,
    MEMORY_LABEL,
    MIG_STRATEGY_LABEL,
    MIG_CONFIG_LABEL,
    REPLICAS_LABEL,
    SHARING_LABEL,
)
"""The labels the inventory reads (not GFD's ``nvidia.com/gfd.timestamp``, rewritten every 60 s)."""


def inventory_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a node object the inventory reads, and nothing else: its name, the
    :data:`INVENTORY_LABELS`, HAMi's register annotation, ``spec.unschedulable`` and
    ``spec.taints``, the ``nvidia.com/`` resources of ``status.allocatable`` and the ``Ready``
    condition's status, reason and message (not its heartbeat). :func:`inventory_from_nodes`
    builds from this view only, so two nodes with equal views give the same inventory: the
    reconciler skips a watch event that leaves the view as it was (GFD's timestamp label, the
    kubelet's heartbeat, any other controller's labels or annotations)."""
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    status = obj.get("status") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    allocatable = status.get("allocatable") or {}
    return {
        "metadata": {
            "name": meta.get("name", ""),
            "labels": {k: labels[k] for k in INVENTORY_LABELS if k in labels},
            "annotations": {k: annotations[k] for k in (HAMI_ANNOTATION,) if k in annotations},
        },
        "spec": {
            "unschedulable": bool(spec.get("unschedulable")),
            "taints": [
                {k: t[k] for k in ("key", "value", "effect") if k in t}
                for t in spec.get("taints") or []
            ],
        },
        "status": {
            "allocatable": {k: v for k, v in allocatable.items() if k.startswith("nvidia.com/")},
            "conditions": [
                {k: c[k] for k in ("type", "status", "reason", "message") if k in c}
                for c in status.get("conditions") or []
                if c.get("type") == "Ready"
            ],
        },
    }


def mig_profile_name(resource: str) -> str:
    """The MIG profile a device-plugin resource names: ``nvidia.com/mig-1g.10gb.me`` is
    ``1g.10gb+me``."""
    name = resource.removeprefix(MIG_RESOURCE_PREFIX)
    return name[: -len(".me")] + "+me" if name.endswith(".me") else name


def product_model(product: str, memory_mib: int | None) -> tuple[str, int]:
    """gpupool's model key and the memory (MiB) for a GFD product label.

    ``("NVIDIA-H100-80GB-HBM3", 81559)`` gives ``("H100-80GB", 81559)``. Suffixes GFD adds for
    sharing (``-SHARED``) or the single MIG strategy (``-MIG-1g.10gb``) are ignored. Without the
    memory label the size in the product name (``80GB``) stands in.
    """
    base = re.sub(r"-(SHARED|MIG-.*)$", "", product)
    if memory_mib is None:
        sized = re.search(r"(\d+)GB", base, re.I)
        memory_mib = int(sized.group(1)) * 1024 if sized else 0
    return model_key(base, memory_mib), memory_mib


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj.get("metadata", {}).get("name", ""))


def _node(obj: Mapping[str, Any], notes: list[str]) -> Node | None:
    name = _name(obj)
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    allocatable: Mapping[str, Any] = (obj.get("status") or {}).get("allocatable") or {}
    whole = _count(allocatable.get(GPU_RESOURCE), f"{name}: {GPU_RESOURCE}", notes)
    replicas = _count(allocatable.get(SHARED_RESOURCE), f"{name}: {SHARED_RESOURCE}", notes)
    mig = _mig_counts(name, allocatable, notes)
    hami = HAMI_ANNOTATION in (meta.get("annotations") or {})  # its count may be renamed
    if not whole and not mig and not replicas and not hami:
        return None
    taints = spec.get("taints") or []
    skip = not_ready_reason(obj) or _skip_reason(spec, taints, labels)
    if skip:
        notes.append(f"node {name} {skip}; left out")
        return None
    _note_taints(name, taints, notes)
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    if HAMI_ANNOTATION in annotations:
        return _hami_node(name, labels, annotations[HAMI_ANNOTATION], whole, notes)
    if replicas or shared_reason(labels):
        return _shared_node(name, labels, whole, replicas, mig, notes)
    product = labels.get(PRODUCT_LABEL, "")
    if not product:
        notes.append(
            f"node {name} has NVIDIA resources but no {PRODUCT_LABEL} label (is GPU feature "
            "discovery running?); its GPUs have model 'unknown' and no MIG"
        )
        gpus = [_whole(name, i, "unknown", 0, None, "") for i in range(whole)]
        return Node(name, tuple(gpus))
    memory = _count(labels.get(MEMORY_LABEL), f"{name}: {MEMORY_LABEL}", notes) or None
    model, memory_mib = product_model(product, memory)
    geometry = GEOMETRIES.get(model)
    gpus = [_whole(name, i, model, memory_mib, geometry, product) for i in range(whole)]
    if mig:
        gpus += _mig_gpus(name, labels, whole, mig, model, memory_mib, geometry, product, notes)
    return Node(name, tuple(gpus))


def _skip_reason(
    spec: Mapping[str, Any], taints: list[Mapping[str, Any]], labels: Mapping[str, str]
) -> str | None:
    """Why a GPU node's GPUs cannot be counted, or ``None``."""
    if spec.get("unschedulable") or any(t.get("key") == UNSCHEDULABLE_TAINT for t in taints):
        return "is cordoned (unschedulable)"
    if labels.get(MIG_STRATEGY_LABEL) == "single" and "-MIG-" in labels.get(PRODUCT_LABEL, ""):
        return (
            f"uses the MIG 'single' strategy ({GPU_RESOURCE} are MIG devices there); gpupool "
            "needs the 'mixed' strategy"
        )
    return None


def not_ready_reason(obj: Mapping[str, Any]) -> str | None:
    """Why a node (API JSON) cannot run pods now, or ``None``: ``"is not ready (Ready=Unknown,
    NodeStatusUnknown: Kubelet stopped posting node status.)"`` when its ``Ready`` condition is
    ``False`` or ``Unknown`` (the kubelet's word, or the node lifecycle controller's once the
    kubelet stopped posting), else ``"is not ready (taint node.kubernetes.io/unreachable:
    NoExecute)"`` for a :data:`LOST_TAINTS` taint. A node without a ``Ready`` condition is not
    judged by it."""
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") != "True":
            words = ": ".join(str(w) for w in (c.get("reason"), c.get("message")) if w)
            return f"is not ready (Ready={c.get('status')}{', ' + words if words else ''})"
    for t in (obj.get("spec") or {}).get("taints") or []:
        if t.get("key") in LOST_TAINTS and t.get("effect") in ("NoSchedule", "NoExecute"):
            return f"is not ready (taint {t['key']}:{t['effect']})"
    return None


def shared_reason(labels: Mapping[str, str]) -> str | None:
    """Why a node's GPUs are shared by the NVIDIA device plugin (time-slicing or MPS), or
    ``None``: its ``nvidia.com/gpu`` counts replicas, not GPUs (counting them as whole GPUs would
    hand one GPU to several notebooks as if each had it alone), so its GPUs take shares only."""
    replicas = str(labels.get(REPLICAS_LABEL, "")).strip()
    product = labels.get(PRODUCT_LABEL, "")
    strategy = labels.get(SHARING_LABEL, "")
    why = []
    if replicas.isdigit() and int(replicas) > 1:
        why.append(f"{REPLICAS_LABEL}={replicas}")
    if product.endswith(SHARED_SUFFIX):
        why.append(f"{PRODUCT_LABEL}={product}")
    if strategy in ("time-slicing", "mps"):
        why.append(f"{SHARING_LABEL}={strategy}")
    if not why:
        return None
    return f"shares its GPUs through the NVIDIA device plugin ({', '.join(why)})"


def _shared_node(
    name: str,
    labels: Mapping[str, str],
    whole: int,
    renamed: int,
    mig: Mapping[str, int],
    notes: list[str],
) -> Node | None:
    """The GPUs of a *shared node* (see the module docstring), or ``None`` with a note."""
    resource, total = (SHARED_RESOURCE, renamed) if renamed else (GPU_RESOURCE, whole)
    why = shared_reason(labels) or f"{SHARED_RESOURCE}={renamed}"

    def leave_out(reason: str) -> None:
        notes.append(f"node {name} {why}, but {reason}; left out")

    if mig:
        leave_out("its MIG instances are shared too (gpupool shares only GPUs without MIG)")
        return None
    count = _count(labels.get(COUNT_LABEL), f"{name}: {COUNT_LABEL}", notes)
    replicas = _count(labels.get(REPLICAS_LABEL), f"{name}: {REPLICAS_LABEL}", notes)
    if replicas < 2 and count and total % count == 0:
        replicas = total // count  # no (or a stale) replicas label: what the resource says
    if replicas < 2 or total % replicas:
        leave_out(
            f"its {total}× {resource} are not whole GPUs times a replica count "
            f"({COUNT_LABEL}={count or '?'}, {REPLICAS_LABEL}={replicas or '?'})"
        )
        return None
    product = labels.get(PRODUCT_LABEL, "")
    memory = _count(labels.get(MEMORY_LABEL), f"{name}: {MEMORY_LABEL}", notes) or None
    if not product:
        leave_out(f"it has no {PRODUCT_LABEL} label, so the size of a replica is unknown")
        return None
    model, memory_mib = product_model(product, memory)
    if memory_mib <= 0:
        leave_out(f"it has no {MEMORY_LABEL} label, so the size of a replica is unknown")
        return None
    gpus = total // replicas
    if count and gpus != count:
        notes.append(
            f"node {name}: {total}× {resource} are {gpus} GPU(s) of {replicas} replicas, "
            f"not the {count} of {COUNT_LABEL}; counting {gpus}"
        )
    strategy = labels.get(SHARING_LABEL) or "time-slicing or MPS"
    notes.append(
        f"node {name}: {gpus}× {model} shared by the device plugin ({strategy}) into "
        f"{replicas} replicas of {memory_mib // replicas} MiB ({resource}); they take only "
        "shares, each one replica, and no share larger than a replica"
    )
    return _shares_only(
        name, gpus, model, memory_mib, product, share_resource=resource, share_replicas=replicas
    )


def hami_devices(annotation: str) -> list[tuple[int, str, int]]:
    """``(memory MiB, type, split count)`` of each GPU in HAMi's ``hami.io/node-nvidia-register``
    annotation: a JSON list of ``{"id", "count", "devmem", "devcore", "type", ...}`` (HAMi 2.4
    and later) or the older ``id,count,devmem,devcore,type,numa,health:`` records; ``[]`` when
    unreadable. The split count (``count``: the most pods on the GPU) is 0 when unreadable."""
    try:
        found = json.loads(annotation)
        if isinstance(found, list):
            return [
                (int(d.get("devmem", 0)), str(d.get("type", "")), _count(d.get("count"), "", []))
                for d in found
            ]
    except (ValueError, TypeError, AttributeError):
        pass
    out = []
    for record in annotation.split(":"):
        fields = record.split(",")
        if len(fields) >= 5 and fields[2].strip().isdigit():
            out.append((int(fields[2]), fields[4].strip(), _count(fields[1], "", [])))
    return out


def hami_uuids(annotation: str) -> list[str]:
    """The ``id`` (GPU UUID) of each GPU in HAMi's ``hami.io/node-nvidia-register`` annotation,
    in its order (as :func:`hami_devices` reads it); ``""`` for one without."""
    try:
        found = json.loads(annotation)
        if isinstance(found, list):
            return [str(d.get("id") or "").strip() if isinstance(d, dict) else "" for d in found]
    except (ValueError, TypeError):
        pass
    return [
        record.split(",")[0].strip()
        for record in annotation.split(":")
        if len(record.split(",")) >= 5 and record.split(",")[2].strip().isdigit()
    ]


def _hami_node(
    name: str, labels: Mapping[str, str], annotation: str, whole: int, notes: list[str]
) -> Node | None:
    """The GPUs of a *HAMi node* (see the module docstring), or ``None`` with a note."""
    devices = hami_devices(annotation)
    count = len(devices) or _count(labels.get(COUNT_LABEL), f"{name}: {COUNT_LABEL}", notes)
    product = labels.get(PRODUCT_LABEL) or (devices[0][1].replace(" ", "-") if devices else "")
    label = _count(labels.get(MEMORY_LABEL), f"{name}: {MEMORY_LABEL}", notes)
    memory = label or (devices[0][0] if devices else 0)
    if not count or not product or memory <= 0:
        notes.append(
            f"node {name} runs HAMi ({HAMI_ANNOTATION}), but its GPUs' number, product or "
            "memory cannot be read; left out"
        )
        return None
    model, memory_mib = product_model(product, memory)
    # deviceSplitCount: the most pods HAMi puts on one GPU, whatever their memory
    split = min((d[2] for d in devices), default=0) or whole // count
    # HAMi's count resource renamed (resourceCountName, the chart's kueue.hami): no nvidia.com/gpu
    virtual = (
        f"{whole}× {GPU_RESOURCE} virtual"
        if whole
        else f"{count * split} virtual, under HAMi's own count resource"
    )
    notes.append(
        f"node {name}: {count}× {model} shared by HAMi ({virtual}); "
        f"they take only shares, by memory (nvidia.com/gpumem), at most {split} per GPU"
    )
    labelled = labels.get(PRODUCT_LABEL, "")
    if not labelled:
        notes.append(
            f"node {name} has no {PRODUCT_LABEL} label (is GPU feature discovery running?); "
            "share offers with a model cannot be scheduled there, only those without one"
        )
    node = _shares_only(
        name, count, model, memory_mib, labelled, share_resource=HAMI, share_slots=split
    )
    uuids = hami_uuids(annotation)
    if len(uuids) == count and all(uuids) and len(set(uuids)) == count:
        gpus = tuple(replace(g, uuid=u) for g, u in zip(node.gpus, uuids, strict=True))
        return replace(node, gpus=gpus)
    notes.append(
        f"node {name}: HAMi's annotation ({HAMI_ANNOTATION}) gives no distinct id per GPU, so "
        "shares there cannot be pinned to the ledger's GPU (nvidia.com/use-gpuuuid): HAMi "
        "chooses the GPU, and may place a share where the ledger counted none"
    )
    return node


def _distinct_uuids(built: list[Node | None], notes: list[str]) -> list[Node | None]:
    """``built`` with the GPUs of a node whose (HAMi) UUIDs an earlier node already has renamed
    to synthetic ones, with a note (two nodes cannot hold one GPU)."""
    seen: set[str] = set()
    out: list[Node | None] = []
    for node in built:
        if node is not None and any(g.uuid in seen for g in node.gpus):
            notes.append(
                f"node {node.name} reports GPU UUIDs another node has; they are named "
                f"{SYNTHETIC_PREFIX}{node.name}-gpu<i> here, and shares there are not pinned"
            )
            gpus = tuple(
                replace(g, uuid=f"{SYNTHETIC_PREFIX}{node.name}-gpu{g.index}") for g in node.gpus
            )
            node = replace(node, gpus=gpus)
        if node is not None:
            seen.update(g.uuid for g in node.gpus)
        out.append(node)
    return out


def _shares_only(
    name: str, gpus: int, model: str, memory_mib: int, product: str, **share: Any
) -> Node:
    """A node of ``gpus`` GPUs the platform shares out (``share``: the GPU's share fields)."""
    geometry = GEOMETRIES.get(model)
    return Node(
        name,
        tuple(
            replace(_whole(name, i, model, memory_mib, geometry, product), **share)
            for i in range(gpus)
        ),
    )


def _count(value: Any, what: str, notes: list[str]) -> int:
    """A whole-number quantity or label (``"8"``); 0 with a note when it is not one."""
    if value is None:
        return 0
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    notes.append(f"{what} is {text!r}, not a whole number; read as 0")
    return 0


def _mig_counts(name: str, allocatable: Mapping[str, Any], notes: list[str]) -> dict[str, int]:
    counts = {}
    for resource, value in sorted(allocatable.items()):
        if resource.startswith(MIG_RESOURCE_PREFIX):
            n = _count(value, f"{name}: {resource}", notes)
            if n:
                counts[mig_profile_name(resource)] = n
    return counts


def _note_taints(name: str, taints: list[Mapping[str, Any]], notes: list[str]) -> None:
    for t in taints:
        key, effect = str(t.get("key", "")), t.get("effect")
        if effect not in ("NoSchedule", "NoExecute") or key.startswith("nvidia.com/"):
            continue
        value = f"={t['value']}" if t.get("value") else ""
        if key.startswith(CONDITION_TAINT_PREFIX):  # memory-pressure, disk-pressure, ...
            notes.append(
                f"node {name} has taint {key}{value}:{effect}, which Kubernetes sets while the "
                "node has that condition; its GPUs are counted, and new pods wait there until "
                "it clears (do not tolerate it)"
            )
        else:
            notes.append(
                f"node {name} has taint {key}{value}:{effect}; its GPUs are counted, so give "
                "notebooks a matching toleration (c.KubeGPUSpawner.gpu_tolerations) or select "
                "nodes with inventory = 'kubernetes:<label selector>'"
            )


def _whole(
    node: str, index: int, model: str, memory_mib: int, geometry: Geometry | None, product: str
) -> GPU:
    return GPU(
        uuid=f"{SYNTHETIC_PREFIX}{node}-gpu{index}",
        index=index,
        model=model,
        memory_mib=memory_mib,
        mig_capable=geometry is not None,
        mig_mode="off",
        product_name=product,
        share_resource="",  # the device plugin gives it whole: no shares
    )


def _mig_gpus(
    node: str,
    labels: Mapping[str, str],
    whole: int,
    counts: Mapping[str, int],
    model: str,
    memory_mib: int,
    geometry: Geometry | None,
    product: str,
    notes: list[str],
) -> list[GPU]:
    shown = ", ".join(f"{n}× {p}" for p, n in counts.items())
    if geometry is None:
        notes.append(
            f"node {node}: MIG resources ({shown}) on {model}, a model without MIG geometry "
            "in gpupool; left out"
        )
        return []
    wanted: Counter[Profile] = Counter()
    for name, n in counts.items():
        profile = geometry.resolve(name)
        if profile is None:
            notes.append(f"node {node}: {name} is not a {model} MIG profile; left out")
        else:
            wanted[profile] += n
    total = _count(labels.get(COUNT_LABEL), f"{node}: {COUNT_LABEL}", notes)
    gpus = total - whole if total > whole else None
    layouts = pack_instances(geometry, wanted, gpus)
    if layouts is None:
        on = f"{gpus} MIG GPU(s)" if gpus else f"up to {MAX_GPUS_PER_NODE} GPUs"
        config = labels.get(MIG_CONFIG_LABEL, "unknown")
        notes.append(
            f"node {node}: MIG resources {shown} (mig.config {config}) do not fit {on} of "
            f"{model}; its MIG instances are left out"
        )
        return []
    out = []
    for offset, layout in enumerate(layouts):
        i = whole + offset
        uuid = f"k8s-{node}-gpu{i}"
        instances = tuple(
            MigInstance(p.name, start, f"{uuid}-mig{start}")
            for p, start in sorted(layout, key=lambda ps: ps[1])
        )
        out.append(GPU(uuid, i, model, memory_mib, True, "fixed", instances, product_name=product))
    return out


# -- pure: rebuilding a layout from per-profile counts --------------------------------------
def pack_instances(
    geometry: Geometry, counts: Mapping[Profile, int], gpus: int | None = None
) -> list[Layout] | None:
    """One valid layout of ``counts`` instances on ``gpus`` GPUs (``None``: the fewest that
    hold them), as ``(profile, start)`` lists per GPU, or ``None`` if they do not fit.

    Exhaustive over the layouts one GPU can hold (a few dozen), even shares tried first (as
    mig-parted's ``all-balanced`` gives every GPU the same), with memoised failures, so an 8-GPU
    node is instant. With ``gpus`` given, GPUs beyond those needed come back empty.
    """
    profiles = tuple(sorted((p for p, n in counts.items() if n), key=_largest_first))
    need = tuple(counts[p] for p in profiles)
    if not profiles:
        return [[] for _ in range(gpus or 0)]
    singles = _single_gpu_layouts(geometry, profiles, need)
    if gpus is not None:
        return _search(geometry, profiles, singles, need, gpus)
    for k in range(1, MAX_GPUS_PER_NODE + 1):
        found = _search(geometry, profiles, singles, need, k)
        if found is not None:
            return found
    return None


def _largest_first(p: Profile) -> tuple[int, int, str]:
    return (-p.memory_slots, -p.compute_slices, p.name)


def _single_gpu_layouts(
    geometry: Geometry, profiles: tuple[Profile, ...], need: tuple[int, ...]
) -> list[tuple[int, ...]]:
    """Every non-empty count vector (over ``profiles``) one GPU can hold."""
    found: list[tuple[int, ...]] = []

    def grow(i: int, vector: list[int], slots: int, compute: int) -> None:
        if i == len(profiles):
            if any(vector) and geometry.fit(_expand(profiles, vector)) is not None:
                found.append(tuple(vector))
            return
        p = profiles[i]
        for n in range(min(need[i], p.max_count) + 1):
            s, c = slots + n * p.memory_slots, compute + n * p.compute_slices
            if s > geometry.memory_slots or c > geometry.compute_slices:
                break
            grow(i + 1, [*vector, n], s, c)

    grow(0, [], 0, 0)
    return found


def _expand(profiles: tuple[Profile, ...], vector: Iterable[int]) -> list[Profile]:
    return [p for p, n in zip(profiles, vector, strict=True) for _ in range(n)]


def _search(
    geometry: Geometry,
    profiles: tuple[Profile, ...],
    singles: list[tuple[int, ...]],
    need: tuple[int, ...],
    gpus: int,
) -> list[Layout] | None:
    slots = sum(n * p.memory_slots for n, p in zip(need, profiles, strict=True))
    if slots > gpus * geometry.memory_slots:
        return None

    # the even share first: mig-parted layouts give every GPU the same instances
    share = [n / gpus for n in need]
    weight = [p.memory_slots for p in profiles]
    singles = sorted(
        singles,
        key=lambda v: (
            sum(abs(a - b) for a, b in zip(v, share, strict=True)),
            -sum(a * w for a, w in zip(v, weight, strict=True)),
            v,
        ),
    )

    @cache
    def go(left: tuple[int, ...], k: int, first: int) -> tuple[tuple[int, ...], ...] | None:
        if not any(left):
            return ()
        if k == 0:
            return None
        for j in range(first, len(singles)):
            v = singles[j]
            if all(a <= b for a, b in zip(v, left, strict=True)):
                rest = go(tuple(b - a for a, b in zip(v, left, strict=True)), k - 1, j)
                if rest is not None:
                    return (v, *rest)
        return None

    chosen = go(need, gpus, 0)
    if chosen is None:
        return None
    layouts = [geometry.fit(_expand(profiles, v)) or [] for v in chosen]
    return layouts + [[] for _ in range(gpus - len(layouts))]
