"""The job manager with the real local backend (real torchrun processes): preemption requeues
a borrowing team's newest job when the lender needs its guarantee back, and a queued job is
started by the next pass once it fits."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from gpupool.clock import utcnow
from gpupool.config import GPUPool
from gpupool.core.errors import InvalidRequest, LimitReached
from gpupool.declarations import ConfigError
from gpupool.jobs.local import group_alive, job_pids
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from tests.accounts import shared_mode

SLEEPER = "import time\nwhile True:\n    time.sleep(0.5)\n"


def manager(tmp_path: Path, clock: Callable[[], datetime] = utcnow) -> JobManager:
    c = Config()
    c.GPUPool.inventory = "simulated:n: 2x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"gpu": {"kind": "gpu", "max_count": 2}, "cpu": {"kind": "cpu"}}
    c.GPUPool.teams = {"a": {"guarantee": 1, "borrow_limit": 1}, "b": {"guarantee": 1}}
    shared_mode(c)
    c.LocalJobBackend.kill_grace = 2.0
    c.LocalJobBackend.max_ranks = 8  # preemption is about GPUs, whatever this machine's cores
    c.JobManager.watch_interval = 0.5
    return JobManager(Pool.from_config(GPUPool(config=c)), clock=clock, config=c)


async def until(m: JobManager, job_id: str, state: str, timeout: float = 60) -> None:
    async def reached() -> None:
        while m.jobs[job_id].state != state:
            await asyncio.sleep(0.1)

    await asyncio.wait_for(reached(), timeout)


def test_a_lender_preempts_the_newest_borrowing_job(tmp_path: Path) -> None:
    async def scenario() -> None:
        m = manager(tmp_path)
        await m.start()
        try:
            spec = {"script": SLEEPER, "offer": "gpu", "gpus": 1, "max_restarts": 1}
            first = m.submit("ann", ["a"], spec)
            await m.schedule_pass()
            second = m.submit("ann", ["a"], spec)  # team a borrows its second GPU
            await m.schedule_pass()
            await until(m, first.id, "running")
            await until(m, second.id, "running")
            assert m.pool.ledger.team_used["a"] == 2000

            lender = m.submit("bob", ["b"], {**spec, "max_restarts": 0})
            await m.schedule_pass()
            requeued = m.jobs[second.id]
            assert requeued.state == "queued" and requeued.restarts == 1
            assert requeued.reason.startswith("preempted")
            assert m.jobs[first.id].state == "running"
            await until(m, lender.id, "running")
            used = m.pool.ledger.team_used
            assert (used["a"], used["b"]) == (1000, 1000)
            m.pool.ledger.check_invariants()

            await m.cancel(lender.id, "bob", False)  # the lender is done: a gets its GPU back
            await m.schedule_pass()
            await until(m, second.id, "running")
        finally:
            for job in list(m.jobs.values()):
                if not job.final:
                    await m.cancel(job.id, "admin", True)
            await m.stop()
        assert m.pool.ledger.allocations == {}

    asyncio.run(scenario())


def test_a_job_whose_processes_vanished_while_the_hub_was_down_is_lost(tmp_path: Path) -> None:
    async def scenario() -> None:
        m = manager(tmp_path)
        await m.start()
        job = m.submit("ann", ["a"], {"script": SLEEPER, "offer": "gpu", "gpus": 2})
        await m.schedule_pass()
        await until(m, job.id, "running")
        pid = json.loads(m.jobs[job.id].handle)["pid"]
        await m.stop()  # the hub goes down; the job keeps running
        m.pool.store.close()
        for victim in job_pids(job.id):  # ... and then all its processes vanish
            os.kill(victim, signal.SIGKILL)
        os.killpg(pid, signal.SIGKILL)
        while group_alive(pid) or job_pids(job.id):
            await asyncio.sleep(0.05)

        again = manager(tmp_path)  # the hub comes back
        assert again.pool.ledger.team_used["a"] == 2000  # restored from the database
        await again.start()
        try:
            await until(again, job.id, "lost")
            assert again.jobs[job.id].reason == "its processes are gone and left no exit code"
            assert again.pool.ledger.allocations == {}
        finally:
            await again.stop()

    asyncio.run(scenario())


def test_jobs_queued_before_a_restart_start_at_once_when_the_hub_is_back(tmp_path: Path) -> None:
    """The first pass runs when the manager starts, not a ``schedule_interval`` later (nothing
    else kicks the queue of a hub that just came back with free GPUs)."""
    before = manager(tmp_path)
    job = before.submit("ann", ["a"], {"script": SLEEPER, "offer": "gpu", "gpus": 1})
    assert before.jobs[job.id].state == "queued"  # the hub went down before any pass
    before.pool.store.close()

    async def scenario() -> None:
        again = manager(tmp_path)
        again.schedule_interval = 3600.0
        await again.start()
        try:
            await until(again, job.id, "running")
        finally:
            await again.cancel(job.id, "admin", True)
            await again.stop()

    asyncio.run(scenario())


def queue_only(
    tmp_path: Path, teams: dict[str, Any], inventory: str = "simulated:n: 2x H100-80GB"
) -> JobManager:
    """A manager that is never started: jobs stay queued; its clock ticks a second a call."""
    c = Config()
    c.GPUPool.inventory = inventory
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"gpu": {"kind": "gpu", "max_count": 2}, "cpu": {"kind": "cpu"}}
    c.GPUPool.teams = teams
    shared_mode(c)
    ticks = itertools.count()
    start = datetime(2025, 1, 1, tzinfo=UTC)
    pool = Pool.from_config(GPUPool(config=c))
    return JobManager(pool, clock=lambda: start + timedelta(seconds=next(ticks)), config=c)


JOB = {"script": "print(1)", "offer": "gpu", "gpus": 1}


def test_a_user_may_lower_a_priority_but_not_raise_it_by_default(tmp_path: Path) -> None:
    m = queue_only(tmp_path, {"a": {"guarantee": 1}})
    with pytest.raises(InvalidRequest) as err:
        m.submit("ann", ["a"], {**JOB, "priority": 1})
    assert err.value.message == (
        "Team a lets its users set a priority from -100 to 0 (higher runs first among the "
        "team's own jobs), not 1; a gpupool admin can submit the job with it or change the "
        "team's range."
    )
    assert m.jobs == {}  # nothing was queued
    low = m.submit("ann", ["a"], {**JOB, "priority": -100})
    assert m.jobs[low.id].spec.priority == -100 and m.jobs[low.id].state == "queued"


def test_an_admin_may_set_any_priority(tmp_path: Path) -> None:
    m = queue_only(tmp_path, {"a": {"guarantee": 1}})
    job = m.submit("root", ["a"], {**JOB, "priority": 100}, admin=True)
    assert m.jobs[job.id].spec.priority == 100
    with pytest.raises(InvalidRequest, match="priority must be a whole number from -100 to 100"):
        m.submit("root", ["a"], {**JOB, "priority": 101}, admin=True)


def test_the_range_an_admin_sets_for_a_team_holds_for_its_users(tmp_path: Path) -> None:
    m = queue_only(tmp_path, {"a": {"guarantee": 1, "min_priority": -5, "max_priority": 10}})
    assert m.submit("ann", ["a"], {**JOB, "priority": 10}).spec.priority == 10
    assert m.submit("ann", ["a"], {**JOB, "priority": -5}).spec.priority == -5
    for bad in (11, -6):
        with pytest.raises(InvalidRequest, match=f"from -5 to 10 .*, not {bad};"):
            m.submit("ann", ["a"], {**JOB, "priority": bad})


def test_a_high_priority_job_does_not_jump_another_teams_older_job(tmp_path: Path) -> None:
    teams = {"a": {"guarantee": 1, "max_priority": 100}, "b": {"guarantee": 1}}
    m = queue_only(tmp_path, teams)
    b_old = m.submit("bob", ["b"], JOB)
    a_plain = m.submit("ann", ["a"], JOB)
    a_urgent = m.submit("ann", ["a"], {**JOB, "priority": 100})
    b_new = m.submit("bob", ["b"], JOB)
    # equal fair share: submission time across teams; a's priority orders only a's jobs
    assert m.queue_positions() == {b_old.id: 1, a_urgent.id: 2, a_plain.id: 3, b_new.id: 4}
    # once team b holds its guarantee, team a is further below its own and goes first
    m.pool.allocate("bob", ["b"], "gpu", 1, team="b")
    assert m.queue_positions() == {a_urgent.id: 1, a_plain.id: 2, b_old.id: 3, b_new.id: 4}


def test_a_job_queued_past_reserve_after_is_served_first(tmp_path: Path) -> None:
    """``c.JobManager.reserve_after``: the oldest job queued that long goes first, whatever the
    teams' fair share; the queue positions users see are the order a pass serves."""
    m = queue_only(tmp_path, {"a": {"guarantee": 1}, "b": {"guarantee": 1}})
    m.reserve_after = 60.0
    b_old = m.submit("bob", ["b"], JOB)
    a_new = m.submit("ann", ["a"], JOB)
    m.pool.allocate("bob", ["b"], "gpu", 1, team="b")  # team b holds its guarantee
    assert m.queue_positions() == {a_new.id: 1, b_old.id: 2}  # fair share: a first
    later = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(minutes=2)
    m.clock = lambda: later  # both waited 2 minutes: bob's job is the oldest
    assert m.queue_positions() == {b_old.id: 1, a_new.id: 2}


