"""A database that refuses writes never strands a GPU or a job: what happened (a release, a job's
end) is kept in memory at once and owed to the database, retried with backoff until written;
meanwhile the store is unhealthy and grants are refused with 503 and one sentence. The fault is
real (tables renamed away by another connection: :mod:`tests.store_faults`, on SQLite and
PostgreSQL; a PostgreSQL server stopped and started again); the retry's time is the outbox's
clock seam, never a sleep."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.hub.errors import status_of
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool.store import Store
from gpupool.store.outbox import StoreUnavailable
from tests.accounts import shared_mode
from tests.databases import PostgresServer, running_server
from tests.store_faults import refuse_writes, refusing_writes, take_writes


class Clock:
    """The outbox's monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def config(tmp_path: Path, url: str = "") -> Config:
    c = Config()
    c.GPUPool.inventory = "simulated:n: 2x H100-80GB"
    c.GPUPool.db_url = url or f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"gpu": {"kind": "gpu", "max_count": 2}, "cpu": {"kind": "cpu"}}
    c.GPUPool.teams = {"a": {"guarantee": 2}}
    return c


def pool(tmp_path: Path, clock: Clock, url: str = "") -> Pool:
    p = Pool.from_config(GPUPool(config=config(tmp_path, url)))
    p.writes.clock = clock
    return p


def test_a_release_the_database_refuses_frees_the_gpu_and_is_written_later(
    tmp_path: Path, db_url: str
) -> None:
    clock = Clock()
    p = pool(tmp_path, clock, db_url)
    url = db_url
    held = p.allocate("ann", ["a"], "gpu", 2, kind="notebook", ref="ann/")
    assert p.writes.health()["healthy"]

    refuse_writes(url)
    p.release(held.id)  # the server stopped: never undone because it cannot be written
    assert held.id not in p.ledger.allocations and p.ledger.team_used["a"] == 0
    health = p.writes.health()
    assert not health["healthy"] and health["pending_writes"] == 1
    assert "gpupool_allocations" in health["problem"] and health["since"]  # does not exist

    with pytest.raises(StoreUnavailable) as refused:  # nothing handed out the store cannot know
        p.allocate("bob", ["a"], "gpu", 1, kind="notebook", ref="bob/")
    assert status_of(refused.value) == 503
    assert "gpupool's database cannot record it" in refused.value.message
    assert "Try again" in refused.value.message
    assert p.ledger.allocations == {}

    assert not p.writes.retry_due()  # not due yet: the database is not hammered
    waits = []
    for _ in range(3):  # due, still refused: the wait doubles
        clock.now = p.writes.next_try
        assert not p.writes.retry_due()
        waits.append(p.writes.next_try - clock.now)
    assert waits == [waits[0], 2 * waits[0], 4 * waits[0]]

    take_writes(url)
    assert not p.writes.retry_due()  # works again, but only written when due
    clock.now = p.writes.next_try
    assert p.writes.retry_due()
    assert p.writes.health() == {**health, "healthy": True, "pending_writes": 0, "since": None,
                                 "problem": None}  # fmt: skip
    assert Store(url).load() == []  # what a restart would read: nothing held
    assert p.allocate("bob", ["a"], "gpu", 1, kind="notebook", ref="bob/").count == 1


def test_a_failed_grant_with_nothing_owed_is_healthy_again_once_a_probe_writes(
    tmp_path: Path, db_url: str
) -> None:
    clock = Clock()
    p = pool(tmp_path, clock, db_url)
    url = db_url
    with refusing_writes(url):
        with pytest.raises(StoreUnavailable):
            p.allocate("ann", ["a"], "gpu", 1, kind="notebook", ref="ann/")
        assert p.writes.health()["healthy"] is False
        clock.now = p.writes.next_try
        assert not p.writes.retry_due()  # the probe's write is refused too
    clock.now = p.writes.next_try
    assert p.writes.retry_due()
    assert p.writes.health()["healthy"]


def test_a_job_that_ends_while_the_database_refuses_writes_ends_and_frees_its_gpus(
    tmp_path: Path,
) -> None:
    c = config(tmp_path)
    shared_mode(c)
    c.JobManager.watch_interval = 0.2
    clock = Clock()

    async def scenario() -> None:
        m = JobManager(Pool.from_config(GPUPool(config=c)), config=c)
        m.pool.writes.clock = clock
        url = str(m.pool.store.engine.url)
        await m.start()
        try:
            job = m.submit("ann", ["a"], {"script": "print('done')", "offer": "gpu", "gpus": 1})
            await m.schedule_pass()
            refuse_writes(url)
            async with asyncio.timeout(120):
                while m.jobs[job.id].state not in ("succeeded", "failed"):
                    await asyncio.sleep(0.1)
            assert m.jobs[job.id].state == "succeeded"
            assert m.pool.ledger.allocations == {}  # its GPU is free for the next job
            assert m.pool.writes.health()["pending_writes"] == 2  # its release and its end

            with pytest.raises(StoreUnavailable):  # a job the database cannot record: 503
                m.submit("ann", ["a"], {"script": "print(2)", "offer": "cpu"})
            assert len(m.jobs) == 1

            take_writes(url)
            clock.now = m.pool.writes.next_try
            assert m.pool.writes.retry_due()
            again = Store(url)
            assert again.load() == []
            (stored,) = again.load_jobs()
            assert stored.state == "succeeded" and stored.exit_codes == ((0, 0),)
        finally:
            await m.stop()

    asyncio.run(scenario())


@pytest.fixture
def own_postgresql(postgresql_server: PostgresServer) -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own (it is stopped and started again under a pool);
    whether one can run at all is the session's server's to say."""
    with running_server(postgresql_server.bin_dir) as server:
        yield server


def test_a_postgresql_server_that_goes_down_under_the_pool_strands_nothing(
    tmp_path: Path, own_postgresql: PostgresServer
) -> None:
    own_postgresql.execute("CREATE DATABASE gpupool")
    url = own_postgresql.url("gpupool")
    clock = Clock()
    p = pool(tmp_path, clock, url)
    held = p.allocate("ann", ["a"], "gpu", 1, kind="notebook", ref="ann/")

    own_postgresql.stop()
    p.release(held.id)  # the server stopped: its GPU is free, the delete owed
    assert p.ledger.allocations == {}
    assert p.writes.health()["pending_writes"] == 1
    with pytest.raises(StoreUnavailable):
        p.allocate("bob", ["a"], "gpu", 1, kind="notebook", ref="bob/")

    own_postgresql.start()
    clock.now = p.writes.next_try
    assert p.writes.retry_due()  # the pool's connections were cut: it reconnects
    assert p.writes.health()["healthy"]
    assert Store(url).load() == []
    assert p.allocate("bob", ["a"], "gpu", 1, kind="notebook", ref="bob/").user == "bob"
    p.store.close()
