"""Who may use a device, and what the pool does while something else uses it (pure core).

Attribution (:mod:`gpupool.core.holders`): a process NVML reports on a device counts for the
allocation holding it when it runs as that allocation's code account and, in the shared mode,
when its marker names it; every other process is a *stray* (an account that runs user code) or
*outside* (root, daemons, anyone else). The ledger's *outside use* (:meth:`Ledger.set_outside_use`)
hands out nothing that such a process uses, until it is gone, and says why in refusals and in
the admission verdict; the devices stay in the pool's capacity (a request waits, it is not
refused as impossible).
"""

from __future__ import annotations

import pytest

from gpupool.core import Inventory, Ledger, NoCapacity, Node, Offer, Request, Team
from gpupool.core.holders import Holding, OnDevice, classify, holder_of, outside_reasons
from gpupool.core.ledger import Blocked
from tests.factories import gpu

TEAM = Team("vision", 100_000)
OFFERS = {
    "gpu": Offer("gpu", "gpu", max_count=2),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", profile="3g.40gb"),
    "quarter": Offer("quarter", "share", share_milli=250),
}
FIXED = "MIG-n-2-0"  # tests.factories names instances MIG-<node>-<index>-<start>


def inventory() -> Inventory:
    """Two whole H100s (they take shares too), and one with fixed MIG instances."""
    fixed = gpu("n", 2, mode="fixed", instances=(("3g.40gb", 0), ("3g.40gb", 4)))
    return Inventory((Node("n", (gpu("n", 0), gpu("n", 1), fixed)),), "test")


def ledger() -> Ledger:
    return Ledger(inventory(), OFFERS, {"vision": TEAM})


def ask(led: Ledger, offer: str, alloc_id: str, count: int = 1) -> str:
    return led.allocate(Request("ada", "vision", offer, count), alloc_id).visible_devices


# -- attribution ----------------------------------------------------------------------------------
ADA, BEN = 2001, 2002
SERVER = Holding("a1", "ada/", ADA, by_account=True)  # per-user: ada's account holds it
SHARED = Holding("a2", "ben/", 999, by_account=False)  # shared mode: only by its marker


@pytest.mark.parametrize(
    ("process", "holdings", "held_by"),
    [
        (OnDevice(10, "GPU-x", ADA), [SERVER], "a1"),  # ada's own, no marker: her GPU
        (OnDevice(10, "GPU-x", ADA, claim="a1"), [SERVER], "a1"),
        (OnDevice(11, "GPU-x", BEN), [SERVER], None),  # another account
        (OnDevice(11, "GPU-x", BEN, claim="a1"), [SERVER], None),  # a copied marker: not hers
        (OnDevice(12, "GPU-x", 999), [SHARED], None),  # the shared account, no marker
        (OnDevice(12, "GPU-x", 999, claim="a2"), [SHARED], "a2"),
        (OnDevice(12, "GPU-x", 999, claim="j7"), [Holding("a3", "j7", 999, False)], "a3"),
        (OnDevice(12, "GPU-x", 999, claim="a9"), [SHARED], None),  # another allocation's
        (OnDevice(13, "GPU-x", 0), [Holding("a4", "x/", None, True)], None),  # unknown account
    ],
)
def test_a_process_counts_for_the_allocation_its_account_and_marker_name(
    process: OnDevice, holdings: list[Holding], held_by: str | None
) -> None:
    assert holder_of(process, holdings) == held_by


def test_a_process_holding_nothing_is_a_stray_of_user_code_or_outside() -> None:
    code, unknown = frozenset({BEN, 999}), frozenset({3000})
    assert classify(OnDevice(1, "GPU-x", BEN), None, code, unknown) == "stray"
    assert classify(OnDevice(1, "GPU-x", BEN), "a1", code, unknown) == "held"
    assert classify(OnDevice(2, "GPU-x", 0), None, code | {0}, unknown) == "outside"  # root
    assert classify(OnDevice(3, "GPU-x", 4242), None, code, unknown) == "outside"
    assert classify(OnDevice(4, "GPU-x", 3000), None, code, unknown) == "unknown"