def test_cpu_job_limits_hold_real_jobs_in_the_queue_with_the_reason(tmp_path: Path) -> None:
    """CPU-only jobs cost no GPU-equivalents: the per-user limit and the machine's rank limit
    keep them queued (saying why) instead of starting them all; they start as others end."""

    async def scenario() -> None:
        m = manager(tmp_path)
        m.max_cpu_jobs_per_user = 1
        m.max_cpu_ranks = 4  # whatever the cores of the machine running the test
        m.backend.max_ranks = 4
        await m.start()
        try:
            cpu = {"script": SLEEPER, "offer": "cpu", "gpus": 2}
            first = m.submit("ann", [], cpu)
            second = m.submit("ann", [], cpu)  # over ann's one CPU-only job at a time
            bob = m.submit("bob", [], {**cpu, "gpus": 3})  # 2 + 3 ranks: over the machine's 4
            await m.schedule_pass()
            await until(m, first.id, "running")
            assert m.jobs[second.id].state == "queued"
            assert "max_cpu_jobs_per_user = 1" in m.jobs[second.id].reason
            assert m.jobs[bob.id].state == "queued"
            assert "LocalJobBackend.max_ranks" in m.jobs[bob.id].reason

            await m.cancel(first.id, "ann", False)
            await until(m, first.id, "cancelled")
            await m.schedule_pass()
            started = [j for j in (second, bob) if m.jobs[j.id].state != "queued"]
            assert len(started) == 1  # one of them; the other still waits for ranks
        finally:
            for job in list(m.jobs.values()):
                if not job.final:
                    await m.cancel(job.id, job.owner, True)
            await m.stop()

    asyncio.run(scenario())


