"""The ledger's decisions and refusals, on a small mixed inventory."""

from __future__ import annotations

import pytest

from gpupool.core import (
    InvalidRequest,
    Inventory,
    Ledger,
    NoCapacity,
    Node,
    Offer,
    OfferNotAllowed,
    QuotaExceeded,
    Request,
    Team,
)
from gpupool.core.quota import EVERYONE
from tests.factories import OFFERS, TEAMS, gpu, mixed_inventory


@pytest.fixture
def ledger() -> Ledger:
    return Ledger(mixed_inventory(), OFFERS, TEAMS, policy="first-fit")


def test_whole_gpus_come_from_one_node_and_never_from_mig_gpus() -> None:
    ledger = Ledger(mixed_inventory(), OFFERS, {"ops": Team("ops", 100_000)}, policy="first-fit")
    a = ledger.allocate(Request("ana", "ops", "gpu", 4), "a1")
    assert a.node == "a"
    assert [d.gpu for d in a.devices] == ["GPU-a-0", "GPU-a-1", "GPU-a-2", "GPU-a-3"]
    assert a.cost_milli == 4000
    # node a has only MIG GPUs left; node b has 3 whole-capable A100s (one flex)
    b = ledger.allocate(Request("ana", "ops", "gpu", 1), "a2")
    assert b.node == "b"
    with pytest.raises(NoCapacity):
        ledger.allocate(Request("bob", "ops", "gpu", 3), "a3")
    ledger.check_invariants()


def test_nvlink_offer_takes_an_island(ledger: Ledger) -> None:
    ledger.allocate(Request("ana", "ops", "gpu", 1), "one")  # takes GPU-a-0, breaking pair 0-1
    pair = ledger.allocate(Request("ana", "ops", "h100-pair", 2), "pair")
    assert [d.gpu for d in pair.devices] == ["GPU-a-2", "GPU-a-3"]
    with pytest.raises(NoCapacity):
        ledger.allocate(Request("ana", "ops", "h100-pair", 2), "pair2")  # GPU-a-1 has no partner


def test_fixed_instances_are_preferred_and_carry_their_mig_uuid(ledger: Ledger) -> None:
    a = ledger.allocate(Request("ana", "vision", "mig-3g.40gb"), "m1")
    (device,) = a.devices
    assert device.gpu == "GPU-a-5" and device.instance == "MIG-a-5-0"
    assert a.visible_devices == "MIG-a-5-0"
    assert a.cost_milli == 500
    b = ledger.allocate(Request("ana", "vision", "mig-3g.40gb"), "m2")
    assert b.devices[0].gpu == "GPU-a-4" and b.devices[0].instance is None  # dynamic, to create


def test_quota_refusal_names_the_quota(ledger: Ledger) -> None:
    ledger.allocate(Request("ana", "nlp", "gpu", 1), "n1")
    with pytest.raises(QuotaExceeded) as err:
        ledger.allocate(Request("bob", "nlp", "mig-3g.40gb"), "n2")
    assert err.value.message == (
        "MIG 3g.40gb needs 0.5 GPU-eq but team nlp uses 1 of 1 GPU-eq "
        "(guarantee 1, borrow limit 0); 0 GPU-eq left. Free now: nothing within your quota "
        "(free in the pool: 3× gpu, 8× 1g.10gb, 3× 3g.40gb)."
    )


def test_user_cap(ledger: Ledger) -> None:
    ledger.allocate(Request("ana", "vision", "gpu", 2), "v1")
    with pytest.raises(QuotaExceeded, match="your 2 GPU-eq cap in team vision"):
        ledger.allocate(Request("ana", "vision", "mig-1g.10gb"), "v2")
    ledger.allocate(Request("bob", "vision", "mig-1g.10gb"), "v3")  # another member may


def test_no_capacity_says_what_is_free(ledger: Ledger) -> None:
    for i in range(2):  # both 3g.40gb places: the fixed one and half the dynamic GPU
        ledger.allocate(Request("ana", "ops", "gpu", 1), f"g{i}")
    ledger.allocate(Request("u", "vision", "mig-3g.40gb"), "m1")
    ledger.allocate(Request("v", "vision", "mig-3g.40gb"), "m2")
    ledger.allocate(Request("w", "nlp", "mig-3g.40gb"), "m3")
    with pytest.raises(NoCapacity) as err:
        ledger.allocate(Request("x", "nlp", "mig-3g.40gb"), "m4")
    # nlp holds 0.5 of 1, so a whole GPU (1 GPU-eq) is not listed; the dynamic MIG GPU is full
    # and the fixed one has only its 1g.10gb (and 2g.20gb, not allowed for nlp) instance left
    assert err.value.message == (
        "No 3g.40gb free (team nlp uses 0.5 of 1 GPU-eq). Free now: 1× 1g.10gb."
    )


