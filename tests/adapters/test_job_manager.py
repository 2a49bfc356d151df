"""The job manager with the real local backend (real torchrun processes): preemption requeues
a borrowing team's newest job when the lender needs its guarantee back, and a queued job is
started by the next pass once it fits."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.jobs.local import group_alive, job_pids
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool

SLEEPER = "import time\nwhile True:\n    time.sleep(0.5)\n"


def manager(tmp_path: Path) -> JobManager:
    c = Config()
    c.GPUPool.inventory = "simulated:n: 2x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"gpu": {"kind": "gpu", "max_count": 2}}
    c.GPUPool.teams = {"a": {"guarantee": 1, "borrow_limit": 1}, "b": {"guarantee": 1}}
    c.LocalJobBackend.home_dir_template = str(tmp_path / "home" / "{username}")
    c.LocalJobBackend.kill_grace = 2.0
    c.JobManager.watch_interval = 0.5
    return JobManager(Pool.from_config(GPUPool(config=c)), config=c)


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
