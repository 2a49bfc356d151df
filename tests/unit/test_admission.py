"""The one admission rule: never, now or wait, with the reason; and that it agrees with the
allocator (what it calls ``now`` is granted, what it calls ``wait`` or ``never`` is refused)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.core import Ledger, Offer, PoolError, Request, Team
from gpupool.core.admission import Usage, admit
from gpupool.core.errors import NoCapacity, OfferNotAllowed, QuotaExceeded
from tests.factories import OFFERS, TEAMS, mixed_inventory

H100 = Offer("h100", "gpu", model="H100-80GB", max_count=8)
CPU = Offer("cpu", "cpu")
VISION = Team("vision", 2000, 1000, 2000, frozenset({"h100", "cpu"}))
IDLE = Usage(team_used=0, user_used=0, free=4, capacity=4)


def test_what_fits_now_is_now() -> None:
    assert admit(VISION, H100, 2, 1, IDLE).verdict == "now"
    assert admit(VISION, CPU, 64, 3, Usage(3000, 2000, 0, 0)).verdict == "now"  # CPU costs 0


@pytest.mark.parametrize(
    ("offer", "count", "nodes", "usage", "reason", "cause"),
    [
        (Offer("a100", "gpu"), 1, 1, IDLE, "team vision may not request a100; allowed: cpu, h100",
         "offer"),
        (H100, 4, 1, IDLE, "needs 4 GPU-eq; team vision may hold at most 3", "quota"),
        (H100, 1, 4, IDLE, "needs 4 GPU-eq; team vision may hold at most 3", "quota"),
        (H100, 3, 1, IDLE, "needs 3 GPU-eq; your cap in team vision is 2", "quota"),
        (H100, 2, 1, Usage(0, 0, 0, 1), "this pool holds at most 1 of h100 on one node",
         "capacity"),
        (H100, 1, 1, Usage(0, 0, 0, 0), "this pool holds none of h100 on one node", "capacity"),
    ],
)  # fmt: skip
def test_what_could_never_start_is_never(
    offer: Offer, count: int, nodes: int, usage: Usage, reason: str, cause: str
) -> None:
    a = admit(VISION, offer, count, nodes, usage)
    assert (a.verdict, a.reason, a.cause) == ("never", reason, cause)


@pytest.mark.parametrize(
    ("usage", "count", "reason", "cause"),
    [
        (Usage(2500, 0, 4, 4), 1, "needs 1 GPU-eq; team vision has 0.5 left", "quota"),
        (Usage(1000, 1500, 4, 4), 1, "needs 1 GPU-eq; you have 0.5 of your cap left", "quota"),
        (Usage(0, 0, 0, 4), 1, "none free right now", "capacity"),
        (Usage(0, 0, 1, 4), 2, "only 1 free on one node", "capacity"),
    ],
)
def test_what_could_start_later_would_wait(
    usage: Usage, count: int, reason: str, cause: str
) -> None:
    a = admit(VISION, H100, count, 1, usage)
    assert (a.verdict, a.reason, a.cause) == ("wait", reason, cause)


def test_a_refusal_raises_the_error_of_its_cause() -> None:
    never = admit(VISION, H100, 4, 1, IDLE)
    assert isinstance(never.error("x"), QuotaExceeded)
    assert isinstance(admit(VISION, Offer("a100", "gpu"), 1, 1, IDLE).error("x"), OfferNotAllowed)
    assert isinstance(admit(VISION, H100, 1, 1, Usage(0, 0, 0, 4)).error("x"), NoCapacity)


@settings(max_examples=300, deadline=None)
@given(
    held=st.lists(
        st.tuples(
            st.sampled_from(sorted(TEAMS)), st.sampled_from(sorted(OFFERS)), st.integers(1, 4)
        ),
        max_size=8,
    ),
    team=st.sampled_from(sorted(TEAMS)),
    offer=st.sampled_from(sorted(OFFERS)),
    count=st.integers(1, 4),
)
def test_the_verdict_agrees_with_the_allocator(
    held: list[tuple[str, str, int]], team: str, offer: str, count: int
) -> None:
    """On any state of the ledger, ``now`` means ``allocate`` grants it, anything else that it
    refuses; ``never`` also on an empty pool."""
    ledger = Ledger(mixed_inventory(), OFFERS, TEAMS, policy="first-fit")
    for i, (t, o, n) in enumerate(held):
        with contextlib.suppress(PoolError):
            ledger.allocate(Request(f"u{i}", t, o, n if OFFERS[o].kind == "gpu" else 1), f"h{i}")
    n = count if OFFERS[offer].kind == "gpu" else 1
    verdict = ledger.admit(ledger.teams[team], "ana", OFFERS[offer], n)
    try:
        ledger.allocate(Request("ana", team, offer, n), "probe")
        granted = True
    except PoolError:
        granted = False
    assert granted == verdict.now, verdict
    if verdict.verdict == "never":
        empty = Ledger(mixed_inventory(), OFFERS, TEAMS, policy="first-fit")
        with pytest.raises(PoolError):
            empty.allocate(Request("ana", team, offer, n), "probe")


def test_an_admins_instance_on_a_managed_gpu_makes_what_cannot_fit_never() -> None:
    """A managed GPU (dynamic MIG) with an admin's 4g.40gb at slot 0: a 7g.80gb can never be
    placed there while it stays (never, not wait); a draining instance comes back (wait)."""
    from gpupool.core.inventory import Inventory, Node
    from gpupool.core.ledger import Blocked
    from tests.factories import gpu

    offers = {"mig-7g.80gb": Offer("mig-7g.80gb", "mig", profile="7g.80gb")}
    team = Team("vision", 8000)
    managed = Inventory((Node("n", (gpu("n", 0, mode="dynamic"),)),), source="test")
    ledger = Ledger(managed, offers, {"vision": team})
    assert ledger.admit(team, "ada", offers["mig-7g.80gb"], 1).verdict == "now"
    uuid = managed.gpus[0].uuid
    ledger.block(Blocked(uuid, "4g.40gb", 0, "draining"))
    assert ledger.admit(team, "ada", offers["mig-7g.80gb"], 1).verdict == "wait"
    ledger.unblock(uuid, 0)
    ledger.block(Blocked(uuid, "4g.40gb", 0, "admin"))
    refused = ledger.admit(team, "ada", offers["mig-7g.80gb"], 1)
    assert (refused.verdict, refused.cause) == ("never", "capacity")
    ledger.unblock(uuid, 0)
    assert ledger.admit(team, "ada", offers["mig-7g.80gb"], 1).verdict == "now"