def test_each_device_in_use_outside_the_pool_gets_one_reason_naming_its_processes() -> None:
    found = [
        OnDevice(7, "GPU-x", 0, account="root"),
        OnDevice(9, "GPU-x", BEN, account="ben"),
        OnDevice(8, FIXED, 4242, account="#4242"),
    ]
    reasons = outside_reasons(found)
    assert reasons == {
        "GPU-x": "GPU-x is in use by processes 7 (root), 9 (ben), which do not hold it",
        FIXED: f"{FIXED} is in use by process 8 (#4242), which does not hold it",
    }


# -- the ledger: nothing in outside use is handed out ---------------------------------------------
def test_a_whole_gpu_in_outside_use_is_not_handed_out_until_it_is_free_again() -> None:
    led = ledger()
    reason = "GPU-n-0 is in use by process 7 (root), which does not hold it"
    closed, reopened = led.set_outside_use({"GPU-n-0": reason})
    assert (closed, reopened) == ({"GPU-n-0"}, set())
    assert ask(led, "gpu", "a") == "GPU-n-1"
    with pytest.raises(NoCapacity) as refused:
        ask(led, "gpu", "b")
    assert reason in refused.value.message
    verdict = led.admit(TEAM, "ben", OFFERS["gpu"], 1)
    assert verdict.verdict == "wait" and reason in verdict.reason  # waits: it comes back
    assert led.capacity(OFFERS["gpu"]) == 2
    led.check_invariants()
    assert led.set_outside_use({}) == (set(), {"GPU-n-0"})
    assert ask(led, "gpu", "b") == "GPU-n-0"
    led.check_invariants()


def test_a_gpu_with_shares_takes_no_new_share_while_something_else_uses_it() -> None:
    led = ledger()
    first = ask(led, "quarter", "s1")
    led.set_outside_use({first: f"{first} is in use by process 7 (root), which does not hold it"})
    assert led.placeable(OFFERS["quarter"]) == 4  # only the other GPU's four
    assert ask(led, "quarter", "s2") != first  # the next share goes elsewhere
    led.release("s1")  # the shares' GPU empties: still not handed out, whole or shared
    assert led.placeable(OFFERS["gpu"]) == 0 and led.placeable(OFFERS["quarter"]) == 3
    led.check_invariants()
    led.set_outside_use({})
    assert led.placeable(OFFERS["gpu"]) == 1 and led.placeable(OFFERS["quarter"]) == 7


def test_a_mig_instance_in_outside_use_is_blocked_also_when_its_holder_lets_it_go() -> None:
    led = ledger()
    held = ask(led, "mig-3g.40gb", "m1")
    other = "MIG-n-2-4" if held == FIXED else FIXED
    reason = "in use by process 7 (root), which does not hold it"
    led.set_outside_use({held: f"{held} is {reason}", other: f"{other} is {reason}"})
    assert led.blocked[("GPU-n-2", int(other[-1]))] == Blocked(
        "GPU-n-2", "3g.40gb", int(other[-1]), "outside", other
    )
    assert led.placeable(OFFERS["mig-3g.40gb"]) == 0
    led.release("m1")  # released while the outside process still runs on it: not handed out
    with pytest.raises(NoCapacity) as refused:
        ask(led, "mig-3g.40gb", "m2")
    assert f"{held} is {reason}" in refused.value.message
    led.check_invariants()
    assert led.capacity(OFFERS["mig-3g.40gb"]) == 2
    led.set_outside_use({other: f"{other} is {reason}"})
    assert ask(led, "mig-3g.40gb", "m2") == held
    led.check_invariants()


def test_a_clone_keeps_what_is_in_outside_use() -> None:
    led = ledger()
    led.set_outside_use({"GPU-n-0": "GPU-n-0 is in use", FIXED: f"{FIXED} is in use"})
    twin = led.clone()
    assert twin.outside == led.outside
    assert twin.placeable(OFFERS["gpu"]) == 1 and twin.placeable(OFFERS["mig-3g.40gb"]) == 1
    twin.check_invariants()
