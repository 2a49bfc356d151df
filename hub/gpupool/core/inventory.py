"""The inventory: what hardware the pool has, as frozen data.

Vocabulary
- *node*: one machine (the hub's own host locally, a Kubernetes node otherwise).
- *GPU*: one physical device, named by its NVML UUID (``GPU-…``) and its index on the node.
- *model key*: gpupool's name for a GPU model with its memory, ``H100-80GB``; MIG geometry and
  offers refer to models by this key. :func:`model_key` derives it from NVML's product name.
- *MIG mode* of a GPU:
  ``off`` (whole GPU only); ``dynamic`` (MIG on, instances are created where the pool places them,
  so the policy picks the start slot); ``fixed`` (MIG on with pre-created instances; the pool hands
  out existing free instances); ``flex`` (a GPU that serves either a whole-GPU request or MIG
  slices, MIG being switched on with the first slice: the model of the placement benchmarks).
- *MIG instance*: an existing GPU instance: profile, start slot, and the ``MIG-…`` UUID CUDA uses.
- *share resource* of a GPU with MIG ``off``: ``None`` where the pool hands out shares itself
  (locally: the GPU takes a whole-GPU request or shares); ``""`` where the platform hands the GPU
  out only whole (a plain Kubernetes ``nvidia.com/gpu``: no shares); else what a pod asks for one
  share (``nvidia.com/gpu.shared``, ``nvidia.com/gpu`` on a node whose device plugin shares without
  renaming, or ``hami``): the GPU takes shares only. With ``share_replicas`` (the device plugin's
  time-slicing or MPS replicas) a share takes one whole replica and fits only within one; with
  ``share_slots`` (HAMi's split count: at most that many shares) a share takes at least one
  slot's worth, ``1000 // share_slots``.
- *node pool*: a group of nodes an autoscaler adds on demand (and may have scaled to zero): the
  admin declares what one of its nodes holds (a template :class:`Node`) and at most how many it
  grows to. Its capacity does not exist yet: requests it alone could hold *wait* for it rather
  than being refused as impossible; nothing is ever placed on a template.

Contract: pure data, no I/O. Adapters (NVML, simulated, Kubernetes) build these objects.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from gpupool.core.mig import GEOMETRIES, Geometry

MigMode = Literal["off", "dynamic", "fixed", "flex"]
MIG_MODES: tuple[MigMode, ...] = ("off", "dynamic", "fixed", "flex")


@dataclass(frozen=True)
class MigInstance:
    """An existing MIG GPU instance on one GPU."""

    profile: str
    start: int
    uuid: str | None = None


@dataclass(frozen=True)
class GPU:
    uuid: str
    index: int
    model: str
    memory_mib: int
    mig_capable: bool = False
    mig_mode: MigMode = "off"
    instances: tuple[MigInstance, ...] = ()
    nvlink_peers: frozenset[str] = frozenset()
    product_name: str = ""
    share_resource: str | None = None
    """How the platform hands out shares of this GPU (see *share resource*)."""
    share_replicas: int = 0
    """With a share resource, the replicas the platform splits the GPU into (0: by memory)."""
    share_slots: int = 0
    """With a share resource, the most shares the platform puts on the GPU whatever their size
    (HAMi's ``deviceSplitCount``; 0: no such limit)."""

    @property
    def mig_enabled(self) -> bool:
        return self.mig_mode != "off"

    @property
    def geometry(self) -> Geometry | None:
        return GEOMETRIES.get(self.model) if self.mig_capable else None


@dataclass(frozen=True)
class Node:
    name: str
    gpus: tuple[GPU, ...] = ()


@dataclass(frozen=True)
class NodePool:
    """A node pool that may grow (from zero): what one node holds, at most ``max_nodes`` of them."""

    name: str
    node: Node
    max_nodes: int
    node_selector: tuple[tuple[str, str], ...] = ()
    """Labels the pool's nodes carry (what a pending pod selects to make the autoscaler grow
    this pool and no other)."""


@dataclass(frozen=True)
class Inventory:
    """All nodes of the pool, and where the data came from."""

    nodes: tuple[Node, ...]
    source: str = "unknown"
    simulated: bool = False
    notes: tuple[str, ...] = field(default=())
    node_pools: tuple[NodePool, ...] = ()
    """Declared autoscaled node pools (capacity that may come; see *node pool*)."""

    @property
    def gpus(self) -> tuple[GPU, ...]:
        return tuple(g for n in self.nodes for g in n.gpus)

    @property
    def label(self) -> str:
        """How the pool names itself wherever it is shown: simulated pools say so."""
        n = len(self.gpus)
        kind = "simulated" if self.simulated else self.source
        return f"{n} GPU{'s' if n != 1 else ''} ({kind})"


_FAMILY = re.compile(r"\b(A100|H100|H200|H20|A30|A40|A10|L40S|L40|L4|T4|V100|P100|B200)\b", re.I)
_RTX = re.compile(r"\bRTX\s*(A?\d{4})\b", re.I)
"""GeForce and workstation RTX cards (no MIG; shared by memory): ``RTX3090``, ``RTXA6000``."""
_KNOWN_GB = {
    "A100": (40, 80),
    "H100": (80, 94),
    "H200": (141,),
    "A30": (24,),
    "A10": (24,),
    "A40": (48,),
    "L40S": (48,),
    "L40": (48,),
    "L4": (24,),
    "T4": (16,),
    "V100": (16, 32),
    "P100": (12, 16),
}


def model_key(product_name: str, memory_mib: int) -> str:
    """gpupool's model key for an NVML product name and memory size.

    ``model_key("NVIDIA H100 80GB HBM3", 81559)`` is ``"H100-80GB"``; ``"NVIDIA A100-SXM4-40GB"``
    with 40960 MiB is ``"A100-40GB"``; ``"NVIDIA GeForce RTX 3090"`` with 24576 MiB is
    ``"RTX3090-24GB"``. The memory picks the nearest marketed size, because NVML reports a little
    less than the label.
    """
    rtx = _RTX.search(product_name)
    m = _FAMILY.search(product_name)
    if rtx:
        family = "RTX" + rtx.group(1).upper()
    else:
        family = m.group(1).upper() if m else re.sub(r"[^A-Za-z0-9]+", "-", product_name)
        family = family.strip("-")
    gb = memory_mib / 1024
    sizes = _KNOWN_GB.get(family)
    label = min(sizes, key=lambda s: abs(s - gb)) if sizes else round(gb)
    return f"{family}-{label}GB"
