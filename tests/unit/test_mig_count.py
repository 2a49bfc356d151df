"""Several MIG instances of one profile in one request: config, quota, admission, placement (all on
one node, on one GPU or several), undo when they do not all fit, release and restore."""

from __future__ import annotations

import pytest

from gpupool.core import (
    InvalidRequest,
    Inventory,
    Ledger,
    NoCapacity,
    Node,
    Offer,
    QuotaExceeded,
    Request,
    Team,
)
from gpupool.core.admission import Usage, admit
from gpupool.core.placement import POLICIES, Demand, make_policy
from gpupool.core.quota import check_offer
from gpupool.declarations import ConfigError, config_warnings, parse_offer, parse_settings
from tests.factories import gpu

OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "mig-3g": Offer("mig-3g", "mig", model="H100-80GB", profile="3g.40gb", max_count=5),
    "mig-1g": Offer("mig-1g", "mig", model="H100-80GB", profile="1g.10gb"),
}
TEAMS = {
    "roomy": Team("roomy", 100_000),
    "small": Team("small", 1000, 0, None, None),
    "capped": Team("capped", 10_000, 0, 1000, None),
}


def inventory() -> Inventory:
    """Node a: one dynamic H100 (room for two 3g); node b: two dynamic H100s (room for four);
    node c: a fixed H100 with one 3g.40gb (at 0) and a dynamic one (room for three)."""
    return Inventory(
        (
            Node("a", (gpu("a", 0, mode="dynamic"),)),
            Node("b", (gpu("b", 0, mode="dynamic"), gpu("b", 1, mode="dynamic"))),
            Node(
                "c",
                (
                    gpu("c", 0, mode="fixed", instances=(("3g.40gb", 0),)),
                    gpu("c", 1, mode="dynamic"),
                ),
            ),
        ),
        source="test",
    )


def ledger(policy: str = "gpupool") -> Ledger:
    return Ledger(inventory(), OFFERS, TEAMS, policy=policy)


def state(ledger: Ledger) -> tuple[object, ...]:
    occ = ledger.occ
    return dict(ledger.allocations), list(occ.mask), +ledger.team_used, +ledger.user_used


# -- config --------------------------------------------------------------------------------------


def test_a_mig_offer_takes_a_max_count_validated_like_a_gpu_offers() -> None:
    offer = parse_offer("mig-1g.10gb", {"model": "H100-80GB", "max_count": 3})
    assert (offer.kind, offer.max_count, offer.counted) == ("mig", 3, True)
    for bad in (0, -1, True, "2"):
        with pytest.raises(ConfigError) as e:
            parse_offer("mig-1g.10gb", {"model": "H100-80GB", "max_count": bad})
        assert e.value.path == "GPUPool.offers['mig-1g.10gb'].max_count"
    with pytest.raises(ConfigError, match="only 'gpu' and 'mig' offers take a count"):
        parse_offer("share-q", {"kind": "share", "fraction": 0.25, "max_count": 2})


def test_a_mig_max_count_above_what_one_node_holds_is_warned_about() -> None:
    settings = parse_settings(
        {"mig-3g.40gb": {"model": "H100-80GB", "max_count": 5}}, {"t": {"guarantee": 8}}, {}
    )
    (warning,) = [w for w in config_warnings(settings, inventory()) if "max_count" in w]
    assert warning == (
        "GPUPool.offers['mig-3g.40gb'].max_count: 5 is more than one request can get: at most 4 "
        "3g.40gb instances on one node; larger requests can never be granted"
    )
    fits = parse_settings(
        {"mig-3g.40gb": {"model": "H100-80GB", "max_count": 4}}, {"t": {"guarantee": 8}}, {}
    )
    assert not [w for w in config_warnings(fits, inventory()) if "max_count" in w]


# -- quota and admission -------------------------------------------------------------------------


def test_the_count_of_a_mig_request_is_checked_against_its_offer() -> None:
    team = TEAMS["roomy"]
    assert check_offer(team, OFFERS, "mig-3g", 5) is OFFERS["mig-3g"]
    with pytest.raises(InvalidRequest, match="count from 1 to 5, not 6"):
        check_offer(team, OFFERS, "mig-3g", 6)
    with pytest.raises(InvalidRequest, match="count from 1 to 1, not 2"):
        check_offer(team, OFFERS, "mig-1g", 2)
    usage = Usage(0, 0, 10, 10)
    verdict = admit(team, OFFERS["mig-3g"], 6, 1, usage)
    assert (verdict.verdict, verdict.cause) == ("never", "count")
    assert verdict.reason == "mig-3g takes 1 to 5 3g.40gb instances per node"


