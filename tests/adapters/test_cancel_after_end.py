"""A job whose ranks have all exited keeps its own final state when a cancel arrives while the
rest of it is still going away (torchrun's teardown, a process a rank left behind): the real
local backend, a rank that exits 0 leaving a child in the job's process group."""

from __future__ import annotations

import asyncio
from pathlib import Path

from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from tests.accounts import shared_mode

LEAVES_A_CHILD = (
    "import subprocess\n"
    "subprocess.Popen(['sleep', '60'])  # in the job's process group, after the rank is gone\n"
    "print('done', flush=True)\n"
)


def test_a_cancel_after_every_rank_exited_keeps_succeeded(tmp_path: Path) -> None:
    c = Config()
    c.GPUPool.inventory = "simulated:n: 1x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"cpu": {"kind": "cpu"}}
    c.GPUPool.teams = {"a": {"guarantee": 1}}
    shared_mode(c)
    c.LocalJobBackend.kill_grace = 2.0
    c.JobManager.watch_interval = 0.2

    async def scenario() -> None:
        m = JobManager(Pool.from_config(GPUPool(config=c)), config=c)
        await m.start()
        try:
            job = m.submit("ann", ["a"], {"script": LEAVES_A_CHILD, "offer": "cpu", "gpus": 2})
            await m.schedule_pass()
            async with asyncio.timeout(120):  # both ranks exited 0; the job is still "running"
                while len((await m.backend.check(m.jobs[job.id])).exit_codes) < 2:
                    await asyncio.sleep(0.1)
            assert m.jobs[job.id].state in ("starting", "running")
            ended = await m.cancel(job.id, "ann", False)
            assert ended.state == "succeeded", ended.reason
            assert ended.exit_codes == ((0, 0), (1, 0))
            assert m.pool.ledger.allocations == {}
        finally:
            await m.stop()

    asyncio.run(scenario())
