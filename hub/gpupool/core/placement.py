"""Placement policies: where a demand lands, given the occupancy. Swappable by name.

Vocabulary
- *demand*: the device part of a request: ``count`` whole GPUs (of a ``model``, maybe all in one
  NVLink island) on one node, ``count`` MIG instances of a ``profile`` on one node (each placed
  by the policy in turn, on one GPU or several), or one share of a GPU with MIG
  off (``share_milli`` thousandths, or ``share_mib`` MiB: its *need* on a GPU is then its cost
  there, :func:`gpupool.core.offers.share_cost_milli`); never on the nodes (by ordinal) in
  ``avoid`` (a multi-node job's other nodes, so each of its nodes is a machine).
- *pick*: one device chosen for a demand: GPU ordinal, and for MIG the profile, start slot and,
  on fixed-mode GPUs, the existing instance's UUID; for a share the milli it takes.
- *free milli*: what is left on a GPU in thousandths of it (free MIG slots, or memory not held by
  shares); a node's is the sum over its GPUs.
- Policies: ``first-fit`` (nodes in order, GPUs by index, lowest start slot; whole GPUs: the first
  node with enough whole-free GPUs, its lowest-index ones; a share: the first GPU where it fits),
  ``best-fit`` (the GPU, for MIG and shares, or the node, for whole GPUs, with the least free
  milli left after placing; ties by file order, then GPU index, then lowest start; whole GPUs are
  the node's lowest-index whole-free ones), and ``gpupool``: fragmentation-aware, after FGD
  ("Beware of Fragmentation", ATC'23). It estimates the workload from the demands it has seen and
  places where the expected free capacity that the next demand could *not* use grows least, so
  the largest shapes stay placeable.

Contract: ``place`` leaves the occupancy as it came (several MIG instances are taken on it in
turn while they are placed, and given back); it returns picks or ``None`` (does not fit).
Fixed instances (already created: on ``fixed`` GPUs, and an admin's on ``dynamic`` ones) are
preferred over creating new ones: taking one creates nothing and spends no free slot (an
admin's instance's slots are reserved whether it is held or not).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

from gpupool.core.mig import Geometry, Profile
from gpupool.core.occupancy import (
    FIXED_CODE,
    NODE_CODE,
    SHARE_MILLI,
    WHOLE_SLOTS,
    MinSet,
    Occupancy,
    ShareGroup,
)
from gpupool.core.offers import Offer, share_cost_milli
from gpupool.core.units import GPU_MILLI


@dataclass(frozen=True)
class Demand:
    kind: str  # "gpu", "mig" or "share"
    count: int = 1
    model: str | None = None
    nvlink: bool = False
    profile: str | None = None
    avoid: frozenset[int] = frozenset()
    """Node ordinals the demand must not land on."""
    share_milli: int | None = None
    share_mib: int | None = None

    @classmethod
    def of(cls, offer: Offer, count: int, avoid: frozenset[int] = frozenset()) -> Demand:
        """The device part of a request for ``count`` of ``offer``, off the nodes ``avoid``."""
        return cls(
            offer.kind, count, offer.model, offer.nvlink, offer.profile, avoid,
            offer.share_milli, offer.share_mib,
        )  # fmt: skip

    def share_need(self, memory_mib: int) -> int:
        """The milli a share demand takes on a GPU of ``memory_mib``."""
        if self.share_milli is not None:
            return self.share_milli
        return share_cost_milli(self.share_mib or 0, memory_mib)


class Pick(NamedTuple):
    gpu: int
    profile: Profile | None = None
    start: int | None = None
    instance: str | None = None
    share: int | None = None
    """For a share: the thousandths of the GPU it takes."""


Key = tuple[float, ...]


class PlacementPolicy:
    """Base policy: enumerates candidates; subclasses only rank them with two key functions."""

    name = "base"

    def observe(self, demand: Demand) -> None:
        """Called for every demand before it is placed (whether it fits or not)."""

    def copy(self) -> PlacementPolicy:
        """A policy in this one's state: it places every demand as this one would now (what a
        ledger's clone needs, so that a plan made on it is what the ledger then grants)."""
        return type(self)()

    # ranking hooks: lower sorts first; ties go to lower ordinal, then lower start slot
    def whole_key(self, occ: Occupancy, whole_free: int, free: int, count: int) -> Key:
        raise NotImplementedError

    def mig_key(self, occ: Occupancy, g: int, geo: Geometry, mask: int, p: Profile, s: int) -> Key:
        raise NotImplementedError

    whole_by_free = True
    """Whether :meth:`whole_key` grows with the node's free milli (then nodes are tried by free
    milli, then order; else by order alone)."""

    def share_candidate(
        self, occ: Occupancy, group: ShareGroup, need: int, avoid: frozenset[int]
    ) -> tuple[Key, int] | None:
        """The best GPU of ``group`` for a share of ``need`` milli, with its rank (lower first;
        ties go to the lower ordinal), or ``None`` when none fits."""
        raise NotImplementedError

    # -- enumeration -----------------------------------------------------------------------
    def place(self, occ: Occupancy, demand: Demand) -> list[Pick] | None:
        if demand.kind == "gpu":
            return self._place_whole(occ, demand)
        if demand.kind == "share":
            share = self._place_share(occ, demand)
            return [share] if share else None
        if demand.count > 1:
            return self._place_migs(occ, demand)
        pick = self._pick_fixed(occ, demand) or self._place_dynamic(occ, demand)
        return [pick] if pick else None

    def _place_migs(self, occ: Occupancy, d: Demand) -> list[Pick] | None:
        """``d.count`` MIG instances on one node: the policy places the first anywhere, then,
        each taken on the occupancy in turn, the others on that node; when they do not all fit
        there, the next node the first lands on. The occupancy is left as it came."""
        nodes = frozenset(range(len(occ.node_gpus)))
        avoid = d.avoid
        while True:
            one = replace(d, count=1, avoid=avoid)
            first = self._pick_fixed(occ, one) or self._place_dynamic(occ, one)
            if first is None:
                return None
            n = occ.node_of[first.gpu]
            here = replace(d, count=1, avoid=nodes - {n})
            taken: list[Pick] = []
            try:
                pick: Pick | None = first
                while pick is not None:
                    assert pick.profile is not None and pick.start is not None
                    occ.take_slots(pick.gpu, pick.profile, pick.start)
                    taken.append(pick)
                    if len(taken) == d.count:
                        return taken
                    pick = self._pick_fixed(occ, here) or self._place_dynamic(occ, here)
            finally:
                for p in taken:
                    assert p.profile is not None and p.start is not None
                    occ.free_slots(p.gpu, p.profile, p.start)
            avoid = avoid | {n}

    def _place_share(self, occ: Occupancy, d: Demand) -> Pick | None:
        best: tuple[Key, int] | None = None
        best_need = 0
        for group, need in occ.share_needs(d.model, d.share_need, d.share_mib):
            found = self.share_candidate(occ, group, need, d.avoid)
            if found is not None and (best is None or found < best):
                best, best_need = found, need
        return Pick(best[1], share=best_need) if best else None

    def _place_whole(self, occ: Occupancy, d: Demand) -> list[Pick] | None:
        best: tuple[Key, int] | None = None
        best_gpus: list[int] = []
        by_free = self.whole_by_free
        node: Callable[[int], int] = _node_of_code if by_free else _same
        for key_mf, bucket in occ.node_buckets.items():
            model, f = key_mf
            if f < d.count or (d.model is not None and model != d.model) or not bucket:
                continue
            codes = occ.node_free[key_mf] if by_free else bucket
            if d.nvlink and d.count > 1:
                found: list[int | None] = [c for c in codes if node(c) not in d.avoid]
            else:
                found = [_first(codes, d.avoid, node)]
            for c in found:
                if c is None:
                    continue
                n = node(c)
                free = c // NODE_CODE if by_free else occ.node_free_milli(n)
                key = self.whole_key(occ, f, free, d.count)
                if best is not None and (key, n) >= best:
                    break
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


