"""The job queue's plan: gang starts, order, backfill behind a reservation, preemption."""

from __future__ import annotations

import contextlib
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gpupool.core import Inventory, Ledger, Node, Offer, PoolError, Request, Team
from gpupool.core.queue import (
    Limits,
    Plan,
    Queued,
    Running,
    order,
    release_job,
    schedule,
    try_gang,
)
from tests.factories import gpu

OFFERS = {"gpu": Offer("gpu", "gpu", max_count=3), "cpu": Offer("cpu", "cpu")}


def two_gpu_ledger(gpus: int = 2, **teams: Team) -> Ledger:
    inventory = Inventory((Node("n", tuple(gpu("n", i) for i in range(gpus))),))
    return Ledger(inventory, OFFERS, teams or {"t": Team("t", 10_000)}, policy="first-fit")


def q(job_id: str, gpus: int = 1, team: str = "t", **kw: float) -> Queued:
    fields = {"priority": 0, "created": 0.0, "time_limit": 100.0, **kw}
    return Queued(
        job_id,
        "u",
        team,
        "gpu",
        gpus,
        1,
        int(fields["priority"]),
        fields["created"],
        fields["time_limit"],
    )


def run(
    ledger: Ledger,
    job_id: str,
    gpus: int,
    team: str = "t",
    ends_at: float = 100.0,
    started: float = 0.0,
) -> Running:
    a = ledger.allocate(Request("u", team, "gpu", gpus, "job", job_id), f"{job_id}#0")
    return Running(job_id, team, (a.id,), ends_at, started)


def test_a_gang_starts_whole_or_not_at_all_and_holds_nothing_while_queued() -> None:
    ledger = two_gpu_ledger()
    ledger.allocate(Request("nb", "t", "gpu", 1), "notebook")
    plan = schedule(ledger, [q("big", gpus=2)], [], now=0)
    assert plan.start == [] and plan.head == "big"
    assert plan.waiting["big"] == (
        "No 2× GPU on one node free (team t uses 1 of 10 GPU-eq). Free now: 1× gpu."
    )
    assert set(ledger.allocations) == {"notebook"}  # planning changed nothing


def test_across_teams_fair_share_decides_and_priority_does_not() -> None:
    ledger = two_gpu_ledger(a=Team("a", 2000), b=Team("b", 2000))
    ledger.allocate(Request("x", "a", "gpu", 1), "a-notebook")  # team a uses half its guarantee
    jobs = [
        q("a-old", team="a", created=1),
        q("b-new", team="b", created=5),
        q("a-urgent", team="a", created=9, priority=100),
    ]
    assert [j.id for j in order(ledger, jobs)] == ["b-new", "a-urgent", "a-old"]


def test_within_a_team_priority_then_age_and_never_ahead_of_an_older_job_of_another_team() -> None:
    ledger = two_gpu_ledger(a=Team("a", 2000), b=Team("b", 2000))  # equal fair share
    jobs = [
        q("a-old", team="a", created=1),
        q("b-mid", team="b", created=2),
        q("a-urgent", team="a", created=3, priority=50),
        q("a-later", team="a", created=3.5, priority=50),
        q("b-late", team="b", created=4),
        q("a-low", team="a", created=0, priority=-5),
    ]
    # a-urgent goes first among a's jobs but not before b-mid, which is older; a-old and
    # a-low, ordered after it by priority, wait with it (priority never gains a team places)
    assert [j.id for j in order(ledger, jobs)] == [
        "b-mid",
        "a-urgent",
        "a-later",
        "a-old",
        "a-low",
        "b-late",
    ]


QUEUES = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),
        st.integers(-2, 2),
        st.integers(0, 6).map(float),
    ),
    max_size=12,
)


