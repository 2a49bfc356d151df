"""``LocalJobBackend``: jobs as local ``torchrun`` process groups on this machine.

Vocabulary
- *job directory*: ``<owner's home>/.gpupool/jobs/<job id>/`` with ``script.py``, the per-rank
  logs ``rank-<r>.log`` (written by ``python -m gpupool_lab.rank_log``), per-rank exit codes
  ``rank-<r>.exit``, torchrun's own output ``launcher.log`` and the group's ``exit-code``.
- *owner's home*: ``home_dir_template`` with ``{username}``, the same rule as the local spawner
  (jobs run as the hub's own user when ``run_as_hub_user``, else as the owner's unix account).

Contract: one ``torchrun --nnodes 1 --nproc-per-node N`` per job, c10d rendezvous on a free
loopback port, ``CUDA_VISIBLE_DEVICES`` = the allocated UUIDs, its own session (process group),
so cancel reaches every rank: SIGTERM to the group (torchrun passes it on), then SIGKILL after
``kill_grace`` seconds to the group and to every process started with the job's
``GPUPOOL_JOB`` variable (torchrun starts each rank in a session of its own). The
handle records pid and process start time, so a restarted hub re-attaches only to the very same
process, never to a recycled pid. Subprocesses are started here and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from traitlets import Bool, Float, Unicode

from ..core.errors import InvalidRequest
from ..core.jobs import Job, JobSpec
from ..core.ledger import Allocation
from .backend import JobBackend, Observation

HIDDEN_ENV = ("JUPYTERHUB_API_TOKEN", "JPY_API_TOKEN", "CONFIGPROXY_AUTH_TOKEN", "JUPYTERHUB_")


def process_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (``/proc/<pid>/stat`` field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group (session) ``pgid`` is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_pids(job_id: str) -> list[int]:
    """Every live process of a job, found by the ``GPUPOOL_JOB`` variable it was started with
    (torchrun puts each rank in a session of its own, so the launcher's group misses them)."""
    marker = f"GPUPOOL_JOB={job_id}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(entry.name))
            except OSError:
                continue
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalJobBackend(JobBackend):
    name = "local"

    home_dir_template = Unicode(
        "/tmp/gpupool-home/{username}",
        config=True,
        help="""The owner's home, where job directories go (``{username}`` is expanded); keep it
        equal to ``LocalGPUSpawner.home_dir_template``. Example:
        ``c.LocalJobBackend.home_dir_template = "/srv/homes/{username}"``""",
    )
    run_as_hub_user = Bool(
        True,
        config=True,
        help="""Run jobs as the hub's own unix user (as the local spawner's default does); False
        runs them as the owner's unix account. Example:
        ``c.LocalJobBackend.run_as_hub_user = False``""",
    )
    python = Unicode(
        sys.executable,
        config=True,
        help="""The Python that runs torchrun and the job (it needs torch and gpupool_lab).
        Example: ``c.LocalJobBackend.python = "/opt/conda/bin/python"``""",
    )
    kill_grace = Float(
        10.0,
        config=True,
        help="Seconds between SIGTERM and SIGKILL on cancel. Example: ``5``",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._procs: dict[str, asyncio.subprocess.Process] = {}

    def validate(self, spec: JobSpec) -> None:
        super().validate(spec)
        if spec.nodes != 1:
            raise InvalidRequest(
                f"The local backend runs jobs on this machine: nodes must be 1, not {spec.nodes}."
            )

    def job_dir(self, job: Job) -> Path:
        home = Path(self.home_dir_template.format(username=job.owner))
        return home / ".gpupool" / "jobs" / job.id

    # -- start -------------------------------------------------------------------------------
    async def start(self, job: Job, allocations: list[Allocation]) -> str:
        jdir = self.job_dir(job)
        jdir.mkdir(parents=True, exist_ok=True)
        script = jdir / "script.py"
        script.write_text(job.spec.script)
        if not self.run_as_hub_user:  # the job runs as the owner and writes its logs here
            pw = pwd.getpwnam(job.owner)
            for path in (jdir.parents[1], jdir.parent, jdir, script):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        home = jdir.parents[2]
        workdir = Path(job.spec.workdir) if job.spec.workdir else home
        port = free_port()
        torchrun = [
            self.python, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc-per-node", str(job.spec.gpus),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--max-restarts", "0",
            "-m", "gpupool_lab.rank_log", str(jdir), str(script), *job.spec.args,
        ]  # fmt: skip
        wrapper = '"$@"; echo $? > "$GPUPOOL_JOB_DIR/exit-code"'
        with (jdir / "launcher.log").open("ab") as log:
            proc = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", wrapper, "gpupool-job", *torchrun,
                cwd=str(workdir if workdir.is_dir() else home),
                env=self._env(job, allocations, jdir, home),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,
                preexec_fn=None if self.run_as_hub_user else self._become(job.owner),
            )  # fmt: skip
        self._procs[job.id] = proc
        self.log.info("gpupool: job %s started as pid %s in %s", job.id, proc.pid, jdir)
        return json.dumps({"pid": proc.pid, "start": process_start(proc.pid), "dir": str(jdir)})

    def _env(
        self, job: Job, allocations: list[Allocation], jdir: Path, home: Path
    ) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(HIDDEN_ENV)}
        env.update(dict(job.spec.env))
        env.update(
            HOME=str(home),
            USER=job.owner,
            CUDA_VISIBLE_DEVICES=",".join(a.visible_devices for a in allocations if a.devices),
            GPUPOOL_JOB=job.id,
            GPUPOOL_JOB_DIR=str(jdir),
            GPUPOOL_TEAM=job.team,
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
        )
        return env

    @staticmethod
    def _become(user: str) -> Any:
        pw = pwd.getpwnam(user)

        def preexec() -> None:
            os.setgid(pw.pw_gid)
            os.initgroups(user, pw.pw_gid)
            os.setuid(pw.pw_uid)

        return preexec

    # -- watching ----------------------------------------------------------------------------
    async def check(self, job: Job) -> Observation:
        handle = json.loads(job.handle or "{}")
        jdir = Path(handle.get("dir") or self.job_dir(job))
        codes = self._rank_codes(jdir, job.spec.ranks)
        pid = handle.get("pid")
        proc = self._procs.get(job.id)
        leader_done = proc is not None and proc.returncode is not None
        if pid is not None and not leader_done and process_start(pid) == handle.get("start"):
            up = all((jdir / f"rank-{r}.log").exists() for r in range(job.spec.ranks))
            return Observation("running" if up else "starting", "", codes)
        if (pid is not None and group_alive(pid)) or job_pids(job.id):
            return Observation("running", "", codes)  # the launcher ended; ranks still exiting
        self._procs.pop(job.id, None)
        exit_file = jdir / "exit-code"
        if exit_file.exists():
            return self._ended(int(exit_file.read_text().strip() or "1"), codes)
        if proc is not None and proc.returncode is not None:
            return self._ended(proc.returncode, codes)
        return Observation("lost", "its processes are gone and left no exit code", codes)

    @staticmethod
    def _rank_codes(jdir: Path, ranks: int) -> tuple[tuple[int, int], ...]:
        codes = []
        for r in range(ranks):
            f = jdir / f"rank-{r}.exit"
            with contextlib.suppress(OSError, ValueError):
                codes.append((r, int(f.read_text().strip())))
        return tuple(codes)

    @staticmethod
    def _ended(rc: int, codes: tuple[tuple[int, int], ...]) -> Observation:
        if rc == 0:
            return Observation("succeeded", "all ranks exited 0", codes)
        bad = [f"rank {r} exited {c}" for r, c in codes if c != 0]
        why = ", ".join(bad) if bad else f"torchrun exited {rc}"
        return Observation("failed", f"{why} (see the rank logs)", codes)

    async def wait(self, job: Job, timeout: float) -> None:
        proc = self._procs.get(job.id)
        if proc is None:
            await asyncio.sleep(timeout)  # not our child (re-attached): poll
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), timeout)

    async def cancel(self, job: Job) -> None:
        handle = json.loads(job.handle or "{}")
        pid = handle.get("pid")
        if pid is None:
            return
        if process_start(pid) == handle.get("start"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)  # torchrun passes it on to the ranks
        else:
            for rank_pid in job_pids(job.id):  # the launcher is gone (e.g. killed): the ranks
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank_pid, signal.SIGTERM)

        def kill() -> None:
            if process_start(pid) == handle.get("start"):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            for rank_pid in job_pids(job.id):  # ranks live in sessions of their own
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank_pid, signal.SIGKILL)

        asyncio.get_running_loop().call_later(self.kill_grace, kill)

    def read_log(self, job: Job, rank: int, offset: int) -> tuple[bytes, int]:
        handle = json.loads(job.handle or "{}")
        path = Path(handle.get("dir") or self.job_dir(job)) / f"rank-{rank}.log"
        try:
            with path.open("rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(min(offset, size))
                return f.read(), size
        except FileNotFoundError:
            return b"", 0