def _node_of_code(code: int) -> int:
    return code % NODE_CODE


def _same(x: int) -> int:
    return x


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
    for (m, f), bucket in occ.node_buckets.items():
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
    whole_by_free = False

    def whole_key(self, occ: Occupancy, whole_free: int, free: int, count: int) -> Key:
        return ()

    def mig_key(self, occ: Occupancy, g: int, geo: Geometry, mask: int, p: Profile, s: int) -> Key:
        return ()

    def share_candidate(
        self, occ: Occupancy, group: ShareGroup, need: int, avoid: frozenset[int]
    ) -> tuple[Key, int] | None:
        if not avoid:
            g = group.first_fitting(need)
        else:
            g = next((x for x in group.fitting(need) if occ.node_of[x] not in avoid), None)
        return None if g is None else ((), g)


class BestFit(PlacementPolicy):
    name = "best-fit"

    def whole_key(self, occ: Occupancy, whole_free: int, free: int, count: int) -> Key:
        return (free - count * GPU_MILLI,)

    def mig_key(self, occ: Occupancy, g: int, geo: Geometry, mask: int, p: Profile, s: int) -> Key:
        return (geo.memory_slots - mask.bit_count() - p.memory_slots,)

    def share_candidate(
        self, occ: Occupancy, group: ShareGroup, need: int, avoid: frozenset[int]
    ) -> tuple[Key, int] | None:
        used = group.used_values
        # the most used GPUs where the share still fits, fullest first
        for i in range(bisect_right(used, SHARE_MILLI - need) - 1, -1, -1):
            u = used[i]
            g = _first(group.by_used[u], avoid, occ.node_of.__getitem__)
            if g is not None:
                return (SHARE_MILLI - u - need,), g
        return None