@given(data=QUEUES, used=st.sampled_from([0, 1, 2]), team=st.sampled_from(["a", "b", "c"]))
@settings(max_examples=300, deadline=None)
def test_priority_orders_only_its_own_team_and_never_passes_another_teams_job(
    data: list[tuple[str, int, float]], used: int, team: str
) -> None:
    ledger = two_gpu_ledger(4, a=Team("a", 2000), b=Team("b", 2000), c=Team("c", 0, 4000))
    if used:
        ledger.allocate(Request("x", "a", "gpu", used), "a-notebook")
    jobs = [q(f"j{i}", team=t, priority=p, created=c) for i, (t, p, c) in enumerate(data)]
    ordered = [j.id for j in order(ledger, jobs)]
    assert sorted(ordered) == sorted(j.id for j in jobs)
    place = {job_id: i for i, job_id in enumerate(ordered)}
    for t in "abc":  # a team's own jobs: priority (higher first), then submission time
        mine = [j for j in jobs if j.team == t]
        by_rule = sorted(mine, key=lambda j: (-j.priority, j.created, j.id))
        assert [j.id for j in by_rule] == [j.id for j in sorted(mine, key=lambda j: place[j.id])]
    # with the team's priorities at 0, none of its jobs is behind a job of another team that
    # it is now ahead of: its priorities gained it nothing against the other teams
    level = [replace(j, priority=0) if j.team == team else j for j in jobs]
    plain = {j.id: i for i, j in enumerate(order(ledger, level))}
    for x in jobs:
        for y in jobs:
            if x.team == team != y.team and place[x.id] < place[y.id]:
                assert plain[x.id] < plain[y.id], f"{x} passed {y} by priority"
    # without priorities at all, the order across teams is fair share, then submission time
    flat = order(ledger, [replace(j, priority=0) for j in jobs])
    share = {"a": used / 2, "b": 0.0, "c": float("inf")}
    keys = [(share[j.team], j.created) for j in flat]
    assert keys == sorted(keys)


def test_backfill_only_when_it_cannot_delay_the_head() -> None:
    ledger = two_gpu_ledger(gpus=3)
    running = [run(ledger, "r", 1, ends_at=100)]
    queue = [
        q("head", gpus=3, created=0),
        q("short", created=1, time_limit=50),
        q("long", created=2, time_limit=500),
    ]
    plan = schedule(ledger, queue, running, now=0)
    assert plan.head == "head" and plan.shadow == 100
    assert plan.start == ["short"]
    assert plan.waiting["long"] == "would delay job head, which is first in the queue"


def test_behind_a_head_that_notebooks_block_anything_that_fits_may_start() -> None:
    ledger = two_gpu_ledger()
    ledger.allocate(Request("nb", "t", "gpu", 1), "notebook")  # never ends by itself
    plan = schedule(ledger, [q("head", gpus=2), q("small", created=1, time_limit=10**6)], [], 0)
    assert plan.shadow == float("inf") and plan.start == ["small"]


def test_a_team_within_its_guarantee_preempts_the_newest_borrower() -> None:
    ledger = two_gpu_ledger(a=Team("a", 1000, 1000), b=Team("b", 1000))
    running = [run(ledger, "a1", 1, "a", started=1), run(ledger, "a2", 1, "a", started=2)]
    plan = schedule(ledger, [q("b1", team="b")], running, now=3)
    assert plan.preempt == ["a2"] and plan.start == ["b1"]


def test_no_preemption_for_a_team_that_would_borrow_itself() -> None:
    ledger = two_gpu_ledger(a=Team("a", 1000, 1000), b=Team("b", 1000, 1000))
    running = [run(ledger, "a1", 1, "a"), run(ledger, "a2", 1, "a", started=2)]
    plan = schedule(ledger, [q("b-big", gpus=2, team="b")], running, now=3)
    assert plan.preempt == [] and plan.start == []


def test_a_job_over_its_team_limit_waits_with_the_quota_sentence() -> None:
    ledger = two_gpu_ledger(a=Team("a", 1000))
    plan = schedule(ledger, [q("x", gpus=2, team="a")], [], now=0)
    assert plan.start == [] and "team a uses 0 of 1 GPU-eq" in plan.waiting["x"]


@given(
    data=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(1, 3),
            st.integers(-1, 1),
            st.sampled_from([10.0, 100.0, 1000.0]),
        ),
        max_size=12,
    ),
    running=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 2)), max_size=4),
)
@settings(max_examples=200, deadline=None)
def test_a_plan_never_breaks_a_limit_and_its_starts_fit(
    data: list[tuple[str, int, int, float]], running: list[tuple[str, int]]
) -> None:
    teams = {"a": Team("a", 1000, 1000), "b": Team("b", 2000), "c": Team("c", 1000, 3000)}
    ledger = two_gpu_ledger(4, **teams)
    live = []
    for i, (team, gpus) in enumerate(running):
        with contextlib.suppress(PoolError):
            live.append(run(ledger, f"r{i}", gpus, team, ends_at=50.0 * (i + 1), started=i))
    queue = [
        q(f"j{i}", gpus, team, priority=p, created=i, time_limit=t)
        for i, (team, gpus, p, t) in enumerate(data)
    ]
    plan = schedule(ledger, queue, live, now=0)
    after = carry_out(ledger, plan, queue, live)  # every start must fit, in the plan's order
    by_id = {j.id: j for j in queue}
    after.check_invariants()
    assert set(plan.start).isdisjoint(plan.waiting)
    assert set(plan.start) | set(plan.waiting) == set(by_id)