def test_admission_costs_every_instance_and_counts_them_on_one_node() -> None:
    led = ledger()
    offer = OFFERS["mig-3g"]
    assert OFFERS["mig-3g"].cost_milli(3) == 1500
    small = led.admit(TEAMS["small"], "ana", offer, 3)
    assert (small.verdict, small.cause) == ("never", "quota")
    assert small.reason.startswith("needs 1.5 GPU-eq")
    # the pool holds 2 + 4 + 3 of them, but at most 4 on one node
    assert led.placeable(offer) == 9
    never = led.admit(TEAMS["roomy"], "ana", offer, 5)
    assert (never.verdict, never.cause) == ("never", "capacity")
    assert never.reason == "this pool holds at most 4 of mig-3g on one node"
    assert led.admit(TEAMS["roomy"], "ana", offer, 4).now
    led.allocate(Request("ana", "roomy", "mig-3g", 4), "y")  # node b
    wait = led.admit(TEAMS["roomy"], "ana", offer, 4)
    assert (wait.verdict, wait.cause) == ("wait", "capacity")
    assert wait.reason == "only 3 free on one node"
    assert led.placeable(offer) == 5  # one request of one instance still has five places
    assert led.admit(TEAMS["roomy"], "ana", offer, 3).now


# -- placement -----------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_several_instances_land_on_one_node_over_its_gpus(policy: str) -> None:
    led = ledger(policy)
    a = led.allocate(Request("ana", "roomy", "mig-3g", 4), "four")
    assert a.node == "b" and a.count == 4 and a.cost_milli == 2000
    assert len(a.devices) == 4 and {d.gpu for d in a.devices} == {"GPU-b-0", "GPU-b-1"}
    assert all(d.profile == "3g.40gb" for d in a.devices)
    assert len({(d.gpu, d.start) for d in a.devices}) == 4
    assert led.team_used["roomy"] == 2000
    led.check_invariants()
    assert led.allocate(Request("ana", "roomy", "mig-3g", 3), "three").node == "c"
    assert led.allocate(Request("ana", "roomy", "mig-3g", 2), "two").node == "a"
    with pytest.raises(NoCapacity):
        led.allocate(Request("ana", "roomy", "mig-3g", 1), "none")
    led.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_instances_that_fit_only_across_nodes_are_refused_and_nothing_changes(
    policy: str,
) -> None:
    led = ledger(policy)
    led.allocate(Request("ana", "roomy", "mig-3g", 4), "b")  # node b is full
    before = state(led)
    assert led.placeable(OFFERS["mig-3g"]) == 5  # two on a, three on c
    with pytest.raises(NoCapacity) as e:
        led.allocate(Request("ana", "roomy", "mig-3g", 4), "across")
    assert e.value.message.startswith("No 4× 3g.40gb on one node free")
    assert state(led) == before
    led.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_placing_leaves_the_occupancy_as_it_came(policy: str) -> None:
    led = ledger(policy)
    led.allocate(Request("ana", "roomy", "mig-3g", 1), "one")
    mask, fixed = list(led.occ.mask), {k: set(v) for k, v in led.occ.fixed_buckets.items()}
    picks = make_policy(policy).place(led.occ, Demand("mig", 4, "H100-80GB", profile="3g.40gb"))
    assert picks is not None and len(picks) == 4
    assert len({led.occ.node_of[p.gpu] for p in picks}) == 1
    assert led.occ.mask == mask
    assert {k: set(v) for k, v in led.occ.fixed_buckets.items()} == fixed


def test_a_fixed_instance_and_a_new_one_on_one_node_are_both_handed_out() -> None:
    led = ledger("first-fit")
    c = led.allocate(Request("ana", "roomy", "mig-3g", 3), "c")  # the fixed instance first
    assert c.node == "c"
    fixed = [d for d in c.devices if d.gpu == "GPU-c-0"]
    assert [(d.start, d.instance) for d in fixed] == [(0, "MIG-c-0-0")]
    assert sum(d.gpu == "GPU-c-1" and d.instance is None for d in c.devices) == 2
    assert c.visible_devices.split(",")[0] == "MIG-c-0-0"  # fixed ones come first
    led.check_invariants()


def test_the_quota_is_checked_with_the_total_cost() -> None:
    led = ledger()
    with pytest.raises(QuotaExceeded) as e:
        led.allocate(Request("ana", "capped", "mig-3g", 3), "x")
    assert "3× MIG 3g.40gb needs 1.5 GPU-eq" in e.value.message
    assert led.allocations == {}
    a = led.allocate(Request("ana", "capped", "mig-3g", 2), "y")
    assert a.cost_milli == 1000 and led.user_used["capped", "ana"] == 1000


def test_release_frees_every_instance_and_restore_rebuilds_them() -> None:
    led = ledger()
    a = led.allocate(Request("ana", "roomy", "mig-3g", 4), "four")
    fresh = ledger()
    restored, lost = fresh.restore(led.allocations.values())
    assert lost == [] and restored == [a]
    assert fresh.occ.mask == led.occ.mask and fresh.team_used == led.team_used
    fresh.check_invariants()
    fresh.release("four")
    assert fresh.occ.mask == [0] * len(fresh.occ.gpus) and +fresh.team_used == {}
    assert fresh.placeable(OFFERS["mig-3g"]) == 9
    fresh.check_invariants()
