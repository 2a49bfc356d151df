"""Occupancy: which memory slots of which GPU are taken, indexed so placement stays fast.

Vocabulary
- *ordinal*: a GPU's position in the inventory (nodes in order, GPUs by index); every tie in
  placement is broken by ordinal, i.e. "file order".
- *mask*: a GPU's taken memory slots as bits. A whole-GPU holder takes every slot.
- *whole-free*: a GPU that can take a whole-GPU request now: MIG ``off`` or ``flex``, nothing on it.
- *MIG bucket*: all GPUs that take dynamically placed MIG instances (``dynamic``, or ``flex`` not
  held whole) with the same model, mode and mask. Placement looks at buckets, not GPUs, so a
  decision costs O(distinct masks), not O(GPUs).
- *node bucket*: nodes with the same model, whole-free count and free slots (in eighths of a GPU).
- *fixed bucket*: the free pre-created instances of one model and profile on GPUs with the same
  mask, each as ``ordinal * 16 + start`` (so the minimum is the first GPU, then the lowest start).

Contract: no I/O, no policy. Callers (the ledger) check that slots are free before taking them;
taking a taken slot raises ``ValueError``, which is a bug, never a user error.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from .inventory import GPU, Inventory, MigInstance
from .mig import Geometry, Profile

WHOLE_SLOTS = 8
"""Slots of a GPU without MIG geometry, so that every GPU counts as eight eighths."""

MigKey = tuple[str, str, int]
NodeKey = tuple[str, int, int]
FixedKey = tuple[str, str, int]
FIXED_CODE = 16
"""Fixed instances are coded ``ordinal * FIXED_CODE + start`` (start slots are below 16)."""


class MinSet:
    """A set of ints with fast add, discard and min (a heap with lazy deletion)."""

    __slots__ = ("_heap", "_members")

    def __init__(self) -> None:
        self._heap: list[int] = []
        self._members: set[int] = set()

    def add(self, x: int) -> None:
        if x not in self._members:
            self._members.add(x)
            heapq.heappush(self._heap, x)

    def discard(self, x: int) -> None:
        self._members.discard(x)

    def min(self) -> int | None:
        heap = self._heap
        while heap and heap[0] not in self._members:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._members))


class Occupancy:
    """Mutable slot state over a fixed inventory."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        self.gpus: list[GPU] = list(inventory.gpus)
        self.ordinal: dict[str, int] = {g.uuid: i for i, g in enumerate(self.gpus)}
        self.node_names: list[str] = [n.name for n in inventory.nodes]
        self.node_of: list[int] = []
        self.node_gpus: list[list[int]] = []
        for n_idx, node in enumerate(inventory.nodes):
            first = len(self.node_of)
            self.node_of.extend([n_idx] * len(node.gpus))
            self.node_gpus.append(list(range(first, first + len(node.gpus))))
        self.geometry: list[Geometry | None] = [g.geometry for g in self.gpus]
        self.slots: list[int] = [geo.memory_slots if geo else WHOLE_SLOTS for geo in self.geometry]
        self.mask: list[int] = [0] * len(self.gpus)
        self.whole: list[bool] = [False] * len(self.gpus)
        self.fixed_instances: dict[int, list[tuple[Profile, MigInstance]]] = {
            i: self._resolve_instances(i) for i, g in enumerate(self.gpus) if g.mig_mode == "fixed"
        }
        self.mig_buckets: dict[MigKey, MinSet] = {}
        self.node_buckets: dict[NodeKey, MinSet] = {}
        self.fixed_buckets: dict[FixedKey, MinSet] = {}
        self._gpu_key: list[MigKey | None] = [None] * len(self.gpus)
        self._node_keys: list[list[NodeKey]] = [[] for _ in self.node_gpus]
        self._fixed_keys: dict[int, list[tuple[FixedKey, int]]] = {}
        for g in range(len(self.gpus)):
            self._reindex_gpu(g)
        for n in range(len(self.node_gpus)):
            self._reindex_node(n)

    # -- questions -------------------------------------------------------------------------
    def full(self, g: int) -> int:
        return (1 << self.slots[g]) - 1

    def whole_free(self, g: int) -> bool:
        return self.gpus[g].mig_mode in ("off", "flex") and self.mask[g] == 0

    def free_eighths(self, g: int) -> int:
        free = self.slots[g] - self.mask[g].bit_count()
        return free * WHOLE_SLOTS // self.slots[g]

    def node_free_eighths(self, n: int) -> int:
        return sum(self.free_eighths(g) for g in self.node_gpus[n])

    def whole_free_on(self, n: int, model: str | None) -> list[int]:
        return [
            g
            for g in self.node_gpus[n]
            if self.whole_free(g) and (model is None or self.gpus[g].model == model)
        ]

    def _resolve_instances(self, g: int) -> list[tuple[Profile, MigInstance]]:
        geo = self.geometry[g]
        out = []
        for inst in self.gpus[g].instances:
            p = geo.resolve(inst.profile) if geo else None
            if p is not None:
                out.append((p, inst))
        return out

    # -- changes ---------------------------------------------------------------------------
    def take_whole(self, g: int) -> None:
        if not self.whole_free(g):
            raise ValueError(f"GPU {self.gpus[g].uuid} is not whole-free")
        self.mask[g] = self.full(g)
        self.whole[g] = True
        self._changed(g)

    def take_slots(self, g: int, profile: Profile, start: int) -> None:
        bits = profile.mask_at(start)
        if self.whole[g] or self.mask[g] & bits or self.gpus[g].mig_mode == "off":
            raise ValueError(f"slots {start}+{profile.memory_slots} of {self.gpus[g].uuid} taken")
        self.mask[g] |= bits
        self._changed(g)

    def free_whole(self, g: int) -> None:
        self.mask[g] = 0
        self.whole[g] = False
        self._changed(g)

    def free_slots(self, g: int, profile: Profile, start: int) -> None:
        self.mask[g] &= ~profile.mask_at(start)
        self._changed(g)

    # -- index upkeep ----------------------------------------------------------------------
    def _changed(self, g: int) -> None:
        self._reindex_gpu(g)
        self._reindex_node(self.node_of[g])

    def _reindex_gpu(self, g: int) -> None:
        if g in self.fixed_instances:
            self._reindex_fixed(g)
            return
        gpu = self.gpus[g]
        key: MigKey | None = None
        if gpu.mig_mode in ("dynamic", "flex") and not self.whole[g] and self.geometry[g]:
            key = (gpu.model, gpu.mig_mode, self.mask[g])
        old = self._gpu_key[g]
        if old == key:
            return
        if old is not None:
            self.mig_buckets[old].discard(g)
        if key is not None:
            self.mig_buckets.setdefault(key, MinSet()).add(g)
        self._gpu_key[g] = key

    def _reindex_node(self, n: int) -> None:
        for key in self._node_keys[n]:
            self.node_buckets[key].discard(n)
        free = self.node_free_eighths(n)
        counts: dict[str, int] = {}
        for g in self.node_gpus[n]:
            if self.gpus[g].mig_mode in ("off", "flex"):
                counts[self.gpus[g].model] = counts.get(self.gpus[g].model, 0) + self.whole_free(g)
        keys = [(model, f, free) for model, f in counts.items()]
        for key in keys:
            self.node_buckets.setdefault(key, MinSet()).add(n)
        self._node_keys[n] = keys

    def _reindex_fixed(self, g: int) -> None:
        for key, code in self._fixed_keys.get(g, ()):
            self.fixed_buckets[key].discard(code)
        model, mask = self.gpus[g].model, self.mask[g]
        keys = [
            ((model, p.name, mask), g * FIXED_CODE + inst.start)
            for p, inst in self.fixed_instances[g]
            if not mask & p.mask_at(inst.start)
        ]
        for key, code in keys:
            self.fixed_buckets.setdefault(key, MinSet()).add(code)
        self._fixed_keys[g] = keys
