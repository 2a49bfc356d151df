"""Occupancy: which memory slots or shares of which GPU are taken, indexed so placement stays fast.

Vocabulary
- *ordinal*: a GPU's position in the inventory (nodes in order, GPUs by index); every tie in
  placement is broken by ordinal, i.e. "file order".
- *mask*: a GPU's taken memory slots as bits. A whole-GPU holder takes every slot.
- *whole-free*: a GPU that can take a whole-GPU request now: MIG ``off`` or ``flex``, nothing on it
  (no slot, no share).
- *share*: thousandths ("milli") of a GPU's memory held by one allocation on a GPU with MIG
  ``off`` (the only mode that takes shares: a ``flex`` GPU is sliced by MIG, which isolates better).
  A GPU holds one kind at a time: one whole-GPU holder, or MIG instances, or shares summing to at
  most :data:`SHARE_MILLI`. *used* is that sum; *free milli* is what is left (of any kind: free
  slots in thousandths on a MIG GPU, nothing on a whole-held one).
- *share group*: the share-taking GPUs of one model, memory size, replica and slot count (a
  share asked by size costs the same on each), with an index by used milli (sorted non-empty
  values, each a set of GPUs) and a max-free tree over the group's GPUs in ordinal order (the
  first GPU where a share fits, in O(log n)). Placement looks at used values, not GPUs. A GPU
  whose *share resource* is ``""`` takes no shares; one with a share resource takes shares only
  (never a whole-GPU request).
- *replica need*: on GPUs split into ``replicas`` by the platform (Kubernetes time-slicing or
  MPS), a share takes one whole replica, ``SHARE_MILLI // replicas``, and only if it fits in one
  replica's memory (``memory_mib / replicas``); on GPUs with ``slots`` (HAMi's split count: at
  most that many shares, whatever their size) a share takes at least ``SHARE_MILLI // slots``.
  :meth:`ShareGroup.need` says what a share takes.
- *MIG bucket*: all GPUs that take dynamically placed MIG instances (``dynamic``, or ``flex`` not
  held whole) with the same model, mode and mask. Placement looks at buckets, not GPUs, so a
  decision costs O(distinct masks), not O(GPUs).
- *node bucket*: nodes with the same model and whole-free count, by ordinal; beside it the same
  nodes coded ``free_milli * NODE_CODE + ordinal`` (the node with the least free milli summed
  over its GPUs first, then file order).
- *fixed bucket*: the free pre-created instances of one model and profile on GPUs with the same
  mask, each as ``ordinal * 16 + start`` (so the minimum is the first GPU, then the lowest start).
- *closed* GPU: one in outside use (:mod:`gpupool.core.holders`): no new placement of any kind
  goes on it (it is not whole-free, takes no share, no MIG instance), while what holds it keeps
  it; reopened once nothing else uses it. Restoring an allocation onto it is still possible.
- *reserved slots*: on a ``dynamic`` GPU, the slots of the instances it already has (an admin's,
  on a GPU whose instances the pool creates): each is a fixed instance there, handed out as it
  is, and no other placement (an instance to create, a blocked slot) ever overlaps it, held or
  free. The GPU's MIG bucket and fixed buckets are keyed by ``mask | reserved``
  (:meth:`Occupancy.placement_mask`); ``mask`` itself holds only what is taken.

Contract: no I/O, no policy. Callers (the ledger) check that slots are free before taking them;
taking a taken slot (or more share than is free, or a share on a GPU that takes none)
raises ``ValueError``, which is a bug, never a user error.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right, insort
from collections.abc import Callable, Collection, Iterator

from gpupool.core.inventory import GPU, Inventory, MigInstance
from gpupool.core.mig import Geometry, Profile
from gpupool.core.units import GPU_MILLI

WHOLE_SLOTS = 8
"""Slots of a GPU without MIG geometry, so that every GPU counts as eight eighths."""

SHARE_MILLI = GPU_MILLI
"""All the shares on one GPU add up to at most this (its whole memory)."""

MigKey = tuple[str, str, int]
NodeKey = tuple[str, int]
ShareKey = tuple[str, int, int, int]
"""A share group: ``(model, memory_mib, replicas, slots)`` (replicas 0: shares by memory; slots
0: no limit on the number of shares)."""
NODE_CODE = 1 << 24
"""Nodes by free milli are coded ``free_milli * NODE_CODE + ordinal`` (fewer than 2**24 nodes)."""
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

    def copy(self) -> MinSet:
        twin = MinSet()
        twin._heap = self._heap[:]
        twin._members = set(self._members)
        return twin

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._members))


class ShareGroup:
    """The share-taking GPUs of one model and memory size, indexed by used milli and by order.

    A member is *available* unless held whole; ``by_used[u]`` holds the available members with
    ``u`` milli of shares on them, ``used_values`` the sorted ``u`` with any, and ``tree`` the
    largest free milli under each node of a binary tree over the members (``-1``: unavailable).
    """

    __slots__ = (
        "by_used",
        "members",
        "memory_mib",
        "model",
        "pos",
        "replicas",
        "size",
        "slots",
        "tree",
        "used_values",
    )

    def __init__(
        self, model: str, memory_mib: int, replicas: int, slots: int, members: list[int]
    ) -> None:
        self.model = model
        self.memory_mib = memory_mib
        self.replicas = replicas
        self.slots = slots
        self.members = members
        self.pos = {g: i for i, g in enumerate(members)}
        self.by_used: dict[int, MinSet] = {}
        self.used_values: list[int] = []
        size = 1
        while size < len(members):
            size *= 2
        self.size = size
        self.tree = [-1] * (2 * size)

    def copy(self) -> ShareGroup:
        """The same group with its own index (members and positions are shared: never changed)."""
        twin = object.__new__(ShareGroup)
        for name in ("model", "memory_mib", "replicas", "slots", "members", "pos", "size"):
            setattr(twin, name, getattr(self, name))
        twin.by_used = {u: m.copy() for u, m in self.by_used.items()}
        twin.used_values = self.used_values[:]
        twin.tree = self.tree[:]
        return twin

    def need(self, milli: int, share_mib: int | None = None) -> int:
        """What a share of ``milli`` (asked as ``share_mib`` MiB, if by size) takes on a member:
        ``milli``; on GPUs split into replicas one replica when it fits in one, else more than a
        GPU (it never fits); on GPUs with share slots at least one slot's worth."""
        replicas = self.replicas
        if milli <= 0:
            return milli
        if not replicas:
            return max(milli, SHARE_MILLI // self.slots) if self.slots else milli
        if share_mib is not None:
            fits = share_mib * replicas <= self.memory_mib
        else:
            fits = milli * replicas <= SHARE_MILLI
        return SHARE_MILLI // replicas if fits else SHARE_MILLI + 1

    def set(self, g: int, old: int | None, new: int | None) -> None:
        """Member ``g`` goes from ``old`` to ``new`` used milli (``None``: unavailable)."""
        if old == new:
            return
        if old is not None:
            bucket = self.by_used[old]
            bucket.discard(g)
            if not bucket:
                del self.by_used[old]
                self.used_values.pop(bisect_right(self.used_values, old) - 1)
        if new is not None:
            target = self.by_used.get(new)
            if target is None:
                target = self.by_used[new] = MinSet()
                insort(self.used_values, new)
            target.add(g)
        i = self.pos[g] + self.size
        tree = self.tree
        tree[i] = -1 if new is None else SHARE_MILLI - new
        i //= 2
        while i:
            a, b = tree[2 * i], tree[2 * i + 1]
            tree[i] = a if a > b else b
            i //= 2

    def first_fitting(self, need: int) -> int | None:
        """The first member (in ordinal order) with at least ``need`` milli free."""
        tree = self.tree
        if tree[1] < need:
            return None
        i = 1
        while i < self.size:
            i = 2 * i if tree[2 * i] >= need else 2 * i + 1
        return self.members[i - self.size]

    def fitting(self, need: int) -> Iterator[int]:
        """Every member with at least ``need`` milli free, in ordinal order (for avoided nodes)."""
        tree = self.tree
        return (g for i, g in enumerate(self.members) if tree[i + self.size] >= need)


class Occupancy:
    """Mutable slot state over a fixed inventory."""

    def __init__(
        self, inventory: Inventory, carry: tuple[Occupancy, Collection[str]] | None = None
    ) -> None:
        """``carry``: an occupancy and node names; the slot state (taken, whole, shares,
        closed) of every GPU of ``inventory`` not on those nodes is copied from that occupancy,
        where the GPU is the same (its UUID), before the indexes are built."""
        self.inventory = inventory
        self.gpus: list[GPU] = list(inventory.gpus)
        self.ordinal: dict[str, int] = {g.uuid: i for i, g in enumerate(self.gpus)}
        self.node_names: list[str] = [n.name for n in inventory.nodes]
        self.node_ordinal: dict[str, int] = {name: n for n, name in enumerate(self.node_names)}
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
        self.share_used: list[int] = [0] * len(self.gpus)
        self.share_only: list[bool] = [bool(g.share_resource) for g in self.gpus]
        """GPUs the platform hands out as shares only (never whole)."""
        self.closed: list[bool] = [False] * len(self.gpus)
        """GPUs in outside use (see *closed*)."""
        self._share_index: list[int | None] = [None] * len(self.gpus)
        """What each share-taking GPU's group index holds for it (``None``: unavailable)."""
        carried = self._carry(*carry) if carry is not None else {}
        resolved = carry[0].fixed_instances if carry is not None else {}
        members: dict[ShareKey, list[int]] = {}
        for g, gpu in enumerate(self.gpus):
            if gpu.mig_mode == "off" and gpu.share_resource != "":
                replicas, slots = (
                    (gpu.share_replicas, gpu.share_slots) if gpu.share_resource else (0, 0)
                )
                members.setdefault((gpu.model, gpu.memory_mib, replicas, slots), []).append(g)
        self.share_groups: dict[ShareKey, ShareGroup] = {
            key: ShareGroup(*key, gs) for key, gs in members.items()
        }
        self.share_group_of: dict[int, ShareGroup] = {}
        for group in self.share_groups.values():
            for g in group.members:
                self.share_group_of[g] = group
                self._sync_share(g)
        self.fixed_instances: dict[int, list[tuple[Profile, MigInstance]]] = {
            i: resolved[carried[i]] if i in carried else self._resolve_instances(i)
            for i, g in enumerate(self.gpus)
            if g.mig_mode == "fixed" or (g.mig_mode == "dynamic" and g.instances)
        }
        self.reserved: list[int] = [0] * len(self.gpus)
        """Slots of the pre-made instances of ``dynamic`` GPUs (see *reserved slots*)."""
        for i, instances in self.fixed_instances.items():
            if self.gpus[i].mig_mode == "dynamic":
                for p, inst in instances:
                    self.reserved[i] |= p.mask_at(inst.start)
        self.mig_buckets: dict[MigKey, MinSet] = {}
        self.node_buckets: dict[NodeKey, MinSet] = {}
        self.node_free: dict[NodeKey, MinSet] = {}
        self.fixed_buckets: dict[FixedKey, MinSet] = {}
        self._gpu_key: list[MigKey | None] = [None] * len(self.gpus)
        self._node_keys: list[list[tuple[NodeKey, int]]] = [[] for _ in self.node_gpus]
        self._fixed_keys: dict[int, list[tuple[FixedKey, int]]] = {}
        for g in range(len(self.gpus)):
            self._reindex_gpu(g)
        for n in range(len(self.node_gpus)):
            self._reindex_node(n)

    def copy(self) -> Occupancy:
        """An independent occupancy in the same state, for a ledger's clone: the tables derived
        from the inventory are shared (nothing changes them after ``__init__``), the slot state
        and every index over it are copied (a copy, not a rebuild: the cost is the copying)."""
        twin = object.__new__(Occupancy)
        twin.__dict__.update(self.__dict__)
        twin.mask, twin.whole = self.mask[:], self.whole[:]
        twin.share_used, twin.closed = self.share_used[:], self.closed[:]
        twin._share_index = self._share_index[:]
        twin.share_groups = {key: group.copy() for key, group in self.share_groups.items()}
        groups = twin.share_groups.values()
        twin.share_group_of = {g: group for group in groups for g in group.members}
        twin.mig_buckets = {key: m.copy() for key, m in self.mig_buckets.items()}
        twin.node_buckets = {key: m.copy() for key, m in self.node_buckets.items()}
        twin.node_free = {key: m.copy() for key, m in self.node_free.items()}
        twin.fixed_buckets = {key: m.copy() for key, m in self.fixed_buckets.items()}
        twin._gpu_key = self._gpu_key[:]
        twin._node_keys = [keys[:] for keys in self._node_keys]
        twin._fixed_keys = {g: keys[:] for g, keys in self._fixed_keys.items()}
        return twin

    def _carry(self, old: Occupancy, skip: Collection[str]) -> dict[int, int]:
        """Copy the slot state of the GPUs carried over (see ``carry``); returns their old
        ordinals by new."""
        carried: dict[int, int] = {}
        for g, gpu in enumerate(self.gpus):
            o = old.ordinal.get(gpu.uuid)
            node = self.node_names[self.node_of[g]]
            if o is None or node in skip or old.gpus[o] != gpu:
                continue
            if old.node_names[old.node_of[o]] != node:
                continue
            self.mask[g], self.whole[g] = old.mask[o], old.whole[o]
            self.share_used[g], self.closed[g] = old.share_used[o], old.closed[o]
            carried[g] = o
        return carried

    # -- questions -------------------------------------------------------------------------
    def full(self, g: int) -> int:
        return (1 << self.slots[g]) - 1

    def whole_free(self, g: int) -> bool:
        """Whether a whole-GPU request may be placed on GPU ``g`` now (never a closed one)."""
        return self.whole_empty(g) and not self.closed[g]

    def whole_empty(self, g: int) -> bool:
        """Whether GPU ``g`` can be held whole: nothing on it, whether closed or not."""
        return (
            self.gpus[g].mig_mode in ("off", "flex")
            and self.mask[g] == 0
            and self.share_used[g] == 0
            and not self.share_only[g]
        )

    def share_needs(
        self,
        model: str | None,
        cost_on: Callable[[int], int],
        share_mib: int | None = None,
        *,
        fitting: bool = True,
    ) -> Iterator[tuple[ShareGroup, int]]:
        """The share groups of ``model`` (``None``: every model), each with what one share takes
        on its GPUs: ``cost_on(memory_mib)`` (an offer's or a demand's cost on that memory), or
        one replica (:meth:`ShareGroup.need`; ``share_mib`` for a share asked by size). With
        ``fitting``, only the groups where that fits on an empty GPU."""
        for group in self.share_groups.values():
            if model is not None and group.model != model:
                continue
            need = group.need(cost_on(group.memory_mib), share_mib)
            if not fitting or 0 < need <= SHARE_MILLI:
                yield group, need

    def free_milli(self, g: int) -> int:
        """What is free on GPU ``g`` in thousandths of it: slots, or memory left to shares."""
        if self.share_used[g]:
            return SHARE_MILLI - self.share_used[g]
        free = self.slots[g] - self.mask[g].bit_count()
        return free * GPU_MILLI // self.slots[g]

    def node_free_milli(self, n: int) -> int:
        return sum(self.free_milli(g) for g in self.node_gpus[n])

    def node_whole_free(self, n: int) -> int:
        return sum(self.whole_free(g) for g in self.node_gpus[n])

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
        if not self.whole_empty(g):
            raise ValueError(f"GPU {self.gpus[g].uuid} is not whole-free")
        self.mask[g] = self.full(g)
        self.whole[g] = True
        self._changed(g)

    def placement_mask(self, g: int) -> int:
        """The slots no new placement may use on GPU ``g``: taken or reserved."""
        return self.mask[g] | self.reserved[g]

    def is_fixed_instance(self, g: int, profile: Profile, start: int) -> bool:
        """Whether GPU ``g`` has a pre-made instance of ``profile`` at ``start``."""
        return any(p == profile and i.start == start for p, i in self.fixed_instances.get(g, ()))

    def take_slots(self, g: int, profile: Profile, start: int) -> None:
        bits = profile.mask_at(start)
        if self.whole[g] or self.mask[g] & bits or self.gpus[g].mig_mode == "off":
            raise ValueError(f"slots {start}+{profile.memory_slots} of {self.gpus[g].uuid} taken")
        if self.reserved[g] & bits and not self.is_fixed_instance(g, profile, start):
            raise ValueError(
                f"slots {start}+{profile.memory_slots} of {self.gpus[g].uuid} overlap an "
                "admin's instance"
            )
        self.mask[g] |= bits
        self._changed(g)

    def free_whole(self, g: int) -> None:
        self.mask[g] = 0
        self.whole[g] = False
        self._changed(g)

    def free_slots(self, g: int, profile: Profile, start: int) -> None:
        self.mask[g] &= ~profile.mask_at(start)
        self._changed(g)

    def take_share(self, g: int, milli: int) -> None:
        used = self.share_used[g]
        if (
            g not in self.share_group_of
            or self.whole[g]
            or milli <= 0
            or used + milli > SHARE_MILLI
        ):
            raise ValueError(f"no {milli} milli share free on {self.gpus[g].uuid}")
        self.share_used[g] = used + milli
        self._sync_share(g)
        self._reindex_node(self.node_of[g])

    def free_share(self, g: int, milli: int) -> None:
        used = self.share_used[g]
        if milli > used:
            raise ValueError(f"{self.gpus[g].uuid} holds {used} milli of shares, not {milli}")
        self.share_used[g] = used - milli
        self._sync_share(g)
        self._reindex_node(self.node_of[g])

    def close(self, g: int) -> None:
        """Place nothing new on GPU ``g`` (see *closed*) until :meth:`reopen`."""
        self.closed[g] = True
        self._changed(g)

    def reopen(self, g: int) -> None:
        self.closed[g] = False
        self._changed(g)

    # -- index upkeep ----------------------------------------------------------------------
    def _changed(self, g: int) -> None:
        self._reindex_gpu(g)
        self._reindex_node(self.node_of[g])
        self._sync_share(g)

    def _sync_share(self, g: int) -> None:
        """Put a share-taking GPU's used milli into its group's index, or take it out while it
        is held whole or closed."""
        group = self.share_group_of.get(g)
        if group is None:
            return
        new = None if self.whole[g] or self.closed[g] else self.share_used[g]
        group.set(g, self._share_index[g], new)
        self._share_index[g] = new

    def _reindex_gpu(self, g: int) -> None:
        gpu = self.gpus[g]
        if g in self.fixed_instances:
            self._reindex_fixed(g)
            if gpu.mig_mode == "fixed":
                return
        key: MigKey | None = None
        open_ = not self.whole[g] and not self.closed[g]
        if gpu.mig_mode in ("dynamic", "flex") and open_ and self.geometry[g]:
            key = (gpu.model, gpu.mig_mode, self.mask[g] | self.reserved[g])
        old = self._gpu_key[g]
        if old == key:
            return
        if old is not None:
            self.mig_buckets[old].discard(g)
        if key is not None:
            self.mig_buckets.setdefault(key, MinSet()).add(g)
        self._gpu_key[g] = key

    def _reindex_node(self, n: int) -> None:
        for key, code in self._node_keys[n]:
            self.node_buckets[key].discard(n)
            self.node_free[key].discard(code)
        code = self.node_free_milli(n) * NODE_CODE + n
        counts: dict[str, int] = {}
        for g in self.node_gpus[n]:
            if self.gpus[g].mig_mode in ("off", "flex") and not self.share_only[g]:
                counts[self.gpus[g].model] = counts.get(self.gpus[g].model, 0) + self.whole_free(g)
        keys = [((model, f), code) for model, f in counts.items()]
        for key, c in keys:
            if key not in self.node_buckets:
                self.node_buckets[key] = MinSet()
                self.node_free[key] = MinSet()
            self.node_buckets[key].add(n)
            self.node_free[key].add(c)
        self._node_keys[n] = keys

    def _reindex_fixed(self, g: int) -> None:
        for key, code in self._fixed_keys.get(g, ()):
            self.fixed_buckets[key].discard(code)
        model, mask = self.gpus[g].model, self.mask[g]
        keys = [
            ((model, p.name, mask | self.reserved[g]), g * FIXED_CODE + inst.start)
            for p, inst in self.fixed_instances[g]
            if not mask & p.mask_at(inst.start) and not self.closed[g]
        ]
        for key, code in keys:
            self.fixed_buckets.setdefault(key, MinSet()).add(code)
        self._fixed_keys[g] = keys
