"""The Slurm spawner's ``poll`` and state, in process, against real daemons: many spawners read one
shared poller (``SlurmCommands.calls`` does not grow with their polls), a controller that does not
answer is "running", an ended job is its exit status, and a job a snapshot fresh for its
submission no longer lists is gone (Slurm purged it after ``MinJobAge``)."""

from __future__ import annotations

import asyncio
import importlib
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from gpupool.declarations import ConfigError
from gpupool.hub.objects import SETTINGS_KEY, HubObjects
from gpupool.slurm.devcluster import DevCluster
from gpupool.slurm.engine import SlurmEngine
from gpupool.slurm.notebook import JobExit
from gpupool.slurm.settings import SlurmSettings
from gpupool.usercode import hub_account
from gpupool_spawner.mixin import UnknownExit
from gpupool_spawner.slurm import SlurmSpawner, SlurmSpawnerBase
from tests.slurm_cluster import MakeCluster

SERVERS = 6


def _engine(cluster: DevCluster) -> SlurmEngine:
    return SlurmEngine(SlurmSettings(slurm_conf=str(cluster.conf), command_timeout=10))


def _spawner(engine: SlurmEngine, job_id: int, submitted_at: float) -> SlurmSpawnerBase:
    hub = HubObjects(None, None, None, slurm=engine)  # type: ignore[arg-type]
    user = SimpleNamespace(name="ada", settings={SETTINGS_KEY: hub})
    spawner = SlurmSpawnerBase(user=user, _deprecated_db_session=None)
    spawner.load_state({"slurm_job_id": job_id, "slurm_node": "gpu1"})
    spawner._submitted_at = submitted_at
    return spawner


async def _until(check, timeout: float = 60) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.2)


def test_many_servers_one_poller_unknown_is_running_ended_and_gone(
    make_slurm_cluster: MakeCluster,
) -> None:
    cluster = make_slurm_cluster(min_job_age=3)

    async def run() -> None:
        engine = _engine(cluster)
        poller, commands = engine.poller, engine.commands
        job_id = await commands.sbatch("#!/bin/sh\nsleep 600\n", [], hub_account(), {}, "/tmp")
        submitted = time.monotonic()
        spawners = [_spawner(engine, job_id, submitted) for _ in range(SERVERS)]
        assert await spawners[0].poll() is None  # the first poll waits for the first snapshot
        await poller.fresh(submitted)
        calls = commands.calls
        for _ in range(10):
            assert [await s.poll() for s in spawners] == [None] * SERVERS
        assert commands.calls == calls  # 60 polls, no squeue of their own

        cluster.stop_controller()  # unknown is not stopped
        await poller.refresh()
        assert poller.failure
        assert [await s.poll() for s in spawners] == [None] * SERVERS
        cluster.start_controller()

        async def answers() -> bool:
            await poller.refresh()
            return poller.known

        await _until(answers)
        assert await spawners[0].poll() is None

        await commands.scancel(job_id)
        await _until(lambda: _ended(engine, job_id))
        status = await spawners[0].poll()
        assert isinstance(status, JobExit) and status != 0 and "CANCELLED" in str(status)

        async def purged() -> bool:  # MinJobAge=3: Slurm forgets it
            await poller.fresh(time.monotonic())
            return poller.job(job_id) is None

        await _until(purged)
        gone = await spawners[0].poll()
        assert isinstance(gone, UnknownExit) and "no longer listed" in str(gone)
        # a job submitted after the last snapshot is not gone, only newer than it
        newer = _spawner(engine, job_id, time.monotonic())
        assert await newer.poll() is None

    asyncio.run(run())


async def _ended(engine: SlurmEngine, job_id: int) -> bool:
    snapshot = await engine.poller.fresh(time.monotonic())
    job = snapshot.jobs.get(job_id)
    return job is not None and job.ended


def test_the_state_keeps_the_job_and_node_and_a_bad_time_limit_names_the_key() -> None:
    spawner = SlurmSpawnerBase(
        user=SimpleNamespace(name="ada", settings={}), _deprecated_db_session=None
    )
    spawner.load_state({"slurm_job_id": 42, "slurm_node": "gpu2"})
    assert spawner.get_state() == {"slurm_job_id": 42, "slurm_node": "gpu2"}
    spawner.clear_state()
    assert spawner.get_state() == {}
    with pytest.raises(ConfigError, match=r"SlurmSpawner\.time_limit"):
        SlurmSpawner(
            user=SimpleNamespace(name="ada", settings={}),
            _deprecated_db_session=None,
            time_limit="eight hours",
        )


def test_the_spawner_is_jupyterhubs_gpupool_slurm() -> None:
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["jupyterhub.spawners"]["gpupool-slurm"]
    module, _, name = target.partition(":")
    assert getattr(importlib.import_module(module), name) is SlurmSpawner
