"""Noticing that JupyterHub shuts down, before it frees the servers' GPUs.

Why a log filter: JupyterHub offers extensions no shutdown hook. On SIGTERM or SIGINT it logs
``Received signal SIGTERM, initiating shutdown...`` (``Initiating shutdown...`` from ``stop()``),
then stops every server (``cleanup_servers``), whose GPUs come back to the pool, and only then
cancels every task. A job manager that saw those GPUs come back would start a queued job in a
hub that is going away. The line JupyterHub logs first, from the signal's own callback, is the
only hook there is: :class:`ShutdownWatch`, a filter on the ``JupyterHub`` logger, calls its
callbacks once, synchronously, when it passes. ``tests/hub/test_shutdown.py`` fails if JupyterHub
stops logging it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

_LINES = ("initiating shutdown", "Initiating shutdown")


class ShutdownWatch(logging.Filter):
    """Calls ``callbacks`` once, when JupyterHub logs that it begins to shut down."""

    def __init__(self, callbacks: list[Callable[[], None]]) -> None:
        super().__init__()
        self.callbacks = callbacks
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.seen and isinstance(record.msg, str) and record.msg.endswith(_suffixes()):
            self.seen = True
            for callback in self.callbacks:
                callback()
        return True


def _suffixes() -> tuple[str, ...]:
    return tuple(f"{line}..." for line in _LINES)


def watch(logger: logging.Logger, callback: Callable[[], None]) -> None:
    """Call ``callback`` when JupyterHub, logging on ``logger``, begins to shut down.

    ``callback`` is called synchronously, inside the logging call: a plain function that
    starts what must happen (cancels a task, schedules a stop), never a coroutine function,
    whose coroutine nobody would await (a ``TypeError`` here)."""
    if inspect.iscoroutinefunction(callback):
        raise TypeError(
            f"shutdown.watch({callback!r}): a coroutine function would never be awaited; pass "
            "a plain function that schedules it"
        )
    for f in logger.filters:
        if isinstance(f, ShutdownWatch):
            f.callbacks.append(callback)
            return
    logger.addFilter(ShutdownWatch([callback]))
