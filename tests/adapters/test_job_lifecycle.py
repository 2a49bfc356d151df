"""A job has one owner at a time: cancel, the scheduling pass and the watcher never race.

The real local backend (real torchrun processes, run as the account the tests run user code
as), with gates the test opens and closes: the backend's ``start`` can be held before it starts
processes or after it has started them but before it returns their handle, and the watcher can
be held before it looks again. Every interleaving below is reached by opening gates, never by
sleeping.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.core.jobs import Job
from gpupool.core.ledger import Allocation
from gpupool.jobs.local import LocalJobBackend, job_pids
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from tests.accounts import shared_mode

T = TypeVar("T")
SLEEPER = "import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.5)\n"
QUICK = "print('done', flush=True)\n"


class Gate:
    """A point the backend stops at: ``reached`` is set when it gets there; it goes on once
    ``opened`` is set."""

    def __init__(self, open_: bool = True) -> None:
        self.reached = asyncio.Event()
        self.opened = asyncio.Event()
        if open_:
            self.opened.set()

    async def pass_(self) -> None:
        self.reached.set()
        await self.opened.wait()


class GatedBackend(LocalJobBackend):
    """The real local backend with gates: per job, before starting processes, after starting
    them (before returning the handle), and before each wait of the watcher."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.before: dict[str, Gate] = {}
        self.after: dict[str, Gate] = {}
        self.watching: dict[str, Gate] = {}

    def gate(self, table: dict[str, Gate], job_id: str) -> Gate:
        return table.setdefault(job_id, Gate())

    async def start(self, job: Job, allocations: list[Allocation]) -> str:
        await self.gate(self.before, job.id).pass_()
        handle = await super().start(job, allocations)
        await self.gate(self.after, job.id).pass_()
        return handle

    async def wait(self, job: Job, timeout: float) -> None:
        await self.gate(self.watching, job.id).pass_()
        await super().wait(job, timeout)


def manager(tmp_path: Path, launches: int = 4) -> JobManager:
    c = Config()
    c.GPUPool.inventory = "simulated:n: 2x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"gpu": {"kind": "gpu", "max_count": 2}}
    c.GPUPool.teams = {"a": {"guarantee": 2}}
    shared_mode(c)
    c.JobManager.backend_class = GatedBackend
    c.JobManager.max_concurrent_launches = launches
    c.JobManager.schedule_interval = 3600.0  # passes only when the test runs one
    c.LocalJobBackend.kill_grace = 2.0
    return JobManager(Pool.from_config(GPUPool(config=c)), config=c)


@contextlib.asynccontextmanager
async def started(m: JobManager) -> AsyncIterator[JobManager]:
    """The manager running (its loop and watchers) for the body, stopped after it."""
    await m.start()
    try:
        yield m
    finally:
        await m.stop()


def gates(m: JobManager) -> GatedBackend:
    assert isinstance(m.backend, GatedBackend)
    return m.backend


async def within(awaitable: Awaitable[T], seconds: float = 60) -> T:
    return await asyncio.wait_for(awaitable, seconds)


async def until(m: JobManager, job_id: str, states: set[str]) -> None:
    async def reached() -> None:
        while m.jobs[job_id].state not in states:
            await asyncio.sleep(0.05)

    await within(reached())


def held(m: JobManager, job_id: str) -> list[str]:
    return [a.id for a in m.pool.ledger.allocations.values() if a.ref == job_id]


