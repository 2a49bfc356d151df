"""MIG geometry against NVIDIA's placement tables (DESIGN.md, ``nvidia-smi mig -lgipp``)."""

import pytest

from gpupool.core.mig import GEOMETRIES

EIGHT_SLOT = {
    # model: (1g, 2g, 3g, 4g, 7g, 1g double-memory) names
    "A100-40GB": ("1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb", "1g.10gb"),
    "A100-80GB": ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.20gb"),
    "H100-80GB": ("1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1g.20gb"),
    "H200-141GB": ("1g.18gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb", "1g.35gb"),
}

VALID = {
    "4g+3g": ("4g", "3g"),
    "3x2g+1g": ("2g", "2g", "2g", "1g"),
    "7x1g": ("1g",) * 7,
    "4g+2g+1g": ("4g", "2g", "1g"),
    "7g": ("7g",),
    "4x1g-double": ("1gd",) * 4,
    "3g+3g": ("3g", "3g"),
}
INVALID = {
    "4g+4g": ("4g", "4g"),
    "3g+3g+1g": ("3g", "3g", "1g"),
    "3x2g+2x1g": ("2g", "2g", "2g", "1g", "1g"),
    "8x1g": ("1g",) * 8,
    "7g+1g": ("7g", "1g"),
    "5x1g-double": ("1gd",) * 5,
}


def names(model: str, shapes: tuple[str, ...]) -> list[str]:
    g1, g2, g3, g4, g7, g1d = EIGHT_SLOT[model]
    table = {"1g": g1, "2g": g2, "3g": g3, "4g": g4, "7g": g7, "1gd": g1d}
    return [table[s] for s in shapes]


@pytest.mark.parametrize("model", sorted(EIGHT_SLOT))
@pytest.mark.parametrize("layout", sorted(VALID))
def test_valid_layouts_fit_with_legal_disjoint_placements(model: str, layout: str) -> None:
    geo = GEOMETRIES[model]
    placed = geo.fit(names(model, VALID[layout]))
    assert placed is not None, f"{layout} must fit on {model}"
    mask = 0
    for profile, start in placed:
        assert start in profile.starts
        assert not mask & profile.mask_at(start)
        mask |= profile.mask_at(start)
    assert mask <= geo.full_mask


@pytest.mark.parametrize("model", sorted(EIGHT_SLOT))
@pytest.mark.parametrize("layout", sorted(INVALID))
def test_invalid_layouts_are_refused(model: str, layout: str) -> None:
    assert GEOMETRIES[model].fit(names(model, INVALID[layout])) is None


def test_one_3g_leaves_room_for_three_1g_not_four() -> None:
    geo = GEOMETRIES["H100-80GB"]
    three_g, one_g = geo.by_name["3g.40gb"], geo.by_name["1g.10gb"]
    assert geo.max_fit[one_g][0] == 7
    assert geo.max_fit[one_g][three_g.mask_at(0)] == 3
    assert geo.fit(["1g.10gb"] * 3, occupied=[(three_g, 0)]) is not None
    assert geo.fit(["1g.10gb"] * 4, occupied=[(three_g, 0)]) is None


def test_seven_1g_leave_slot_seven_empty() -> None:
    geo = GEOMETRIES["A100-80GB"]
    placed = geo.fit(["1g.10gb"] * 7)
    assert placed is not None
    assert sorted(s for _, s in placed) == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("valid", "layout"),
    [
        (True, ["2g.12gb", "1g.6gb", "1g.6gb"]),
        (True, ["4g.24gb"]),
        (False, ["4g.24gb", "1g.6gb"]),
        (True, ["1g.6gb"] * 4),
        (False, ["2g.12gb"] * 3),
    ],
)
def test_a30_has_four_slots(valid: bool, layout: list[str]) -> None:
    assert (GEOMETRIES["A30-24GB"].fit(layout) is not None) is valid


def test_profiles_resolve_by_id_and_size_despite_name_drift() -> None:
    geo = GEOMETRIES["H100-80GB"]
    assert geo.resolve("3g.39gb").name == "3g.40gb"
    assert geo.resolve("MIG 3g.40gb").name == "3g.40gb"
    assert geo.resolve(profile_id=9, memory_slots=4).name == "3g.40gb"
    assert geo.resolve(profile_id=15).name == "1g.20gb"
    assert geo.resolve(profile_id=9, memory_slots=2) is None  # size contradicts the ID
    assert geo.resolve("3g.20gb") is None  # an A100-40GB name, 50% off
    assert geo.resolve("5g.50gb") is None


def test_costs_are_memory_slots_over_eight() -> None:
    geo = GEOMETRIES["H100-80GB"]
    assert geo.cost_milli(geo.by_name["3g.40gb"]) == 500
    assert geo.cost_milli(geo.by_name["1g.10gb"]) == 125
    assert geo.cost_milli(geo.by_name["7g.80gb"]) == 1000
    a30 = GEOMETRIES["A30-24GB"]
    assert a30.cost_milli(a30.by_name["1g.6gb"]) == 250


def test_profile_ids_match_nvidia_smi() -> None:
    ids = {p.name: p.profile_id for p in GEOMETRIES["H100-80GB"].profiles}
    assert ids == {
        "1g.10gb": 19,
        "1g.10gb+me": 20,
        "1g.20gb": 15,
        "2g.20gb": 14,
        "3g.40gb": 9,
        "4g.40gb": 5,
        "7g.80gb": 0,
    }
    a30 = {p.name: p.profile_id for p in GEOMETRIES["A30-24GB"].profiles}
    assert a30 == {"1g.6gb": 14, "1g.6gb+me": 21, "2g.12gb": 5, "2g.12gb+me": 6, "4g.24gb": 0}
