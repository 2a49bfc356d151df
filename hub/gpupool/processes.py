"""This hub's processes as reconciliation sees them: what each claims, read from ``/proc``
(:mod:`gpupool.procfs`), and stopping them.

Vocabulary
- *marker*: ``GPUPOOL_HUB=<Pool.hub_marker>`` (:data:`MARKER`), in the environment of every
  server this hub starts and so of everything a server starts. A *scan* (:func:`scan`) keeps only
  processes with this hub's marker: another hub's, another test run's or anyone else's are never
  read as this hub's.
- *claim*: what a process says it holds, as a :class:`gpupool.core.reconcile.Proc`:
  ``GPUPOOL_ALLOCATION`` or ``GPUPOOL_JOB``, ``GPUPOOL_OFFER``, ``GPUPOOL_TEAM`` and
  ``CUDA_VISIBLE_DEVICES``.
- *same*: a process read earlier is still the very process (pid and start time), not a recycled
  pid.

Contract: only the processes :func:`stoppable` lets through are signalled: never pid 1, the
hub's own process group or a process running as root; and a process is signalled only while it is
the same. A stop sends SIGTERM to the process group when its leader is among those stopped (else
to the process), then SIGKILL after the grace.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence

from gpupool.core.reconcile import Proc
from gpupool.procfs import boot_time, environ, parse_environ, process_start, stat_fields, with_item

MARKER = "GPUPOOL_HUB"

Log = logging.Logger | logging.LoggerAdapter[logging.Logger]


def read_process(pid: int, env: Mapping[str, str] | None = None) -> Proc | None:
    """What process ``pid`` claims, from its environment (``None`` if gone or unreadable)."""
    fields = stat_fields(pid)
    if env is None:
        env = environ(pid)
    if fields is None or env is None or fields[0] in ("Z", "X"):
        return None
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    start = int(fields[19])
    visible = tuple(d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip())
    return Proc(
        pid=pid,
        pgid=int(fields[2]),
        uid=uid,
        start=start,
        allocation=env.get("GPUPOOL_ALLOCATION", ""),
        job=env.get("GPUPOOL_JOB", ""),
        offer=env.get("GPUPOOL_OFFER", ""),
        team=env.get("GPUPOOL_TEAM", ""),
        visible=visible,
        started_at=boot_time() + start / os.sysconf("SC_CLK_TCK"),
    )


def scan(marker: str) -> list[Proc]:
    """Every live process whose environment carries ``GPUPOOL_HUB=<marker>``."""
    found = []
    for pid, items in with_item(f"{MARKER}={marker}"):
        proc = read_process(pid, parse_environ(items))
        if proc is not None:
            found.append(proc)
    return found


def same(p: Proc) -> bool:
    """Whether ``p`` is still the very process it was when read (not gone, not a recycled pid)."""
    return p.start is not None and process_start(p.pid) == p.start


def server_alive(pid: int, start: int | None, allocation: str) -> bool:
    """Whether a local server JupyterHub records is the live process ``pid``: with the start
    time its state saved, or (a state from before they were saved) a process whose
    environment names its allocation (when readable)."""
    now = process_start(pid)
    if now is None:
        return False
    if start is not None:
        return now == start
    env = environ(pid)
    if env is None or not allocation:
        return True
    return env.get("GPUPOOL_ALLOCATION") == allocation


def stoppable(procs: Sequence[Proc], log: Log, news: Callable[[str], bool]) -> list[Proc]:
    """The processes that may be signalled: never root, pid 1 or the hub's own group (each
    refusal is logged when ``news(message)`` says it is new)."""
    hub = {os.getpid(), os.getpgrp()}
    ok = []
    for p in procs:
        if p.uid == 0 or p.pid == 1 or p.pid in hub or p.pgid in hub:
            message = (
                f"process {p.pid} was not stopped: it runs as root or in the hub's process "
                "group (user code never does)"
            )
            if news(message):
                log.error("gpupool: %s", message)
            continue
        ok.append(p)
    return ok


def send(procs: Sequence[Proc], sig: signal.Signals, log: Log) -> None:
    """``sig`` to each process's group when the group's leader is one of them (and still the
    same process), else to the process alone."""
    leaders = {p.pid: p for p in procs}
    groups: set[int] = set()
    for p in procs:
        if not same(p):
            continue
        leader = leaders.get(p.pgid)
        try:
            if leader is not None and same(leader):
                if p.pgid not in groups:
                    groups.add(p.pgid)
                    os.killpg(p.pgid, sig)
            else:
                os.kill(p.pid, sig)
        except ProcessLookupError:
            pass
        except PermissionError:
            log.error("gpupool: not allowed to signal process %d (%s)", p.pid, sig.name)


def stop_now(procs: Sequence[Proc], grace: float, log: Log) -> None:
    """Stop ``procs`` (already :func:`stoppable`) and return once they are gone: SIGTERM, then
    SIGKILL after ``grace`` seconds (blocking: for the pass at start)."""
    if not procs:
        return
    send(procs, signal.SIGTERM, log)
    if wait_gone(procs, grace):
        return
    send(procs, signal.SIGKILL, log)
    if not wait_gone(procs, 10):
        left = ", ".join(str(p.pid) for p in procs if same(p))
        log.error("gpupool: processes %s survived SIGKILL for 10 s", left)


async def stop_soon(procs: Sequence[Proc], grace: float, log: Log) -> None:
    """:func:`stop_now` without blocking the event loop (and without waiting after SIGKILL)."""
    if not procs:
        return
    send(procs, signal.SIGTERM, log)
    deadline = time.monotonic() + grace
    while any(same(p) for p in procs) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if any(same(p) for p in procs):
        send(procs, signal.SIGKILL, log)


def wait_gone(procs: Sequence[Proc], timeout: float) -> bool:
    """Wait until none of ``procs`` is alive (a zombie is not); ``False`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(same(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
