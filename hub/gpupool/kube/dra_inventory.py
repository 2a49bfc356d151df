"""The inventory of a cluster whose GPUs are given through Dynamic Resource Allocation
(``device_allocation = "dra"``): each node's GPUs from NVIDIA's DRA driver's ResourceSlices,
the node's other facts from its Node object (issue 26, section 4).

Vocabulary
- *DRA-only node*: a node where NVIDIA's DRA driver (``gpu.nvidia.com``, NVIDIA/
  k8s-dra-driver-gpu) runs and the device plugin does not, so its Node publishes no
  ``nvidia.com/gpu`` capacity (``status.allocatable``): its GPUs exist only as devices of the
  driver's ResourceSlices. :func:`gpupool.kube.nodes.inventory_from_nodes` would leave it out.
- *slice view* (:func:`slice_view`): the part of a ResourceSlice the inventory reads (its
  name, driver, node, pool and devices), so the reconciler skips a watch event that leaves it as
  it was (as :func:`gpupool.kube.nodes.inventory_view` does for nodes).
- *current slices* (:func:`current_slices`): per pool (driver, pool name), the slices of its
  newest ``spec.pool.generation`` only, as the scheduler's structured allocator gathers them
  (``GatherPools``/``addSlice`` in ``staging/src/k8s.io/dynamic-resource-allocation/
  structured/internal/stable/pools_stable.go``, ``structured/pools.go`` before 1.34: an older
  generation is "out-dated" and ignored; a pool with fewer slices than ``resourceSliceCount`` is
  ``IsIncomplete``). A driver updating a pool bumps its generation and rewrites its slices (the
  ``ResourceSlice`` type's documentation in ``k8s.io/api/resource/v1``; NVIDIA's driver
  publishes one pool per node, named after it, devices by ``GetDevice`` in
  ``cmd/gpu-kubelet-plugin/deviceinfo.go`` of NVIDIA/k8s-dra-driver-gpu), so for a moment both
  generations exist: only the newer counts. An incomplete pool's GPUs are counted as published
  so far, with a note.

Contract: :func:`inventory_from_slices` is pure: the same node objects and slices give the same
inventory. A GPU node is a node (:func:`gpupool.kube.nodes.inventory_view`) with at least one
current slice device of NVIDIA's driver of ``type`` ``gpu`` and a UUID; its GPUs are those
devices in PCI bus order (*node GPUs* of :mod:`gpupool.kube.claims`; index ``i`` is the
``i``-th), each named by its real UUID (``GPU-…``), its model from ``productName`` and the
capacity ``memory`` (offers' model matching), whole (MIG ``off``, no shares: gpupool pins whole
GPUs only under DRA). Nodes not ready or cordoned are left out with a note, other taints noted,
as for device-plugin nodes; a node with device-plugin GPUs but no slices is left out with a
note (claims cannot be allocated there); slices of a node that does not exist (or does not
match the pool's node selector) are ignored. No I/O: the slices are listed and watched by
:mod:`gpupool.kube.api` and :mod:`gpupool.kube.reconcile`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from gpupool.core.inventory import GPU, Inventory, Node
from gpupool.core.mig import GEOMETRIES
from gpupool.kube.claims import NVIDIA_DRIVER, SliceDevice, node_gpus, slice_devices
from gpupool.kube.nodes import (
    GPU_RESOURCE,
    NodePart,
    _note_taints,
    _skip_reason,
    inventory_view,
    not_ready_reason,
    product_model,
)

_MEMORY = re.compile(r"^(\d+)(Ki|Mi|Gi|Ti|K|M|G|T)?$")
_UNITS = {
    None: 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def slice_view(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The *slice view* of a ResourceSlice (API JSON)."""
    spec = obj.get("spec") or {}
    return {
        "metadata": {"name": (obj.get("metadata") or {}).get("name", "")},
        "spec": {
            "driver": spec.get("driver", ""),
            "nodeName": spec.get("nodeName", ""),
            "pool": dict(spec.get("pool") or {}),
            "devices": [
                {k: d[k] for k in ("name", "attributes", "capacity") if k in d}
                for d in spec.get("devices") or []
            ],
        },
    }


