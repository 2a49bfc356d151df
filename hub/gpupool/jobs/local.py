"""``LocalJobBackend``: jobs as local ``torchrun`` process groups on this machine.

Vocabulary
- *job directory*: ``<owner's home>/.gpupool/jobs/<job id>/`` with ``script.py``, the per-rank
  logs ``rank-<r>.log`` (written by ``python -m gpupool_lab.rank_log``), per-rank exit codes
  ``rank-<r>.exit``, torchrun's own output ``launcher.log`` and the group's ``exit-code``.
- *owner's home*: the owner's unix home in the per-user mode, else ``home_dir_template`` with
  ``{username}``: the same rules as the local spawner, whose settings are the defaults here.
- *code account*: who runs the job (:mod:`gpupool.usercode`): the owner's own unix account in
  the per-user mode, else the shared account; never root.

Contract: one ``torchrun --nnodes 1 --nproc-per-node N`` per job, c10d rendezvous on the job's
own loopback (a private network per job, :mod:`gpupool.jobs.private_network`, unless
``job_network`` is ``host`` or the machine cannot: then a free port on the shared loopback, and
the hub says so at start and on the admin page), ``CUDA_VISIBLE_DEVICES`` = the allocated
UUIDs (a job on N MIG instances: each rank gets its own one, through ``GPUPOOL_RANK_DEVICES``,
and the ranks use gloo: :func:`gpupool.core.offers.rank_env`), its own session (process group),
so cancel reaches every rank: SIGTERM to the group (torchrun passes it on), then SIGKILL after
``kill_grace`` seconds to the group and to every process started with the job's
``GPUPOOL_JOB`` variable (torchrun starts each rank in a session of its own). The
handle records pid and process start time, so a restarted hub re-attaches only to the very same
process, never to a recycled pid. Subprocesses are started here and nowhere else. Retention
forgets an ended job's directory with ``rm -rf`` as the code account (:meth:`~.forget`).

The hub never follows a path the user controls: the job's first process, already running as the
code account, makes the job directory, writes the script it reads from its stdin and opens its
own log (:data:`PREPARE_AND_RUN`); the hub reads logs and exit codes only as files owned by the
code account, never through a link, at most ``max_log_chunk`` bytes at a time. Jobs get the
hub's environment only through ``env_keep``.

A share of a GPU without MIG (:mod:`gpupool.shares`) adds ``GPUPOOL_SHARE_MILLI``,
``GPUPOOL_SHARE_MIB``, ``GPUPOOL_SHARE_ENFORCEMENT`` and, on a GPU under MPS, the MPS client
limits. MPS with per-user jobs (``run_as_hub_user = False``) stops the hub at start
(MPS serves one unix user at a time).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from traitlets import Bool, CaselessStrEnum, Float, Int, List, Unicode, default

from gpupool.core.errors import InvalidRequest
from gpupool.core.inventory import GPU
from gpupool.core.jobs import Job, JobSpec
from gpupool.core.ledger import Allocation
from gpupool.core.offers import Offer, rank_env
from gpupool.declarations import ConfigError
from gpupool.jobs import private_network
from gpupool.jobs.backend import JobBackend, Observation
from gpupool.jobs.folders import exit_code, read_rank_log, remove_job_folder
from gpupool.procfs import process_start, with_item
from gpupool.shares import ShareEnforcement, check_mps_accounts, share_env
from gpupool.usercode import (
    Account,
    become,
    check_shared_mode,
    code_account,
    owned_size,
    read_owned,
    spawner_setting,
)

PREPARE_AND_RUN = """\
(umask 077 && mkdir -p -- "$GPUPOOL_JOB_DIR" && cat > "$GPUPOOL_JOB_DIR/script.py") || exit 111
exec </dev/null >>"$GPUPOOL_JOB_DIR/launcher.log" 2>&1 || exit 111
cd -- "$GPUPOOL_WORKDIR" 2>/dev/null || cd -- "$HOME" 2>/dev/null || cd /
"$@"
echo $? > "$GPUPOOL_JOB_DIR/exit-code"
"""
"""The job's first process (``/bin/sh``, as the code account): make the job directory (private),
write the script from stdin, send everything after to ``launcher.log`` (which closes the pipe
the hub reads set-up errors from), then run torchrun and record its exit code."""


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group (session) ``pgid`` is still there."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def job_pids(job_id: str, uid: int | None = None) -> list[int]:
    """Every live process of a job, found by the ``GPUPOOL_JOB`` variable it was started with
    (torchrun puts each rank in a session of its own, so the launcher's group misses them);
    with ``uid``, only processes of that account (another user cannot claim a job's marker).
    Scans ``/proc``: the backend calls it in a worker thread."""
    return [pid for pid, _ in with_item(f"GPUPOOL_JOB={job_id}", uid)]


RENDEZVOUS_PORT = 29400
"""torchrun's own default c10d port, used inside a job's private network (nobody else is there)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalJobBackend(JobBackend):
    name = "local"

    home_dir_template = Unicode(
        config=True,
        help="""The owner's home in the shared mode, where job directories go (``{username}`` is
        expanded); default: ``LocalGPUSpawner.home_dir_template``. The per-user mode uses the
        owner's unix home. Example:
        ``c.LocalJobBackend.home_dir_template = "/srv/homes/{username}"``""",
    )
    run_as_hub_user = Bool(
        config=True,
        help="""The shared mode: run every job as one account (``shared_account``, or the hub's
        own when the hub is not root); False runs each job as the owner's unix account (the hub
        must be root). Default: ``LocalGPUSpawner.run_as_hub_user``. Example:
        ``c.LocalJobBackend.run_as_hub_user = False``""",
    )
    shared_account = Unicode(
        config=True,
        help="""The unprivileged unix account that runs jobs in the shared mode when the hub runs
        as root (user code never runs as root). Default: ``LocalGPUSpawner.shared_account``.
        Example: ``c.LocalJobBackend.shared_account = "gpupool-demo"``""",
    )
    env_keep = List(
        Unicode(),
        ["PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "CONDA_ROOT", "CONDA_DEFAULT_ENV",
         "VIRTUAL_ENV", "LANG", "LC_ALL", "TZ"],
        config=True,
        help="""The hub's environment variables a job inherits (no others: the hub's secrets
        stay in the hub). Example:
        ``c.LocalJobBackend.env_keep = ["PATH", "LANG", "NCCL_SOCKET_IFNAME"]``""",
    )  # fmt: skip
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
    max_ranks = Int(
        os.cpu_count() or 1,
        config=True,
        help="""The most ranks (processes) of all jobs this machine runs at once; more wait in the
        queue, saying so, and a job with more ranks is refused. Default: the machine's cores.
        Example: ``c.LocalJobBackend.max_ranks = 16``""",
    )
    max_log_chunk = Int(
        1 << 20,
        config=True,
        help="The most bytes of a rank's log one read returns. Example: ``262144``",
    )
    niceness = Int(
        min=0,
        max=19,
        config=True,
        help="""How much lower than the hub's the CPU priority of a job's processes is (``nice``
        values, 0 to 19); default: ``LocalGPUSpawner.niceness`` (10). Example:
        ``c.LocalJobBackend.niceness = 5``""",
    )
    job_network = CaselessStrEnum(
        ["private", "host"],
        "private",
        config=True,
        help="""``private``: each job gets a network namespace of its own with only a loopback,
        so its rendezvous and its ranks' traffic are out of every other account's reach (and the
        job has no other network: no internet, no hub). ``host``: jobs share the machine's
        network; any account on the machine can connect to a job's rendezvous. Needs the hub to
        run as root; left at its default where the machine cannot, the hub warns at start and
        uses ``host``; set explicitly, it stops the hub. Example:
        ``c.LocalJobBackend.job_network = "host"``""",
    )

    @default("home_dir_template")
    def _default_home(self) -> str:
        return str(
            spawner_setting(self.config, "home_dir_template", "/tmp/gpupool-home/{username}")
        )

    @default("run_as_hub_user")
    def _default_shared_mode(self) -> bool:
        return bool(spawner_setting(self.config, "run_as_hub_user", True))

    @default("niceness")
    def _default_niceness(self) -> int:
        return int(spawner_setting(self.config, "niceness", 10))

    @default("shared_account")
    def _default_shared_account(self) -> str:
        return str(spawner_setting(self.config, "shared_account", ""))

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._killers: set[asyncio.Task[None]] = set()  # SIGKILLs due after kill_grace
        self.shares = ShareEnforcement(config=self.config)
        """How shares are enforced (MPS or watched): checked here, at the hub's start."""
        check_mps_accounts(self.shares, self.config)
        if self.run_as_hub_user:  # a shared mode that would run jobs as root stops the hub
            check_shared_mode(self.shared_account, self._key("shared_account"))
        elif os.geteuid() != 0:
            raise ConfigError(
                self._key("run_as_hub_user"),
                "False runs each job as its owner's unix account, which needs the hub to run "
                "as root; set it to True (jobs run as the hub's account) or run the hub as root",
            )
        self.private_network, self.network_note = self._network()

    def _network(self) -> tuple[bool, str]:
        """Whether jobs get a private network, and the sentence that says so (admin page)."""
        if self.job_network == "host":
            return False, (
                "shared: jobs use the machine's network (LocalJobBackend.job_network = host); "
                "any account on this machine can reach a job's rendezvous"
            )
        why = private_network.unavailable()
        if not why:
            return True, "private: each job has a network namespace of its own (loopback only)"
        if "job_network" in self.config.get("LocalJobBackend", {}):
            raise ConfigError("LocalJobBackend.job_network", f"private is not possible: {why}")
        note = f"shared, because a private network is not possible here: {why}"
        self.log.warning(
            "gpupool: jobs' network is %s; any account on this machine can reach a job's "
            "rendezvous (LocalJobBackend.job_network)",
            note,
        )
        return False, note

    def _key(self, name: str) -> str:
        """The setting an admin should fix: this class's, or the spawner's it defaulted from."""
        mine = "LocalJobBackend" in self.config and name in self.config["LocalJobBackend"]
        return f"{'LocalJobBackend' if mine else 'LocalGPUSpawner'}.{name}"

    def validate(self, spec: JobSpec) -> None:
        super().validate(spec)
        if spec.nodes != 1:
            raise InvalidRequest(
                f"The local backend runs jobs on this machine: nodes must be 1, not {spec.nodes}."
            )
        if spec.ranks > self.max_ranks:
            raise InvalidRequest(
                f"This machine runs at most {self.max_ranks} ranks at once "
                f"(LocalJobBackend.max_ranks); the job asks for {spec.ranks}, so it could never "
                "start."
            )

    def account(self, owner: str) -> Account:
        """The unix account that runs ``owner``'s jobs (never root)."""
        return code_account(
            owner,
            per_user=not self.run_as_hub_user,
            shared_account=self.shared_account,
            key=self._key("shared_account" if self.run_as_hub_user else "run_as_hub_user"),
        )

    def home(self, owner: str) -> Path:
        if self.run_as_hub_user:
            return Path(self.home_dir_template.format(username=owner))
        return Path(self.account(owner).home)

    def job_dir(self, job: Job) -> Path:
        return self.home(job.owner) / ".gpupool" / "jobs" / job.id

    # -- start -------------------------------------------------------------------------------
    async def start(self, job: Job, allocations: list[Allocation]) -> str:
        account = self.account(job.owner)
        jdir = self.job_dir(job)
        home = jdir.parents[2]
        port = RENDEZVOUS_PORT if self.private_network else free_port()
        torchrun = [
            self.python, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc-per-node", str(job.spec.gpus),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--max-restarts", "0",  # failures end the job: max_restarts counts preemptions
            "-m", "gpupool_lab.rank_log", str(jdir), str(jdir / "script.py"), *job.spec.args,
        ]  # fmt: skip
        command = ["/usr/bin/nice", "-n", str(self.niceness),
                   "/bin/sh", "-c", PREPARE_AND_RUN, "gpupool-job", *torchrun]  # fmt: skip
        env = self._env(job, allocations, jdir, home, account)
        stdin = job.spec.script.encode()
        if self.private_network:  # root starts the launcher, clean; it becomes the account
            command = [*private_network.launcher(account.uid, account.gid, account.groups),
                       "--", *command]  # fmt: skip
            env, stdin, how = {}, private_network.header(env) + stdin, {}
        else:
            how = become(account)
        proc = await asyncio.create_subprocess_exec(
            *command,
            cwd="/",
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            **how,
        )  # fmt: skip
        self._procs[job.id] = proc
        problem = await self._prepared(proc, stdin)
        if problem:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)
            self._procs.pop(job.id, None)
            raise RuntimeError(f"the job directory could not be prepared as {account.name}: "
                               f"{problem}")  # fmt: skip
        self.log.info(
            "gpupool: job %s started as pid %s (%s) in %s", job.id, proc.pid, account.name, jdir
        )
        return json.dumps({"pid": proc.pid, "start": process_start(proc.pid), "dir": str(jdir)})

    @staticmethod
    async def _prepared(proc: asyncio.subprocess.Process, script: bytes) -> str:
        """Hand the script to the job's first process and read what it says before its output
        goes to ``launcher.log``: nothing when the job directory is ready, else why not."""
        assert proc.stdin is not None and proc.stderr is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.write(script)
            await proc.stdin.drain()
        proc.stdin.close()
        try:
            said = await asyncio.wait_for(proc.stderr.read(4096), 60)
        except TimeoutError:
            return "it did not finish setting up within 60 s"
        return said.decode(errors="replace").strip()

    def _env(
        self, job: Job, allocations: list[Allocation], jdir: Path, home: Path, account: Account
    ) -> dict[str, str]:
        env = {k: os.environ[k] for k in self.env_keep if k in os.environ}
        if self.private_network:
            env.update(private_network.LOOPBACK_ENV)
        env.update(dict(job.spec.env))
        env.update(
            HOME=str(home),
            USER=job.owner,
            LOGNAME=account.name,
            CUDA_VISIBLE_DEVICES=",".join(a.visible_devices for a in allocations if a.devices),
            GPUPOOL_JOB=job.id,
            GPUPOOL_HUB=self.marker,
            GPUPOOL_JOB_DIR=str(jdir),
            GPUPOOL_WORKDIR=job.spec.workdir or str(home),
            GPUPOOL_TEAM=job.team,
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
        )
        for a in allocations:  # a share: its cap, how it is enforced, MPS's client limits
            env.update(share_env(a, self._gpus(), self.shares))
        offers = self._offers()
        for a in allocations:  # several MIG instances: one each per rank, gloo between them
            env.update(rank_env(offers.get(a.offer), len(a.devices), a.visible_devices))
        return env

    def _offers(self) -> dict[str, Offer]:
        """The pool's offers (the job manager that owns this backend holds the pool)."""
        pool = getattr(self.parent, "pool", None)
        return pool.ledger.offers if pool is not None else {}

    def _gpus(self) -> tuple[GPU, ...]:
        """The pool's GPUs (the job manager that owns this backend holds the pool)."""
        pool = getattr(self.parent, "pool", None)
        return pool.inventory.gpus if pool is not None else ()

    # -- watching ----------------------------------------------------------------------------
    def _owned(self, job: Job) -> tuple[Path, Account | None]:
        """The job's directory and the account whose files in it the hub reads (``None`` if the
        account is gone: then nothing there is read)."""
        handle = json.loads(job.handle or "{}")
        try:
            account = self.account(job.owner)
        except ConfigError:
            account = None
        return Path(handle.get("dir") or self.job_dir(job)), account

    def _read_small(self, path: Path, account: Account | None) -> str | None:
        """A short owned file's text (an exit code), or ``None`` if missing or refused."""
        if account is None:
            return None
        try:
            return read_owned(path, account, 0, 64)[0].decode(errors="replace").strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.log.warning("gpupool: not reading %s: %s", path, e.strerror)
            return None

    async def check(self, job: Job) -> Observation:
        handle = json.loads(job.handle or "{}")
        jdir, account = self._owned(job)
        codes = self._rank_codes(jdir, job.spec.ranks, account)
        pid = handle.get("pid")
        proc = self._procs.get(job.id)
        leader_done = proc is not None and proc.returncode is not None
        if pid is not None and not leader_done and process_start(pid) == handle.get("start"):
            up = account is not None and all(
                owned_size(jdir / f"rank-{r}.log", account) is not None
                for r in range(job.spec.ranks)
            )
            return Observation("running" if up else "starting", "", codes)
        uid = account.uid if account else None
        alive = pid is not None and group_alive(pid)
        if alive or bool(await asyncio.to_thread(job_pids, job.id, uid)):
            return Observation("running", "", codes)  # the launcher ended; ranks still exiting
        self._procs.pop(job.id, None)
        rc = exit_code(self._read_small(jdir / "exit-code", account))
        if rc is None and len(codes) == job.spec.ranks:  # the launcher was stopped (e.g. with
            rc = max((abs(c) for _, c in codes), default=0)  # the hub) after every rank ended
        if rc is not None:
            return self._ended(rc, codes)
        if proc is not None and proc.returncode is not None:
            return self._ended(proc.returncode, codes)
        return Observation("lost", "its processes are gone and left no exit code", codes)

    def _rank_codes(
        self, jdir: Path, ranks: int, account: Account | None
    ) -> tuple[tuple[int, int], ...]:
        codes = []
        for r in range(ranks):
            code = exit_code(self._read_small(jdir / f"rank-{r}.exit", account))
            if code is not None:
                codes.append((r, code))
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
        """SIGTERM to the job's process group (torchrun passes it on), or, when there is no
        live launcher (it died, or its handle was never saved), to every process carrying the
        job's marker; SIGKILL to all of them after ``kill_grace``."""
        handle = json.loads(job.handle or "{}")
        pid = handle.get("pid")
        _, account = self._owned(job)
        uid = account.uid if account else None
        if pid is not None and process_start(pid) == handle.get("start"):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)  # torchrun passes it on to the ranks
        else:
            for rank_pid in await asyncio.to_thread(job_pids, job.id, uid):  # no launcher: the
                with contextlib.suppress(ProcessLookupError):  # ranks, found by their marker
                    os.kill(rank_pid, signal.SIGTERM)

        async def kill() -> None:
            await asyncio.sleep(self.kill_grace)
            if pid is not None and process_start(pid) == handle.get("start"):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            for rank_pid in await asyncio.to_thread(job_pids, job.id, uid):  # ranks live in
                with contextlib.suppress(ProcessLookupError):  # sessions of their own
                    os.kill(rank_pid, signal.SIGKILL)

        task = asyncio.ensure_future(kill())
        self._killers.add(task)
        task.add_done_callback(self._killers.discard)

    async def read_log(self, job: Job, rank: int, offset: int) -> tuple[bytes, int]:
        """At most ``max_log_chunk`` bytes of the rank's log, read in a worker thread only as an
        owned file of the job's account: a link or a file of anyone else reads as an empty log
        (and is logged)."""
        return await asyncio.to_thread(self._read_log, job, rank, offset)

    def _read_log(self, job: Job, rank: int, offset: int) -> tuple[bytes, int]:
        jdir, account = self._owned(job)
        if account is None:
            return b"", 0
        return read_rank_log(jdir, account, rank, offset, self.max_log_chunk, self.log, job.id)

    async def forget(self, job: Job) -> None:
        """Remove the ended job's directory (script, logs, exit codes) as its code account,
        which made it: ``rm -rf`` as that account, so nothing but what it may remove goes."""
        jdir, account = self._owned(job)
        if account is not None:  # the account is gone: nothing of it is touched
            await remove_job_folder(jdir, job.id, account)
