"""Shares of GPUs without MIG in the core: offers and their settings, the ledger's one-kind-per-GPU
rule and costs, the exact baseline placement rules, gpupool's fragmentation-aware choice,
admission and the spawn menu's label."""

from __future__ import annotations

import pytest

from gpupool.core import GPU, Inventory, Ledger, Node, Offer, Request, Team
from gpupool.core.admission import Usage, admit
from gpupool.core.errors import NoCapacity, QuotaExceeded
from gpupool.core.ledger import Allocation, Device
from gpupool.core.occupancy import Occupancy
from gpupool.core.offers import share_cost_milli
from gpupool.core.placement import Demand, make_policy
from gpupool.declarations import ConfigError, config_warnings, parse_offer, parse_settings
from gpupool.hub.menu import team_menu
from tests.factories import gpu

RTX = "RTX3090-24GB"
RTX_MIB = 24576


def rtx(node: str, index: int, memory: int = RTX_MIB) -> GPU:
    return GPU(f"GPU-{node}-{index}", index, RTX, memory)


def pool(*sizes: int) -> Inventory:
    """Nodes ``n0``, ``n1``… of RTX 3090s (MIG off), ``sizes[i]`` GPUs each."""
    return Inventory(
        tuple(Node(f"n{i}", tuple(rtx(f"n{i}", j) for j in range(k))) for i, k in enumerate(sizes))
    )


ROOMY = Team("lab", guarantee_milli=100_000)
OFFERS = {
    "gpu": Offer("gpu", "gpu", max_count=8),
    "quarter": Offer("quarter", "share", share_milli=250),
    "half": Offer("half", "share", share_milli=500),
    "six": Offer("six", "share", model=RTX, share_mib=6144),
    "ten": Offer("ten", "share", share_mib=10240),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", profile="3g.40gb"),
}


def ledger(inventory: Inventory, policy: str = "first-fit", team: Team = ROOMY) -> Ledger:
    return Ledger(inventory, OFFERS, {team.name: team}, policy=policy)


def take(led: Ledger, offer: str, ident: str, count: int = 1, team: str = "lab") -> Allocation:
    a = led.allocate(Request("ana", team, offer, count), ident)
    led.check_invariants()
    return a


# -- offers and settings --------------------------------------------------------------------
def test_share_offers_parse_by_memory_and_by_fraction() -> None:
    six = parse_offer("six", {"kind": "share", "memory": "6GB", "model": RTX})
    assert (six.kind, six.share_mib, six.share_milli, six.model) == ("share", 6144, None, RTX)
    assert six.label == "6 GB share of RTX3090-24GB"
    assert six.unit_cost_milli() == 250
    quarter = parse_offer("share-quarter", {"fraction": 0.25})  # the kind from the name
    assert (quarter.kind, quarter.share_milli, quarter.share_mib) == ("share", 250, None)
    assert quarter.label == "25% share of a GPU"
    assert parse_offer("s", {"kind": "share", "memory": "512 MiB"}).share_mib == 512
    assert parse_offer("s", {"kind": "share", "memory": "6.5GiB"}).label == "6.5 GB share of a GPU"
    # by memory without a model: allowed, priced where it lands (the ledger knows its GPUs)
    assert parse_offer("s", {"kind": "share", "memory": "6GB"}).unit_cost_milli() == 0