def current_slices(
    slices: Iterable[Mapping[str, Any]], notes: list[str] | None = None
) -> list[Mapping[str, Any]]:
    """The *current slices* of ``slices`` (NVIDIA's driver's only), by name; an incomplete pool
    gets a note in ``notes``."""
    pools: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != NVIDIA_DRIVER:
            continue
        pools[NVIDIA_DRIVER, str((spec.get("pool") or {}).get("name") or "")].append(item)
    out: list[Mapping[str, Any]] = []
    for (_, pool), items in sorted(pools.items()):
        newest = max(_generation(i) for i in items)
        kept = [i for i in items if _generation(i) == newest]
        wanted = int((kept[0]["spec"].get("pool") or {}).get("resourceSliceCount") or len(kept))
        if notes is not None and len(kept) < wanted:
            notes.append(
                f"pool {pool} of {NVIDIA_DRIVER} is incomplete ({len(kept)} of its {wanted} "
                "ResourceSlices published so far); its GPUs are counted as published"
            )
        out += kept
    return sorted(out, key=lambda i: str((i.get("metadata") or {}).get("name") or ""))


def _generation(item: Mapping[str, Any]) -> int:
    return int(((item.get("spec") or {}).get("pool") or {}).get("generation") or 0)


def memory_mib(device: Mapping[str, Any]) -> int:
    """A slice device's capacity ``memory`` in MiB (``{"value": "80Gi"}``); 0 when absent."""
    value = str(((device.get("capacity") or {}).get("memory") or {}).get("value") or "")
    m = _MEMORY.match(value.strip())
    return int(m[1]) * _UNITS[m[2]] // 2**20 if m else 0


def inventory_from_slices(
    nodes: Iterable[Mapping[str, Any]], slices: Iterable[Mapping[str, Any]]
) -> Inventory:
    """The pool's inventory from node objects and ResourceSlices (see the module docstring)."""
    notes: list[str] = []
    current = current_slices(slices, notes)
    devices = slice_devices(current)
    memory = {
        (str(s["spec"].get("nodeName") or ""), str(d.get("name") or "")): memory_mib(d)
        for s in current
        for d in s["spec"].get("devices") or []
    }
    built = []
    for obj in sorted((inventory_view(n) for n in nodes), key=lambda o: o["metadata"]["name"]):
        node = _dra_node(obj, devices, memory, notes)
        if node is not None:
            built.append(node)
    return Inventory(tuple(built), source="kubernetes", simulated=False, notes=tuple(notes))


def dra_node_part(obj: Mapping[str, Any], slices: Iterable[Mapping[str, Any]]) -> NodePart:
    """The :class:`gpupool.kube.nodes.NodePart` of one node under DRA: its GPUs from its own
    ResourceSlices (``slices``: those naming it), its facts from the node object, as
    :func:`inventory_from_slices` builds it (a node watch event rebuilds this node alone)."""
    view = inventory_view(obj)
    inventory = inventory_from_slices([obj], slices)
    node = inventory.nodes[0] if inventory.nodes else None
    return NodePart(view["metadata"]["name"], node, inventory.notes, not not_ready_reason(view))


def _dra_node(
    obj: Mapping[str, Any],
    devices: list[SliceDevice],
    memory: Mapping[tuple[str, str], int],
    notes: list[str],
) -> Node | None:
    name = obj["metadata"]["name"]
    gpus = node_gpus(devices, name)
    if not gpus:
        if obj["status"]["allocatable"].get(GPU_RESOURCE) not in (None, "0", 0):
            notes.append(
                f"node {name} has {GPU_RESOURCE} from the device plugin but no ResourceSlice of "
                f"{NVIDIA_DRIVER} (is NVIDIA's DRA driver running there?); under "
                "device_allocation 'dra' its GPUs cannot be claimed; left out"
            )
        return None
    taints = obj["spec"]["taints"]
    skip = not_ready_reason(obj) or _skip_reason(obj["spec"], taints, obj["metadata"]["labels"])
    if skip:
        notes.append(f"node {name} {skip}; left out")
        return None
    _note_taints(name, taints, notes)
    out = []
    for i, device in enumerate(gpus):
        product = device.product.replace(" ", "-")
        model, mib = product_model(product, memory.get((name, device.name)) or None)
        out.append(
            GPU(
                uuid=device.uuid,
                index=i,
                model=model if device.product else "unknown",
                memory_mib=mib,
                mig_capable=GEOMETRIES.get(model) is not None,
                mig_mode="off",
                product_name=product,
                share_resource="",
            )
        )
    return Node(name, tuple(out))


def uses_dra(config: Any) -> bool:
    """Whether notebooks or jobs get their GPUs through DRA under ``config`` (then the pool's
    inventory is :func:`inventory_from_slices`)."""
    from gpupool.kube.claims import DRA
    from gpupool.kube.settings import KubeJobSettings, notebook_settings

    if notebook_settings(config).device_allocation == DRA:
        return True
    return "KubeJobBackend" in config and KubeJobSettings(config=config).device_allocation == DRA
