"""``SlurmSpawner`` (``gpupool-slurm``): each JupyterLab server is a Slurm batch job, with GPUs.

Vocabulary
- *server job*: the batch job of one server (:mod:`gpupool.slurm.notebook` builds its arguments
  and script), submitted as the user's own unix account (a root hub becomes it, any other goes
  through ``SlurmSettings.sudo``), with the gres, node and account of the server's allocation.
- *port report*: the server picks its port on the node and reports it with its own token
  (:mod:`gpupool.hub.server_port`); the hub takes the host from Slurm (the node's address).
- *shared poller*: every ``poll``, ``progress`` and wait reads the hub's one ``squeue``
  (:class:`gpupool.slurm.poller.SlurmPoller`); no spawner runs ``squeue`` itself.
- *unknown*: the controller does not answer: ``poll`` says "running" (``None``), never
  "stopped"; a start keeps waiting.

Contract: ``start`` returns once the server's port answers on its node; a job that ends (or
vanishes) before that fails the spawn at once with the tail of its output file; a start that is
cancelled (JupyterHub's cancel of a pending spawn, its ``start_timeout``) cancels the job.
``stop`` cancels the job whether pending or running and waits until Slurm lists it ended or
gone. The state keeps the job id and node, so a restarted hub re-attaches through the poller.
The allocation is the mixin's: taken before ``start``, released on stop, failure and exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from jupyterhub.spawner import Spawner
from sqlalchemy.orm import object_session
from traitlets import Float, Int, List, Unicode, default, validate

from gpupool.core.errors import PoolError
from gpupool.declarations import ConfigError
from gpupool.hub.errors import http_error, refuse
from gpupool.hub.objects import hub_objects
from gpupool.slurm.commands import SlurmUnavailable
from gpupool.slurm.engine import SlurmEngine
from gpupool.slurm.inventory import gres_request, gres_types_of
from gpupool.slurm.names import Tag, server_job_name
from gpupool.slurm.notebook import (
    NotStarting,
    ServerJob,
    batch_script,
    exit_status,
    node_address,
    output_path,
    progress_message,
    sbatch_args,
    spawn_failure,
    tail_text,
)
from gpupool.slurm.parse import SlurmJob
from gpupool.slurm.settings import SlurmSettings, check_time_limit
from gpupool.usercode import Account, UnsafeFile, account, owned_size, read_owned
from gpupool_spawner.mixin import GPUSpawnerMixin, UnknownExit

JOB_KEY = "slurm_job_id"
NODE_KEY = "slurm_node"
TAIL_BYTES = 16384


class SlurmSpawnerBase(SlurmSettings, Spawner):
    """A server as a Slurm batch job (no GPUs of gpupool's: :class:`SlurmSpawner` adds them)."""

    time_limit = Unicode(
        "8:00:00",
        config=True,
        help="""The Slurm time limit of a server job (``--time``): Slurm stops the server then.
        Example: ``c.SlurmSpawner.time_limit = "1-00:00:00"``""",
    )
    output_template = Unicode(
        "{home}/.gpupool-{job_name}.log",
        config=True,
        help="""The server job's output file (``--output``), written by Slurm as the user; the
        hub reads its tail when the job dies before its server answers, only as a file that
        user owns. ``{home}``, ``{username}`` and ``{job_name}`` are replaced; the folder must
        exist on the node. One file per server, overwritten by its next start. Example:
        ``c.SlurmSpawner.output_template = "/scratch/{username}/{job_name}.log"``""",
    )
    workdir = Unicode(
        "",
        config=True,
        help="""The folder the server starts in (``--chdir``); empty: the user's home. Example:
        ``c.SlurmSpawner.workdir = "/scratch/{username}"``""",
    )
    port_python = Unicode(
        "python3",
        config=True,
        help="""The Python on the node that reports the server's port (standard library only,
        run with ``-I``) before ``Spawner.cmd`` starts. Example:
        ``c.SlurmSpawner.port_python = "/opt/jupyter/bin/python"``""",
    )
    bind_ip = Unicode(
        "0.0.0.0",
        config=True,
        help="""The address the server listens on, on its node (the hub reaches it at the
        node's address in ``sinfo``). Example: ``c.SlurmSpawner.bind_ip = "0.0.0.0"``""",
    )
    sbatch_extra = List(
        Unicode(),
        config=True,
        help="""More ``sbatch`` arguments for every server job (``--qos``, ``--mem``,
        ``--cpus-per-task``), after gpupool's. Example:
        ``c.SlurmSpawner.sbatch_extra = ["--cpus-per-task=4", "--mem=32G"]``""",
    )
    start_poll_interval = Float(
        3.0,
        config=True,
        help="""While a server starts, the oldest ``squeue`` snapshot it accepts, in seconds
        (the shared poller makes at most one call a second for all starts together). Example:
        ``c.SlurmSpawner.start_poll_interval = 5``""",
    )
    stop_timeout = Float(
        60.0,
        config=True,
        help="""Seconds ``stop`` waits for Slurm to list a cancelled job as ended. Example:
        ``c.SlurmSpawner.stop_timeout = 120``""",
    )
    tail_lines = Int(
        20,
        config=True,
        help="""How many last lines of a dead job's output the spawn page shows. Example:
        ``c.SlurmSpawner.tail_lines = 40``""",
    )

    slurm_job_id = Int(0, help="The server's Slurm job (state).")
    slurm_node = Unicode("", help="The node the server's job was sent to (state).")

    @default("start_timeout")
    def _default_start_timeout(self) -> int:
        return 600  # a job may pend a while; the page shows Slurm's reason meanwhile

    @validate("time_limit")
    def _valid_time_limit(self, proposal: dict[str, Any]) -> str:
        return check_time_limit(str(proposal["value"]), f"{type(self).__name__}.time_limit")

    _port: asyncio.Future[int] | None = None
    _cancelling: asyncio.Future[None] | None = None
    _job_seen: SlurmJob | None = None
    _submitted_at = float("-inf")
    """When the job was submitted (monotonic); ``-inf`` for one re-attached after a restart."""

    # -- what the subclass says of the request -----------------------------------------------
    def slurm_request(self) -> tuple[str, str, str]:
        """``(gres, node, team)`` of this server's job; none by default."""
        return "", "", ""

    def slurm_tag(self) -> str:
        return ""

    # -- the hub's Slurm side -----------------------------------------------------------------
    @property
    def slurm(self) -> SlurmEngine:
        engine = hub_objects(self.user.settings).slurm
        if engine is None:
            raise refuse(
                503,
                "The Slurm spawner needs the Slurm inventory: set c.GPUPool.inventory = "
                '"slurm" (see docs/slurm.md).',
            )
        return engine

    def code_account(self) -> Account:
        """The user's unix account (never root); a 403 naming the fix when there is none."""
        try:
            return account(self.user.name, f"{type(self).__name__} (the user's unix account)")
        except ConfigError as e:
            raise refuse(403, f"{self.user.name}'s server cannot start here: {e}") from None

    def get_env(self) -> dict[str, str]:
        env: dict[str, str] = super().get_env()
        who = self.code_account()
        env.update({"USER": who.name, "LOGNAME": who.name, "HOME": who.home})
        return env

    def server_job(self, who: Account, account: str) -> ServerJob:
        """What to submit for this server, as ``who``, charged to Slurm ``account`` (``""``:
        none; :meth:`SlurmEngine.submit_account`)."""
        gres, node, _team = self.slurm_request()
        name = server_job_name(self.user.name, self.name)
        home = who.home
        workdir = self.workdir.format(username=who.name) if self.workdir else home
        return ServerJob(
            job_name=name,
            tag=self.slurm_tag(),
            time_limit=self.time_limit,
            gres=gres,
            node=node,
            account=account,
            partition=self.partition,
            output=output_path(self.output_template, home, who.name, name),
            workdir=workdir,
            extra=tuple(self.sbatch_extra),
        )

    # -- start ---------------------------------------------------------------------------------
    async def start(self) -> Any:
        engine = self.slurm
        who = self.code_account()
        team = self.slurm_request()[2]
        try:
            job = self.server_job(who, await engine.submit_account(who.name, team))
        except PoolError as e:
            raise http_error(e) from None
        script = batch_script(
            [*self.cmd, *self.get_args()],
            self.port_python,
            self.bind_ip,
            note=f"for {self.user.name}/{self.name}",
        )
        self._port = asyncio.get_running_loop().create_future()
        self._job_seen = None
        try:
            # sbatch itself runs in "/": the job's folder (--chdir) need not exist on the hub
            job_id = await engine.commands.sbatch(
                script, sbatch_args(job), who, self.get_env(), "/"
            )
        except PoolError as e:
            self.log.info("gpupool: Slurm did not take %s's server: %s", self.user.name, e.message)
            raise http_error(e) from None
        self._submitted_at = time.monotonic()  # after sbatch answered: the job exists now
        self.slurm_job_id, self.slurm_node = job_id, job.node
        self._save_state()
        self.log.info(
            "gpupool: %s/%s is Slurm job %s (%s)", self.user.name, self.name, job_id, job.gres
        )
        try:
            port = await self._until_port(engine, job_id, job.output, who)
            node = await self._running_node(engine, job_id, job.output, who)
            host = await self._address(engine, node)
            await self._until_answers(engine, job_id, host, port, job.output, who)
        except asyncio.CancelledError:
            # JupyterHub's cancel of a pending spawn waits a second, then calls stop (which
            # cancels the job); a start that failed or timed out is stopped by JupyterHub too.
            # Ending now keeps the spawn from looking pending then; the job is cancelled here
            # as well in case no stop follows.
            self._cancelling = asyncio.ensure_future(self._cancel(engine, job_id, who))
            raise
        finally:
            self._port = None
        self.slurm_node = node
        return host, port

    def _save_state(self) -> None:
        """Keep the job id in JupyterHub's database now (JupyterHub saves state only after
        ``start``), so a hub restart during a long pending start still knows the job."""
        orm = self.orm_spawner
        if orm is None:
            return
        orm.state = self.get_state()
        session = object_session(orm)
        if session is not None:
            session.commit()

    def slurm_port_reported(self, port: int) -> None:
        """The server's port report (:mod:`gpupool.hub.server_port`): accepted once, while this
        server starts; :class:`NotStarting` otherwise."""
        waiting = self._port
        if waiting is None or waiting.done():
            raise NotStarting(
                f"{self.user.name}'s server is not waiting for a port report "
                "(only a starting server reports its port, once)"
            )
        waiting.set_result(port)

    async def _until_port(self, engine: SlurmEngine, job_id: int, output: str, who: Account) -> int:
        assert self._port is not None
        while not self._port.done():
            self._check_alive(engine, job_id, output, who)
            await self._next_snapshot(engine, self._port)
        return self._port.result()

    def _check_alive(self, engine: SlurmEngine, job_id: int, output: str, who: Account) -> None:
        """Fail the start at once if the job ended or is gone (as a snapshot fresh for its
        submission says); an unknown controller is waited out."""
        poller = engine.poller
        if not poller.known or poller.last.started < self._submitted_at:
            return
        job = poller.last.jobs.get(job_id)
        if job is None:
            self._fail(job_id, "gone from Slurm's queue", output, who)
        elif job.ended:
            self._fail(job_id, job.state, output, who)
        else:
            self._job_seen = job

    def _fail(self, job_id: int, state: str, output: str, who: Account) -> None:
        message = spawn_failure(job_id, state, self._tail(output, who))
        self.log.warning("gpupool: %s/%s: %s", self.user.name, self.name, message)
        raise refuse(500, message)

    def _tail(self, output: str, who: Account) -> str:
        path = Path(output.replace("%%", "%"))
        size = owned_size(path, who)
        if size is None:
            return ""
        try:
            data, _ = read_owned(path, who, max(0, size - TAIL_BYTES), TAIL_BYTES)
        except (OSError, UnsafeFile):
            return ""
        return tail_text(data, self.tail_lines)

    async def _next_snapshot(self, engine: SlurmEngine, *also: asyncio.Future[Any]) -> None:
        """Wait for the poller's next call (asking for one when the last is older than
        ``start_poll_interval``) or for any of ``also``."""
        poller = engine.poller
        if time.monotonic() - poller.last.started >= self.start_poll_interval:
            poller.kick()
        waiter = asyncio.ensure_future(poller.changed(self.start_poll_interval))
        try:
            await asyncio.wait([waiter, *also], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    async def _running_node(
        self, engine: SlurmEngine, job_id: int, output: str, who: Account
    ) -> str:
        """The node the job runs on, from a snapshot taken after the report."""
        since = time.monotonic()
        while True:
            try:
                await engine.poller.fresh(since, timeout=self.start_poll_interval * 2)
            except (SlurmUnavailable, TimeoutError):
                continue
            self._check_alive(engine, job_id, output, who)
            job = engine.poller.last.jobs[job_id]
            if job.nodes:
                return job.nodes[0]
            since = time.monotonic()

    async def _address(self, engine: SlurmEngine, node: str) -> str:
        """The node's address from Slurm (``NodeAddr``), never from the report."""
        result = await engine.commands.run("sinfo", "--json", f"--nodes={node}")
        try:
            document = json.loads(result.stdout) if result.returncode == 0 else {}
        except ValueError:
            document = {}
        return node_address(document if isinstance(document, dict) else {}, node)

    async def _until_answers(
        self, engine: SlurmEngine, job_id: int, host: str, port: int, output: str, who: Account
    ) -> None:
        """Until the server accepts a connection on ``host:port``; the job ending first fails
        the start at once; ``http_timeout`` bounds it."""
        deadline = time.monotonic() + self.http_timeout
        while True:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2)
            except (OSError, TimeoutError):
                pass
            else:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return
            self._check_alive(engine, job_id, output, who)
            if time.monotonic() > deadline:
                raise refuse(
                    500,
                    f"The server of Slurm job {job_id} reported port {port} but did not answer "
                    f"on {host}:{port} in {self.http_timeout:g} s",
                )
            pause = asyncio.ensure_future(asyncio.sleep(0.5))  # between connection attempts
            try:
                await self._next_snapshot(engine, pause)
            finally:
                pause.cancel()

    # -- progress ------------------------------------------------------------------------------
    async def progress(self) -> AsyncIterator[dict[str, Any]]:
        """Slurm's pending reason and start estimate, then where the job runs, from the shared
        poller, each time it changes."""
        engine = hub_objects(self.user.settings).slurm
        if engine is None:
            return
        said = ""
        while self._port is not None and not self._port.done():
            poller = engine.poller
            unknown = "" if poller.known else poller.failure or "not answered yet"
            job = self._job_seen if self.slurm_job_id else None
            if self.slurm_job_id and poller.known:
                job = poller.last.jobs.get(self.slurm_job_id, job)
            message = progress_message(job, unknown)
            if message != said:
                said = message
                yield {
                    "progress": 50 if job is not None and not job.pending else 20,
                    "message": message,
                }
            await poller.changed(self.start_poll_interval)

    # -- stop and poll ------------------------------------------------------------------------
    async def _cancel(self, engine: SlurmEngine, job_id: int, who: Account) -> None:
        """``scancel`` (as the user) unless Slurm lists the job ended; then wait until it does
        or it is gone (``stop_timeout``)."""
        poller = engine.poller
        listed = poller.last.jobs.get(job_id) if poller.known else None
        if listed is None or not listed.ended:
            try:
                await engine.commands.scancel(job_id, account=who)
            except SlurmUnavailable as e:
                # scancel(1) fails for a job already completing: what Slurm lists decides
                self.log.info("gpupool: scancel %s: %s", job_id, e.message)
        since = time.monotonic()
        deadline = since + self.stop_timeout
        while time.monotonic() < deadline:
            try:
                snapshot = await engine.poller.fresh(since, timeout=deadline - time.monotonic())
            except SlurmUnavailable:
                await engine.poller.changed(self.start_poll_interval)
                continue
            except TimeoutError:
                break
            job = snapshot.jobs.get(job_id)
            if job is None or job.ended:
                return
            since = time.monotonic()
        self.log.warning("gpupool: Slurm still lists job %s after scancel", job_id)

    async def stop(self, now: bool = False) -> None:
        job_id = self.slurm_job_id
        if not job_id:
            return
        await self._cancel(self.slurm, job_id, self.code_account())
        self.slurm_job_id = 0

    async def poll(self) -> int | None:
        """From the shared poller only: ``None`` while the job is pending or running, or while
        the controller does not answer; its exit status once ended; ``UnknownExit`` when a
        snapshot fresh for its submission no longer lists it."""
        job_id = self.slurm_job_id
        if not job_id:
            return 0
        engine = self.slurm
        poller = engine.poller
        if not poller.last.answered and not poller.failure:  # a hub that just (re)started
            with contextlib.suppress(SlurmUnavailable, TimeoutError):
                await poller.fresh(float("-inf"), timeout=self.command_timeout)
        try:
            job = poller.job(job_id)
        except SlurmUnavailable:
            return None  # unknown is not stopped
        if job is None:
            if poller.last.started < self._submitted_at:
                return None  # newer than the snapshot
            return UnknownExit(f"Slurm job {job_id} is no longer listed")
        if job.ended:
            return exit_status(job)
        return None

    # -- state -------------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = super().get_state()
        if self.slurm_job_id:
            state[JOB_KEY] = self.slurm_job_id
            state[NODE_KEY] = self.slurm_node
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        job_id = state.get(JOB_KEY)
        self.slurm_job_id = job_id if isinstance(job_id, int) else 0
        self.slurm_node = str(state.get(NODE_KEY) or "")
        self._submitted_at = float("-inf")

    def clear_state(self) -> None:
        super().clear_state()
        self.slurm_job_id = 0
        self.slurm_node = ""


class SlurmSpawner(GPUSpawnerMixin, SlurmSpawnerBase):
    """gpupool's Slurm spawner: the allocation's gres on the allocation's node, charged to the
    team's Slurm account, tagged for the hub (see the module's docstring)."""

    async def start(self) -> Any:
        self.code_account()  # before any allocation: refuse at once, naming what to do
        return await super().start()

    def slurm_request(self) -> tuple[str, str, str]:
        allocation = self.gpupool_allocation
        if allocation is None:
            return "", "", ""
        gres = gres_request(allocation, self.gpupool.inventory, gres_types_of(self.gres_models))
        return gres, allocation.node or "", allocation.team

    def slurm_tag(self) -> str:
        return str(Tag(self.gpupool.hub_marker, "server", self.gpupool_allocation_id))