def test_offers_are_enforced_per_team_and_for_everyone(ledger: Ledger) -> None:
    with pytest.raises(OfferNotAllowed, match=r"Team nlp may not request mig-2g\.20gb"):
        ledger.allocate(Request("ana", "nlp", "mig-2g.20gb"), "x")
    with pytest.raises(OfferNotAllowed, match="Users in no team may not request gpu"):
        ledger.allocate(Request("nobody", EVERYONE, "gpu"), "y")
    cpu = ledger.allocate(Request("nobody", EVERYONE, "cpu"), "z")
    assert cpu.devices == () and cpu.cost_milli == 0


@pytest.mark.parametrize(
    ("offer", "count", "match"),
    [("tpu", 1, "Unknown offer 'tpu'"), ("gpu", 5, "count from 1 to 4"), ("gpu", 0, "count")],
)
def test_bad_requests(ledger: Ledger, offer: str, count: int, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match):
        ledger.allocate(Request("ana", "ops", offer, count), "x")


def test_a_refused_request_changes_nothing() -> None:
    ledger = Ledger(mixed_inventory(), OFFERS, {"big": Team("big", 100_000)})
    ledger.allocate(Request("ana", "big", "gpu", 4), "a")
    before = (list(ledger.occ.mask), dict(ledger.team_used), dict(ledger.allocations))
    with pytest.raises(NoCapacity):
        ledger.allocate(Request("ana", "big", "gpu", 4), "b")
    assert (list(ledger.occ.mask), dict(ledger.team_used), dict(ledger.allocations)) == before


def test_borrowing_beyond_guarantee_up_to_the_limit() -> None:
    teams = {"t": Team("t", guarantee_milli=1000, borrow_limit_milli=1000)}
    ledger = Ledger(mixed_inventory(), OFFERS, teams)
    ledger.allocate(Request("a", "t", "gpu", 2), "x")  # guarantee 1 + borrowed 1
    with pytest.raises(QuotaExceeded, match="uses 2 of 2 GPU-eq"):
        ledger.allocate(Request("a", "t", "mig-1g.5gb"), "y")


def test_release_returns_devices_and_quota(ledger: Ledger) -> None:
    a = ledger.allocate(Request("ana", "vision", "mig-2g.20gb"), "x")
    ledger.release("x")
    assert ledger.team_used["vision"] == 0
    assert all(m == 0 for m in ledger.occ.mask)
    again = ledger.allocate(Request("ana", "vision", "mig-2g.20gb"), "y")
    assert again.devices == a.devices
    with pytest.raises(InvalidRequest, match="No allocation x"):
        ledger.release("x")


def test_restore_rebuilds_and_reports_what_vanished() -> None:
    inv = mixed_inventory()
    first = Ledger(inv, OFFERS, TEAMS)
    kept = first.allocate(Request("ana", "ops", "gpu", 2), "keep")
    gone = first.allocate(Request("bob", "vision", "gpu", 1), "gone")
    mig = first.allocate(Request("cy", "vision", "mig-3g.40gb"), "mig")
    # the GPU of "gone" disappeared: rebuild the inventory without it
    node_a, node_b = inv.nodes
    lost_gpu = gone.devices[0].gpu
    nodes = tuple(
        type(n)(n.name, tuple(g for g in n.gpus if g.uuid != lost_gpu)) for n in (node_a, node_b)
    )
    second = Ledger(type(inv)(nodes, source="test"), OFFERS, TEAMS)
    restored, lost = second.restore(first.allocations.values())
    assert {a.id for a in restored} == {"keep", "mig"} and [a.id for a in lost] == ["gone"]
    assert second.allocations["keep"] == kept and second.allocations["mig"] == mig
    second.check_invariants()


def test_quota_is_charged_for_what_the_placement_blocks() -> None:
    # "1g.10gb" is a 1-slot profile on H100-80GB but a 2-slot one on A100-40GB
    offers = {"m": Offer("m", "mig", profile="1g.10gb")}
    ledger = Ledger(mixed_inventory(), offers, {"t": Team("t", 125)}, policy="first-fit")
    a = ledger.allocate(Request("u", "t", "m"), "a")
    assert a.cost_milli == 125 and a.devices[0].gpu == "GPU-a-5"  # the fixed 1g.10gb instance
    a100_only = Inventory((Node("b", (gpu("b", 0, "A100-40GB", "flex"),)),))
    small = Ledger(a100_only, offers, {"t": Team("t", 125)})
    with pytest.raises(QuotaExceeded, match=r"needs 0\.25 GPU-eq"):
        small.allocate(Request("u", "t", "m"), "c")
    assert small.allocations == {} and small.occ.mask == [0]
