"""Placement policies: where a demand lands, given the occupancy. Swappable by name.

Vocabulary
- *demand*: the device part of a request: ``count`` whole GPUs (of a ``model``, maybe all in one
  NVLink island) on one node, or one MIG instance of a ``profile``; never on the nodes (by
  ordinal) in ``avoid`` (a multi-node job's other nodes, so each of its nodes is a machine).
- *pick*: one device chosen for a demand: GPU ordinal, and for MIG the profile, start slot and,
  on fixed-mode GPUs, the existing instance's UUID.
- Policies: ``first-fit`` (nodes in order, GPUs by index, lowest start slot), ``best-fit`` (the GPU,
  for MIG, or node, for whole GPUs, with the fewest free slots left after placing; ties by order
  then lowest start), and ``gpupool``: fragmentation-aware, after FGD ("Beware of Fragmentation",
  ATC'23). It estimates the workload from the demands it has seen and places where the expected
  free capacity that the next demand could *not* use grows least, so the largest shapes stay
  placeable.

Contract: ``place`` never mutates the occupancy; it returns picks or ``None`` (does not fit).
Fixed-mode instances (already created) are preferred over creating new ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from .mig import Geometry, Profile
from .occupancy import FIXED_CODE, WHOLE_SLOTS, MinSet, Occupancy


@dataclass(frozen=True)
class Demand:
    kind: str  # "gpu" or "mig"
    count: int = 1
    model: str | None = None
    nvlink: bool = False
    profile: str | None = None
    avoid: frozenset[int] = frozenset()
    """Node ordinals the demand must not land on."""


class Pick(NamedTuple):
    gpu: int
    profile: Profile | None = None
    start: int | None = None
    instance: str | None = None


Key = tuple[float, ...]


class PlacementPolicy:
    """Base policy: enumerates candidates; subclasses only rank them with two key functions."""

    name = "base"

    def observe(self, demand: Demand) -> None:
        """Called for every demand before it is placed (whether it fits or not)."""

    # ranking hooks: lower sorts first; ties go to lower ordinal, then lower start slot
    def whole_key(self, occ: Occupancy, whole_free: int, free: int, count: int) -> Key:
        raise NotImplementedError

    def mig_key(self, occ: Occupancy, g: int, geo: Geometry, mask: int, p: Profile, s: int) -> Key:
        raise NotImplementedError

    # -- enumeration -----------------------------------------------------------------------
    def place(self, occ: Occupancy, demand: Demand) -> list[Pick] | None:
        if demand.kind == "gpu":
            return self._place_whole(occ, demand)
        pick = self._pick_fixed(occ, demand) or self._place_dynamic(occ, demand)
        return [pick] if pick else None

    def _place_whole(self, occ: Occupancy, d: Demand) -> list[Pick] | None:
        best: tuple[Key, int] | None = None
        best_gpus: list[int] = []
        for (model, f, free), bucket in occ.node_buckets.items():
            if f < d.count or (d.model is not None and model != d.model) or not bucket:
                continue
            key = self.whole_key(occ, f, free, d.count)
            if d.nvlink and d.count > 1:
                nodes: list[int | None] = [n for n in bucket if n not in d.avoid]
            else:
                nodes = [_first(bucket, d.avoid, lambda n: n)]
            for n in nodes:
                if n is None or (best is not None and (key, n) >= best):
                    continue
                gpus = occ.whole_free_on(n, model)
                gpus = _island(occ, gpus, d.count) if d.nvlink and d.count > 1 else gpus
                if len(gpus) >= d.count:
                    best, best_gpus = (key, n), gpus[: d.count]
                    break
        return [Pick(g) for g in best_gpus] if best else None

    node_aware_empty = False
    """Whether an empty ``flex`` GPU's node matters (then each node is a separate candidate)."""

    def _place_dynamic(self, occ: Occupancy, d: Demand) -> Pick | None:
        best: tuple[Key, int, int] | None = None
        best_profile: Profile | None = None
        for (model, mode, mask), bucket in occ.mig_buckets.items():
            if d.model is not None and model != d.model:
                continue
            g = _first(bucket, d.avoid, occ.node_of.__getitem__)
            geo = occ.geometry[g] if g is not None else None
            p = geo.resolve(d.profile) if geo else None
            if g is None or geo is None or p is None:
                continue
            gpus = [g]
            if self.node_aware_empty and mode == "flex" and mask == 0:
                gpus = _first_whole_free_per_node_kind(occ, model, d.avoid)
            for g in gpus:
                for s in geo.starts_free(mask, p):
                    cand = (self.mig_key(occ, g, geo, mask, p, s), g, s)
                    if best is None or cand < best:
                        best, best_profile = cand, p
        if best is None:
            return None
        return Pick(best[1], best_profile, best[2])

    def _pick_fixed(self, occ: Occupancy, d: Demand) -> Pick | None:
        best: tuple[Key, int, int] | None = None
        best_profile: Profile | None = None
        for (model, _name, mask), bucket in occ.fixed_buckets.items():
            code = (
                _first(bucket, d.avoid, lambda c: occ.node_of[c // FIXED_CODE])
                if d.model in (None, model)
                else None
            )
            if code is None:
                continue
            g, s = divmod(code, FIXED_CODE)
            geo = occ.geometry[g]
            p = geo.resolve(d.profile) if geo else None
            if geo is None or p is None or p.name != _name:
                continue
            cand = (self.mig_key(occ, g, geo, mask, p, s), g, s)
            if best is None or cand < best:
                best, best_profile = cand, p
        if best is None or best_profile is None:
            return None
        g, s = best[1], best[2]
        uuid = next(i.uuid for p, i in occ.fixed_instances[g] if p == best_profile and i.start == s)
        return Pick(g, best_profile, s, uuid)


def _first(bucket: MinSet, avoid: frozenset[int], node: Callable[[int], int]) -> int | None:
    """The bucket's lowest member whose node is not avoided (``bucket.min()`` when none is)."""
    if not avoid:
        return bucket.min()
    return next((x for x in bucket if node(x) not in avoid), None)


def _first_whole_free_per_node_kind(
    occ: Occupancy, model: str, avoid: frozenset[int] = frozenset()
) -> list[int]:
    """One empty ``flex`` GPU of ``model`` from the first node (not avoided) of each bucket."""
    out = []
    for (m, f, _free), bucket in occ.node_buckets.items():
        n = _first(bucket, avoid, lambda n: n) if m == model and f > 0 else None
        flex = (
            [g for g in occ.whole_free_on(n, model) if occ.gpus[g].mig_mode == "flex"]
            if (n is not None)
            else []
        )
        out.extend(flex[:1])
    return out


def _island(occ: Occupancy, gpus: list[int], count: int) -> list[int]:
    """The first NVLink-connected group among ``gpus`` with at least ``count`` members."""
    free = set(gpus)
    uuid_to_g = {occ.gpus[g].uuid: g for g in gpus}
    seen: set[int] = set()
    for g in gpus:
        if g in seen:
            continue
        group, stack = [], [g]
        seen.add(g)
        while stack:
            cur = stack.pop()
            group.append(cur)
            for peer in occ.gpus[cur].nvlink_peers:
                pg = uuid_to_g.get(peer)
                if pg is not None and pg in free and pg not in seen:
                    seen.add(pg)
                    stack.append(pg)
        if len(group) >= count:
            return sorted(group)
    return []


class FirstFit(PlacementPolicy):
    name = "first-fit"

    def whole_key(self, occ: Occupancy, whole_free: int, free: int, count: int) -> Key:
        return ()

    def mig_key(self, occ: Occupancy, g: int, geo: Geometry, mask: int, p: Profile, s: int) -> Key:
        return ()


class BestFit(PlacementPolicy):
    name = "best-fit"

    def whole_key(self, occ: Occupancy, whole_free: int, free: int, count: int) -> Key:
        return (free - count * WHOLE_SLOTS,)

    def mig_key(self, occ: Occupancy, g: int, geo: Geometry, mask: int, p: Profile, s: int) -> Key:
        return (geo.memory_slots - mask.bit_count() - p.memory_slots,)


class FragmentationAware(PlacementPolicy):
    """gpupool's policy: minimise the growth of expected fragmentation (FGD-style).

    The workload estimate is the mix of demands seen so far (each shape counted once up front, so
    an empty history still guards every shape). For a GPU with mask ``m``, the fragmentation
    against a MIG shape ``p`` is the free slots that ``p`` cannot use: ``free(m) - size(p) *
    fits(p, m)``; against a whole-GPU shape, the free slots of a partly used ``flex`` GPU. For a
    node against a ``k``-GPU shape it is its whole-free GPUs when there are fewer than ``k``.
    The expected fragmentation is the weighted sum; a placement's score is how much it grows,
    then best-fit's slots left, then order.
    """

    name = "gpupool"
    node_aware_empty = True

    def __init__(self) -> None:
        self._seen: Counter[tuple[str, int | str]] = Counter()
        self._weights: dict[tuple[str, int | str], float] = {}
        self._cache: dict[tuple[str, int, str, int], float] = {}
        self._dirty = True

    def observe(self, demand: Demand) -> None:
        shape = ("gpu", demand.count) if demand.kind == "gpu" else ("mig", demand.profile or "")
        new = shape not in self._seen
        self._seen[shape] += 1
        total = sum(self._seen.values())
        # re-derive weights when a shape appears or the history has doubled since last time
        if new or total & (total - 1) == 0:
            self._dirty = True

    def _refresh(self) -> None:
        if not self._dirty:
            return
        total = sum(self._seen.values()) or 1
        self._weights = {k: v / total for k, v in self._seen.items()}
        self._cache.clear()
        self._dirty = False

    def _gpu_frag(self, geo: Geometry, mask: int, flex: bool) -> float:
        key = (geo.model, mask, "flex" if flex else "mig", 0)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        free = geo.memory_slots - mask.bit_count()
        frag = 0.0
        for (kind, what), w in self._weights.items():
            if kind == "mig":
                p = geo.resolve(str(what))
                if p is not None:
                    frag += w * (free - p.memory_slots * geo.max_fit[p][mask])
            elif flex and mask:
                frag += w * free * WHOLE_SLOTS / geo.memory_slots
        self._cache[key] = frag
        return frag

    def _node_frag(self, whole_free: int) -> float:
        return sum(
            w * whole_free * WHOLE_SLOTS
            for (kind, k), w in self._weights.items()
            if kind == "gpu" and isinstance(k, int) and whole_free < k
        )

    def whole_key(self, occ: Occupancy, whole_free: int, free: int, count: int) -> Key:
        self._refresh()
        delta = self._node_frag(whole_free - count) - self._node_frag(whole_free)
        return (delta, free - count * WHOLE_SLOTS)

    def mig_key(self, occ: Occupancy, g: int, geo: Geometry, mask: int, p: Profile, s: int) -> Key:
        self._refresh()
        flex = occ.gpus[g].mig_mode == "flex"
        after = mask | p.mask_at(s)
        delta = self._gpu_frag(geo, after, flex) - self._gpu_frag(geo, mask, flex)
        if flex and mask == 0:
            # the GPU stops being whole-free: its node may no longer fit multi-GPU shapes
            f = sum(occ.whole_free(x) for x in occ.node_gpus[occ.node_of[g]])
            delta += self._node_frag(f - 1) - self._node_frag(f)
        return (delta, geo.memory_slots - after.bit_count())


POLICIES: dict[str, Callable[[], PlacementPolicy]] = {
    FirstFit.name: FirstFit,
    BestFit.name: BestFit,
    FragmentationAware.name: FragmentationAware,
}


def make_policy(name: str) -> PlacementPolicy:
    """A fresh policy by name; ``ValueError`` names the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
