"""The share watch: a loop in the hub that keeps shares of GPUs without MIG within their memory.

Vocabulary
- *watched share*: a notebook or job allocation holding a share (``Device.share_milli``) of a
  GPU without MPS (see :mod:`gpupool.shares`; under MPS the driver enforces the cap itself), on
  a node whose NVML the pool's :class:`~gpupool.monitors.activity.DeviceMonitor` reads (this
  machine, or the simulated NVML).
- *reading*: per-process GPU memory of the shared GPUs, ``nvmlDeviceGetComputeRunningProcesses``
  (``pid``, ``usedGpuMemory``), through the monitor's NVML (:meth:`DeviceMonitor.processes`).
- *holder of a process*: every process on a share's GPU counts for the share it holds it under
  (:func:`gpupool.core.holders.holder_of`): in the per-user mode every process of the share's
  user's own account (a kernel, a terminal's command, a job it started outside the hub); in
  the shared mode one of the shared account that this hub's marker ``GPUPOOL_HUB`` and
  ``GPUPOOL_ALLOCATION=<id>`` (a server, its kernels) or ``GPUPOOL_JOB=<job id>`` (a job's
  ranks) name, in its environment or its parents' (``/proc``, :mod:`gpupool.procfs`). Every
  other process on the GPU holds none of it: the device watch's (:mod:`.device_watch`), which
  warns and stops user code and keeps the GPU from new shares while something else uses it.
- *over*: the processes of one share use more than its cap (summed over them, in MiB). The
  first look that finds it *warns*: the user sees it in JupyterLab (the same channel as the idle
  reclaimer's warning: ``idle.warning`` of ``GET /hub/api/gpupool/allocations``, which the lab's
  status bar shows and notifies), the admin page lists it, and it is logged and counted. A share
  under its cap again is forgiven. A share still over ``ShareEnforcement.grace_minutes`` after
  the warning is *stopped*: a notebook's server through JupyterHub's REST API (as the reclaimer
  stops one, with its service's token), a job cancelled by the job manager with the reason.
  Every warning and stop goes into ``gpupool_share_overuse_total{kind, action}`` and into the
  admin page's list of recent ones, with the reason.

Seams: the clock (the pool's), how processes are read (``read``, and ``facts``: a process's
account and claim) and how an allocation is stopped (``stop``), so tests drive it against the
simulated NVML with real processes.

Contract: one look never fails the loop (errors are logged); a device NVML cannot read, or a
process whose memory NVML does not report (``usedGpuMemory`` not available), counts as nothing
(said once). ``/proc`` is read in a worker thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from tornado.httpclient import HTTPClientError

from gpupool import metrics
from gpupool.background import Periodic
from gpupool.clock import iso
from gpupool.core.holders import Holding, OnDevice, holder_of
from gpupool.core.ledger import Allocation
from gpupool.hub.hub_api import reply_message
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool.procfs import claim, uids
from gpupool.shares import ShareEnforcement, cap_mib, share_devices
from gpupool.usercode import CodeAccounts, code_accounts

MIB = 1 << 20
EVENTS_KEPT = 50
"""How many recent warnings and stops the admin page lists."""

Reading = dict[str, list[tuple[int, int | None]]]
"""GPU UUID -> its compute processes as ``(pid, used bytes or None)``."""


@dataclass(frozen=True)
class Over:
    """A share over its cap: since when, the last reading, and when it will be stopped."""

    since: float
    used_mib: int
    cap_mib: int
    gpu: str
    stop_at: float


@dataclass(frozen=True)
class Event:
    """One warning or stop, for the admin page."""

    at: float
    action: str
    kind: str
    ref: str
    user: str
    team: str
    gpu: str
    used_mib: int
    cap_mib: int
    reason: str


class ShareWatch:
    """Watches shares' GPU memory and warns, then stops, those over their cap (module doc)."""

    def __init__(
        self,
        pool: Pool,
        enforcement: ShareEnforcement,
        *,
        stop: Callable[[Allocation, str], Awaitable[None]],
        log: logging.Logger,
        accounts: CodeAccounts,
        read: Callable[[str, list[str]], Reading] | None = None,
        facts: Callable[[int], tuple[int, str] | None] | None = None,
    ) -> None:
        """``stop(allocation, reason)`` stops a notebook's server or cancels a job;
        ``accounts``: who runs user code; ``read`` and ``facts`` (a process's account and claim,
        ``None`` when gone) default to NVML through the pool's monitor and to ``/proc``."""
        self.pool = pool
        self.enforcement = enforcement
        self.stop = stop
        self.log = log
        self.accounts = accounts
        self.read = read or pool.monitor.processes
        self.facts = facts or self._facts_from_proc
        self.over: dict[str, Over] = {}
        self.stopped: set[str] = set()
        """Allocations this watch stopped, until the pool releases them (never stopped twice)."""
        self.events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self._said: set[str] = set()
        self.background = Periodic(
            "share watch pass", self.look, lambda: self.enforcement.period, log
        )

    @property
    def grace(self) -> float:
        return self.enforcement.grace_minutes * 60

    def now(self) -> float:
        return float(self.pool.clock().timestamp())

    # -- what others read ----------------------------------------------------------------------
    def warning(self, allocation: Allocation) -> dict[str, str] | None:
        """The warning of a share over its cap, in the idle reclaimer's shape (``reclaim_at``,
        ``action``, ``reason`` ``memory``, ``message``), or ``None``."""
        over = self.over.get(allocation.id)
        if over is None:
            return None
        return {
            "reclaim_at": iso(over.stop_at) or "",
            "action": "stop",
            "reason": "memory",
            "message": warning_message(allocation, over),
        }

    def view(self) -> dict[str, Any]:
        """What the admin page shows: how shares are enforced and the recent warnings and stops,
        newest first."""
        return {
            "grace_minutes": f"{self.enforcement.grace_minutes:g}",
            "mps": list(self.enforcement.mps),
            "events": [
                {
                    **e.__dict__,
                    "when": datetime.fromtimestamp(e.at, UTC).strftime("%Y-%m-%d %H:%M UTC"),
                }
                for e in reversed(self.events)
            ],
        }

    # -- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        self.background.start()

    async def close(self) -> None:
        await self.background.stop()

    def watched(self) -> list[Allocation]:
        """The allocations with a share of a GPU without MPS, on nodes whose NVML is read."""
        gpus = {g.uuid: g for g in self.pool.inventory.gpus}
        out = []
        for a in list(self.pool.ledger.allocations.values()):
            shares = share_devices(a)
            if not shares or not self.pool.monitor.can_read(a.node):
                continue
            if any(d.gpu in gpus and not self.enforcement.uses_mps(gpus[d.gpu]) for d in shares):
                out.append(a)
        return out

    async def look(self) -> list[tuple[Allocation, str]]:
        """One pass; returns what was warned or stopped (``(allocation, "warn"|"stop")``)."""
        now = self.now()
        self.stopped &= set(self.pool.ledger.allocations)
        watched = [a for a in self.watched() if a.id not in self.stopped]
        for gone in set(self.over) - {a.id for a in watched}:
            del self.over[gone]
        if not watched:
            return []
        gpus = {g.uuid: g for g in self.pool.inventory.gpus}
        by_node: dict[str, set[str]] = defaultdict(set)
        for a in watched:
            by_node[a.node or ""].update(d.gpu for d in share_devices(a))
        readings: Reading = {}
        for node, uuids in by_node.items():
            readings.update(self.read(node, sorted(uuids)))
        pids = sorted({pid for procs in readings.values() for pid, _ in procs})
        facts = await asyncio.to_thread(lambda: {pid: self.facts(pid) for pid in pids})
        holdings: dict[str, list[Holding]] = defaultdict(list)
        for held in list(self.pool.ledger.allocations.values()):
            for d in share_devices(held):
                holdings[d.gpu].append(self.accounts.holding(held))
        done: list[tuple[Allocation, str]] = []
        for a in watched:
            used, cap, gpu = 0, 0, ""
            for d in share_devices(a):
                g = gpus.get(d.gpu)
                if g is None or self.enforcement.uses_mps(g):
                    continue
                gpu = gpu or g.uuid
                cap += cap_mib(g.memory_mib, d.share_milli or 0)
                for pid, used_bytes in readings.get(d.gpu, []):
                    found = facts.get(pid)
                    process = OnDevice(pid, d.gpu, found[0], claim=found[1]) if found else None
                    if process and holder_of(process, holdings[d.gpu]) == a.id:
                        used += self._bytes(pid, used_bytes)
            used_mib = used // MIB
            before = self.over.get(a.id)
            if used_mib <= cap:
                if before is not None:
                    self.log.info(
                        "gpupool: %s is back within its share (%d of %d MiB on %s)",
                        a.ref, used_mib, cap, gpu,
                    )  # fmt: skip
                    del self.over[a.id]
                continue
            if before is None:
                over = Over(now, used_mib, cap, gpu, now + self.grace)
                self.over[a.id] = over
                self._record(a, over, "warn", now, warning_message(a, over))
                done.append((a, "warn"))
                if over.stop_at > now:
                    continue
            else:
                over = Over(before.since, used_mib, cap, gpu, before.stop_at)
                self.over[a.id] = over
                if now < over.stop_at:
                    continue
            reason = stop_reason(over, self.enforcement.grace_minutes)
            try:
                await self.stop(a, reason)
            except Exception as e:
                self.log.error("gpupool: could not stop %s (over its share): %s", a.ref, e)
                continue
            self.over.pop(a.id, None)
            self.stopped.add(a.id)
            self._record(a, over, "stop", now, reason)
            done.append((a, "stop"))
        return done

    def _bytes(self, pid: int, used: int | None) -> int:
        if used is None:
            self._once(
                "unknown-memory",
                f"NVML does not report the GPU memory of process {pid} (a container without "
                "the host's PID namespace, or no permission): shares' memory use may be missed",
            )
            return 0
        return used

    def _record(self, a: Allocation, over: Over, action: str, now: float, text: str) -> None:
        metrics.SHARE_OVERUSE.labels(kind=a.kind, action=action).inc()
        log = self.log.warning if action == "stop" else self.log.info
        log(
            "gpupool: %s %s of %s (%s, team %s): %d MiB of GPU memory on %s, over its share of "
            "%d MiB",
            "stopping" if action == "stop" else "warned", a.kind, a.ref, a.user, a.team,
            over.used_mib, over.gpu, over.cap_mib,
        )  # fmt: skip
        self.events.append(
            Event(
                now, action, a.kind, a.ref, a.user, a.team, over.gpu, over.used_mib,
                over.cap_mib, text,
            )
        )  # fmt: skip

    def _once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log.warning("gpupool: %s", message)

    # -- the default seam -----------------------------------------------------------------------
    def _facts_from_proc(self, pid: int) -> tuple[int, str] | None:
        """The account (0 when its real or effective uid is root) and claim of ``pid``."""
        ids = uids(pid)
        if ids is None:
            return None
        return (0 if 0 in ids else ids[0]), claim(pid, self.pool.hub_marker)