def test_a_job_cancelled_during_a_pass_is_never_granted_and_the_pass_goes_on(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with started(
            manager(tmp_path, launches=1)
        ) as m:  # one start at a time: b waits behind a
            backend = gates(m)
            a = m.submit("ann", ["a"], {"script": QUICK, "offer": "gpu"})
            b = m.submit("ann", ["a"], {"script": QUICK, "offer": "gpu"})
            backend.gate(backend.before, a.id).opened.clear()
            passing = asyncio.create_task(m.schedule_pass())
            await within(backend.before[a.id].reached.wait())  # a is being started; b planned
            cancelled = await within(m.cancel(b.id, "ann", False))
            assert cancelled.state == "cancelled" and held(m, b.id) == []
            backend.before[a.id].opened.set()
            await within(passing)  # the pass ends without an error
            await until(m, a.id, {"succeeded"})
            assert m.jobs[b.id].state == "cancelled" and m.jobs[b.id].handle == ""
            assert m.pool.ledger.allocations == {}

    asyncio.run(scenario())


def test_cancel_while_starting_stops_the_processes_it_has_no_handle_for_yet(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with started(manager(tmp_path)) as m:
            backend = gates(m)
            job = m.submit("ann", ["a"], {"script": SLEEPER, "offer": "gpu", "gpus": 2})
            backend.gate(backend.after, job.id).opened.clear()
            passing = asyncio.create_task(m.schedule_pass())
            await within(backend.after[job.id].reached.wait())  # processes up, no handle yet
            assert m.jobs[job.id].state == "starting" and m.jobs[job.id].handle == ""
            cancelling = asyncio.create_task(m.cancel(job.id, "ann", False))
            backend.after[job.id].opened.set()
            done = await within(cancelling)
            await within(passing)
            assert done.state == "cancelled" and done.reason == "cancelled by ann"
            assert job_pids(job.id) == []  # every rank is gone
            assert m.pool.ledger.allocations == {}
            assert m.jobs[job.id].handle  # the launch's handle was kept, not overwritten

    asyncio.run(scenario())


def test_a_job_that_ended_on_its_own_keeps_its_state_and_exit_codes_when_cancelled(
    tmp_path: Path,
) -> None:
    async def scenario() -> None:
        async with started(manager(tmp_path)) as m:
            backend = gates(m)
            job = m.submit("ann", ["a"], {"script": QUICK, "offer": "gpu", "gpus": 2})
            watcher = backend.gate(backend.watching, job.id)
            watcher.opened.clear()  # the watcher looks once, then waits at the gate
            await m.schedule_pass()
            await within(watcher.reached.wait())
            exit_file = Path(m.backend.job_dir(m.jobs[job.id])) / "exit-code"  # type: ignore[attr-defined]

            async def ended() -> None:
                while not os.path.exists(exit_file):
                    await asyncio.sleep(0.05)

            await within(ended())  # the job is over; the watcher has not seen it yet
            done = await within(m.cancel(job.id, "ann", False))
            assert done.state == "succeeded" and dict(done.exit_codes) == {0: 0, 1: 0}
            watcher.opened.set()  # the watcher looks again and leaves the final state alone
            await within(_no_watchers(m))
            assert m.jobs[job.id].state == "succeeded" and m.pool.ledger.allocations == {}

    asyncio.run(scenario())


def test_a_cancelled_job_stays_cancelled_whatever_the_watcher_sees_next(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with started(manager(tmp_path)) as m:
            job = m.submit("ann", ["a"], {"script": SLEEPER, "offer": "gpu"})
            await m.schedule_pass()
            await until(m, job.id, {"running"})
            done = await within(m.cancel(job.id, "ann", False))
            assert done.state == "cancelled"
            await within(_no_watchers(m))
            assert m.jobs[job.id].state == "cancelled" and m.jobs[job.id].reason == done.reason

    asyncio.run(scenario())


async def _no_watchers(m: JobManager) -> None:
    while m._watchers:
        await asyncio.sleep(0.05)


def test_a_job_whose_launcher_died_is_recorded_from_its_ranks_exit_codes(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with started(manager(tmp_path)) as m:
            job = m.submit("ann", ["a"], {"script": QUICK, "offer": "gpu", "gpus": 2})
            await m.schedule_pass()
            await until(m, job.id, {"succeeded"})
        ended = m.jobs[job.id]
        jdir = Path(json.loads(ended.handle)["dir"])
        (jdir / "exit-code").unlink()  # as when the hub's exit killed the launcher (asyncio does)
        restarted = GatedBackend(config=m.config)  # a new hub: not its child, no exit-code
        seen = await restarted.check(ended)
        assert (seen.state, dict(seen.exit_codes)) == ("succeeded", {0: 0, 1: 0})

    asyncio.run(scenario())
