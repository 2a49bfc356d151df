"""``SlurmJobBackend``: "Run distributed" jobs as Slurm batch jobs (``srun torchrun``).

Select it with ``c.JobManager.backend_class = "gpupool.slurm.jobs.SlurmJobBackend"``.

Vocabulary
- *Slurm job*: one ``sbatch`` per gpupool job, submitted as the job's owner (their own unix
  account: Slurm runs, charges and limits it as them), ``--nodes`` = the job's nodes,
  ``--nodelist`` = the nodes the ledger granted, ``--gres`` = what each node's allocation holds
  in Slurm's words, tagged ``--comment=gpupool:<hub marker>:job:<job id>``; the batch script
  is :func:`gpupool.slurm.batch.batch_script`.
- *job folder*: ``jobs_folder`` (the owner's home by default) ``/<job id>`` on the filesystem
  every node and the hub share: script, per-rank logs and exit codes, the *final record*
  (:mod:`gpupool.slurm.batch`).
- *handle*: ``{"slurm_job_id": N, "dir": "<job folder>"}``.
- *engine*: the hub's Slurm side (:class:`gpupool.slurm.engine.SlurmEngine`: the commands and
  the ONE shared poller), handed over by the job manager (``JobManager(..., slurm=engine)``,
  which ``gpupool.hub.setup`` does); a backend built without one (a test, a tool) makes its own
  from its settings and starts its poller's loop at its first use.

Contract: :meth:`check` never calls Slurm: it reads the shared poller's last snapshot
(``PENDING`` → ``starting`` with Slurm's reason and start estimate, ``RUNNING`` → ``running``,
an ended state → ``succeeded``/``failed`` with Slurm's state, reason and exit status and the
ranks' exit codes); a controller that does not answer keeps the last observation (unknown,
never ``lost``); a job Slurm no longer lists (it forgets ended jobs ``MinJobAge`` seconds
later, slurm.conf(5)) ends as its final record says, and ``lost`` only without one. The hub
reads the job folder only as files owned by the owner's account (never through a link) and
writes nothing there.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from traitlets import Float, Int, List, Unicode

from gpupool.core.errors import InvalidRequest
from gpupool.core.inventory import Inventory
from gpupool.core.jobs import Job
from gpupool.core.ledger import Allocation
from gpupool.core.offers import DDP_BACKEND, Offer, one_rank_per_instance
from gpupool.declarations import ConfigError
from gpupool.jobs.backend import JobBackend, Observation
from gpupool.jobs.folders import exit_code, read_rank_log, remove_job_folder
from gpupool.slurm.batch import (
    FINAL_RECORD,
    FOLDER_FAILED,
    BatchJob,
    batch_script,
    sbatch_args,
)
from gpupool.slurm.commands import SlurmUnavailable
from gpupool.slurm.engine import SlurmEngine
from gpupool.slurm.inventory import gres_request, gres_types_of
from gpupool.slurm.names import Tag, batch_job_name, parse_tag
from gpupool.slurm.parse import SlurmJob
from gpupool.slurm.settings import SlurmSettings
from gpupool.usercode import Account, account, read_owned


class SlurmJobBackend(JobBackend, SlurmSettings):
    name = "slurm"
    distinct_nodes = True  # one Slurm node per node of the job (--nodes with --nodelist)
    enforces_time_limit = True  # --time, from when Slurm starts the job (not while pending)
    run_as_hub_user = False  # each job runs as its owner (gpupool.usercode.code_accounts)
    network_note = (
        "the cluster's: a job's rendezvous listens on its first node, reachable from the "
        "cluster's network as Slurm's nodes are"
    )

    python = Unicode(
        "python3",
        config=True,
        help="""The Python on the compute nodes that runs torchrun and the job (it needs torch
        and gpupool_lab), the same path on every node. Example:
        ``c.SlurmJobBackend.python = "/opt/conda/bin/python"``""",
    )
    jobs_folder = Unicode(
        "{home}/.gpupool/jobs",
        config=True,
        help="""Where job folders go, on a filesystem every node and the hub see (``{home}``:
        the owner's home, ``{username}``: their name); the job makes its folder as its owner.
        Example: ``c.SlurmJobBackend.jobs_folder = "/scratch/{username}/gpupool-jobs"``""",
    )
    env_keep = List(
        Unicode(),
        ["PATH", "LANG", "LC_ALL", "TZ"],
        config=True,
        help="""The hub's environment variables a job inherits (no others: the hub's secrets
        stay in the hub); Slurm adds its own. Example:
        ``c.SlurmJobBackend.env_keep = ["PATH", "LANG", "NCCL_SOCKET_IFNAME"]``""",
    )
    kill_grace = Float(
        15.0,
        config=True,
        help="""Seconds the job manager waits, after ``scancel``, for Slurm to say the job has
        ended before it frees the job's GPUs in the ledger anyway (Slurm itself sends SIGKILL
        ``KillWait`` seconds after SIGTERM). Example: ``30``""",
    )
    max_log_chunk = Int(
        1 << 20,
        config=True,
        help="The most bytes of a rank's log one read returns. Example: ``262144``",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        folder = self.jobs_folder
        if "{" in folder.replace("{home}", "").replace("{username}", "") or not (
            folder.startswith(("/", "{home}"))
        ):
            raise ConfigError(
                "SlurmJobBackend.jobs_folder",
                f"{folder!r} is not an absolute path using {{home}} and {{username}} only "
                '(e.g. "/scratch/{username}/gpupool-jobs")',
            )
        self._own: SlurmEngine | None = None
        self._own_started = False
        self._submitted: dict[str, float] = {}
        """Per job this object submitted, when (monotonic): a snapshot older than that may
        simply not list it yet."""
        self._last: dict[str, Observation] = {}
        """Per job, the last observation from an answered snapshot (kept while Slurm is
        unknown)."""

    # -- the hub's Slurm side ----------------------------------------------------------------
    @property
    def engine(self) -> SlurmEngine:
        """The hub's engine (from the job manager), else one of this backend's own."""
        given = getattr(self.parent, "slurm", None)
        if isinstance(given, SlurmEngine):
            return given
        if self._own is None:
            self._own = SlurmEngine(self, self.log)
        if not self._own_started:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return self._own  # not in the event loop yet: started at the first use in it
            self._own.start()
            self._own_started = True
        return self._own

    def _pool(self) -> Any:
        """The pool (the job manager that owns this backend holds it), or ``None``."""
        return getattr(self.parent, "pool", None)

    def _offers(self) -> dict[str, Offer]:
        pool = self._pool()
        return pool.ledger.offers if pool is not None else {}

    def _inventory(self) -> Inventory:
        pool = self._pool()
        return pool.inventory if pool is not None else Inventory(())

    # -- who and where -----------------------------------------------------------------------
    def account(self, owner: str) -> Account:
        """The owner's own unix account (Slurm runs the job as them; never root)."""
        return account(owner, "SlurmJobBackend (a Slurm job runs as its owner's unix account)")

    def job_dir(self, job: Job, owner: Account) -> Path:
        base = self.jobs_folder.replace("{home}", owner.home).replace("{username}", owner.name)
        return Path(base) / job.id

    def _owned(self, job: Job) -> tuple[Path | None, Account | None]:
        handle = _handle(job)
        try:
            owner = self.account(job.owner)
        except ConfigError:
            return None, None  # the account is gone: nothing of it is read
        return Path(handle.get("dir") or self.job_dir(job, owner)), owner

    # -- start -------------------------------------------------------------------------------
    def batch_job(self, job: Job, allocations: Sequence[Allocation], account: str) -> BatchJob:
        """What to submit for ``job`` on ``allocations`` (one per node), charged to Slurm
        ``account`` (``""``: none; :meth:`SlurmEngine.submit_account`)."""
        types = gres_types_of(self.gres_models)
        inventory = self._inventory()
        gres = [gres_request(a, inventory, types) for a in allocations]
        if len(set(gres)) > 1:
            held = ", ".join(
                f"{g or 'no GPU'} on {a.node}" for g, a in zip(gres, allocations, strict=True)
            )
            raise InvalidRequest(
                f"the job's nodes hold different GPUs ({held}); a Slurm job asks the same gres "
                "of each node: use an offer of one GPU model"
            )
        offer = self._offers().get(allocations[0].offer) if allocations else None
        per_device = offer is not None and one_rank_per_instance(offer, job.spec.gpus)
        return BatchJob(
            name=batch_job_name(job.owner, job.id),
            tag=str(Tag(self.marker, "job", job.id)),
            account=account,
            nodes=tuple(a.node for a in allocations if a.node),  # all or none have one
            node_count=len(allocations),
            gres=gres[0] if gres else "",
            procs_per_node=job.spec.gpus,
            one_task_per_device=per_device,
            time_limit=job.spec.time_limit,
            partition=self.partition,
        )

    def job_env(self, job: Job, jdir: Path, owner: Account, per_device: bool) -> dict[str, str]:
        """The job's environment (exported to it by ``sbatch``; Slurm adds its own)."""
        env = {k: os.environ[k] for k in self.env_keep if k in os.environ}
        env.update(dict(job.spec.env))
        env.update(
            HOME=owner.home,
            USER=owner.name,
            LOGNAME=owner.name,
            GPUPOOL_JOB=job.id,
            GPUPOOL_HUB=self.marker,
            GPUPOOL_JOB_DIR=str(jdir),
            GPUPOOL_PYTHON=self.python,
            GPUPOOL_WORKDIR=job.spec.workdir or owner.home,
            GPUPOOL_TEAM=job.team,
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            PYTHONUNBUFFERED="1",
        )
        if per_device:  # a rank per MIG instance (Slurm gives each task its own): gloo
            env[DDP_BACKEND] = "gloo"
        return env

    async def start(self, job: Job, allocations: list[Allocation]) -> str:
        if not self.marker:
            raise RuntimeError("the backend has no hub marker (the job manager sets it)")
        owner = self.account(job.owner)
        jdir = self.job_dir(job, owner)
        engine = self.engine
        batch = self.batch_job(job, allocations, await engine.submit_account(owner.name, job.team))
        env = self.job_env(job, jdir, owner, batch.one_task_per_device)
        since = time.monotonic()
        slurm_id = await engine.commands.sbatch(
            batch_script(batch, job.spec.script, job.spec.args),
            sbatch_args(batch),
            owner,
            env,
            cwd="/",
        )
        self._submitted[job.id] = since
        engine.poller.kick()
        self.log.info(
            "gpupool: job %s submitted to Slurm as job %s (%s, %s) in %s",
            job.id, slurm_id, owner.name, ",".join(batch.nodes), jdir,
        )  # fmt: skip
        return json.dumps({"slurm_job_id": slurm_id, "dir": str(jdir)})

    # -- watching ----------------------------------------------------------------------------
    async def check(self, job: Job) -> Observation:
        slurm_id = _handle(job).get("slurm_job_id")
        if not isinstance(slurm_id, int):
            return Observation("lost", "it has no Slurm job (its submission did not finish)")
        poller = self.engine.poller
        try:
            listed = poller.job(slurm_id)
        except SlurmUnavailable as e:
            last = self._last.get(job.id)  # else (a restarted hub) as the job was
            state = last.state if last is not None else job.state
            state = state if state in ("starting", "running") else "starting"
            return Observation(
                state, f"Slurm: unknown (the controller does not answer: {e.message}); will retry"
            )
        if listed is None and poller.last.started < self._submitted.get(job.id, -1.0):
            return Observation("starting", f"Slurm: submitted as job {slurm_id}")
        jdir, owner = self._owned(job)
        mine = listed if listed is not None and _mine(listed, job, self.marker) else None
        if mine is not None and mine.pending:
            seen = observe(mine, ())  # no rank has run: nothing to read on the shared disk
        elif mine is not None:
            codes = await asyncio.to_thread(self._rank_codes, jdir, owner, job.spec.ranks)
            seen = observe(mine, codes)
        else:  # forgotten (MinJobAge), or the id is someone else's job now
            codes = await asyncio.to_thread(self._rank_codes, jdir, owner, job.spec.ranks)
            record = await asyncio.to_thread(self._read_small, jdir, owner, FINAL_RECORD)
            seen = from_record(slurm_id, record, codes)
        if not seen.ended:
            self._last[job.id] = seen
        else:
            self._last.pop(job.id, None)
            self._submitted.pop(job.id, None)
        return seen

    def _read_small(self, jdir: Path | None, owner: Account | None, name: str) -> str | None:
        """A short owned file of the job folder (an exit code, the final record), or ``None``
        if missing or refused."""
        if jdir is None or owner is None:
            return None
        try:
            return read_owned(jdir / name, owner, 0, 4096)[0].decode(errors="replace").strip()
        except FileNotFoundError:
            return None
        except OSError as e:
            self.log.warning("gpupool: not reading %s: %s", jdir / name, e.strerror)
            return None

    def _rank_codes(
        self, jdir: Path | None, owner: Account | None, ranks: int
    ) -> tuple[tuple[int, int], ...]:
        codes = []
        for r in range(ranks):
            code = exit_code(self._read_small(jdir, owner, f"rank-{r}.exit"))
            if code is not None:
                codes.append((r, code))
        return tuple(codes)

    async def wait(self, job: Job, timeout: float) -> None:
        await self.engine.poller.changed(timeout)

    async def cancel(self, job: Job) -> None:
        """``scancel`` as the owner: the job's Slurm job, or (no handle: the submission's answer
        was lost) every listed Slurm job carrying its tag and run by its owner."""
        owner = self.account(job.owner)
        engine = self.engine
        slurm_id = _handle(job).get("slurm_job_id")
        ids = [slurm_id] if isinstance(slurm_id, int) else []
        if not ids and engine.poller.known:
            ids = [j.job_id for j in engine.poller.last.jobs.values() if _mine(j, job, self.marker)]
        for i in ids:
            await engine.commands.scancel(i, owner)
        engine.poller.kick()

    async def read_log(self, job: Job, rank: int, offset: int) -> tuple[bytes, int]:
        """At most ``max_log_chunk`` bytes of the rank's log (an owned file of the owner's
        account, read in a worker thread; a link or anyone else's file reads as empty)."""
        return await asyncio.to_thread(self._read_log, job, rank, offset)

    def _read_log(self, job: Job, rank: int, offset: int) -> tuple[bytes, int]:
        jdir, owner = self._owned(job)
        if jdir is None or owner is None:
            return b"", 0
        return read_rank_log(jdir, owner, rank, offset, self.max_log_chunk, self.log, job.id)

    async def forget(self, job: Job) -> None:
        """Remove the ended job's folder as its owner (``rm -rf`` as that account; a hub that is
        not root goes through ``sudo``)."""
        jdir, owner = self._owned(job)
        if jdir is not None and owner is not None:
            await remove_job_folder(jdir, job.id, owner, self.sudo)


