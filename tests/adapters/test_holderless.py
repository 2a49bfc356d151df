"""While the hub runs, an allocation with no holder at all (no process claims it, JupyterHub
records no server of its ref) is released once it has been so for the grace, and logged; a start
in progress (JupyterHub records the server, pending) and a live server keep theirs. The decision
is pure (:func:`gpupool.core.reconcile.plan`); the time is the caller's."""

from __future__ import annotations

from gpupool.core.ledger import Ledger
from gpupool.core.offers import Request
from gpupool.core.reconcile import Proc, Record, holderless, plan
from tests.factories import OFFERS, TEAMS, mixed_inventory


def ledger_with(*users: str) -> Ledger:
    ledger = Ledger(mixed_inventory(), OFFERS, TEAMS)
    for i, user in enumerate(users):
        ledger.allocate(Request(user, "vision", "gpu", 1, "notebook", f"{user}/"), f"a{i}")
    return ledger


def test_an_allocation_without_any_holder_is_released_after_the_grace() -> None:
    ledger = ledger_with("ada", "ben", "cal")
    records = [
        Record("ben", "", frozenset({"vision"})),  # a start in progress: no allocation yet
        Record("cal", "", frozenset({"vision"}), "a2", 300, True),
    ]
    procs = [Proc(pid=300, pgid=300, uid=1000, start=1, allocation="a2")]
    assert holderless(ledger, records, procs) == {"a0"}

    since = {"a0": 100.0}
    early = plan(
        ledger, records, procs, at_start=False, holderless_since=since, now=159.0, grace=60
    )
    assert early == []
    (action,) = plan(
        ledger, records, procs, at_start=False, holderless_since=since, now=160.0, grace=60
    )
    assert (action.action, action.release) == ("released", "a0")
    assert "JupyterHub records no server ada/" in action.message and "60 s" in action.message


def test_an_allocation_a_process_still_claims_is_never_released_as_holderless() -> None:
    ledger = ledger_with("ada")
    kernel = Proc(pid=400, pgid=400, uid=1000, start=1, allocation="a0")
    assert holderless(ledger, [], [kernel]) == set()
    since = {"a0": 0.0}  # even if an earlier pass saw it alone
    assert plan(ledger, [], [kernel], at_start=False, holderless_since=since, now=1e6) == []


def test_ranks_of_unknown_jobs_are_left_running_when_the_pool_database_was_lost() -> None:
    """An emptied pool database knows no job: a running job's ranks are reported and left
    running (an admin decides), not stopped as ranks of a job that never was."""
    ranks = [Proc(pid=500 + r, pgid=500, uid=1000, start=1, job="j1") for r in range(2)]
    (stopped,) = plan(Ledger(mixed_inventory(), OFFERS, TEAMS), [], ranks, at_start=True)
    assert stopped.action == "stopped"
    (kept,) = plan(
        Ledger(mixed_inventory(), OFFERS, TEAMS), [], ranks, at_start=True, keep_unknown_jobs=True
    )
    assert kept.action == "reported" and kept.stop == ()
    assert "job j1 runs (processes 500, 501" in kept.message and "left running" in kept.message
