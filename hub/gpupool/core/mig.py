"""MIG geometry: which GPU-instance profiles a model offers and where they may sit.

Vocabulary
- *memory slot*: one of the GPU's equal memory slices (8 on A100/H100/H200, 4 on A30).
  A GPU's occupancy is a bitmask over its memory slots (bit ``i`` = slot ``i`` is taken).
- *profile*: an NVIDIA GPU-instance profile (``3g.40gb``), with its NVIDIA profile ID (the ``ID``
  column of ``nvidia-smi mig -lgip``, ``profileId`` in NVML), memory slots, compute slices and
  allowed start slots (``nvidia-smi mig -lgipp``: ``{0,4}:4``).
- *geometry*: the profiles of one GPU model.

Contract: pure functions and frozen data; no I/O. Names drift with drivers (``3g.39gb`` for
``3g.40gb``), so :meth:`Geometry.resolve` matches by profile ID and size, and by the compute part
plus the nearest memory size when only a name is known.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

_NAME = re.compile(r"^(?P<compute>\d+)g\.(?P<mem>\d+)gb(?P<me>\+me)?$")


@dataclass(frozen=True)
class Profile:
    """One GPU-instance profile of one model."""

    name: str
    profile_id: int
    compute_slices: int
    memory_slots: int
    starts: tuple[int, ...]
    max_count: int
    memory_gb: int

    @property
    def compute(self) -> str:
        """The compute part of the name, ``3g``."""
        return f"{self.compute_slices}g"

    def mask_at(self, start: int) -> int:
        """The occupancy bits this profile takes when placed at ``start``."""
        return ((1 << self.memory_slots) - 1) << start


@dataclass(frozen=True)
class Geometry:
    """The MIG layout rules of one GPU model."""

    model: str
    memory_slots: int
    compute_slices: int
    profiles: tuple[Profile, ...] = field(repr=False)

    @property
    def full_mask(self) -> int:
        return (1 << self.memory_slots) - 1

    @cached_property
    def by_name(self) -> dict[str, Profile]:
        return {p.name: p for p in self.profiles}

    @cached_property
    def by_id(self) -> dict[int, Profile]:
        return {p.profile_id: p for p in self.profiles}

    def resolve(
        self,
        name: str | None = None,
        *,
        profile_id: int | None = None,
        memory_slots: int | None = None,
    ) -> Profile | None:
        """The profile meant by an NVML profile ID (and placement size) or by a name.

        An ID wins over a name; a size that contradicts the ID means the ID belongs to another
        model and nothing matches. A drifted name (``3g.39gb``) resolves to the profile with the
        same compute part and the nearest memory size, as long as that is within 10%.
        """
        if profile_id is not None:
            found = self.by_id.get(profile_id)
            if found is None or (memory_slots is not None and found.memory_slots != memory_slots):
                return None
            return found
        if name is None:
            return None
        name = name.strip().lower().removeprefix("mig-").removeprefix("mig ")
        if name in self.by_name:
            return self.by_name[name]
        m = _NAME.match(name)
        if not m:
            return None
        compute, mem, media = int(m["compute"]), int(m["mem"]), bool(m["me"])
        candidates = [
            p
            for p in self.profiles
            if p.compute_slices == compute
            and p.name.endswith("+me") == media
            and abs(p.memory_gb - mem) <= 0.1 * p.memory_gb
            and (memory_slots is None or p.memory_slots == memory_slots)
        ]
        return min(candidates, key=lambda p: abs(p.memory_gb - mem), default=None)

    def cost_milli(self, profile: Profile) -> int:
        """GPU-equivalents this profile blocks, in thousandths (DESIGN.md's quota unit)."""
        return profile.memory_slots * 1000 // self.memory_slots

    def starts_free(self, occupied: int, profile: Profile) -> list[int]:
        """Allowed start slots for ``profile`` on a GPU whose taken slots are ``occupied``."""
        return [s for s in profile.starts if not occupied & profile.mask_at(s)]

    def fit(
        self, wanted: Iterable[str | Profile], occupied: Sequence[tuple[Profile, int]] = ()
    ) -> list[tuple[Profile, int]] | None:
        """Where a multiset of profiles fits one GPU (beside what is ``occupied``), or ``None``.

        Returns ``(profile, start)`` pairs for the wanted profiles, largest first. Exhaustive
        backtracking: a GPU has at most 8 slots, so this is tiny.
        """
        profiles: list[Profile] = []
        for w in wanted:
            p = w if isinstance(w, Profile) else self.resolve(w)
            if p is None or p not in self.profiles:
                return None
            profiles.append(p)
        counts = Counter(p for p, _ in occupied)
        counts.update(profiles)
        if any(n > p.max_count for p, n in counts.items()):
            return None
        compute_used = sum(p.compute_slices * n for p, n in counts.items())
        if compute_used > self.compute_slices:
            return None
        mask = 0
        for p, s in occupied:
            if mask & p.mask_at(s):
                return None
            mask |= p.mask_at(s)
        order = sorted(profiles, key=lambda p: (-p.memory_slots, -p.compute_slices, p.name))

        def place(i: int, mask: int) -> list[tuple[Profile, int]] | None:
            if i == len(order):
                return []
            p = order[i]
            for s in self.starts_free(mask, p):
                rest = place(i + 1, mask | p.mask_at(s))
                if rest is not None:
                    return [(p, s), *rest]
            return None

        return place(0, mask)

    @cached_property
    def max_fit(self) -> dict[Profile, tuple[int, ...]]:
        """For each profile, how many more instances fit, indexed by occupancy mask.

        Counts slot geometry only (the occupancy mask does not say which profiles made it), which
        is exact for every table here: each profile's start list already encodes its max count.
        """
        table: dict[Profile, tuple[int, ...]] = {}
        for p in self.profiles:
            row = []
            for mask in range(1 << self.memory_slots):
                row.append(_greedy_count(self, p, mask))
            table[p] = tuple(row)
        return table


def _greedy_count(geometry: Geometry, p: Profile, mask: int) -> int:
    # Same-size placements either coincide or do not overlap for every profile in the tables
    # (starts are multiples of the size, or size 1), so taking the lowest free start each time
    # is optimal.
    n = 0
    while n < p.max_count:
        starts = geometry.starts_free(mask, p)
        if not starts:
            break
        mask |= p.mask_at(starts[0])
        n += 1
    return n


def _eight_slot_model(model: str, gb: tuple[int, int, int, int, int, int]) -> Geometry:
    """An 8-slot, 7-slice model (A100, H100, H200): sizes for 1g, 1g-double, 2g, 3g, 4g, 7g."""
    g1, g1d, g2, g3, g4, g7 = gb
    profiles = (
        Profile(f"1g.{g1}gb", 19, 1, 1, (0, 1, 2, 3, 4, 5, 6), 7, g1),
        Profile(f"1g.{g1}gb+me", 20, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1, g1),
        Profile(f"1g.{g1d}gb", 15, 1, 2, (0, 2, 4, 6), 4, g1d),
        Profile(f"2g.{g2}gb", 14, 2, 2, (0, 2, 4), 3, g2),
        Profile(f"3g.{g3}gb", 9, 3, 4, (0, 4), 2, g3),
        Profile(f"4g.{g4}gb", 5, 4, 4, (0,), 1, g4),
        Profile(f"7g.{g7}gb", 0, 7, 8, (0,), 1, g7),
    )
    return Geometry(model, 8, 7, profiles)


_A30 = Geometry(
    "A30-24GB",
    4,
    4,
    (
        Profile("1g.6gb", 14, 1, 1, (0, 1, 2, 3), 4, 6),
        Profile("1g.6gb+me", 21, 1, 1, (0, 1, 2, 3), 1, 6),
        Profile("2g.12gb", 5, 2, 2, (0, 2), 2, 12),
        Profile("2g.12gb+me", 6, 2, 2, (0, 2), 1, 12),
        Profile("4g.24gb", 0, 4, 4, (0,), 1, 24),
    ),
)

GEOMETRIES: dict[str, Geometry] = {
    g.model: g
    for g in (
        _eight_slot_model("A100-40GB", (5, 10, 10, 20, 20, 40)),
        _eight_slot_model("A100-80GB", (10, 20, 20, 40, 40, 80)),
        _eight_slot_model("H100-80GB", (10, 20, 20, 40, 40, 80)),
        _eight_slot_model("H200-141GB", (18, 35, 35, 71, 71, 141)),
        _A30,
    )
}
"""MIG-capable models by gpupool's model key (``H100-80GB``)."""


def geometry_for(model: str) -> Geometry | None:
    """The geometry of a model key, or ``None`` for a model without MIG."""
    return GEOMETRIES.get(model)