# -- what a Slurm job's state means (pure) -------------------------------------------------------
def observe(listed: SlurmJob, codes: tuple[tuple[int, int], ...]) -> Observation:
    """What a Slurm job the controller lists means for its gpupool job."""
    if listed.ended:
        return ended(listed.state, listed.exit_code, codes, _reason(listed.reason))
    if listed.state == "RUNNING":
        return Observation("running", f"Slurm: RUNNING on {','.join(listed.nodes)}", codes)
    why = _reason(listed.reason)
    words = f"Slurm: {listed.state}" + (f" ({why})" if why else "")
    if listed.pending and listed.start_time > 0:
        when = datetime.fromtimestamp(listed.start_time, UTC).strftime("%Y-%m-%d %H:%M UTC")
        words += f", expected to start by {when}"
    return Observation("starting", words, codes)


def ended(
    state: str, status: int, codes: tuple[tuple[int, int], ...], why: str = ""
) -> Observation:
    """An ended Slurm job (``state``, the batch script's exit ``status``) as an observation:
    succeeded only when Slurm says COMPLETED with status 0 and no rank exited non-zero."""
    bad = [f"rank {r} exited {c}" for r, c in codes if c != 0]
    if state == "COMPLETED" and status == 0 and not bad:
        return Observation("succeeded", "Slurm: COMPLETED; all ranks exited 0", codes)
    words = f"Slurm: {state}" + (f" ({why})" if why else "")
    if status == FOLDER_FAILED:
        words += f", exit {status}: the job could not make its folder or write its script"
    elif status:
        words += f", exit {status}"
    if bad:
        words += f": {', '.join(bad)} (see the rank logs)"
    return Observation("failed", words, codes)