class FragmentationAware(PlacementPolicy):
    """gpupool's policy: minimise the growth of expected fragmentation (FGD-style).

    The workload estimate is the mix of demands seen so far (each shape counted once up front, so
    an empty history still guards every shape). For a GPU with mask ``m``, the fragmentation
    against a MIG shape ``p`` is the free slots that ``p`` cannot use: ``free(m) - size(p) *
    fits(p, m)``; against a whole-GPU shape, the free slots of a partly used ``flex`` GPU. For a
    node against a ``k``-GPU shape it is its whole-free GPUs when there are fewer than ``k``.
    For a GPU with MIG off and ``F`` milli free (shares): against a share larger than ``F``, all
    of ``F``; against a whole-GPU shape, ``F`` when the GPU is partly used. Everything is counted
    in eighths of a GPU. The expected fragmentation is the weighted sum; a placement's score is
    how much it grows (for a share on an empty GPU, the node's too), then best-fit's free milli
    left, then order.

    Shares are ranked by used milli, not by GPU: for each share size the used values are sorted
    once by score (cached until the workload estimate changes), and the first used value that
    some GPU has wins; empty GPUs are weighed per node kind (their node's whole-free count).
    """

    name = "gpupool"
    node_aware_empty = True

    def __init__(self) -> None:
        self._seen: Counter[tuple[str, int | str]] = Counter()
        self._weights: dict[tuple[str, int | str], float] = {}
        self._cache: dict[tuple[str, int, str, int], float] = {}
        self._share_frags: dict[int, list[float]] = {}
        self._share_orders: dict[tuple[int, int], list[int]] = {}
        self._dirty = True

    def copy(self) -> FragmentationAware:
        """The demands seen and the weights derived from them (re-derived only now and then,
        so both are copied); the caches are functions of the weights and are shared."""
        twin = type(self)()
        twin._seen = Counter(self._seen)
        twin._weights = dict(self._weights)
        twin._dirty = self._dirty
        twin._cache = dict(self._cache)
        twin._share_frags = dict(self._share_frags)
        twin._share_orders = dict(self._share_orders)
        return twin

    def observe(self, demand: Demand) -> None:
        shape: tuple[str, int | str]
        if demand.kind == "gpu":
            shape = ("gpu", demand.count)
        elif demand.kind == "share":
            if demand.share_milli is not None:
                shape = ("share", demand.share_milli)
            else:
                shape = ("share-mib", demand.share_mib or 0)
        else:
            shape = ("mig", demand.profile or "")
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
        self._share_frags.clear()
        self._share_orders.clear()
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
            elif kind == "gpu" and flex and mask:
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
        return (delta, free - count * GPU_MILLI)

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

    # -- shares ----------------------------------------------------------------------------
    def _share_frag(self, memory_mib: int) -> list[float]:
        """Fragmentation (eighths) of a MIG-off GPU of ``memory_mib`` by its free milli."""
        frags = self._share_frags.get(memory_mib)
        if frags is not None:
            return frags
        # larger[F]: the weight of share shapes that need more than F milli
        larger = [0.0] * (SHARE_MILLI + 2)
        whole = 0.0
        for (kind, what), w in self._weights.items():
            if kind == "gpu":
                whole += w
            elif kind in ("share", "share-mib") and isinstance(what, int):
                need = what if kind == "share" else share_cost_milli(what, memory_mib)
                larger[min(need, SHARE_MILLI + 1) - 1] += w
        for f in range(SHARE_MILLI, -1, -1):
            larger[f] += larger[f + 1]
        scale = WHOLE_SLOTS / SHARE_MILLI
        frags = [
            f * scale * (larger[f] + (whole if f < SHARE_MILLI else 0.0))
            for f in range(SHARE_MILLI + 1)
        ]
        self._share_frags[memory_mib] = frags
        return frags

    def _share_order(self, memory_mib: int, need: int) -> list[int]:
        """Used values ``u`` from 1 to ``1000 - need``, best first: by the growth of
        fragmentation when a ``need`` share joins, then by free milli left."""
        key = (memory_mib, need)
        order = self._share_orders.get(key)
        if order is None:
            frag = self._share_frag(memory_mib)
            top = SHARE_MILLI
            order = sorted(
                range(1, top - need + 1),
                key=lambda u: (frag[top - u - need] - frag[top - u], top - u - need),
            )
            self._share_orders[key] = order
        return order

    def share_candidate(
        self, occ: Occupancy, group: ShareGroup, need: int, avoid: frozenset[int]
    ) -> tuple[Key, int] | None:
        self._refresh()
        frag = self._share_frag(group.memory_mib)
        top = SHARE_MILLI
        node_of = occ.node_of.__getitem__
        best: tuple[Key, int] | None = None
        by_used = group.by_used
        for u in self._share_order(group.memory_mib, need):
            bucket = by_used.get(u)
            if bucket:
                g = _first(bucket, avoid, node_of)
                if g is not None:
                    best = ((frag[top - u - need] - frag[top - u], top - u - need), g)
                    break
        if 0 in by_used:
            # an empty GPU: its node loses a whole-free GPU too; one candidate per node kind
            base = frag[top - need] - frag[top]
            empties = [_first(by_used[0], avoid, node_of)]
            for (model, f), bucket in occ.node_buckets.items():
                n = _first(bucket, avoid, lambda n: n) if model == group.model and f else None
                if n is not None:
                    empties.append(
                        next(
                            (
                                g
                                for g in occ.node_gpus[n]
                                if occ.share_group_of.get(g) is group and occ.whole_free(g)
                            ),
                            None,
                        )
                    )
            for g in empties:
                if g is None:
                    continue
                f = occ.node_whole_free(occ.node_of[g])
                cand = ((base + self._node_frag(f - 1) - self._node_frag(f), top - need), g)
                if best is None or cand < best:
                    best = cand
        return best


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
