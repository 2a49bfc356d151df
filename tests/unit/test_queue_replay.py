"""The queueing replay (``benchmarks.queue``): the baselines on tiny cases worked out by hand,
properties of every policy on small random cases against brute-force checks (each job starts
once, capacity is never exceeded, EASY starts its head by the shadow time found by trying every
moment), load scaling, gpupool's real queue draining a tiny synthetic trace and preempting a
borrower, a job no node can hold, and the count of how a gang fares in gpupool's queue."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import trace as traces
from benchmarks.queue import POLICIES, baseline_step, simulate, step_for
from benchmarks.queue_baselines import (
    Job,
    Live,
    allocation_id,
    best_effort_fifo,
    easy_backfill,
    fifo,
    fits,
    request_of,
)
from benchmarks.queue_gpupool import HeadCounts, Step, gpupool_step, watch_gangs
from benchmarks.queue_jobs import (
    SimJob,
    Started,
    build_pool,
    cap_gaps,
    make_jobs,
    offer_costs,
    offered_demand,
    read_timed_pods,
    sample_nodes,
    scale_arrivals,
    team_of,
)
from benchmarks.replay import build_inventory, read_nodes
from gpupool.core.ledger import Ledger


def pool(nodes: Sequence[tuple[str, int]]) -> Ledger:
    return build_pool(build_inventory(nodes, "mig"), [], "best-fit")


def job(name: str, gpus: int, limit: float = 100.0, arrival: float = 0.0) -> Job:
    return Job(name, team_of(name), "gpu", gpus, arrival, limit)


def holding(ledger: Ledger, name: str, gpus: int, limit_end: float) -> Live:
    """A live job of ``gpus`` whole GPUs whose limit ends at ``limit_end``."""
    j = job(name, gpus)
    assert fits(ledger, j)
    ledger.allocate(request_of(j), allocation_id(name))
    return Live(name, allocation_id(name), limit_end)


# -- hand-made cases ------------------------------------------------------------------------
def test_fifo_blocks_behind_a_head_that_does_not_fit() -> None:
    ledger = pool([("a", 2)])
    live = [holding(ledger, "r", 1, 100.0)]
    assert fifo(ledger, [job("big", 2), job("small", 1)], live, 0.0) == []
    assert set(ledger.allocations) == {"r#0"}


def test_best_effort_fifo_skips_a_head_that_does_not_fit() -> None:
    ledger = pool([("a", 2)])
    live = [holding(ledger, "r", 1, 100.0)]
    assert best_effort_fifo(ledger, [job("big", 2), job("small", 1)], live, 0.0) == ["small"]
    assert set(ledger.allocations) == {"r#0", "small#0"}


def test_easy_backfills_a_job_that_ends_before_the_shadow_time() -> None:
    ledger = pool([("a", 2)])
    live = [holding(ledger, "r", 1, 100.0)]
    assert easy_backfill(ledger, [job("big", 2), job("short", 1, limit=100.0)], live, 0.0) == [
        "short"
    ]


def test_easy_does_not_backfill_a_job_that_would_delay_the_head() -> None:
    ledger = pool([("a", 2)])
    live = [holding(ledger, "r", 1, 100.0)]
    assert easy_backfill(ledger, [job("big", 2), job("long", 1, limit=101.0)], live, 0.0) == []
    assert set(ledger.allocations) == {"r#0"}


def test_easy_backfills_a_long_job_that_leaves_the_reservation_free() -> None:
    ledger = pool([("a", 2), ("b", 8)])
    live = [holding(ledger, "r", 8, 100.0)]
    # the head (8 GPUs) can only ever run on b, at 100; a long 1-GPU job on a leaves b alone
    started = easy_backfill(ledger, [job("big", 8), job("long", 1, limit=10**6)], live, 0.0)
    assert started == ["long"]
    assert ledger.allocations["long#0"].node == "a"


# -- properties on small random cases -------------------------------------------------------
NODES = [("a", 2), ("b", 8), ("c", 4)]


@st.composite
def small_cases(draw: st.DrawFn) -> list[SimJob]:
    n = draw(st.integers(1, 12))
    out = []
    at = 0.0
    for i in range(n):
        at += draw(st.sampled_from([0.0, 1.0, 5.0, 20.0]))
        gpus = draw(st.sampled_from([1, 1, 2, 4, 8]))
        duration = float(draw(st.integers(1, 60)))
        name = f"j{i}"
        out.append(
            SimJob(name, team_of(name), "x", "gpu", gpus, gpus * 1000, at, duration, duration)
        )
    return out


def never_over_capacity(segments: Sequence[tuple[float, float, int, str]], capacity: int) -> bool:
    """At every start, the summed cost of the stretches covering that moment fits the pool."""
    for start, _, _, _ in segments:
        held = sum(c for s, e, c, _ in segments if s <= start < e)
        if held > capacity:
            return False
    return True


@settings(max_examples=40, deadline=None)
@given(small_cases(), st.sampled_from(POLICIES))
def test_every_policy_starts_each_job_once_within_capacity(jobs: list[SimJob], policy: str) -> None:
    ledger = build_pool(build_inventory(NODES, "mig"), jobs, "best-fit")
    run = simulate(ledger, jobs, step_for(policy))
    assert run.unstarted == []
    assert set(run.starts) == {j.id for j in jobs}
    assert all(run.starts[j.id] >= j.arrival for j in jobs)
    assert len(run.segments) == len(jobs) + run.preemptions  # one stretch per start
    assert never_over_capacity(run.segments, 14_000)
    assert not ledger.allocations  # everything released at the end
    if policy != "gpupool":
        assert run.preemptions == 0


@settings(max_examples=40, deadline=None)
@given(small_cases())
def test_the_starvation_guard_starts_each_job_once_and_preempts_nothing(
    jobs: list[SimJob],
) -> None:
    """gpupool's queue with ``reserve_after = 0`` (``--reserve-after 0``): every queued job is
    starving, so the oldest always holds the reservation and nothing is preempted."""
    ledger = build_pool(build_inventory(NODES, "mig"), jobs, "best-fit")
    run = simulate(ledger, jobs, step_for("gpupool", reserve_after=0.0))
    assert run.unstarted == [] and set(run.starts) == {j.id for j in jobs}
    assert run.preemptions == 0
    assert never_over_capacity(run.segments, 14_000)


def brute_force_shadow(ledger: Ledger, head: Job, running: Sequence[Started], now: float) -> float:
    """The first moment among now and the running jobs' limit ends at which ``head`` fits on a
    copy of ``ledger`` holding only the jobs still running then (every moment tried afresh)."""
    for t in sorted({now, *(s.start + s.job.limit for s in running)}):
        trial = ledger.clone()
        for s in running:
            if s.start + s.job.limit <= t:
                for a in s.allocations:
                    trial.release(a)
        if fits(trial, head):
            return t
    return float("inf")


@settings(max_examples=40, deadline=None)
@given(small_cases())
def test_easy_starts_the_head_by_its_shadow_time(jobs: list[SimJob]) -> None:
    """With exact time limits, a job that was ever the head starts by the shadow time it had
    the first time it was the head (found after the pass, by brute force)."""
    promised: dict[str, float] = {}
    inner = baseline_step("easy-backfill")

    def watched(
        ledger: Ledger, queue: dict[str, SimJob], running: dict[str, Started], now: float
    ) -> tuple[list[str], list[str]]:
        started, preempted = inner(ledger, queue, running, now)
        rest = [j for j in queue.values() if j.id not in started]
        if rest and rest[0].id not in promised:
            after = [*running.values()]
            for job_id in started:
                j = queue[job_id]
                after.append(Started(j, now, now + j.duration, (allocation_id(job_id),)))
            head = rest[0]
            as_job = Job(head.id, head.team, head.offer, head.count, head.arrival, head.limit)
            promised[head.id] = brute_force_shadow(ledger, as_job, after, now)
        return started, preempted

    step: Step = watched
    ledger = build_pool(build_inventory(NODES, "mig"), jobs, "best-fit")
    run = simulate(ledger, jobs, step)
    for job_id, shadow in promised.items():
        assert run.starts[job_id] <= shadow


# -- load scaling and the trace -------------------------------------------------------------
@settings(max_examples=30, deadline=None)
@given(small_cases(), st.sampled_from([0.8, 0.95, 1.1]))
def test_load_scaling_hits_its_target(jobs: list[SimJob], target: float) -> None:
    if len({j.arrival for j in jobs}) < 2:
        return  # no span to scale
    scaled = scale_arrivals(jobs, 14_000, target)
    assert abs(offered_demand(scaled, 14_000) - target) < 1e-9
    assert [j.arrival for j in scaled] == sorted(j.arrival for j in scaled)


def test_cap_gaps_cuts_only_the_longest_gaps() -> None:
    jobs = [SimJob(f"j{i}", "t0", "x", "gpu", 1, 1000, t, 1.0, 1.0) for i, t in
            enumerate([0.0, 1.0, 2.0, 1000.0, 1001.0, 1003.0])]  # fmt: skip
    assert [j.arrival for j in cap_gaps(jobs, 2.0)] == [0.0, 1.0, 2.0, 4.0, 5.0, 7.0]


def test_gpupool_queue_drains_a_tiny_synthetic_trace(tmp_path: Path) -> None:
    folder = traces.write_synthetic_trace(tmp_path, seed=3, pods=60)
    pods, skipped = read_timed_pods(folder / traces.POD_FILE)
    assert skipped.gpu_less + skipped.no_times + skipped.not_positive + len(pods) == 60
    nodes = sample_nodes(read_nodes(folder / traces.NODE_FILE), 24)  # two 8-GPU nodes
    inventory = build_inventory(nodes, "mig")
    jobs = make_jobs(pods, "mig", offer_costs(inventory, pods, "mig"), max_duration=3600)
    capacity = sum(n for _, n in nodes) * 1000
    jobs = scale_arrivals(cap_gaps(jobs), capacity, 1.1)
    run = simulate(build_pool(inventory, jobs, "gpupool"), jobs, step_for("gpupool"))
    assert run.unstarted == []
    assert set(run.starts) == {j.id for j in jobs}


def test_a_job_no_node_can_hold_is_reported_unstarted() -> None:
    jobs = [
        SimJob("small", "t0", "1 GPU", "gpu", 1, 1000, 0.0, 10.0, 10.0),
        SimJob("huge", "t1", "8 GPUs", "gpu", 8, 8000, 1.0, 10.0, 10.0),
    ]
    for policy in POLICIES:
        run = simulate(build_pool(build_inventory([("a", 4)], "mig"), jobs, "best-fit"), jobs,
                       step_for(policy))  # fmt: skip
        assert (run.unstarted, set(run.starts)) == (["huge"], {"small"})


def test_the_gang_watch_counts_the_passes_a_gang_waits_and_leads() -> None:
    jobs = [
        SimJob("small", "t0", "1 GPU", "gpu", 1, 1000, 0.0, 10.0, 10.0),
        SimJob("gang", "t1", "8 GPUs", "gpu", 8, 8000, 1.0, 10.0, 10.0),
    ]
    counts = {"gang": HeadCounts()}
    step: Step = functools.partial(gpupool_step, watch=watch_gangs(counts))
    run = simulate(build_pool(build_inventory([("a", 8)], "mig"), jobs, "best-fit"), jobs, step)
    assert run.starts == {"small": 0.0, "gang": 10.0}
    assert counts["gang"] == HeadCounts(queued=2, head=1, overtaken=0)  # waits at 1, starts at 10


def test_gpupool_preempts_a_borrower_and_requeues_it() -> None:
    """Four 1-GPU jobs of t0 borrow a 4-GPU pool (guarantee 1 GPU per team); a t1 job within
    its guarantee takes back the newest one, which restarts from zero when a GPU frees."""
    jobs = [SimJob(f"a{i}", "t0", "1 GPU", "gpu", 1, 1000, float(i), 100.0, 100.0)
            for i in range(4)]  # fmt: skip
    jobs.append(SimJob("b", "t1", "1 GPU", "gpu", 1, 1000, 10.0, 5.0, 5.0))
    run = simulate(build_pool(build_inventory([("a", 4)], "mig"), jobs, "best-fit"), jobs,
                   step_for("gpupool"))  # fmt: skip
    assert run.preemptions == 1
    assert run.starts["b"] == 10.0
    assert run.starts["a3"] == 15.0  # requeued, restarted when b ended
    assert run.lost_milli_s == 1000 * (10.0 - 3.0)
    assert sorted(e for s, e, c, t in run.segments if c) == [10.0, 15.0, 100.0, 101.0, 102.0, 115.0]


# -- a gang's floor: the wait no decision after its arrival avoids, short of preemption -------
def test_a_gangs_floor_is_when_the_jobs_running_at_its_arrival_have_left_it_room() -> None:
    jobs = [
        SimJob("long", "t0", "1 GPU", "gpu", 1, 1000, 0.0, 50.0, 50.0),
        SimJob("short", "t0", "1 GPU", "gpu", 1, 1000, 0.0, 10.0, 10.0),
        SimJob("gang", "t1", "2-4 GPUs", "gpu", 4, 4000, 1.0, 10.0, 10.0),
        SimJob("late", "t0", "1 GPU", "gpu", 1, 1000, 2.0, 100.0, 100.0),
    ]
    runs = {
        policy: simulate(build_pool(build_inventory([("a", 4), ("b", 4)], "mig"), jobs,
                                    "best-fit"), jobs, step_for(policy, reserve_after=0.0))
        for policy in POLICIES
    }  # fmt: skip
    for policy, run in runs.items():
        # best-fit put both on one node; node b is free at the gang's arrival: floor = arrival
        assert run.floors == {"gang": 1.0}, policy
        assert run.starts["gang"] == 1.0, policy
    one_node = build_pool(build_inventory([("a", 4)], "mig"), jobs, "best-fit")
    run = simulate(one_node, jobs, step_for("fifo"))
    assert run.floors == {"gang": 50.0}  # both 1-GPU jobs must end first: the long one at 50
    assert run.starts["gang"] == 50.0


@settings(max_examples=40, deadline=None)
@given(small_cases(), st.sampled_from(POLICIES))
def test_no_policy_that_preempts_nothing_starts_a_gang_before_its_floor(
    jobs: list[SimJob], policy: str
) -> None:
    """The floor is a lower bound: found by brute force over the jobs running at the gang's
    arrival, and never beaten by a policy that preempts nothing (gpupool with every job
    starving, ``reserve_after = 0``, preempts nothing)."""
    floors: dict[str, float] = {}
    inner = step_for(policy, reserve_after=0.0)

    def watched(
        ledger: Ledger, queue: dict[str, SimJob], running: dict[str, Started], now: float
    ) -> tuple[list[str], list[str]]:
        for j in queue.values():
            if j.count > 1 and j.arrival == now and j.id not in floors:
                as_job = Job(j.id, j.team, j.offer, j.count, j.arrival, j.limit)
                floors[j.id] = brute_force_shadow(ledger, as_job, [*running.values()], now)
        return inner(ledger, queue, running, now)

    step: Step = watched
    run = simulate(build_pool(build_inventory(NODES, "mig"), jobs, "best-fit"), jobs, step)
    assert run.floors == floors
    assert run.preemptions == 0
    assert all(run.starts[j] >= floor for j, floor in floors.items())