def cpu_job(job_id: str, user: str, procs: int = 1, created: float = 0.0) -> Queued:
    return Queued(job_id, user, "t", "cpu", 1, 1, 0, created, 100.0, cpu=True, procs=procs)


def test_the_machines_ranks_bound_every_job_and_the_rest_wait_saying_so() -> None:
    ledger = two_gpu_ledger(gpus=4)
    running = [replace(run(ledger, "r", 2), user="u", ranks=2)]
    jobs = [q("gpu2", gpus=2, created=1), cpu_job("c1", "v", procs=1, created=2)]
    plan = schedule(ledger, jobs, running, now=0, limits=Limits(ranks=3))
    assert plan.start == ["c1"]  # two more ranks would be five; one more fits
    assert plan.waiting["gpu2"] == (
        "waiting for CPUs: this machine runs at most 3 ranks at once "
        "(LocalJobBackend.max_ranks) and 2 are running"
    )
    assert plan.head is None  # a job waiting on a limit holds no reservation


def test_a_user_runs_at_most_so_many_cpu_jobs_and_ranks_and_others_go_on() -> None:
    ledger = two_gpu_ledger()
    jobs = [cpu_job(f"a{i}", "ann", created=i) for i in range(5)] + [cpu_job("b", "bob", 4, 9)]
    plan = schedule(ledger, jobs, [], now=0, limits=Limits(user_cpu_jobs=2, user_cpu_ranks=5))
    assert plan.start == ["a0", "a1", "b"]
    assert plan.waiting["a2"] == (
        "waiting: you run 2 CPU-only jobs, the most at once (JobManager.max_cpu_jobs_per_user = 2)"
    )
    plan = schedule(ledger, [cpu_job("big", "ann", 6)], [], now=0, limits=Limits(user_cpu_ranks=5))
    assert plan.waiting["big"].endswith("JobManager.max_cpu_ranks_per_user = 5")


# -- starving jobs: the oldest holds the reservation (c.JobManager.reserve_after) -------------
def test_a_starving_gang_holds_the_reservation_whatever_the_fair_share() -> None:
    ledger = two_gpu_ledger(3, a=Team("a", 3000), b=Team("b", 3000))
    running = [run(ledger, "r", 1, "b", ends_at=100)]  # team b is further above its share
    queue = [q("big", gpus=3, team="b", created=0), q("small", team="a", created=900)]
    # by fair share team a's job goes first and starts, though it would delay the gang
    assert schedule(ledger, queue, running, now=1000).start == ["small"]
    plan = schedule(ledger, queue, running, now=1000, reserve_after=500)
    assert (plan.head, plan.shadow, plan.start) == ("big", 100, [])
    assert plan.waiting["small"] == "would delay job big, which is first in the queue"
    # not starving yet: the fair-share order again
    assert schedule(ledger, queue, running, now=400, reserve_after=500).start == ["small"]


def test_while_a_job_starves_nothing_is_preempted() -> None:
    """A preempted job keeps its submission time: it would starve next and preempt in turn."""
    ledger = two_gpu_ledger(a=Team("a", 1000, 1000), b=Team("b", 1000))
    running = [run(ledger, "a1", 1, "a", started=1), run(ledger, "a2", 1, "a", started=2)]
    waiting = [q("b1", team="b", created=3)]
    assert schedule(ledger, waiting, running, now=3, reserve_after=10).preempt == ["a2"]
    plan = schedule(ledger, waiting, running, now=13, reserve_after=10)
    assert (plan.preempt, plan.start, plan.head) == ([], [], "b1")


def two_node_ledger(gpus: int = 4, **teams: Team) -> Ledger:
    """Two nodes ``m`` and ``n``, best-fit: the tightest node that fits is chosen."""
    nodes = tuple(Node(name, tuple(gpu(name, i) for i in range(gpus))) for name in "mn")
    return Ledger(Inventory(nodes), OFFERS, teams or {"t": Team("t", 10_000)}, policy="best-fit")


def carry_out(ledger: Ledger, plan: Plan, queue: list[Queued], live: list[Running]) -> Ledger:
    """The plan done as the job manager does it, on a copy: preemptions, then each start in
    order, off the nodes the plan keeps it off (``JobManager._grant``)."""
    after = ledger.clone()
    for victim in plan.preempt:
        release_job(after, victim)
    by_id = {j.id: j for j in queue}
    for job_id in plan.start:
        keep_off = plan.keep_off.get(job_id, frozenset())
        assert try_gang(after, by_id[job_id], keep_off=keep_off) == "", f"{job_id} does not fit"
    return after


