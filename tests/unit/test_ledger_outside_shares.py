"""Outside shares (:meth:`gpupool.core.ledger.Ledger.set_outside_shares`): memory of a
share-taking GPU something else uses, taken from the ledger's shares there and nowhere else."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpupool.core import Inventory, Ledger, NoCapacity, Node, Offer, Request, Team
from tests.factories import gpu

OFFERS = {
    "share-40gb": Offer("share-40gb", "share", share_mib=40960),
    "share-8gb": Offer("share-8gb", "share", share_mib=8192),
}


def ledger() -> Ledger:
    """One node of two 45 GiB GPUs that take shares only, at most 10 each (as HAMi's)."""
    gpus = tuple(
        replace(
            gpu("n", i, model="L40S-48GB"), memory_mib=46068, share_resource="hami", share_slots=10
        )
        for i in range(2)
    )
    return Ledger(Inventory((Node("n", gpus),)), OFFERS, {"t": Team("t", 10_000)})


def test_an_outside_share_takes_its_memory_on_its_gpu_only() -> None:
    led = ledger()
    led.set_outside_shares({"GPU-n-0": (30720, "30 GB of GPU-n-0 is used by pod ml/infer")})
    led.check_invariants()
    a = led.allocate(Request("ada", "t", "share-40gb"), "a")
    assert [d.gpu for d in a.devices] == ["GPU-n-1"]
    with pytest.raises(NoCapacity, match=r"30 GB of GPU-n-0 is used by pod ml/infer"):
        led.allocate(Request("bob", "t", "share-40gb"), "b")
    b = led.allocate(Request("bob", "t", "share-8gb"), "b")  # what is left of GPU-n-0
    assert [d.gpu for d in b.devices] == ["GPU-n-0"]
    twin = led.clone()
    twin.check_invariants()
    assert twin.outside_shares == led.outside_shares
    led.set_outside_shares({})  # the pod ended
    led.release("b")
    led.check_invariants()
    assert led.allocate(Request("cy", "t", "share-40gb"), "c").devices[0].gpu == "GPU-n-0"
    led.check_invariants()


def test_an_outside_share_takes_at_most_what_is_free_and_ignores_unknown_gpus() -> None:
    led = ledger()
    led.allocate(Request("ada", "t", "share-40gb"), "a")  # on GPU-n-0
    led.set_outside_shares({"GPU-n-0": (30720, "x"), "GPU-gone": (1024, "y")})
    led.check_invariants()
    assert led.occ.share_used[0] == 1000  # full, not more
    led.release("a")
    led.check_invariants()
    led.set_outside_shares({"GPU-n-0": (30720, "x")})  # taken again in full on the next change
    assert led.occ.share_used[0] == 667
    led.check_invariants()


def two_nodes() -> Ledger:
    """Nodes m and n, each of two 45 GiB GPUs that take shares only (as HAMi's)."""
    nodes = tuple(
        Node(
            name,
            tuple(
                replace(
                    gpu(name, i, model="L40S-48GB"),
                    memory_mib=46068,
                    share_resource="hami",
                    share_slots=10,
                )
                for i in range(2)
            ),
        )
        for name in ("m", "n")
    )
    return Ledger(Inventory(nodes), OFFERS, {"t": Team("t", 10_000)})


@pytest.mark.parametrize("changed", [(), ("m",), ("n",), ("m", "n")])
def test_a_node_rebuild_keeps_outside_shares_as_a_full_rebuild_does(
    changed: tuple[str, ...],
) -> None:
    """Both rebuilds of the inventory take the outside shares again, once, after the ledger's own
    shares: rebuilding one node (``replace_nodes``) leaves the same occupancy as all of them."""
    led = two_nodes()
    led.allocate(Request("ada", "t", "share-8gb"), "a")
    led.set_outside_shares({"GPU-m-1": (30720, "x"), "GPU-n-0": (8192, "y")})
    full, _, lost = led.rebuilt(led.inventory)
    part, _, lost_part = led.replace_nodes(led.inventory, changed)
    assert lost == lost_part == []
    for rebuilt in (full, part):
        rebuilt.check_invariants()
        assert rebuilt.outside_shares == led.outside_shares
        assert rebuilt.occ.share_used == led.occ.share_used