def _clock(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%H:%M UTC")


def warning_message(allocation: Allocation, over: Over) -> str:
    what = "server" if allocation.kind == "notebook" else "job"
    then = "stopped" if allocation.kind == "notebook" else "cancelled"
    return (
        f"This {what}'s processes use {over.used_mib} MiB of GPU memory on {over.gpu}, more than "
        f"its share ({allocation.offer}: {over.cap_mib} MiB), which the GPU's other users need. "
        f"Unless they use less, the {what} will be {then} at {_clock(over.stop_at)}. Free GPU "
        "memory now (delete tensors, then torch.cuda.empty_cache()) or restart the kernel, and "
        "save your work: unsaved changes and kernel state are lost when the server stops."
    )


def stop_reason(over: Over, grace_minutes: float) -> str:
    return (
        f"{over.used_mib} MiB of GPU memory on {over.gpu}, over the share's {over.cap_mib} MiB "
        f"for more than {grace_minutes:g} min after a warning"
    )


def stopper(
    reclaimer: IdleReclaimer, jobs: JobManager, log: logging.Logger
) -> Callable[[Allocation, str], Awaitable[None]]:
    """How the watch stops what is over its share: a notebook's server through JupyterHub's
    REST API with the reclaimer's service token (which may stop servers), a job through the job
    manager (its reason says why)."""

    async def stop(allocation: Allocation, reason: str) -> None:
        if allocation.kind == "job":
            await jobs.cancel(allocation.ref, f"gpupool (over its GPU share: {reason})", True)
            return
        if not reclaimer.api_url:
            raise RuntimeError("no URL of JupyterHub's REST API to stop the server with")
        user, _, server = allocation.ref.partition("/")
        try:
            answered = await reclaimer.hub.stop_server(user, server)
        except HTTPClientError as e:
            raise RuntimeError(reply_message(e)) from None
        log.warning(
            "gpupool: %s %s: %s",
            "stopped" if answered else "stopping (JupyterHub carries on with it)",
            allocation.ref,
            reason,
        )

    return stop


def build_watch(
    pool: Pool,
    reclaimer: IdleReclaimer,
    jobs: JobManager,
    config: Any,
    log: logging.Logger,
) -> ShareWatch:
    """The hub's share watch (settings ``c.ShareEnforcement``, checked now: a bad value stops
    the hub naming the key), its warnings shown through the reclaimer's ``idle.warning``."""
    from gpupool.shares import check_mps_accounts

    enforcement = ShareEnforcement(config=config, log=log)
    check_mps_accounts(enforcement, config)
    accounts = code_accounts(config, jobs.backend)
    stop = stopper(reclaimer, jobs, log)
    watch = ShareWatch(pool, enforcement, stop=stop, log=log, accounts=accounts)
    reclaimer.warnings.append(watch.warning)
    return watch
