"""An admin's MIG instance on a GPU whose instances the pool creates (``dynamic``, MIG on demand):
a *fixed instance* there, handed out as it is (its ``MIG-…`` UUID, nothing to create), while the
pool's own instances go on the free slots around it and never over it; admission counts it."""

from __future__ import annotations

import pytest

from gpupool.core import Inventory, Ledger, NoCapacity, Node, Offer, Request, Team
from gpupool.core.ledger import Allocation, Blocked, Device
from gpupool.core.placement import POLICIES
from tests.factories import gpu

OFFERS = {
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", profile="3g.40gb"),
    "mig-4g.40gb": Offer("mig-4g.40gb", "mig", profile="4g.40gb"),
    "mig-7g.80gb": Offer("mig-7g.80gb", "mig", profile="7g.80gb"),
    "mig-1g.10gb": Offer("mig-1g.10gb", "mig", profile="1g.10gb"),
}
TEAM = Team("vision", 100_000)
ADMIN = "MIG-n-0-4"  # tests.factories names instances MIG-<node>-<index>-<start>


def managed(*instances: tuple[str, int]) -> Inventory:
    """One managed H100 (MIG on, instances made on demand) with an admin's ``instances``."""
    return Inventory((Node("n", (gpu("n", 0, mode="dynamic", instances=instances),)),), "test")


def ledger(inventory: Inventory, policy: str = "first-fit") -> Ledger:
    return Ledger(inventory, OFFERS, {"vision": TEAM}, policy=policy)


def ask(led: Ledger, offer: str, alloc_id: str) -> Allocation:
    return led.allocate(Request("ada", "vision", offer), alloc_id)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_admins_instance_is_handed_out_first_as_it_is(policy: str) -> None:
    led = ledger(managed(("3g.40gb", 4)), policy)
    first = ask(led, "mig-3g.40gb", "a")
    assert first.devices == (Device("GPU-n-0", "3g.40gb", 4, ADMIN),)  # nothing to create
    assert first.cost_milli == 500
    second = ask(led, "mig-3g.40gb", "b")  # the pool's own, beside it, to be created
    assert second.devices == (Device("GPU-n-0", "3g.40gb", 0, None),)
    with pytest.raises(NoCapacity):
        ask(led, "mig-3g.40gb", "c")
    led.check_invariants()
    led.release("a")  # the admin's instance is free again, for the next user, as it is
    again = ask(led, "mig-3g.40gb", "d")
    assert again.devices == first.devices
    led.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_the_pools_instances_never_go_over_an_admins_instance_even_when_it_is_free(
    policy: str,
) -> None:
    led = ledger(managed(("1g.10gb", 6)), policy)
    with pytest.raises(NoCapacity):
        ask(led, "mig-7g.80gb", "big")  # slot 6 is the admin's
    made = [ask(led, "mig-4g.40gb", "four")]
    made += [ask(led, "mig-1g.10gb", f"one{i}") for i in range(3)]  # the 6, then 4 and 5
    assert made[1].devices[0].instance == "MIG-n-0-6"
    starts = sorted((d.start, d.instance) for a in made for d in a.devices)
    assert starts == [(0, None), (4, None), (5, None), (6, "MIG-n-0-6")]  # 1g never at 7
    with pytest.raises(NoCapacity):
        ask(led, "mig-1g.10gb", "more")
    led.check_invariants()


def test_placeable_and_capacity_count_the_admins_instance_and_the_slots_around_it() -> None:
    led = ledger(managed(("3g.40gb", 4)))
    three, seven = OFFERS["mig-3g.40gb"], OFFERS["mig-7g.80gb"]
    assert (led.placeable(three), led.capacity(three)) == (2, 2)
    assert (led.placeable(seven), led.capacity(seven)) == (0, 0)
    assert led.admit(TEAM, "ada", seven, 1).verdict == "never"
    ask(led, "mig-3g.40gb", "a")  # the admin's
    ask(led, "mig-3g.40gb", "b")  # the pool's
    assert (led.placeable(three), led.capacity(three)) == (0, 2)
    assert led.admit(TEAM, "ada", three, 1).verdict == "wait"
    led.release("a")
    assert led.admit(TEAM, "ada", three, 1).verdict == "now"


def test_a_holder_of_the_admins_instance_is_restored_with_it() -> None:
    inventory = managed(("3g.40gb", 4))
    before = ledger(inventory)
    held = ask(before, "mig-3g.40gb", "a")
    assert held.devices[0].instance == ADMIN
    ours = replace_instance(ask(before, "mig-3g.40gb", "b"), "MIG-made-by-the-pool")
    after = ledger(inventory)
    restored, lost = after.restore([held, ours])
    assert lost == [] and restored == [held, ours]
    assert after.occ.mask == before.occ.mask
    after.check_invariants()
    with pytest.raises(NoCapacity):
        ask(after, "mig-3g.40gb", "c")


def test_a_persisted_placement_over_an_admins_instance_is_lost() -> None:
    """An admin made an instance over the slots of a persisted allocation (while the hub was
    down, after its own instance went): the allocation cannot come back."""
    over = Allocation(
        "a", "ada", "vision", "mig-4g.40gb", "notebook", "", 1, 500, "n",
        (Device("GPU-n-0", "4g.40gb", 0, "MIG-gone"),),
    )  # fmt: skip
    led = ledger(managed(("1g.10gb", 2)))
    assert led.restore([over]) == ([], [over])
    assert led.allocations == {} and led.occ.mask == [0]
    led.check_invariants()


def test_only_an_admins_instance_itself_can_be_blocked_over_its_slots() -> None:
    led = ledger(managed(("3g.40gb", 4)))
    three = OFFERS["mig-3g.40gb"]
    for profile, start in (("1g.10gb", 5), ("2g.20gb", 4), ("7g.80gb", 0)):
        with pytest.raises(ValueError, match="admin"):
            led.block(Blocked("GPU-n-0", profile, start, "off"))
    led.block(Blocked("GPU-n-0", "3g.40gb", 0, "off"))  # the free half may be
    assert led.placeable(three) == 1  # the admin's instance stays allocatable
    led.block(Blocked("GPU-n-0", "3g.40gb", 4, "gone", ADMIN))  # NVML lost it: not handed out
    assert (led.placeable(three), led.capacity(three)) == (0, 0)
    assert led.admit(TEAM, "ada", three, 1).verdict == "never"
    with pytest.raises(NoCapacity):
        ask(led, "mig-3g.40gb", "a")
    led.check_invariants()
    led.unblock("GPU-n-0", 4)
    assert ask(led, "mig-3g.40gb", "b").devices[0].instance == ADMIN
    led.check_invariants()


def replace_instance(a: Allocation, uuid: str) -> Allocation:
    from dataclasses import replace

    return replace(a, devices=tuple(replace(d, instance=uuid) for d in a.devices))
