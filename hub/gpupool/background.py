"""The hub's background loops: one task each, started in the running event loop, stopped cleanly.

Vocabulary
- *pass*: one call of a loop's ``run`` coroutine function. An exception it raises is logged
  (``gpupool: <what> failed``) and the loop goes on; a cancellation ends the loop.
- *period*: seconds from the end of one pass to the start of the next, read before each wait (a
  setting changed while the loop runs applies from the next wait).
- *kick*: a pass now rather than at the end of the period; kicks that come while a pass runs
  make one more pass, not one each.
- *first*: what the loop awaits once before its first pass (e.g. the hub's REST API answering).

Contract: :meth:`Periodic.stop` cancels the task and returns once it has ended; a pass in
progress is cancelled where it waits. Waits are ``asyncio.timeout`` around ``Event.wait``, never
``asyncio.wait_for``, which on Python 3.11 can swallow a cancel that arrives just as the event is
set (CPython #86296) and leave the loop running after ``stop()``. The loop's time is the event
loop's own (no clock seam: the services' clocks date what they observe, not when they look).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable


class Periodic:
    """Runs ``run`` every ``period()`` seconds, or sooner when kicked, in one task."""

    def __init__(
        self,
        what: str,
        run: Callable[[], Awaitable[object]],
        period: Callable[[], float],
        log: logging.Logger | logging.LoggerAdapter[logging.Logger],
        *,
        at_once: bool = True,
        first: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        """``what``: the pass in words, for the log and the task's name (``"share watch
        pass"``); ``at_once``: the first pass runs at start rather than after one period."""
        self.what = what
        self.run = run
        self.period = period
        self.log = log
        self.at_once = at_once
        self.first = first
        self.task: asyncio.Task[None] | None = None
        self._kicked = asyncio.Event()

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self) -> None:
        """Start the loop in the running event loop (once: a running loop is left alone)."""
        if self.running:
            return
        kicked, self._kicked = self._kicked.is_set(), asyncio.Event()  # one of this event loop
        if kicked or self.at_once:
            self._kicked.set()
        loop = asyncio.get_running_loop()
        self.task = loop.create_task(self._loop(), name=f"gpupool: {self.what}")

    def kick(self) -> None:
        """Ask for a pass soon (before start: the first pass runs at once)."""
        self._kicked.set()

    def cancel(self) -> None:
        """Cancel the loop without waiting for it to end (from synchronous code)."""
        if self.task is not None:
            self.task.cancel()

    async def stop(self) -> None:
        """Cancel the loop and return once it has ended."""
        task, self.task = self.task, None
        if task is not None:
            await stop_tasks([task], self.log)

    async def _loop(self) -> None:
        if self.first is not None:
            await self.first()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.period()):
                    await self._kicked.wait()
            self._kicked.clear()
            try:
                await self.run()
            except Exception:
                self.log.exception("gpupool: %s failed", self.what)


async def stop_tasks(
    tasks: Iterable[asyncio.Task[None]],
    log: logging.Logger | logging.LoggerAdapter[logging.Logger],
) -> None:
    """Cancel ``tasks`` and return once each has ended (no timeout hides one that would not);
    a task that had failed (not cancelled) is logged. A cancel of the caller is not swallowed."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.error("gpupool: task %s had failed: %r", task.get_name(), task.exception())
