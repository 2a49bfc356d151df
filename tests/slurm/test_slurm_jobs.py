"""The Slurm job backend through the job manager, against real daemons and real ``torchrun``.

Each test starts a dev cluster (:mod:`tests.slurm_cluster`: one slurmd per node on this host,
so a 2-node job really runs 2 ``srun`` tasks) and a pool whose inventory is the cluster's
(``sinfo``); jobs run as a real unprivileged unix account (:func:`tests.accounts.unix_user`)
with the tests' runtime Python (torch, gloo on CPU).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.hub.models import job_model
from gpupool.hub.objects import build
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool.slurm.commands import SlurmCommands
from gpupool.slurm.devcluster import DevCluster, NodeLayout
from gpupool.slurm.engine import SlurmEngine
from gpupool.slurm.jobs import SlurmJobBackend
from gpupool.slurm.names import parse_tag
from gpupool.slurm.parse import SlurmJob
from gpupool.usercode import account, code_accounts
from tests.accounts import IS_ROOT, NOT_ROOT, RUNTIME_PYTHON, unix_user
from tests.slurm_cluster import MakeCluster, with_accounting

pytestmark = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)

OWNER, OTHER = "gpupool-sjob", "gpupool-sjob2"
COSTS = {"gpu:h100": 1000, "gpu:1g.10gb": 125}
"""The gres costs of :func:`config`'s gres models."""
H100S = (NodeLayout("gpu1", {"h100": 2, "1g.10gb": 3}), NodeLayout("gpu2", {"h100": 2}))
"""Two nodes with the same whole-GPU type (a job asks the same gres of each node)."""

DDP = """\
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
rank = int(os.environ["RANK"])
print(f"rank {rank} of {dist.get_world_size()} sum {int(t.item())}"
      f" on {os.environ.get('SLURMD_NODENAME')} devices {os.environ.get('CUDA_VISIBLE_DEVICES')}"
      f" ddp {os.environ.get('GPUPOOL_DDP_BACKEND', '')}", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 and rank == 1 else 0)
"""
SLEEPER = "import time\nprint('sleeping', flush=True)\nwhile True:\n    time.sleep(0.5)\n"
SLEEP_THEN_FAIL = """\
import os, sys, time
time.sleep(float(sys.argv[1]))
sys.exit(3 if os.environ["RANK"] == "1" else 0)
"""


def config(cluster: DevCluster, tmp_path: Path, jobs_root: Path | None = None) -> Config:
    c = Config()
    c.GPUPool.inventory = "slurm"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {
        "h100": {"kind": "gpu", "model": "H100-80GB", "max_count": 2},
        "mig": {"kind": "mig", "model": "H100-80GB", "profile": "1g.10gb", "max_count": 2},
    }
    c.GPUPool.teams = {"lab": {"guarantee": 4}}
    c.SlurmSettings.slurm_conf = str(cluster.conf)
    c.SlurmSettings.gres_models = {"h100": "H100-80GB", "1g.10gb": "H100-80GB"}
    c.SlurmSettings.poll_period = 1.0
    c.JobManager.backend_class = "gpupool.slurm.jobs.SlurmJobBackend"
    c.JobManager.watch_interval = 0.5
    c.SlurmJobBackend.python = RUNTIME_PYTHON
    c.SlurmJobBackend.kill_grace = 20.0
    if jobs_root is not None:
        c.SlurmJobBackend.jobs_folder = f"{jobs_root}/{{username}}"
    return c


def manager(c: Config, engine: str = "mirror") -> JobManager:
    """A job manager over a pool of the cluster, handed the hub's Slurm side (started) as
    ``gpupool.hub.setup`` does: ``"mirror"``, with the mirror as in the hub; ``"plain"``, its
    poller only (the ledger does not learn of other users' jobs); ``""``: none, the backend
    makes its own."""
    pool = Pool.from_config(GPUPool(config=c))
    slurm = None
    if engine:
        slurm = SlurmEngine.from_config(c, pool=pool if engine == "mirror" else None)
        slurm.apply_accounts(pool.ledger)
        slurm.start()
    return JobManager(pool, config=c, slurm=slurm)