def test_a_backfill_goes_around_the_heads_reserved_node_where_best_fit_would_block_it() -> None:
    """Best-fit puts a small job on the fullest node that fits; when that is the node the head
    waits for, the job would delay the head, though the other node has room that nobody has
    reserved. The plan places it off the reserved node, and the grant does the same."""
    ledger = two_node_ledger()
    running = [run(ledger, "m-short", 3, ends_at=100), run(ledger, "n-long", 2, ends_at=1000)]
    queue = [q("big", gpus=3, created=0), q("small", created=1, time_limit=500)]
    plan = schedule(ledger, queue, running, now=0, reserve_after=0)
    assert (plan.head, plan.shadow, plan.reserved) == ("big", 100, {"m"})
    assert plan.start == ["small"] and plan.keep_off == {"small": {"m"}}
    after = carry_out(ledger, plan, queue, running)
    assert after.allocations["small#0"].node == "n"
    release_job(after, "m-short")  # at the shadow time the head fits, as reserved
    assert try_gang(after, queue[0]) == ""
    # the same job placed by best-fit alone lands on m and would delay the head
    assert ledger.clone().allocate(q("small").request([]), "x").node == "m"


@given(
    data=st.lists(
        st.tuples(
            st.sampled_from(["a", "b"]),
            st.integers(1, 3),  # the offer's max_count
            st.integers(0, 20),
            st.sampled_from([10.0, 100.0, 1000.0]),
        ),
        min_size=1,
        max_size=10,
    ),
    running=st.lists(
        st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 2), st.sampled_from([5.0, 50.0])),
        max_size=6,
    ),
    nodes=st.sampled_from([1, 2]),
)
@settings(max_examples=300, deadline=None)
def test_nothing_started_delays_the_oldest_starving_job(
    data: list[tuple[str, int, int, float]], running: list[tuple[str, int, float]], nodes: int
) -> None:
    """EASY's guarantee, checked by brute force: with every job starving, the oldest one
    starts first or is the head, and then, with the plan carried out as the job manager does it
    (reserved nodes kept off), it still fits at its shadow time once every job that ends by
    then (running or just started, at its time limit) has ended."""
    teams = {"a": Team("a", 2000, 2000), "b": Team("b", 2000, 2000)}
    ledger = two_gpu_ledger(4, **teams) if nodes == 1 else two_node_ledger(3, **teams)
    live = []
    for i, (team, gpus, ends) in enumerate(running):
        with contextlib.suppress(PoolError):
            live.append(run(ledger, f"r{i}", gpus, team, ends_at=ends, started=0))
    queue = [
        q(f"j{i}", gpus, team, created=c, time_limit=t) for i, (team, gpus, c, t) in enumerate(data)
    ]
    now = 100.0  # every job has waited at least reserve_after
    plan = schedule(ledger, queue, live, now, reserve_after=50)
    oldest = min(queue, key=lambda j: (j.created, j.id))
    assert plan.preempt == []
    if oldest.id in plan.start or plan.head is None:
        return  # it started (first of all); the fair-share rules go on as before
    assert plan.head == oldest.id
    at_shadow = carry_out(ledger, plan, queue, live)
    by_id = {j.id: j for j in queue}
    for r in live:
        if r.ends_at <= plan.shadow:
            release_job(at_shadow, r.id)
    for job_id in plan.start:  # started ones that end by the shadow time are gone then
        if now + by_id[job_id].time_limit <= plan.shadow:
            release_job(at_shadow, job_id)
    if plan.shadow != float("inf"):
        assert try_gang(at_shadow, by_id[plan.head]) == "", "a start delayed the oldest job"


def test_a_trial_that_only_asks_whether_it_fits_skips_the_free_now_sentence() -> None:
    """The queue's trials (shadow time, preemption, backfill) allocate with ``explain=False``:
    the same refusal, without the costly "Free now" sentence; the plan's reasons keep it."""
    ledger = two_gpu_ledger()
    ledger.allocate(Request("nb", "t", "gpu", 1), "notebook")
    assert try_gang(ledger, q("big", gpus=2), explain=False) == "No 2× GPU free."
    assert "Free now: 1× gpu." in try_gang(ledger, q("big", gpus=2))
    assert set(ledger.allocations) == {"notebook"}
