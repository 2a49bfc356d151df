"""Reading live processes from ``/proc``: the one place gpupool looks at other processes.

Vocabulary
- *start*: when a process started, in clock ticks since boot (``/proc/<pid>/stat`` field 22).
  A pid with the same start is the very same process; a recycled pid has another start. A
  zombie (or a pid that is gone) has no start (``None``): it holds nothing any more.
- *environment item*: one ``KEY=value`` entry of ``/proc/<pid>/environ``. gpupool finds what it
  started by items it put there (``GPUPOOL_JOB=<id>``, ``GPUPOOL_HUB=<marker>``).
- *account* of a process: its real and effective uids (``/proc/<pid>/status``; the owner of
  ``/proc/<pid>`` is root for a process that made itself non-dumpable, whoever runs it).
- *claim*: the ``GPUPOOL_ALLOCATION`` (or else ``GPUPOOL_JOB``) of the process, or of its nearest
  parent, whose environment carries a given hub's marker.

Contract: every function reads, never signals, and answers "gone" (``None`` or leaving the pid
out) for a process that vanishes or cannot be read while it looks. A scan of ``/proc`` reads
every process's environment: call it from a worker thread (``asyncio.to_thread``) when the event
loop is serving requests.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path


def stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, … (``None`` if gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``None`` if it is gone or a zombie)."""
    fields = stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def boot_time() -> float:
    """The machine's boot time, seconds since the epoch (turns a start into a date)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def parse_environ(items: Iterable[bytes]) -> dict[str, str]:
    """``KEY=value`` items (``/proc/<pid>/environ`` split at NUL) as a dict."""
    pairs = (i.decode(errors="replace").partition("=") for i in items if b"=" in i)
    return {k: v for k, _, v in pairs}


def environ(pid: int) -> dict[str, str] | None:
    """The environment ``pid`` was started with (``None`` if gone or not readable)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return parse_environ(raw.split(b"\0"))


def pids() -> list[int]:
    """Every process id in ``/proc`` now (any of them may be gone by the time it is read)."""
    return [int(entry.name) for entry in os.scandir("/proc") if entry.name.isdigit()]


def environ_items(pid: int) -> list[bytes] | None:
    """The environment items of ``pid``, undecoded (``None`` if gone or not readable): cheaper
    than :func:`environ` when most processes are only tested for one item."""
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None


def cmdline(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces (``""`` if gone or a zombie):
    unlike :func:`command`, not cut at 15 characters, and a script run by its interpreter is
    named (``python /usr/bin/jupyterhub-singleuser``)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def with_item(item: str, uid: int | None = None) -> list[tuple[int, list[bytes]]]:
    """Every live process whose environment holds ``item`` exactly (``KEY=value``), with its
    environment items; with ``uid``, only processes of that account (another account cannot
    claim what gpupool marked by copying the marker)."""
    want = item.encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if uid is not None and entry.stat().st_uid != uid:
                continue
            raw = Path(f"/proc/{entry.name}/environ").read_bytes()
        except OSError:
            continue
        items = raw.split(b"\0")
        if want in items:
            found.append((int(entry.name), items))
    return found


def uids(pid: int) -> tuple[int, int] | None:
    """The real and effective uid of ``pid`` (``None`` if gone or unreadable)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            return int(fields[1]), int(fields[2])
    return None


def command(pid: int) -> str:
    """The command name of ``pid`` (``/proc/<pid>/comm``; ``""`` if gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


ANCESTORS = 64
"""How far up a process's parents :func:`claim` looks for gpupool's variables."""


def claim(pid: int, marker: str) -> str:
    """What ``pid``, or its nearest parent whose environment carries ``GPUPOOL_HUB=<marker>``,
    belongs to: its ``GPUPOOL_ALLOCATION``, else its ``GPUPOOL_JOB`` (``""``: none)."""
    for _ in range(ANCESTORS):
        env = environ(pid)
        if env is not None and env.get("GPUPOOL_HUB") == marker:
            found = env.get("GPUPOOL_ALLOCATION") or env.get("GPUPOOL_JOB")
            if found:
                return found
        fields = stat_fields(pid)
        if fields is None or int(fields[1]) <= 1:
            return ""
        pid = int(fields[1])
    return ""
