"""The job manager: accepts jobs, runs the queue against the one pool, watches running jobs.

Vocabulary
- *submit*: check a spec on the hub (team membership, offer allowed, counts, limits, what the
  backend can run) and persist it as ``queued``; nothing is allocated yet.
- *pass*: one scheduling round (:func:`gpupool.core.queue.schedule` on the pool's ledger): preempt
  what the plan says (requeued, or failed past ``max_restarts``), then allocate each job to start
  for real, all its nodes or none, and hand it to the backend. A pass runs after every submit,
  every job end, every release of a notebook's devices, and every ``schedule_interval`` seconds.
- *watch*: one task per active job, asking the backend what its processes do; it ends the job
  (and frees its devices at once) when they end, and enforces the time limit. A backend that
  sees the cluster take the job back (``queued``: Kueue preempted it) has it stopped, its
  devices freed, and requeued as a preemption is (failed past ``max_restarts``).
- *fair use*: a user's jobs queued or running and the logs they follow are capped per user
  (``user_limits`` of the job's team, :mod:`gpupool.core.limits`): 429 before anything is stored.
- *retention*: jobs that ended over ``retention_days`` ago are forgotten (:meth:`prune`: their
  logs, rows and scripts); a job's script lives only in the database, read when it starts.

Contract: a submit is persisted before anyone is told (503 when the database cannot record it);
a later state change is kept at once and written now or, when the database refuses, owed and
retried (:class:`~gpupool.store.outbox.Outbox`): a job that ended is never left running in
memory because its row could not be written. Nothing large stays in memory
(the jobs the manager keeps carry no script). Jobs and notebooks share the
pool (``kind="job"`` allocations), so quotas hold across both doors. Time comes from ``clock``
(default :func:`gpupool.clock.utcnow`), the one time seam.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from dataclasses import replace
from datetime import datetime
from typing import Any

from traitlets import Float, Int, Type, validate
from traitlets.config import LoggingConfigurable

from gpupool import metrics
from gpupool.background import Periodic
from gpupool.clock import utcnow
from gpupool.core.errors import InvalidRequest, PoolError, UnknownAllocation
from gpupool.core.jobs import Job, JobSpec, check_submission, job_devices, transition
from gpupool.core.offers import check_ddp_backend
from gpupool.core.paging import page
from gpupool.core.parse import check_size, clip, clip_names, whole_number
from gpupool.core.queue import (
    Limits,
    Queued,
    Running,
    ScaleUp,
    scale_ups,
    schedule,
    serving_order,
)
from gpupool.core.quota import PRIORITY_RANGE, Team, check_offer, check_priority, resolve_team
from gpupool.core.retention import expired
from gpupool.declarations import ConfigError
from gpupool.jobs.backend import JobBackend, Observation, every_rank_exited
from gpupool.jobs.local import LocalJobBackend
from gpupool.pool import Pool

MAX_SCRIPT_BYTES = 1 << 20
MAX_WORD_BYTES = 32 << 10
"""The longest single argument or ``NAME=value`` a job may pass (Linux refuses to exec a process
with one over 128 KiB, and the job would fail to start)."""
MAX_ARGS_ENV_BYTES = 256 << 10
"""All of a job's arguments and environment together (exec's own limit is about 2 MiB, shared
with the environment every rank inherits)."""


class JobManager(LoggingConfigurable):
    backend_class = Type(
        LocalJobBackend,
        klass=JobBackend,
        config=True,
        help="""What runs jobs: ``gpupool.jobs.local.LocalJobBackend`` (torchrun on this
        machine) or ``gpupool.kube.jobs.KubeJobBackend`` (Kubernetes Indexed Jobs). Example:
        ``c.JobManager.backend_class = "gpupool.kube.jobs.KubeJobBackend"``""",
    )
    schedule_interval = Float(
        5.0, config=True, help="Seconds between scheduling passes when nothing else triggers one."
    )
    watch_interval = Float(
        2.0, config=True, help="Seconds between looks at a running job's processes. Example: 1"
    )
    default_time_limit = Int(
        4 * 3600, config=True, help="Time limit of a job that names none, in seconds. Example: 3600"
    )
    max_time_limit = Int(
        7 * 24 * 3600, config=True, help="The longest time limit a job may ask for, in seconds."
    )
    max_restarts_limit = Int(
        5,
        config=True,
        help="""The largest ``max_restarts`` a job may ask for: how often the pool may requeue
        it after preempting it (a failed job is never restarted). Example: 3""",
    )
    log_poll_interval = Float(
        0.5,
        config=True,
        help="""Seconds between reads of a followed log (``?follow=1``) while nothing new has come.
        Example: ``c.JobManager.log_poll_interval = 1.0``""",
    )
    reserve_after = Float(
        float("inf"),
        config=True,
        help="""Seconds a queued job waits before it holds the queue's one reservation, whatever
        the teams' fair share: while it cannot start, no other job may start if it would delay
        it (EASY backfill's guarantee against starvation, for the oldest job); ``inf``: the
        reservation goes to the first blocked job in fair-share order. Example:
        ``c.JobManager.reserve_after = 4 * 3600``""",
    )
    max_concurrent_launches = Int(
        4,
        config=True,
        help="""How many jobs a scheduling pass starts at the same time (their GPUs are granted
        first, in the queue's order; starting processes is what runs concurrently). Example: 8""",
    )
    max_cpu_ranks = Int(
        os.cpu_count() or 1,
        config=True,
        help="""The most processes per node a CPU-only job may run (its ``gpus``); CPU jobs cost
        no GPU-equivalents, so this is what bounds their load. Default: this machine's cores.
        Example: ``c.JobManager.max_cpu_ranks = 4``""",
    )
    max_cpu_jobs_per_user = Int(
        4,
        config=True,
        help="""The most CPU-only jobs one user runs at once (0: no limit); more wait in the
        queue, saying so. CPU-only jobs cost no GPU-equivalents, so quotas do not bound them.
        Example: ``c.JobManager.max_cpu_jobs_per_user = 2``""",
    )
    max_cpu_ranks_per_user = Int(
        0,
        config=True,
        help="""The most ranks of one user's CPU-only jobs running at once (0: no limit but the
        machine's, ``LocalJobBackend.max_ranks``). Example:
        ``c.JobManager.max_cpu_ranks_per_user = 8``""",
    )
    max_submission_bytes = Int(
        2 << 20,
        config=True,
        help="""The largest job submission (the request body, checked before it is parsed) the
        REST API accepts, in bytes; bigger ones get HTTP 413 with the limit. A job's script may
        be up to 1 MiB. Example: ``c.JobManager.max_submission_bytes = 4 << 20``""",
    )

    retention_days = Float(
        30.0,
        config=True,
        help="""Days a job is kept after it ended (its row, script and logs; it is listed until
        then), so the database and the homes do not grow for ever; 0 keeps ended jobs for ever.
        Jobs still queued or running are always kept. Example:
        ``c.JobManager.retention_days = 90``""",
    )
    prune_interval = Float(
        3600.0,
        config=True,
        help="""Seconds between looks for jobs to forget (``retention_days``); the first look is
        right after the hub starts. Example: ``c.JobManager.prune_interval = 600``""",
    )

    @validate("retention_days", "prune_interval")
    def _not_negative(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if value < 0 or value != value:
            name = proposal["trait"].name
            raise ConfigError(f"JobManager.{name}", f"must be a number >= 0, got {value!r}")
        return value

    def __init__(
        self,
        pool: Pool,
        clock: Callable[[], datetime] = utcnow,
        slurm: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.pool = pool
        self.clock = clock
        self.slurm = slurm
        """The hub's Slurm side (:class:`gpupool.slurm.engine.SlurmEngine`) on a Slurm
        inventory, for the Slurm job backend (its shared poller); ``None`` elsewhere."""
        self.backend: JobBackend = self.backend_class(parent=self, log=self.log)
        self.backend.marker = pool.hub_marker
        self.jobs: dict[str, Job] = {j.id: j for j in pool.store.load_jobs()}
        self._watchers: dict[str, asyncio.Task[None]] = {}
        self._pass_lock = asyncio.Lock()
        self._nodes_requested: list[ScaleUp] | None = None
        """The node pools' nodes last asked of the backend (``None``: not yet since the start,
        so the first pass also withdraws requests an earlier run left; see
        :meth:`_request_nodes`)."""
        self._locks: dict[str, asyncio.Lock] = {}
        self._next_prune = 0.0
        """When the loop next forgets old jobs (:meth:`prune`; at once after a start)."""
        self._followers: Counter[str] = Counter()
        """Per user, the job logs they follow now (see :meth:`following`)."""
        self._launching = asyncio.Semaphore(self.max_concurrent_launches)
        self.stopping = False
        """Set when the hub shuts down: no pass starts anything any more."""
        self.scheduler = Periodic(
            "scheduling pass", self._scheduled, lambda: self.schedule_interval, self.log
        )
        """A pass every ``schedule_interval`` seconds, and soon after every :meth:`kick`."""
        self.starting: asyncio.Task[None] | None = None
        """The task running :meth:`start` in the hub (kept so it is not garbage-collected)."""
        pool.on_devices.append(self._devices_renamed)

    def now(self) -> float:
        return self.clock().timestamp()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Re-attach active jobs, release job allocations nobody holds, start the loop (its
        first pass runs at once)."""
        held = {a for j in self.jobs.values() if j.active for a in j.allocations}
        for a in list(self.pool.ledger.allocations.values()):
            if a.kind == "job" and a.id not in held:
                self.log.warning("gpupool: releasing %s of finished job %s", a.id, a.ref)
                self.pool.release(a.id)
        for job in list(self.jobs.values()):
            if job.active:
                self.log.info("gpupool: re-attaching job %s (%s)", job.id, job.state)
                self._watch(job.id)
        self.pool.on_release.append(lambda _a: self.kick())
        self.pool.on_inventory.append(self.kick)
        self.scheduler.start()  # a first pass at once: jobs queued before a restart, old requests

    async def stop(self) -> None:
        """Stop scheduling and watching (the hub is shutting down); running jobs keep running
        and are re-attached at the next start."""
        self.stopping = True
        for task in self._watchers.values():
            task.cancel()
        await self.scheduler.stop()

    def shutting_down(self) -> None:
        """The hub is going away: start nothing more (the GPUs its servers free as it stops
        them are not for queued jobs now; they start at the next start)."""
        if not self.stopping:
            self.log.info("gpupool: the hub shuts down; no job starts until it is back")
        self.stopping = True

    def kick(self) -> None:
        """Ask for a scheduling pass soon."""
        self.scheduler.kick()

    async def _scheduled(self) -> None:
        """The loop's pass: schedule, then forget old jobs when due (each failure logged)."""
        try:
            await self.schedule_pass()
        except Exception:
            self.log.exception("gpupool: scheduling pass failed")
        if self.retention_days and self.now() >= self._next_prune:
            try:
                await self.prune()
            except Exception:
                self.log.exception("gpupool: forgetting old jobs failed")

    # -- the user's side ---------------------------------------------------------------------
    def submit(
        self, owner: str, groups: Iterable[str], fields: dict[str, Any], *, admin: bool = False
    ) -> Job:
        """Check and queue a job; ``admin`` (the caller holds ``custom:gpupool:admin``) may set
        any priority, others only one in their team's range."""
        check_submission(fields)  # storable, runnable text, before anything else (core.jobs)
        spec = self._spec(fields)
        ledger = self.pool.ledger
        team = resolve_team(ledger.teams, ledger.everyone, groups, spec.team)
        team.check_limit("jobs", self.open_jobs(owner))  # 429 before anything is stored
        offer = check_offer(team, ledger.offers, spec.offer, 1 if _cpu(ledger, spec) else spec.gpus)
        check_ddp_backend(offer, spec.gpus, dict(spec.env))  # nccl never spans MIG instances
        check_priority(team, spec.priority, admin)
        if offer.kind == "cpu" and spec.gpus > self.max_cpu_ranks:
            raise InvalidRequest(
                f"A CPU-only job runs at most {self.max_cpu_ranks} processes per node, not "
                f"{spec.gpus} (JobManager.max_cpu_ranks)."
            )
        self.backend.validate(spec)
        count = 1 if offer.kind == "cpu" else spec.gpus
        admission = ledger.admit(team, owner, offer, count, spec.nodes, self.backend.distinct_nodes)
        if admission.verdict == "never":
            raise admission.error(f"The job {admission.reason}; it could never start.")
        reason = f"waiting: {admission.reason}" if admission.reason else "waiting to start"
        job = Job(uuid.uuid4().hex[:12], owner, team.name, spec, reason=reason, created=self.now())
        job = self._save(job)  # the script goes to the store; the hub keeps the job without
        self.log.info("gpupool: job %s submitted by %s (team %s)", job.id, owner, team.name)
        self.kick()
        return job

    def _spec(self, f: dict[str, Any]) -> JobSpec:
        def whole(key: str, default: int, low: int, high: int) -> int:
            value = f.get(key, default)
            return whole_number(default if value is None else value, key, low, high, text=False)

        unknown = sorted(set(f) - _FIELDS)
        if unknown:
            raise InvalidRequest(f"Unknown job fields: {clip_names(unknown)}.")
        script = f.get("script")
        if not isinstance(script, str) or not script.strip():
            raise InvalidRequest("script must be the job's Python code (a non-empty string).")
        check_size(len(_utf8(script)), MAX_SCRIPT_BYTES, "The script")
        args, env = _given(f, "args", []), _given(f, "env", {})
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise InvalidRequest("args must be a list of strings.")
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise InvalidRequest("env must map strings to strings.")
        words = [len(_utf8(w)) for w in [*args, *(f"{k}={v}" for k, v in env.items())]]
        check_size(max(words, default=0), MAX_WORD_BYTES, "The longest of args and env")
        check_size(sum(words), MAX_ARGS_ENV_BYTES, "The total of args and env")
        texts = {k: _given(f, k, "") for k in ("name", "filename", "workdir", "offer", "team")}
        if not all(isinstance(v, str) for v in texts.values()):
            raise InvalidRequest("name, filename, workdir, offer and team must be strings.")
        return JobSpec(
            script=script,
            offer=texts["offer"] or "cpu",
            gpus=whole("gpus", 1, 1, 64),
            nodes=whole("nodes", 1, 1, 64),
            team=texts["team"] or None,
            name=texts["name"][:200] or texts["filename"][:200] or "job",
            filename=texts["filename"][:200] or "script.py",
            workdir=texts["workdir"],
            args=tuple(args),
            env=tuple(sorted(env.items())),
            time_limit=whole("time_limit", self.default_time_limit, 1, self.max_time_limit),
            max_restarts=whole("max_restarts", 0, 0, self.max_restarts_limit),
            priority=whole("priority", 0, *PRIORITY_RANGE),
        )

    def check_room(self, owner: str, groups: Iterable[str]) -> None:
        """Refuse (429) a submission before its body is even read when ``owner`` already has as
        many jobs queued or running as the jobs limit of every team they could charge it to."""
        ledger = self.pool.ledger
        teams = [ledger.teams[g] for g in set(groups) if g in ledger.teams] or [ledger.everyone]
        roomiest = max(teams, key=lambda t: t.user_limits.jobs or float("inf"))
        roomiest.check_limit("jobs", self.open_jobs(owner))

    def open_jobs(self, owner: str) -> int:
        """How many of ``owner``'s jobs are queued or running (what ``user_limits.jobs``
        bounds)."""
        return sum(1 for j in self.jobs.values() if j.owner == owner and not j.final)

    def listing(
        self, user: str, admin: bool, limit: int, cursor: str | None = None
    ) -> tuple[list[Job], str | None]:
        """A page of the jobs ``user`` may see, newest first, and the next page's cursor
        (:mod:`gpupool.core.paging`)."""
        mine = (j for j in self.jobs.values() if admin or j.owner == user)
        return page(mine, lambda j: (j.created, j.id), limit, cursor)

    def get(self, job_id: str, user: str, admin: bool) -> Job:
        job = self.jobs.get(job_id)
        if job is None or not (admin or job.owner == user):
            raise UnknownAllocation(f"No job {clip(job_id)}.")  # 404, whether it exists or not
        return job

    async def cancel(self, job_id: str, user: str, admin: bool) -> Job:
        """Cancel in any state: a queued job at once; a starting or running one once everything
        it started is stopped. A job that ended first keeps its own final state, also when
        every rank had exited and only the launcher's teardown (or a process a rank left) ran."""
        self.get(job_id, user, admin)
        async with self._owner(job_id):
            job = self.jobs[job_id]
            if job.final:
                return job
            if job.state == "queued":
                return self._finish(job_id, "cancelled", f"cancelled by {user}")
            done = None
            if job.handle:  # it may have ended on its own before the cancel: that is its state
                seen = await self.backend.check(job)
                if seen.ended:
                    return self._finish(job_id, seen.state, seen.reason, seen.exit_codes)
                done = every_rank_exited(seen, job.spec.ranks)  # only tearing down
            await self._stop_processes(job)  # by its handle, or by its marker if it has none
            if done is not None:
                job = self._finish(job_id, done.state, done.reason, done.exit_codes)
            else:
                job = self._finish(job_id, "cancelled", f"cancelled by {user}")
        self.kick()
        return job

    # -- logs ----------------------------------------------------------------------------------
    async def read_log(self, job: Job, rank: int, offset: int) -> tuple[bytes, int]:
        """A chunk of ``rank``'s log from ``offset``, and the log's size now (never blocks)."""
        return await self.backend.read_log(job, rank, offset)

    @contextlib.contextmanager
    def following(self, user: str, job: Job) -> Iterator[None]:
        """Count a log ``user`` follows while it is open; beyond ``user_limits.log_followers``
        of the job's team, :class:`~gpupool.core.errors.LimitReached` (429) at once."""
        self._team(job.team).check_limit("log_followers", self._followers[user])
        self._followers[user] += 1
        try:
            yield
        finally:
            self._followers[user] -= 1
            if not self._followers[user]:
                del self._followers[user]

    def _team(self, name: str) -> Team:
        """A job's team, or ``everyone`` for a team since removed from the config."""
        ledger = self.pool.ledger
        return ledger.teams.get(name, ledger.everyone)

    async def follow_log(
        self, job: Job, rank: int, offset: int, left: asyncio.Event
    ) -> AsyncGenerator[bytes, None]:
        """The log's chunks from ``offset`` as they come, until the job has ended and its log is
        drained, or ``left`` is set (the reader went away), whichever comes first."""
        while not left.is_set():
            now = self.jobs.get(job.id, job)  # its state before the read: final means drained
            data, _ = await self.backend.read_log(now, rank, offset)
            if left.is_set():  # the reader went away during the read
                return
            if data:
                offset += len(data)
                yield data
                continue
            if now.final:
                return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.log_poll_interval):  # not wait_for: #86296
                    await left.wait()

    def queue_positions(self) -> dict[str, int]:
        """Queued job id -> its place in the queue's own order (1 is served first)."""
        queued = [self._queued(j) for j in self.jobs.values() if j.state == "queued"]
        ordered = serving_order(self.pool.ledger, queued, self.now(), self.reserve_after)
        return {q.id: i for i, q in enumerate(ordered, 1)}

    def queue_position(self, job: Job) -> int | None:
        """1 for the job the queue serves first, None if not queued (one job: for many, ask
        :meth:`queue_positions` once)."""
        return self.queue_positions().get(job.id) if job.state == "queued" else None

    # -- scheduling --------------------------------------------------------------------------
    async def schedule_pass(self) -> None:
        """Plan, preempt, then start what the plan says: every planned job still queued gets its
        GPUs at once, in the plan's order (no await in between), then its processes, several
        at a time (``max_concurrent_launches``), each under its job's lock."""
        async with self._pass_lock:
            if self.stopping:
                return
            now = self.now()
            queued = [self._queued(j) for j in self.jobs.values() if j.state == "queued"]
            await self._request_nodes(queued)
            if not queued:
                return
            running = [self._running(j, now) for j in self.jobs.values() if j.active]
            plan = schedule(
                self.pool.ledger, queued, running, now, self.limits(), self.reserve_after
            )
            for job_id in plan.preempt:
                await self._preempt(job_id)
            granted = [
                job_id
                for job_id in plan.start
                if self._grant(job_id, plan.keep_off.get(job_id, frozenset()))
            ]
            waits = [
                replace(job, reason=why)
                for job_id, why in plan.waiting.items()
                if (job := self.jobs[job_id]).state == "queued" and job.reason != why
            ]
            self.pool.writes.save_jobs(waits)  # one transaction, however many changed
            self.jobs.update((job.id, job) for job in waits)
            await asyncio.gather(*(self._launch(job_id) for job_id in granted))

    async def _request_nodes(self, queued: list[Queued]) -> None:
        """Ask the backend for the node pools' nodes the queue waits for, when that changed
        (an error is logged and the next pass asks again). The first pass always asks, even for
        nothing: requests an earlier run left (for a node pool since removed from the config, or
        for jobs since ended) are withdrawn."""
        node_pools = self.pool.inventory.node_pools
        wanted = scale_ups(self.pool.ledger, queued)
        if wanted == self._nodes_requested:
            return
        try:
            await self.backend.request_nodes(wanted, node_pools)
        except Exception as e:
            self.log.warning("gpupool: could not ask for node pool nodes: %s", e)
            return
        self._nodes_requested = wanted

    def _queued(self, job: Job) -> Queued:
        cpu = _cpu(self.pool.ledger, job.spec)
        return Queued(
            job.id, job.owner, job.team, job.spec.offer, 1 if cpu else job.spec.gpus,
            job.spec.nodes, job.spec.priority, job.created, job.spec.time_limit, cpu,
            job.spec.gpus, self.backend.distinct_nodes,
        )  # fmt: skip

    def _running(self, job: Job, now: float) -> Running:
        cpu = _cpu(self.pool.ledger, job.spec)
        return Running(
            job.id, job.team, job.allocations, job.ends_at(), job.started or now, job.owner,
            job.spec.ranks, cpu,
        )  # fmt: skip

    def limits(self) -> Limits:
        """The load limits the queue keeps (see :class:`gpupool.core.queue.Limits`)."""
        return Limits(
            ranks=self.backend.max_ranks or None,
            user_cpu_jobs=self.max_cpu_jobs_per_user or None,
            user_cpu_ranks=self.max_cpu_ranks_per_user or None,
        )

    def _grant(self, job_id: str, keep_off: frozenset[str] = frozenset()) -> bool:
        """Allocate a planned job's GPUs (off the nodes the plan keeps it off) and mark it
        ``starting``, in one step without awaits; False (nothing taken) if it is no longer
        queued (cancelled since the plan) or no longer fits."""
        job = self.jobs[job_id]
        if job.state != "queued":
            return False
        q = self._queued(job)
        taken: list[str] = []
        devices: list[str] = []
        try:
            held: list[str | None] = []
            for _ in range(q.nodes):
                r = q.request(held, keep_off)
                a = self.pool.allocate(
                    job.owner, [job.team], r.offer, r.count, team=job.team, kind="job",
                    ref=job.id, avoid_nodes=r.avoid_nodes,
                )  # fmt: skip
                taken.append(a.id)
                held.append(a.node)
                devices.extend(job_devices([a]))
        except PoolError as e:
            for alloc_id in taken:
                self.pool.release(alloc_id)
            self._save(replace(job, reason=e.message))
            return False
        metrics.QUEUE_WAIT_SECONDS.labels(team=job.team).observe(max(0.0, self.now() - job.created))
        what = "GPUs granted; starting" if devices else "starting"
        self._save(
            transition(
                job, "starting", what, self.now(), allocations=tuple(taken), devices=tuple(devices)
            )
        )
        return True

    async def _launch(self, job_id: str) -> None:
        """Start a granted job's processes under its lock (a cancel waits for the handle)."""
        async with self._launching, self._owner(job_id):
            job = self.jobs[job_id]
            if job.state != "starting" or job.handle:
                return  # cancelled before its processes were started
            allocations = [self.pool.ledger.allocations[a] for a in job.allocations]
            try:
                script = self.pool.store.job_script(job_id)  # read now, never kept
                if script is None:
                    raise RuntimeError("its script is not in the database any more")
                handle = await self.backend.start(
                    replace(job, spec=replace(job.spec, script=script)), allocations
                )
            except Exception as e:
                self.log.warning("gpupool: job %s could not start: %s", job_id, e)
                await self._stop_processes(job)  # whatever it started, found by its marker
                self._finish(job_id, "failed", f"could not start: {e}")
                return
            self._save(replace(self.jobs[job_id], handle=handle))
        self._watch(job_id)

    async def _stop_processes(self, job: Job) -> None:
        """Stop everything ``job`` started (by its handle, or by its marker when it has none)
        and wait (bounded) until it is gone, so its devices are free when they are released."""
        await self.backend.cancel(job)
        deadline = time.monotonic() + getattr(self.backend, "kill_grace", 10.0) + 5
        while time.monotonic() < deadline and not (await self.backend.check(job)).ended:
            await self.backend.wait(job, 0.5)

    async def _preempt(self, job_id: str) -> None:
        async with self._owner(job_id):
            job = self.jobs[job_id]
            if not job.active:
                return
            await self._stop_processes(job)
            if job.restarts >= job.spec.max_restarts:
                why = "preempted (its team borrowed GPUs the lender needed back)"
                self._finish(
                    job_id, "failed", f"{why} and out of restarts ({job.spec.max_restarts})"
                )
                return
            self._finish(
                job_id, "queued", "preempted: the lending team needed its guarantee back; requeued",
                restarts=job.restarts + 1,
            )  # fmt: skip

    # -- watching ----------------------------------------------------------------------------
    def _watch(self, job_id: str) -> None:
        if job_id not in self._watchers:
            self._watchers[job_id] = asyncio.create_task(self._watch_loop(job_id))

    async def _watch_loop(self, job_id: str) -> None:
        """Look at an active job's processes until it ends (see :meth:`_observed`)."""
        try:
            while self.jobs[job_id].active:
                seen = await self.backend.check(self.jobs[job_id])
                if await self._observed(job_id, seen):
                    self.kick()
                    return
                job = self.jobs[job_id]  # look often while ranks come up, then less often
                await self.backend.wait(
                    job, 0.2 if job.state == "starting" else self.watch_interval
                )
        except asyncio.CancelledError:
            raise
        except Exception:
            self.log.exception("gpupool: watching job %s failed", job_id)
        finally:
            if self._watchers.get(job_id) is asyncio.current_task():
                self._watchers.pop(job_id, None)

    async def _observed(self, job_id: str, seen: Observation) -> bool:
        """Act on what the backend saw, under the job's lock and on the job as it is now (a
        cancel may have ended it meanwhile); True once the job has ended."""
        async with self._owner(job_id):
            job = self.jobs[job_id]
            if not job.active:
                return True
            if seen.ended:
                self._finish(job_id, seen.state, seen.reason, seen.exit_codes)
                return True
            if seen.state == "queued":  # the cluster took it back (Kueue's preemption)
                await self._stop_processes(job)
                if job.restarts >= job.spec.max_restarts:
                    why = f"{seen.reason}; out of restarts ({job.spec.max_restarts})"
                    self._finish(job_id, "failed", why, seen.exit_codes)
                else:
                    why = f"{seen.reason}; requeued"
                    self._finish(job_id, "queued", why, restarts=job.restarts + 1)
                return True
            if seen.state == "running" and job.state == "starting":
                why = seen.reason or "all ranks running"
                job = self._save(transition(job, "running", why, self.now()))
            elif seen.reason and seen.reason != job.reason:  # the cluster's words, for the
                job = self._save(replace(job, reason=seen.reason))  # jobs panel (Slurm's reason)
            if not self.backend.enforces_time_limit and self.now() > job.ends_at():
                await self._stop_processes(job)
                self._finish(job_id, "failed", f"time limit of {job.spec.time_limit} s reached")
                return True
            return False

    def _devices_renamed(self, renamed: Iterable[Any]) -> None:
        """Allocations' devices were renamed in place (read back from the node): each active
        job holding one records the devices its allocations hold now (saved: the jobs API, the
        pages and a restart show the GPUs the node gave, not the ledger's names at grant)."""
        refs = {a.ref for a in renamed if a.kind == "job"}
        for job_id in sorted(refs):
            job = self.jobs.get(job_id)
            if job is None or not job.active:
                continue
            held = [self.pool.ledger.allocations.get(a) for a in job.allocations]
            devices = job_devices([a for a in held if a is not None])
            if devices != job.devices:
                self.log.info(
                    "gpupool: job %s runs on %s (read back; granted as %s)",
                    job_id,
                    ",".join(devices),
                    ",".join(job.devices),
                )
                self._save(replace(job, devices=devices))

    # -- state -------------------------------------------------------------------------------
    def _owner(self, job_id: str) -> asyncio.Lock:
        """The job's lock: whoever holds it is the only one changing the job (launch, watch,
        cancel, preempt); each re-reads the job inside it."""
        lock = self._locks.get(job_id)
        if lock is None:
            lock = self._locks[job_id] = asyncio.Lock()
        return lock

    def _finish(
        self,
        job_id: str,
        state: Any,
        reason: str,
        exit_codes: tuple[tuple[int, int], ...] = (),
        **changes: Any,
    ) -> Job:
        """Move the job as it is now to a final state (or back to ``queued``), releasing its
        GPUs in the same step; a job already final stays as it is (a final state is final)."""
        job = self.jobs[job_id]
        if job.final:
            return job
        for alloc_id in job.allocations:
            with contextlib.suppress(UnknownAllocation):
                self.pool.release(alloc_id)
        ended = transition(
            job, state, reason, self.now(), exit_codes=exit_codes or job.exit_codes, **changes
        )
        self.log.info("gpupool: job %s %s: %s", job_id, state, reason)
        return self._save(ended)

    def _save(self, job: Job) -> Job:
        """Persist ``job``, then keep it in memory without its script. At submit (the job
        carries its script) a grant: when the database cannot record it, nothing is kept
        (:class:`~gpupool.store.outbox.StoreUnavailable`, 503). Any later state is kept at once
        and written now or, when the database refuses, owed (``pool.writes``)."""
        if job.spec.script:
            self.pool.writes.grant(lambda: self.pool.store.save_job(job))
            job = replace(job, spec=replace(job.spec, script=""))
        else:
            self.pool.writes.save_jobs([job])
        self.jobs[job.id] = job
        return job

    # -- retention -----------------------------------------------------------------------------
    async def prune(self) -> list[str]:
        """Forget the jobs that ended more than ``retention_days`` ago: their logs (the
        backend's :meth:`~gpupool.jobs.backend.JobBackend.forget`), then their rows and scripts;
        returns their ids. Jobs still queued or running are never forgotten."""
        now = self.now()
        if not self.pool.writes.pay():  # an owed row written after its delete would come back
            return []
        gone = expired(self.jobs.values(), now, self.retention_days * 86400)
        for job in gone:
            try:
                await self.backend.forget(job)
            except Exception as e:  # its row goes anyway; the files are the owner's
                self.log.warning("gpupool: the files of job %s stay: %s", job.id, e)
        self.pool.store.delete_jobs(j.id for j in gone)
        for job in gone:
            self.jobs.pop(job.id, None)
            self._locks.pop(job.id, None)
        if gone:
            shown = ", ".join(j.id for j in gone[:50]) + (" …" if len(gone) > 50 else "")
            self.log.info(
                "gpupool: forgot %d job(s) that ended over %g days ago: %s",
                len(gone),
                self.retention_days,
                shown,
            )
        self._next_prune = now + self.prune_interval
        return [j.id for j in gone]


_FIELDS = {
    "script", "name", "filename", "workdir", "args", "env", "offer", "gpus", "nodes", "team",
    "time_limit", "max_restarts", "priority",
}  # fmt: skip


def _given(fields: dict[str, Any], key: str, default: Any) -> Any:
    """A field's value, or ``default`` when it is absent or null (never for ``false``, ``0``,
    ``[]``...: a value of the wrong type is refused by its check, not taken as "not given")."""
    value = fields.get(key)
    return default if value is None else value


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _cpu(ledger: Any, spec: JobSpec) -> bool:
    offer = ledger.offers.get(spec.offer)
    return offer is not None and offer.kind == "cpu"