async def until(
    check: Callable[[], Awaitable[Any] | Any],
    timeout: float = 90.0,
    seen: Callable[[], object] = lambda: "",
) -> Any:
    """Poll ``check`` until it holds; a failure says what ``seen`` shows then."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if asyncio.iscoroutine(found):
            found = await found
        if found:
            return found
        assert time.monotonic() < deadline, f"condition not reached; last seen: {seen()}"
        await asyncio.sleep(0.2)


def slurm_job(m: JobManager, job_id: str) -> SlurmJob | None:
    handle = json.loads(m.jobs[job_id].handle or "{}")
    slurm = m.slurm or getattr(m.backend, "_own", None)
    assert slurm is not None
    return slurm.poller.last.jobs.get(handle.get("slurm_job_id", -1))


def _in_state(job: SlurmJob | None, state: str) -> SlurmJob | None:
    return job if job is not None and job.state == state else None


async def log_of(m: JobManager, job_id: str, rank: int) -> str:
    data, _ = await m.read_log(m.jobs[job_id], rank, 0)
    return data.decode()


async def stop(m: JobManager) -> None:
    await m.stop()
    slurm = m.slurm or getattr(m.backend, "_own", None)
    if slurm is not None:
        await slurm.stop()


@pytest.fixture
def owner() -> str:
    return unix_user(OWNER).pw_name


@pytest.fixture
def jobs_root(owner: str) -> Iterator[Path]:
    """This test's ``jobs_folder`` parent (the owner's to write in; pytest's own temporary
    folder is root's alone), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-slurm-jobs-", dir="/tmp"))
    path.chmod(0o755)
    who = account(owner, "test")
    os.chown(path, who.uid, who.gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_hubs_slurm_side_reaches_the_backend(slurm_cluster: DevCluster, tmp_path: Path) -> None:
    """``gpupool.hub``'s objects hand the engine (one shared poller) to the job backend; jobs run
    as their owners' accounts (what the device and share watches count on)."""
    c = config(slurm_cluster, tmp_path)
    c.SlurmSettings.gres_models = {"h100": "H100-80GB", "1g.10gb": "H100-80GB", "a100": "A100-40GB"}
    pool = Pool.from_config(GPUPool(config=c))
    engine = SlurmEngine.from_config(c, pool=pool)
    hub = build(pool, c, logging.getLogger("test"), None, engine)
    assert isinstance(hub.jobs.backend, SlurmJobBackend)
    assert hub.jobs.backend.engine is engine
    assert code_accounts(c, hub.jobs.backend).jobs_per_user


def test_a_two_node_ddp_job_runs_a_rank_per_node_as_its_owner(
    make_slurm_cluster: MakeCluster, tmp_path: Path, owner: str
) -> None:
    """On a cluster with slurmdbd, whose accounts the hub manages: every submit needs the
    owner's association with their team's account (``everyone`` for users in no team)."""
    cluster = make_slurm_cluster(nodes=H100S, **with_accounting(COSTS))
    loner = unix_user(OTHER).pw_name  # in no team
    c = config(cluster, tmp_path)  # jobs in the owner's home
    c.SlurmAccounts.manage = True
    c.GPUPool.offers = {**c.GPUPool.offers, "cpu": {"kind": "cpu"}}
    c.GPUPool.everyone = {"offers": ["cpu"]}

    async def scenario() -> None:
        m = manager(c)
        await m.start()
        try:
            job = m.submit(owner, ["lab"], {"script": DDP, "offer": "h100", "nodes": 2})
            alone = m.submit(loner, [], {"script": "print('alone')", "offer": "cpu"})
            await m.schedule_pass()
            running = await until(lambda: _in_state(slurm_job(m, job.id), "RUNNING"))
            assert running.user == owner and running.account == "lab"
            await until(lambda: m.jobs[alone.id].final)
            assert m.jobs[alone.id].state == "succeeded", m.jobs[alone.id].reason
            tag = parse_tag(running.comment)
            assert tag is not None and (tag.kind, tag.id) == ("job", job.id)
            assert tag.marker == m.pool.hub_marker
            await until(lambda: m.jobs[job.id].final)
            done = m.jobs[job.id]
            assert done.state == "succeeded", done.reason
            assert done.reason == "Slurm: COMPLETED; all ranks exited 0"
            assert dict(done.exit_codes) == {0: 0, 1: 0}
            logs = [await log_of(m, job.id, r) for r in (0, 1)]
            nodes = set()
            for r, text in enumerate(logs):  # a real all_reduce over both ranks, one per node
                line = next(x for x in text.splitlines() if x.startswith(f"rank {r} of 2 sum 2"))
                nodes.add(line.split(" on ")[1].split()[0])
            assert nodes == set(running.nodes) == {"gpu1", "gpu2"}
            folder = Path(json.loads(done.handle)["dir"])
            assert folder.stat().st_uid == account(owner, "test").uid
            record = json.loads((folder / "slurm-final.json").read_text())
            assert (record["state"], record["exit"]) == ("COMPLETED", 0)
            # a log the owner turned into a link (to the hub's secrets, say) reads as empty
            (folder / "rank-1.log").unlink()
            (folder / "rank-1.log").symlink_to("/etc/shadow")
            os.lchown(folder / "rank-1.log", account(owner, "test").uid, -1)
            assert await m.read_log(done, 1, 0) == (b"", 0)
            assert folder == Path(account(owner, "test").home) / ".gpupool" / "jobs" / job.id
            await m.backend.forget(done)  # retention: rm -rf as the owner
            assert not folder.exists() and Path("/etc/shadow").exists()
        finally:
            await stop(m)

    asyncio.run(scenario())


def test_a_failing_rank_fails_the_job_with_its_exit_code(
    make_slurm_cluster: MakeCluster, tmp_path: Path, owner: str, jobs_root: Path
) -> None:
    cluster = make_slurm_cluster(nodes=H100S)

    async def scenario() -> None:
        m = manager(config(cluster, tmp_path, jobs_root))
        await m.start()
        try:
            spec = {"script": DDP, "offer": "h100", "nodes": 2, "args": ["3"]}
            job = m.submit(owner, ["lab"], spec)
            await m.schedule_pass()
            await until(lambda: m.jobs[job.id].final)
            done = m.jobs[job.id]
            assert done.state == "failed"
            assert done.reason.startswith("Slurm: FAILED")
            assert "rank 1 exited 3 (see the rank logs)" in done.reason
            assert dict(done.exit_codes)[1] == 3
            assert "sum 2" in await log_of(m, job.id, 1)
        finally:
            await stop(m)

    asyncio.run(scenario())


def test_mig_instances_get_a_rank_each_over_gloo(
    make_slurm_cluster: MakeCluster, tmp_path: Path, owner: str, jobs_root: Path
) -> None:
    cluster = make_slurm_cluster(nodes=H100S)

    async def scenario() -> None:
        m = manager(config(cluster, tmp_path, jobs_root))
        await m.start()
        try:
            job = m.submit(owner, ["lab"], {"script": DDP, "offer": "mig", "gpus": 2})
            await m.schedule_pass()
            await until(lambda: m.jobs[job.id].final)
            done = m.jobs[job.id]
            assert done.state == "succeeded", done.reason
            logs = [await log_of(m, job.id, r) for r in (0, 1)]
            devices = set()
            for r, text in enumerate(logs):
                line = next(x for x in text.splitlines() if x.startswith(f"rank {r} of 2 sum 2"))
                assert line.endswith("ddp gloo")
                devices.add(line.split(" devices ")[1].split()[0])
            assert len(devices) == 2  # each rank its own MIG instance (Slurm's task binding)
        finally:
            await stop(m)

    asyncio.run(scenario())


def test_a_job_over_different_gpu_types_fails_at_start_saying_why(
    make_slurm_cluster: MakeCluster, tmp_path: Path, owner: str, jobs_root: Path
) -> None:
    """Slurm asks one ``--gres`` of every node of a job: an H100 on one node and an A100 on
    the other cannot be one job."""
    slurm_cluster = make_slurm_cluster(
        nodes=(NodeLayout("gpu1", {"h100": 1}), NodeLayout("gpu2", {"a100": 1}))
    )

    async def scenario() -> None:
        c = config(slurm_cluster, tmp_path, jobs_root)
        c.GPUPool.offers = {"any": {"kind": "gpu", "max_count": 1}}
        c.SlurmSettings.gres_models = {"h100": "H100-80GB", "a100": "A100-40GB"}
        m = manager(c)
        await m.start()
        try:
            job = m.submit(owner, ["lab"], {"script": DDP, "offer": "any", "nodes": 2})
            await m.schedule_pass()
            await until(lambda: m.jobs[job.id].final)
            done = m.jobs[job.id]
            assert done.state == "failed"
            assert "the job's nodes hold different GPUs (gpu:" in done.reason
            assert "use an offer of one GPU model" in done.reason
            assert not [j for j in _squeue(slurm_cluster) if j["user_name"] == owner]
        finally:
            await stop(m)

    asyncio.run(scenario())


def test_a_job_pending_in_slurm_shows_slurms_reason_and_cancels(
    make_slurm_cluster: MakeCluster, tmp_path: Path, owner: str, jobs_root: Path
) -> None:
    """GPUs taken outside the hub (another user's job the ledger does not know of): the job
    waits in Slurm, and the jobs panel says why in Slurm's words; cancel reaches it."""
    cluster = make_slurm_cluster(nodes=H100S)
    other = account(unix_user(OTHER).pw_name, "test")

    async def scenario() -> None:
        m = manager(config(cluster, tmp_path, jobs_root), engine="plain")  # blind to the blocker
        await m.start()
        slurm = SlurmCommands(str(cluster.conf))
        blocker = await slurm.sbatch(
            "#!/bin/sh\nsleep 600\n",
            ["--nodes=2", "--gres=gpu:h100:2", "--output=/dev/null"],
            other,
            {"PATH": "/usr/bin:/bin"},
            "/",
        )
        try:
            await until(lambda: _state(cluster, blocker) == "RUNNING")
            job = m.submit(owner, ["lab"], {"script": SLEEPER, "offer": "h100"})
            await m.schedule_pass()
            # Slurm's own words for why the job waits (Resources, mostly; under load a node
            # can answer late and Slurm says so): the panel shows what squeue says of the job
            await until(
                lambda: m.jobs[job.id].reason.startswith("Slurm: PENDING ("),
                seen=lambda: (m.jobs[job.id].reason, _squeue(cluster)),
            )
            seen = m.jobs[job.id]
            assert seen.state == "starting"
            slurm_id = json.loads(seen.handle)["slurm_job_id"]
            listed = next(j for j in _squeue(cluster) if j["job_id"] == slurm_id)
            assert listed["job_state"] == "PENDING"
            assert f"Slurm: PENDING ({listed['state_reason']})" in seen.reason, seen.reason
            assert job_model(seen, None)["reason"] == seen.reason
            cancelled = await m.cancel(job.id, owner, False)
            assert cancelled.state == "cancelled"
            assert _state(cluster, slurm_id) == "CANCELLED"
        finally:
            await slurm.scancel(blocker)
            await stop(m)

    asyncio.run(scenario())


def test_cancel_while_running_stops_the_slurm_job(
    make_slurm_cluster: MakeCluster, tmp_path: Path, owner: str, jobs_root: Path
) -> None:
    cluster = make_slurm_cluster(nodes=H100S)

    async def scenario() -> None:
        m = manager(config(cluster, tmp_path, jobs_root))
        await m.start()
        try:
            job = m.submit(owner, ["lab"], {"script": SLEEPER, "offer": "h100", "nodes": 2})
            await m.schedule_pass()
            await until(lambda: m.jobs[job.id].state == "running")
            assert m.jobs[job.id].reason == "Slurm: RUNNING on gpu1,gpu2"
            await until(lambda: "sleeping" in _folder_text(m, job.id, "rank-1.log"))
            done = await m.cancel(job.id, owner, False)
            assert done.state == "cancelled"
            slurm_id = json.loads(done.handle)["slurm_job_id"]  # kept when a job ends
            await until(lambda: _state(cluster, slurm_id) == "CANCELLED")
            record = await until(lambda: _folder_text(m, job.id, "slurm-final.json"))
            assert json.loads(record)["state"] == "CANCELLED"
        finally:
            await stop(m)

    asyncio.run(scenario())


def test_slurm_ends_a_job_at_its_time_limit(
    make_slurm_cluster: MakeCluster, tmp_path: Path, owner: str, jobs_root: Path
) -> None:
    """Slurm's ``--time`` (whole minutes) ends the job, counted from its real start; the job
    manager does not stop it at its own count (30 s here) meanwhile."""
    cluster = make_slurm_cluster(nodes=H100S)

    async def scenario() -> None:
        m = manager(config(cluster, tmp_path, jobs_root))
        await m.start()
        try:
            spec = {"script": SLEEPER, "offer": "h100", "nodes": 2, "time_limit": 30}
            job = m.submit(owner, ["lab"], spec)
            await m.schedule_pass()
            await until(lambda: m.jobs[job.id].state == "running")
            await until(lambda: m.jobs[job.id].final, 180)  # Slurm: a minute, checked every 30 s
            done = m.jobs[job.id]
            assert done.state == "failed"
            assert done.reason.startswith("Slurm: TIMEOUT"), done.reason
            assert done.finished is not None and done.started is not None
            assert done.finished - done.started >= 60
            record = await until(lambda: _folder_text(m, job.id, "slurm-final.json"))
            assert json.loads(record)["state"] == "TIMEOUT"
        finally:
            await stop(m)

    asyncio.run(scenario())


def test_a_final_state_outlives_slurms_memory_and_a_hub_restart(
    make_slurm_cluster: MakeCluster, tmp_path: Path, owner: str, jobs_root: Path
) -> None:
    """Slurm without slurmdbd forgets an ended job MinJobAge seconds later (2 here): a hub that
    was down meanwhile reads the job's end from its folder; the restarted manager's backend
    makes its own poller (no engine handed over)."""
    cluster = make_slurm_cluster(nodes=H100S, min_job_age=2)
    c = config(cluster, tmp_path, jobs_root)

    async def scenario() -> None:
        m = manager(c)
        await m.start()
        spec = {"script": SLEEP_THEN_FAIL, "offer": "h100", "nodes": 2, "args": ["2"]}
        failing = m.submit(owner, ["lab"], spec)
        sleeper = m.submit(owner, ["lab"], {"script": SLEEPER, "offer": "h100"})
        await m.schedule_pass()
        await until(lambda: m.jobs[failing.id].state == "running")
        await until(lambda: m.jobs[sleeper.id].state == "running")
        ids = {j: json.loads(m.jobs[j].handle)["slurm_job_id"] for j in (failing.id, sleeper.id)}
        await stop(m)  # the hub goes down; its jobs run on

        await SlurmCommands(str(cluster.conf)).scancel(ids[sleeper.id])  # cancelled meanwhile
        await until(lambda: all(_state(cluster, i) is None for i in ids.values()), 120)

        again = manager(c, engine="")
        await again.start()
        try:
            await until(lambda: again.jobs[failing.id].final and again.jobs[sleeper.id].final)
            failed = again.jobs[failing.id]
            assert failed.state == "failed"
            assert failed.reason.startswith("Slurm: FAILED, exit ")  # srun's status
            assert failed.reason.endswith(
                ": rank 1 exited 3 (see the rank logs) (from the job's folder)"
            )
            assert dict(failed.exit_codes) == {0: 0, 1: 3}
            cancelled = again.jobs[sleeper.id]
            assert cancelled.state == "failed"
            assert cancelled.reason.startswith("Slurm: CANCELLED")
            assert cancelled.reason.endswith("(from the job's folder)")
        finally:
            await stop(again)

    asyncio.run(scenario())


def test_a_controller_that_does_not_answer_is_unknown_never_lost(
    make_slurm_cluster: MakeCluster, tmp_path: Path, owner: str, jobs_root: Path
) -> None:
    cluster = make_slurm_cluster(nodes=H100S)
    c = config(cluster, tmp_path, jobs_root)
    c.SlurmSettings.command_timeout = 3.0

    async def scenario() -> None:
        m = manager(c)
        await m.start()
        try:
            job = m.submit(owner, ["lab"], {"script": SLEEPER, "offer": "h100"})
            await m.schedule_pass()
            await until(lambda: m.jobs[job.id].state == "running")
            cluster.stop_controller()
            await until(lambda: m.jobs[job.id].reason.startswith("Slurm: unknown"))
            assert m.jobs[job.id].state == "running"
            assert isinstance(m.backend, SlurmJobBackend)
            seen = await m.backend.check(m.jobs[job.id])
            assert (seen.state, seen.ended) == ("running", False)
            cluster.start_controller()
            await until(lambda: m.jobs[job.id].reason.startswith("Slurm: RUNNING"), 120)
            done = await m.cancel(job.id, owner, False)
            assert done.state == "cancelled"
        finally:
            await stop(m)

    asyncio.run(scenario())


def _squeue(cluster: DevCluster) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = json.loads(cluster.run("squeue", "--all", "--json").stdout)["jobs"]
    return jobs


def _state(cluster: DevCluster, slurm_id: int) -> str | None:
    found = [j for j in _squeue(cluster) if j["job_id"] == slurm_id]
    return str(found[0]["job_state"]) if found else None


def _folder_text(m: JobManager, job_id: str, name: str) -> str:
    job = m.jobs[job_id]
    path = Path(json.loads(job.handle)["dir"]) / name
    return path.read_text() if path.is_file() else ""