def test_a_jobs_script_lives_in_the_store_not_in_the_hubs_memory(tmp_path: Path) -> None:
    """The script (up to 1 MiB) is read from the database when the job starts; the job the hub
    keeps in memory, queued, running or ended, holds none of it."""
    script = "# " + "x" * ((1 << 20) - 64) + "\nprint('ran', flush=True)\n"

    async def scenario() -> None:
        m = manager(tmp_path)
        await m.start()
        try:
            job = m.submit("ann", ["a"], {"script": script, "offer": "cpu"})
            assert m.jobs[job.id].spec.script == "" and job.spec.script == ""
            assert m.pool.store.job_script(job.id) == script
            await m.schedule_pass()
            await until(m, job.id, "succeeded")
            ran = m.backend.job_dir(m.jobs[job.id]) / "script.py"  # what the backend was given
            assert ran.read_text() == script and m.jobs[job.id].spec.script == ""
            log, _ = await m.read_log(m.jobs[job.id], 0, 0)
            assert b"ran" in log
        finally:
            await m.stop()

    asyncio.run(scenario())


def test_finished_jobs_are_forgotten_after_the_retention_rows_scripts_and_logs(
    tmp_path: Path,
) -> None:
    """``JobManager.retention_days`` after a job ended, its row, script and job directory (its
    logs) go; younger ended jobs and jobs still queued or running stay, however old."""
    now = [datetime(2026, 1, 1, tzinfo=UTC)]

    async def scenario() -> None:
        m = manager(tmp_path, clock=lambda: now[0])
        m.retention_days = 30
        m.max_time_limit = 100 * 86400
        await m.start()
        try:
            old = m.submit("ann", ["a"], {"script": "print('old')", "offer": "cpu"})
            long = {"script": SLEEPER, "offer": "cpu", "time_limit": 90 * 86400}
            sleeper = m.submit("bob", ["b"], long)
            await m.schedule_pass()
            await until(m, old.id, "succeeded")
            await until(m, sleeper.id, "running")
            old_dir = m.backend.job_dir(m.jobs[old.id])
            assert (old_dir / "rank-0.log").is_file()
            now[0] += timedelta(days=20)
            young = m.submit("ann", ["a"], {"script": "print('young')", "offer": "cpu"})
            await m.schedule_pass()
            await until(m, young.id, "succeeded")
            now[0] += timedelta(days=10, seconds=1)  # old ended 30 days ago, young 10

            assert await m.prune() == [old.id]
            assert old.id not in m.jobs and not old_dir.exists()
            assert m.pool.store.job_script(old.id) is None
            assert {j.id for j in m.pool.store.load_jobs()} == {young.id, sleeper.id}
            assert (m.backend.job_dir(m.jobs[young.id]) / "rank-0.log").is_file()
            assert m.jobs[sleeper.id].state == "running"  # 30 days old, but not ended

            m.retention_days = 0  # keeps ended jobs for ever
            now[0] += timedelta(days=365)
            assert await m.prune() == []
        finally:
            await m.cancel(sleeper.id, "admin", True)
            await m.stop()

    asyncio.run(scenario())


