"""One ``squeue`` for every server and job: the shared poller.

Vocabulary
- *snapshot*: every job the controller listed in one ``squeue --json --all`` call, with the
  monotonic time the call *started* (what it cannot have missed) and whether it answered.
- *fresh for t*: a snapshot whose call started after ``t``; a job submitted before ``t`` and
  missing from it is really gone (ended more than ``MinJobAge`` ago, or cancelled and purged),
  while one missing from an older snapshot may just be newer than it.
- *unknown*: the last call failed (timeout, controller down): consumers keep what they knew and
  read nothing as "stopped" (:class:`gpupool.slurm.commands.SlurmUnavailable`).

Contract: one call at a time, at most one per ``min_interval`` seconds however many consumers
ask (:meth:`fresh` kicks the loop and waits), otherwise one per ``period`` seconds, jittered by
``± jitter`` of it so that hubs do not beat in step. Listeners (:attr:`on_snapshot`) hear each
answered snapshot, in the event loop. Seams: ``commands`` (Slurm), ``clock`` (monotonic), and
``random`` (the jitter).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gpupool.background import Periodic
from gpupool.slurm.commands import SlurmCommands, SlurmUnavailable
from gpupool.slurm.parse import SlurmJob

log = logging.getLogger("gpupool")


@dataclass(frozen=True)
class Snapshot:
    jobs: dict[int, SlurmJob] = field(default_factory=dict)
    started: float = float("-inf")
    """When the call that made it started (monotonic seconds)."""
    answered: bool = False
    failure: str = ""


class SlurmPoller:
    def __init__(
        self,
        commands: SlurmCommands,
        *,
        period: float = 10.0,
        min_interval: float = 1.0,
        jitter: float = 0.2,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.commands = commands
        self.period = period
        self.min_interval = min_interval
        self.jitter = jitter
        self.log = logger
        self.clock = clock
        self.rand = rand
        self.last = Snapshot()
        """The newest snapshot the controller answered (jobs as last known)."""
        self.failure = ""
        """Why the last call failed; ``""`` when it answered."""
        self.on_snapshot: list[Callable[[Snapshot], object]] = []
        self._changed = asyncio.Condition()
        self._loop = Periodic("Slurm poll", self.refresh, self._next_period, logger)
        self._last_call = float("-inf")

    # -- what consumers read -----------------------------------------------------------------
    @property
    def known(self) -> bool:
        """Whether the last call answered."""
        return not self.failure and self.last.answered

    def job(self, job_id: int) -> SlurmJob | None:
        """The job as last listed, ``None`` when the last answered snapshot does not list it;
        :class:`SlurmUnavailable` while the controller does not answer."""
        if not self.known:
            raise SlurmUnavailable(self.failure or "Slurm's controller has not answered yet")
        return self.last.jobs.get(job_id)

    async def fresh(self, since: float, timeout: float | None = None) -> Snapshot:
        """A snapshot fresh for ``since`` (monotonic), asking for one now; raises
        :class:`SlurmUnavailable` when that call fails, ``TimeoutError`` after ``timeout``."""
        async with asyncio.timeout(timeout):
            async with self._changed:
                while self.last.started < since or not self.known:
                    if self.failure and self._failed_at >= since:
                        raise SlurmUnavailable(self.failure)
                    self.kick()
                    await self._changed.wait()
                return self.last

    async def changed(self, timeout: float) -> None:
        """Return after the next call (answered or not), or after ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout), self._changed:
                await self._changed.wait()
        except TimeoutError:
            pass

    # -- the loop ----------------------------------------------------------------------------
    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    def kick(self) -> None:
        if self._loop.running:
            self._loop.kick()
        else:  # not started (a test, a hub without its loop yet): one call now
            asyncio.get_running_loop().create_task(self.refresh())

    def _next_period(self) -> float:
        return max(self.min_interval, self.period * (1 + self.jitter * (2 * self.rand() - 1)))

    _failed_at = float("-inf")
    _running = False

    async def refresh(self) -> None:
        """One ``squeue`` call (waiting out ``min_interval`` since the last one; a call already
        running is not doubled: its result serves)."""
        if self._running:
            return
        self._running = True
        try:
            wait = self._last_call + self.min_interval - self.clock()
            if wait > 0:
                await asyncio.sleep(wait)  # rate limit, not synchronisation
            started = self._last_call = self.clock()
            try:
                jobs = await self.commands.squeue()
            except SlurmUnavailable as e:
                if not self.failure:
                    self.log.warning("gpupool: Slurm's jobs unknown: %s", e.message)
                self.failure = e.message
                self._failed_at = started
            else:
                if self.failure:
                    self.log.info("gpupool: Slurm's controller answers again")
                self.failure = ""
                self.last = Snapshot({j.job_id: j for j in jobs}, started, True)
                for listener in self.on_snapshot:
                    try:
                        listener(self.last)
                    except Exception:
                        self.log.exception("gpupool: a Slurm snapshot listener failed")
        finally:
            self._running = False
        async with self._changed:
            self._changed.notify_all()