def from_record(
    slurm_id: int, record: str | None, codes: tuple[tuple[int, int], ...]
) -> Observation:
    """A job Slurm no longer lists, from its final record (``None``: there is none)."""
    try:
        found = json.loads(record) if record else None
    except ValueError:
        found = None
    if (
        not isinstance(found, dict)
        or found.get("job_id") != slurm_id
        or not isinstance(found.get("state"), str)
        or not isinstance(found.get("exit"), int)
    ):
        return Observation(
            "lost",
            f"Slurm no longer lists job {slurm_id} and it left no final record in its folder "
            "(killed before its batch script could write one, or its node failed)",
            codes,
        )
    seen = ended(found["state"][:40], found["exit"], codes)
    return Observation(seen.state, f"{seen.reason} (from the job's folder)", codes)


def _reason(reason: str) -> str:
    return "" if reason in ("", "None") else reason


def _mine(listed: SlurmJob, job: Job, marker: str) -> bool:
    """Whether a listed Slurm job is ``job``'s: its tag, run by its owner."""
    tag = parse_tag(listed.comment)
    return (
        tag is not None
        and tag.kind == "job"
        and tag.id == job.id
        and tag.marker == marker
        and listed.user == job.owner
    )


def _handle(job: Job) -> dict[str, Any]:
    try:
        found = json.loads(job.handle or "{}")
    except ValueError:
        return {}
    return found if isinstance(found, dict) else {}