def test_a_negative_retention_stops_the_hub_naming_the_key(tmp_path: Path) -> None:
    pool = queue_only(tmp_path, {}).pool
    c = Config()
    c.JobManager.retention_days = -1
    with pytest.raises(ConfigError, match=r"^JobManager.retention_days: must be a number >= 0"):
        JobManager(pool, config=c)


def test_a_user_at_the_jobs_limit_of_every_team_is_refused_before_the_body_is_read(
    tmp_path: Path,
) -> None:
    teams = {"a": {"guarantee": 1, "user_limits": {"jobs": 1}}, "b": {"user_limits": {"jobs": 2}}}
    m = queue_only(tmp_path, teams)
    m.check_room("ann", ["a", "b"])  # room in both
    m.submit("ann", ["a", "b"], {**JOB, "team": "a"})
    m.check_room("ann", ["a", "b"])  # a is full, b has room: the body decides
    with pytest.raises(LimitReached, match="You have 1 job queued or running; the limit is 1"):
        m.submit("ann", ["a", "b"], {**JOB, "team": "a"})
    m.submit("ann", ["a", "b"], {"script": "print(1)", "offer": "cpu", "team": "b"})
    with pytest.raises(LimitReached, match=r"You have 2 jobs .* the limit is 2 per user in team b"):
        m.check_room("ann", ["a", "b"])
    m.check_room("bob", ["a", "b"])  # per user


def test_a_pass_writes_every_changed_waiting_reason_in_one_transaction(tmp_path: Path) -> None:
    """However many queued jobs a pass finds waiting for a new reason, the database commits once
    (one user's many queued jobs do not make every pass slow)."""
    from sqlalchemy import event

    m = queue_only(tmp_path, {"a": {"guarantee": 1}})
    jobs = [m.submit("ann", ["a"], JOB) for _ in range(6)]
    assert {m.jobs[j.id].reason for j in jobs} == {"waiting to start"}
    m.pool.allocate("bob", ["a"], "gpu", 1, team="a")  # the team's whole quota: all must wait
    commits: list[None] = []
    event.listen(m.pool.store.engine, "commit", lambda _conn: commits.append(None))
    asyncio.run(m.schedule_pass())
    reasons = {m.jobs[j.id].reason for j in jobs}
    assert len(reasons) == 1 and "team a" in reasons.pop()
    assert len(commits) == 1
    assert {j.id: j.reason for j in m.pool.store.load_jobs()} == {
        j.id: m.jobs[j.id].reason for j in jobs
    }


def test_a_running_manager_forgets_old_jobs_on_its_own(tmp_path: Path) -> None:
    """The loop forgets expired jobs at its first pass after a start, then every
    ``prune_interval``: no one has to call :meth:`JobManager.prune`."""
    now = [datetime(2026, 1, 1, tzinfo=UTC)]

    async def scenario() -> None:
        m = manager(tmp_path, clock=lambda: now[0])
        old = m.submit("ann", ["a"], {"script": "print(1)", "offer": "cpu"})
        await m.cancel(old.id, "ann", False)  # ended while queued
        now[0] += timedelta(days=31)
        await m.start()
        try:

            async def forgotten() -> None:
                while old.id in m.jobs:
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(forgotten(), 30)
            assert m.pool.store.load_jobs() == [] and m.pool.store.job_script(old.id) is None
        finally:
            await m.stop()

    asyncio.run(scenario())


def test_a_grant_keeps_off_the_nodes_the_plan_keeps_it_off(tmp_path: Path) -> None:
    """The queue places a backfilled job off the head's reserved nodes (``Plan.keep_off``); the
    grant must place it the same way, or it lands where the placement policy prefers, which
    may be the node the head waits for."""
    m = queue_only(tmp_path, {"a": {"guarantee": 4}}, "simulated:m: 2x H100-80GB; n: 2x H100-80GB")
    free = m.submit("ann", ["a"], JOB)
    kept = m.submit("ann", ["a"], JOB)
    assert m._grant(free.id)
    assert m._grant(kept.id, frozenset({"m"}))
    nodes = [m.pool.ledger.allocations[m.jobs[j.id].allocations[0]].node for j in (free, kept)]
    assert nodes == ["m", "n"]
