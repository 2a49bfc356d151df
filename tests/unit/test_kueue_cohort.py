"""Kueue's cohort rule in the hub's admission (:mod:`gpupool.core.cohort`): what the hub grants
with Kueue on, Kueue admits; checked against a brute-force model of Kueue's invariants."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gpupool.core import Inventory, Ledger, Node, Offer, PoolError, Request, Team
from gpupool.core.admission import Usage, admit
from gpupool.core.cohort import Cohort, Quota, cohort_verdict
from gpupool.core.errors import QuotaExceeded
from tests.factories import gpu

H100 = Offer("h100", "gpu", model="H100-80GB", max_count=8)
NLP = Team("nlp", 1000, 0)
VISION = Team("vision", 2000, 4000)


def pool(cohort: str = "gpupool", teams: tuple[Team, ...] = (NLP, VISION)) -> Ledger:
    """An 8-GPU pool (two nodes of four H100s) whose teams' guarantees total 3."""
    nodes = tuple(Node(n, tuple(gpu(n, i) for i in range(4))) for n in ("a", "b"))
    return Ledger(Inventory(nodes), {"h100": H100}, {t.name: t for t in teams}, cohort=cohort)


def fits_kueue(cohort: Cohort, team: str, used: Mapping[str, int], cost: int) -> bool:
    """Brute force over Kueue's invariants, not its formula: after admitting ``cost``, the
    cohort's usage (each member's usage beyond its local quota, ``accumulateFromChild``) is
    within its quota (what the members lend), and the team's usage stored in the cohort within
    what it lends plus its borrowing limit (kueue pkg/cache/scheduler/resource_node.go)."""
    after = {**used, team: used.get(team, 0) + cost}
    if team not in cohort.quotas:
        return cost == 0
    lent = sum(q.nominal - q.local() for q in cohort.quotas.values())
    if sum(max(0, after.get(t, 0) - q.local()) for t, q in cohort.quotas.items()) > lent:
        return False
    q = cohort.quotas[team]
    if q.borrowing_limit is None:
        return True
    return max(0, after[team] - q.local()) <= q.nominal - q.local() + q.borrowing_limit


def legal(cohort: Cohort, used: Mapping[str, int]) -> bool:
    """A state Kueue can be in without debt (nothing admitted beyond its quotas)."""
    return all(fits_kueue(cohort, t, used, 0) for t in cohort.quotas)


quotas = st.builds(
    Quota,
    st.integers(0, 6),
    st.one_of(st.none(), st.integers(0, 6)),
    st.one_of(st.none(), st.integers(0, 6)),
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.sampled_from("abcd"), quotas, min_size=1, max_size=4),
    st.dictionaries(st.sampled_from("abcd"), st.integers(0, 8), max_size=4),
    st.sampled_from("abcd"),
)
def test_room_is_the_most_kueue_admits(
    members: dict[str, Quota], used: dict[str, int], team: str
) -> None:
    cohort = Cohort("c", members)
    used = {t: u for t, u in used.items() if t in members}
    assume(legal(cohort, used))
    fitting = [x for x in range(0, 30) if fits_kueue(cohort, team, used, x)]
    assert cohort.room(team, used) == max(fitting)
    # most: what fits with the cohort empty
    empty = [x for x in range(0, 30) if fits_kueue(cohort, team, {}, x)]
    assert cohort.most(team) == (max(empty) if team in members else 0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["nlp", "vision"]), st.integers(1, 4)), max_size=8),
)
def test_the_hub_grants_only_what_kueue_admits(requests: list[tuple[str, int]]) -> None:
    """Whatever sequence of grants the hub makes with Kueue on, Kueue's invariants hold after
    each, and every verdict ``now`` is a grant that Kueue admits."""
    ledger = pool()
    assert ledger.cohort is not None
    for i, (team, count) in enumerate(requests):
        verdict = ledger.admit(ledger.team(team), "u", H100, count)
        used = dict(ledger.team_used)
        kueue = fits_kueue(ledger.cohort, team, used, count * 1000)
        try:
            ledger.allocate(Request("u", team, "h100", count), f"a{i}")
        except PoolError:
            assert verdict.verdict != "now"
            continue
        assert kueue, (team, count, used)
        assert verdict.verdict == "now"


def test_a_team_borrows_only_what_the_cohort_leaves_unused() -> None:
    """nlp (guarantee 1) and vision (guarantee 2, borrow limit 4) hold 1 and 2 of an 8-GPU
    pool: the hub's own limits leave vision 4 more, Kueue's cohort none."""
    for cohort, expected in (("", "now"), ("gpupool", "wait")):
        ledger = pool(cohort)
        ledger.allocate(Request("n", "nlp", "h100", 1), "n1")
        ledger.allocate(Request("v", "vision", "h100", 2), "v1")
        verdict = ledger.admit(VISION, "v", H100, 1)
        assert verdict.verdict == expected
    assert verdict.cause == "quota"
    assert verdict.reason == (
        "needs 1 GPU-eq; Kueue's cohort gpupool: 3 of 3 GPU-eq nominal quota in use; "
        "vision may borrow only what others leave unused"
    )
    with pytest.raises(QuotaExceeded, match="vision may borrow only what others leave unused"):
        ledger.allocate(Request("v", "vision", "h100", 1), "v2")
    ledger.release("n1")  # nlp's quota unused again: vision may borrow it
    assert ledger.admit(VISION, "v", H100, 1).now
    assert not ledger.admit(VISION, "v", H100, 2).now


def test_more_than_the_cohort_ever_lends_is_never() -> None:
    ledger = pool()
    verdict = ledger.admit(VISION, "v", H100, 4)  # within vision's limit of 6, above 3
    assert (verdict.verdict, verdict.cause) == ("never", "quota")
    assert verdict.reason == (
        "needs 4 GPU-eq; Kueue's cohort gpupool can admit at most 3 GPU-eq for team vision"
    )


def test_a_lender_waits_while_others_borrow_its_quota() -> None:
    ledger = pool(teams=(Team("nlp", 1000, 2000), VISION))
    ledger.allocate(Request("n", "nlp", "h100", 3), "n1")
    verdict = ledger.admit(VISION, "v", H100, 1)
    assert verdict.verdict == "wait"
    assert "others borrow what vision lends until Kueue reclaims it" in verdict.reason


def test_without_kueue_the_verdict_is_the_hubs_own() -> None:
    usage = Usage(3000, 0, 5, 8)
    cohort = Cohort.of_teams("gpupool", (NLP, VISION))
    assert admit(VISION, H100, 1, 1, usage).now
    with_kueue = Usage(2000, 0, 5, 8, cohort=cohort, cohort_used={"nlp": 1000, "vision": 2000})
    assert admit(VISION, H100, 1, 1, with_kueue).verdict == "wait"
    assert cohort_verdict(cohort, "vision", {}, 0) == ("now", "")  # CPU costs nothing


def test_everyone_is_in_the_cohort_only_with_quota() -> None:
    assert set(Cohort.of_teams("c", (NLP,), Team("everyone")).quotas) == {"nlp"}
    assert set(Cohort.of_teams("c", (NLP,), Team("everyone", 0, 500)).quotas) == {
        "nlp",
        "everyone",
    }