@pytest.mark.parametrize(
    ("spec", "key", "words"),
    [
        ({"kind": "share"}, "['s']", "exactly one of 'memory'"),
        ({"kind": "share", "memory": "6GB", "fraction": 0.5}, "['s']", "exactly one of"),
        ({"kind": "share", "memory": "six"}, "['s'].memory", "a size like '6GB'"),
        ({"kind": "share", "memory": 6}, "['s'].memory", "a size like '6GB'"),
        ({"kind": "share", "fraction": 0}, "['s'].fraction", "above 0 and at most 1"),
        ({"kind": "share", "fraction": 1.5}, "['s'].fraction", "above 0 and at most 1"),
        ({"kind": "share", "fraction": True}, "['s'].fraction", "above 0 and at most 1"),
        ({"kind": "share", "memory": "32GB", "model": RTX}, "['s'].memory", "more than a"),
        ({"kind": "share", "fraction": 0.5, "max_count": 2}, "['s'].max_count", "only 'gpu'"),
        ({"kind": "share", "fraction": 0.5, "nvlink": True}, "['s'].nvlink", "only 'gpu'"),
        ({"kind": "gpu", "memory": "6GB"}, "['s'].memory", "only 'share' offers"),
        ({"kind": "mig", "profile": "3g.40gb", "fraction": 0.5}, "['s'].fraction", "only 'share'"),
        ({"kind": "tpu"}, "['s'].kind", "'share'"),
    ],
)
def test_bad_share_offers_name_the_key(spec: dict[str, object], key: str, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_offer("s", spec)
    assert e.value.path == f"GPUPool.offers{key}"
    assert words in e.value.reason


def test_a_share_offer_no_gpu_without_mig_can_hold_is_a_warning() -> None:
    settings = parse_settings(
        {"s": {"kind": "share", "fraction": 0.5}, "big": {"kind": "share", "memory": "40GB"}},
        {},
        {},
    )
    mig_only = Inventory((Node("a", (gpu("a", 0, mode="dynamic"),)),))
    [one, two] = config_warnings(settings, mig_only)
    assert one.startswith("GPUPool.offers['big']: every GPU in the pool has MIG on")
    assert two.startswith("GPUPool.offers['s']: every GPU in the pool has MIG on")
    [big] = config_warnings(settings, pool(1))
    assert big.startswith("GPUPool.offers['big'].memory: 40 GB share of a GPU is larger")


def test_share_cost_is_rounded_up() -> None:
    assert share_cost_milli(6144, 24576) == 250
    assert share_cost_milli(6144, 24268) == 254  # NVML reports a little less than the label
    assert share_cost_milli(20480, 81559) == 252


# -- the ledger -----------------------------------------------------------------------------
def test_a_share_costs_its_memory_fraction_and_sees_the_gpu() -> None:
    led = ledger(pool(1))
    a = take(led, "six", "a")
    assert a.cost_milli == 250 and a.devices == (Device("GPU-n0-0", share_milli=250),)
    assert a.visible_devices == "GPU-n0-0"
    b = take(led, "half", "b")
    assert b.devices == (Device("GPU-n0-0", share_milli=500),)
    assert led.team_used["lab"] == 750 and led.occ.share_used == [750]


def test_a_share_by_size_costs_what_it_takes_on_the_gpu_it_lands_on() -> None:
    inv = Inventory((Node("a", (rtx("a", 0, 40960),)), Node("b", (rtx("b", 0, 20480),))))
    led = ledger(inv, "first-fit")
    assert led.unit_cost_milli(OFFERS["ten"]) == 250  # the least: 10 of 40 GB
    assert take(led, "ten", "a").cost_milli == 250
    led2 = ledger(Inventory((Node("b", (rtx("b", 0, 20480),)),)))
    assert take(led2, "ten", "b").cost_milli == 500


def test_the_quota_is_checked_before_and_after_placing_a_share() -> None:
    inv = Inventory((Node("b", (rtx("b", 0, 20480),)),))
    tight = Team("tight", guarantee_milli=400)
    led = ledger(inv, team=tight)
    with pytest.raises(QuotaExceeded):  # 10 GB of a 20 GB GPU is 0.5
        take(led, "ten", "a", team="tight")
    assert led.allocations == {} and led.occ.share_used == [0]
    assert take(led, "quarter", "q", team="tight").cost_milli == 250
    with pytest.raises(QuotaExceeded, match="Free now"):
        take(led, "half", "h", team="tight")


def test_a_gpu_holds_one_kind_at_a_time() -> None:
    led = ledger(pool(2))
    take(led, "gpu", "w")  # GPU 0 whole
    s = take(led, "half", "s")
    assert s.devices[0].gpu == "GPU-n0-1"  # never on the whole-held GPU
    with pytest.raises(NoCapacity, match="No 1× GPU on one node free"):
        take(led, "gpu", "w2")  # GPU 1 has a share: not whole-free
    take(led, "half", "s2")
    with pytest.raises(NoCapacity, match="No 25% share of a GPU free"):
        take(led, "quarter", "q")  # GPU 1 is full, GPU 0 held whole
    led.release("w")
    assert take(led, "quarter", "q").devices[0].gpu == "GPU-n0-0"
    led.release("s")
    led.release("s2")
    assert take(led, "gpu", "w3").devices[0].gpu == "GPU-n0-1"


def test_shares_never_land_on_mig_or_flex_gpus() -> None:
    inv = Inventory(
        (Node("a", (gpu("a", 0, mode="flex"), gpu("a", 1, mode="dynamic"), gpu("a", 2))),)
    )
    led = ledger(inv)
    assert [take(led, "quarter", f"q{i}").devices[0].gpu for i in range(4)] == ["GPU-a-2"] * 4
    with pytest.raises(NoCapacity):
        take(led, "quarter", "q5")
    assert take(led, "mig-3g.40gb", "m").devices[0].gpu == "GPU-a-0"
    led.check_invariants()


def test_placeable_counts_shares_that_fit_gpu_by_gpu() -> None:
    led = ledger(pool(2, 1))
    assert led.placeable(OFFERS["quarter"]) == 12
    assert led.placeable(OFFERS["six"]) == 12
    take(led, "half", "h")  # n0/0 has 500 left
    take(led, "gpu", "w")  # n0/1 whole
    assert led.placeable(OFFERS["quarter"]) == 2 + 4
    assert led.placeable(OFFERS["half"]) == 1 + 2
    assert led.placeable(OFFERS["gpu"]) == 1
    assert led.capacity(OFFERS["half"]) == 6


def test_restore_brings_shares_back_and_loses_the_ones_that_no_longer_fit() -> None:
    led = ledger(pool(2))
    held = [take(led, "half", "a"), take(led, "quarter", "b"), take(led, "half", "c")]
    fresh = ledger(pool(2))
    restored, lost = fresh.restore(held)
    assert lost == [] and fresh.allocations == led.allocations
    assert fresh.occ.share_used == led.occ.share_used
    fresh.check_invariants()
    # one GPU left, and it now has MIG on: shares there are lost
    mig = Inventory((Node("n0", (gpu("n0", 0, mode="dynamic"), rtx("n0", 1))),))
    other = Ledger(mig, OFFERS, {"lab": ROOMY})
    restored, lost = other.restore(held)
    on_0 = {a.id for a in held if a.devices[0].gpu == "GPU-n0-0"}
    assert {a.id for a in lost} == on_0 and {a.id for a in restored} == {"a", "b", "c"} - on_0
    # more share than the GPU holds
    over = Allocation(
        "x",
        "ana",
        "lab",
        "half",
        "notebook",
        "",
        1,
        700,
        "n0",
        (Device("GPU-n0-0", share_milli=700),),
    )
    again = ledger(pool(1))
    assert again.restore([held[0], over])[1] == [over]


def test_invariants_catch_a_share_on_a_whole_held_gpu() -> None:
    led = ledger(pool(1))
    take(led, "gpu", "w")
    bad = Allocation(
        "x",
        "ana",
        "lab",
        "half",
        "notebook",
        "",
        1,
        500,
        "n0",
        (Device("GPU-n0-0", share_milli=500),),
    )
    led.allocations["x"] = bad
    led.team_used["lab"] += 500
    led.user_used["lab", "ana"] += 500
    with pytest.raises(AssertionError, match="share on whole-held GPU"):
        led.check_invariants()


def test_occupancy_refuses_more_share_than_is_free() -> None:
    occ = Occupancy(pool(1))
    occ.take_share(0, 800)
    with pytest.raises(ValueError):
        occ.take_share(0, 300)
    with pytest.raises(ValueError):
        occ.take_whole(0)
    with pytest.raises(ValueError):
        occ.free_share(0, 900)
    occ.free_share(0, 800)
    assert occ.whole_free(0)


# -- baseline placement rules, exactly ------------------------------------------------------
def place_share(occ: Occupancy, policy: str, milli: int) -> tuple[int, int] | None:
    found = make_policy(policy).place(occ, Demand("share", share_milli=milli))
    return None if found is None else (found[0].gpu, found[0].share or 0)


def loaded(sizes: tuple[int, ...], used: dict[int, int], whole: tuple[int, ...] = ()) -> Occupancy:
    occ = Occupancy(pool(*sizes))
    for g, milli in used.items():
        occ.take_share(g, milli)
    for g in whole:
        occ.take_whole(g)
    return occ


def test_first_fit_takes_the_first_gpu_in_file_order_where_the_share_fits() -> None:
    occ = loaded((2, 2), {0: 900, 1: 600, 2: 100})
    assert place_share(occ, "first-fit", 300) == (1, 300)
    assert place_share(occ, "first-fit", 450) == (2, 450)
    assert place_share(occ, "first-fit", 50) == (0, 50)
    assert place_share(loaded((1,), {0: 990}), "first-fit", 50) is None


def test_best_fit_takes_the_gpu_with_the_least_free_left_ties_by_order() -> None:
    occ = loaded((2, 2), {0: 900, 1: 600, 2: 100, 3: 600})
    assert place_share(occ, "best-fit", 300) == (1, 300)  # 100 left on 1 and on 3: order
    assert place_share(occ, "best-fit", 100) == (0, 100)  # 0 left
    assert place_share(occ, "best-fit", 500) == (2, 500)


def test_whole_gpus_first_fit_and_best_fit_by_node_free_milli() -> None:
    # n0: 3 GPUs, one with a 500 share; n1: 2 empty GPUs; n2: 2 GPUs, one with a 900 share
    occ = loaded((3, 2, 2), {0: 500, 5: 900})
    first = make_policy("first-fit").place(occ, Demand("gpu", 1))
    best = make_policy("best-fit").place(occ, Demand("gpu", 1))
    assert [p.gpu for p in first or []] == [1]  # the first node with a whole-free GPU
    assert [p.gpu for p in best or []] == [6]  # n2: 100 + 1000 free, least left after
    two_first = make_policy("first-fit").place(occ, Demand("gpu", 2))
    two_best = make_policy("best-fit").place(occ, Demand("gpu", 2))
    assert [p.gpu for p in two_first or []] == [1, 2]  # n0: lowest-index whole-free ones
    assert [p.gpu for p in two_best or []] == [3, 4]  # n1 2000 - 2000 < n0 2500 - 2000


def test_best_fit_whole_gpu_ties_go_to_file_order() -> None:
    occ = loaded((2, 2), {})
    assert [p.gpu for p in make_policy("best-fit").place(occ, Demand("gpu", 1)) or []] == [0]


# -- gpupool --------------------------------------------------------------------------------
def test_gpupool_fills_a_used_gpu_before_breaking_an_empty_one() -> None:
    occ = loaded((2,), {0: 500})
    policy = make_policy("gpupool")
    for milli in (250, 250, 500, 1000):
        policy.observe(Demand("share", share_milli=milli))
    found = policy.place(occ, Demand("share", share_milli=250))
    assert found is not None and found[0].gpu == 0


def test_gpupool_breaks_an_empty_gpu_on_the_node_with_fewest_whole_free() -> None:
    # n0: 4 empty GPUs; n1: 2 GPUs, one held whole; nothing used fits a 900 share
    occ = loaded((4, 2), {}, whole=(4,))
    policy = make_policy("gpupool")
    for d in (Demand("gpu", 4), Demand("gpu", 1), Demand("share", share_milli=900)):
        policy.observe(d)
    found = policy.place(occ, Demand("share", share_milli=900))
    assert found is not None and found[0].gpu == 5  # keeps n0 whole for a 4-GPU request
    best = make_policy("best-fit").place(occ, Demand("share", share_milli=900))
    assert best is not None and best[0].gpu == 0


@pytest.mark.parametrize("policy", ["first-fit", "best-fit", "gpupool"])
def test_shares_avoid_the_nodes_a_job_already_has(policy: str) -> None:
    occ = loaded((1, 1), {0: 100})
    found = make_policy(policy).place(occ, Demand("share", share_milli=100, avoid=frozenset({0})))
    assert found is not None and found[0].gpu == 1


# -- admission and the menu -----------------------------------------------------------------
def test_admission_for_shares() -> None:
    team = Team("t", guarantee_milli=500, offers=frozenset({"ten", "half", "quarter"}))
    led = Ledger(Inventory((Node("b", (rtx("b", 0, 20480),)),)), OFFERS, {"t": team})
    assert led.admit(team, "ana", OFFERS["half"], 1).verdict == "now"
    take(led, "quarter", "q", team="t")
    half = led.admit(team, "ana", OFFERS["half"], 1)
    assert (half.verdict, half.cause) == ("wait", "quota")
    # by size: 10 GB of this 20 GB GPU costs 0.5, more than is left
    ten = led.admit(team, "ana", OFFERS["ten"], 1)
    assert ten.verdict == "wait" and "needs 0.5 GPU-eq" in ten.reason
    small = Team("small", guarantee_milli=400, offers=frozenset({"ten"}))
    never = admit(small, OFFERS["ten"], 1, 1, Usage(0, 0, 1, 1, unit_cost=500))
    assert (never.verdict, never.cause) == ("never", "quota")
    big = Offer("big", "share", share_milli=750)
    full = admit(Team("x", 5000), big, 1, 1, Usage(0, 0, 0, 1))
    assert (full.verdict, full.reason) == ("wait", "none free right now")


def test_the_spawn_menu_lists_share_offers_with_their_label_and_cost() -> None:
    led = ledger(pool(1))
    menu = team_menu(led, ROOMY, "ana")
    six = next(c for c in menu.choices if c.offer == "six")
    assert (six.label, six.cost_milli, six.free, six.enabled) == (
        "6 GB share of RTX3090-24GB",
        250,
        4,
        True,
    )
    ten = next(c for c in menu.choices if c.offer == "ten")
    assert ten.label == "10 GB share of a GPU" and ten.cost_milli == 417


@pytest.mark.parametrize(
    ("product", "mib", "key"),
    [
        ("NVIDIA GeForce RTX 3090", 24576, "RTX3090-24GB"),
        ("NVIDIA GeForce RTX 4090", 24564, "RTX4090-24GB"),
        ("NVIDIA RTX A6000", 49140, "RTXA6000-48GB"),
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
    ],
)
def test_model_keys_of_rtx_cards_fit_share_offers(product: str, mib: int, key: str) -> None:
    from gpupool.core.inventory import model_key

    assert model_key(product, mib) == key
    parse_offer("s", {"kind": "share", "memory": "6GB", "model": key})  # a valid model key
