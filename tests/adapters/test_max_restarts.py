"""``max_restarts`` means one thing everywhere: how many times the pool may put a job back in the
queue after preempting it. A job that fails is never restarted: the hub ends it ``failed`` and
starts it no more (whatever its ``max_restarts``), the local backend runs torchrun with
``--max-restarts 0``, a Kubernetes Job has ``backoffLimit: 0`` (tests/deploy/test_kube_jobs.py),
and the ``gpupool`` command's help says so. Preemption's requeue is
tests/adapters/test_job_manager.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

import gpupool.jobs.local as local
from gpupool.config import GPUPool
from gpupool.core.jobs import Job, JobSpec
from gpupool.core.ledger import Allocation
from gpupool.jobs.backend import JobBackend, Observation
from gpupool.jobs.local import LocalJobBackend
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool_lab.command.main import build_parser
from tests.accounts import shared_mode


class FailingBackend(JobBackend):
    """A backend whose every job's rank 0 exits 1 as soon as it started; it counts its starts."""

    name = "failing"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.starts: list[str] = []

    async def start(self, job: Job, allocations: list[Allocation]) -> str:
        self.starts.append(job.id)
        return f"handle-{job.id}"

    async def check(self, job: Job) -> Observation:
        return Observation("failed", "rank 0 exited 1 (see the rank logs)", ((0, 1),))

    async def wait(self, job: Job, timeout: float) -> None:
        return None

    async def cancel(self, job: Job) -> None:
        return None

    async def read_log(self, job: Job, rank: int, offset: int) -> tuple[bytes, int]:
        return b"", 0


def config(tmp_path: Path) -> Config:
    c = Config()
    c.GPUPool.inventory = "simulated:n: 2x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"gpu": {"kind": "gpu", "max_count": 2}}
    c.GPUPool.teams = {"a": {"guarantee": 2}}
    shared_mode(c)
    c.JobManager.schedule_interval = 3600.0  # passes only when the test runs one
    return c


async def ended(m: JobManager, job_id: str) -> None:
    while m.jobs[job_id].active:
        await asyncio.sleep(0.05)  # polling the state, as test_job_manager's until() does


def test_a_failed_job_is_not_restarted_whatever_its_max_restarts(tmp_path: Path) -> None:
    c = config(tmp_path)
    c.JobManager.backend_class = FailingBackend
    m = JobManager(Pool.from_config(GPUPool(config=c)), config=c)

    async def scenario() -> None:
        await m.start()
        try:
            job = m.submit("ann", ["a"], {"script": "x", "offer": "gpu", "max_restarts": 3})
            await m.schedule_pass()
            await asyncio.wait_for(ended(m, job.id), 30)
            await m.schedule_pass()  # a pass after the end starts nothing again
            failed = m.jobs[job.id]
            assert (failed.state, failed.restarts) == ("failed", 0), failed.reason
            assert failed.reason.startswith("rank 0 exited 1")
            assert m.backend.starts == [job.id]  # type: ignore[attr-defined]
            assert m.pool.ledger.team_used["a"] == 0
        finally:
            await m.stop()

    asyncio.run(scenario())


class Launched(Exception):
    """What the stand-in for process creation raises, with the command it was given."""


def test_the_local_backend_runs_torchrun_without_restarts_on_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = config(tmp_path)
    pool = Pool.from_config(GPUPool(config=c))
    job = Job("job-1", "ann", "a", JobSpec(script="x", offer="gpu", max_restarts=3))
    grant = pool.allocate("ann", ["a"], "gpu", 1, team="a", ref="job:job-1", kind="job")

    async def launch(*command: str, **_: Any) -> None:
        raise Launched(command)

    monkeypatch.setattr(local.asyncio, "create_subprocess_exec", launch)
    with pytest.raises(Launched) as launched:
        asyncio.run(LocalJobBackend(config=c).start(job, [grant]))
    command = list(launched.value.args[0])
    at = command.index("--max-restarts")
    assert command[at + 1] == "0" and command.count("--max-restarts") == 1


def test_the_commands_help_says_what_max_restarts_means(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["submit", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "requeue the job after preempting it" in help_text
    assert "a job that fails is never restarted" in help_text
    assert "restarts on failure" not in help_text
