"""The device watch: a loop in the hub that keeps every device of the pool to its holders.

Vocabulary (what a process on a device is, *held*, *stray*, *outside*, *unknown*, and *outside
use*: :mod:`gpupool.core.holders`)
- *watched device*: a GPU without MIG (held whole, shared, or free) or a MIG instance (the
  inventory's and those made for allocations), on a node whose NVML the pool's monitor reads.
- *look*: one pass. The processes NVML reports on every watched device
  (:meth:`~gpupool.monitors.activity.DeviceMonitor.processes`), each read from ``/proc``
  (its account and claim, in a worker thread), counted for a holder or not; the accounts of the
  others looked up (in the per-user mode: is it a hub user's? ``GET /users/<name>`` of
  JupyterHub's REST API, as the reclaimer's service); then the pool told which devices are in
  outside use (:meth:`gpupool.pool.Pool.set_outside_use`): nothing is handed out on them, with
  the reason in refusals and on the spawn page, until they are free again.
- *stray* under the ``stop`` policy: *warned* in the allocations its process belongs to (its
  claim's, or in the per-user mode its account's user's notebooks) through the reclaimer's
  warning channel (``idle.warning``, reason ``device``, which JupyterLab shows) and on the admin
  page; after ``grace_minutes`` sent SIGTERM, and SIGKILL at the next look if still there.
  Under ``log``: logged once, listed, left running.
- *outside* and *unknown* processes: never signalled; listed on the admin page.
- *policy* (``DeviceWatch.policy``): ``stop`` by default in the per-user mode; ``log`` by default
  in the shared mode, where every user's code runs as one account: any user can signal the
  others' processes there anyway, so stopping isolates no one, and when the hub is not root
  that account is the hub's own (the admin's), whose work outside the hub would be stopped.
- *MPS servers* (``nvidia-cuda-mps-server``, which NVML lists on a GPU whose shares run under
  MPS) serve the shares: never strays nor outside.

Seams: the clock (the pool's), NVML (the pool's monitor), ``/proc`` (``facts``) and the hub
users (``is_hub_user``), so tests drive it with real processes of real accounts on the
simulated NVML.

Contract: a process is signalled only while it is the very process looked at (pid and start),
only when its account runs user code, and never when it runs as root (real or effective uid),
is pid 1, or the hub's own process or group. One look never fails the loop (errors are logged).
An account the hub cannot ask about is not stopped, and that is said once while it lasts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pwd
import signal
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from tornado.httpclient import HTTPClientError
from traitlets import Float, Unicode, validate
from traitlets.config import LoggingConfigurable

from gpupool import metrics
from gpupool.background import Periodic
from gpupool.clock import iso
from gpupool.core.holders import Holding, Kind, OnDevice, classify, holder_of, outside_reasons
from gpupool.core.ledger import Allocation
from gpupool.declarations import ConfigError
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool.procfs import claim, command, process_start, uids
from gpupool.usercode import CodeAccounts, code_accounts

KEY = "DeviceWatch"
POLICIES = ("stop", "log")
MIB = 1 << 20
MPS_SERVER = "nvidia-cuda-mps-server"
EVENTS_KEPT = 50
"""How many recent warnings and stops the admin page lists."""


@dataclass(frozen=True)
class Facts:
    """What ``/proc`` says of a process: its account (0 if its real or effective uid is root),
    its start, its claim, and its command name."""

    uid: int
    start: int
    claim: str
    command: str


@dataclass
class Seen:
    """A process found on devices it does not hold, since ``since``; ``noted``: the kind it was
    last logged and counted as; a stray's ``stop_at`` (``None``: not to be stopped)."""

    process: OnDevice
    kind: Kind
    start: int
    since: float
    devices: tuple[str, ...] = ()
    owners: tuple[str, ...] = ()
    noted: str = ""
    stop_at: float | None = None
    signalled: float | None = None
    killed: bool = False


@dataclass(frozen=True)
class Event:
    """One warning, stop or note, for the admin page."""

    at: float
    action: str
    pid: int
    account: str
    device: str
    owners: str
    text: str
    when: str = field(default="")


class DeviceWatch(LoggingConfigurable):
    """Finds processes on devices they do not hold, and deals with them (module docstring)."""

    policy = Unicode(
        "",
        config=True,
        help="""What happens to a process of an account that runs user code (a hub user's, in
        the per-user mode; the shared account) found on a GPU or MIG instance it does not hold:
        ``stop`` (warned in JupyterLab and on the admin page, then stopped after
        ``grace_minutes``) or ``log`` (logged and listed on the admin page, left running).
        Processes of other accounts (root, daemons) are never stopped either way; the pool
        hands out nothing they use until they end. Default: ``stop`` in the per-user mode,
        ``log`` in the shared mode (one account for everyone: users are not isolated from
        each other there). Example: ``c.DeviceWatch.policy = "log"``""",
    )
    grace_minutes = Float(
        5.0,
        config=True,
        help="""Under the ``stop`` policy: minutes between the warning and SIGTERM to a process
        on a device it does not hold (SIGKILL follows at the next look if it is still there).
        Example: ``c.DeviceWatch.grace_minutes = 2``""",
    )
    period = Float(
        30.0,
        config=True,
        help="""Seconds between two looks at every process on the pool's devices. Example:
        ``c.DeviceWatch.period = 10``""",
    )

    @validate("policy")
    def _valid_policy(self, proposal: dict[str, Any]) -> str:
        value = proposal["value"]
        if value not in ("", *POLICIES):
            raise ConfigError(
                f"{KEY}.policy", f"must be one of {', '.join(POLICIES)}, not {value!r}"
            )
        return str(value)

    @validate("grace_minutes", "period")
    def _valid_number(self, proposal: dict[str, Any]) -> float:
        value, name = float(proposal["value"]), proposal["trait"].name
        if not value >= 0 or value == float("inf") or (name == "period" and value == 0):
            bound = "> 0" if name == "period" else ">= 0"
            raise ConfigError(f"{KEY}.{name}", f"must be a number {bound}, got {value!r}")
        return value

    def __init__(
        self,
        pool: Pool,
        accounts: CodeAccounts,
        *,
        is_hub_user: Callable[[str], Awaitable[bool | None]],
        facts: Callable[[int], Facts | None] | None = None,
        **kwargs: Any,
    ) -> None:
        """``is_hub_user(account name)``: ``None`` when it cannot be told (the hub did not
        answer); ``facts`` defaults to ``/proc``."""
        super().__init__(**kwargs)
        self.pool = pool
        self.accounts = accounts
        self.is_hub_user = is_hub_user
        self.facts = facts or self._facts_from_proc
        self.seen: dict[tuple[int, int], Seen] = {}
        """Processes on devices they do not hold, by pid and start, as of the last look."""
        self.events: deque[Event] = deque(maxlen=EVENTS_KEPT)
        self._said: set[str] = set()
        self.background = Periodic("device watch pass", self.look, lambda: self.period, self.log)

    @property
    def in_force(self) -> str:
        """The policy in force: the setting, or the mode's default."""
        return self.policy or ("stop" if self.accounts.per_user else "log")

    @property
    def why(self) -> str:
        if self.policy:
            return f"set ({KEY}.policy)"
        if self.accounts.per_user:
            return "the default in the per-user mode: each user's code runs as their own account"
        return (
            "the default in the shared mode: every user's code runs as one account, so users "
            "are not isolated from each other"
        )

    def now(self) -> float:
        return float(self.pool.clock().timestamp())

    # -- what others read ----------------------------------------------------------------------
    def warning(self, allocation: Allocation) -> dict[str, str] | None:
        """The warning for a stray of ``allocation`` due to be stopped, in the idle
        reclaimer's shape (``reclaim_at``, ``action``, ``reason`` ``device``, ``message``)."""
        due = [
            s
            for s in self.seen.values()
            if allocation.id in s.owners and s.stop_at is not None and s.signalled is None
        ]
        if not due:
            return None
        first = min(due, key=lambda s: s.stop_at or 0.0)
        return {
            "reclaim_at": iso(first.stop_at) or "",
            "action": "stop",
            "reason": "device",
            "message": warning_message(first),
        }

    def view(self) -> dict[str, Any]:
        """What the admin page shows: the policy in force and why, the processes on devices
        they do not hold, what is not handed out, and the recent warnings and stops."""
        return {
            "policy": self.in_force,
            "policy_why": self.why,
            "grace_minutes": f"{self.grace_minutes:g}",
            "watching": any(self.pool.monitor.can_read(n.name) for n in self.pool.inventory.nodes),
            "processes": [_row(s) for s in sorted(self.seen.values(), key=_order)],
            "closed": [self.pool.ledger.outside[d] for d in sorted(self.pool.ledger.outside)],
            "events": [
                replace(e, when=_clock(e.at, "%Y-%m-%d %H:%M UTC")).__dict__
                for e in reversed(self.events)
            ],
        }

    # -- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        self.background.start()

    async def close(self) -> None:
        await self.background.stop()

    def watched(self) -> dict[str, list[str]]:
        """Node -> the watched devices on it (see the vocabulary)."""
        made: dict[str, list[str]] = {}
        for a in list(self.pool.ledger.allocations.values()):
            for d in a.devices:
                if d.instance:
                    made.setdefault(d.gpu, []).append(d.instance)
        out: dict[str, list[str]] = {}
        for node in self.pool.inventory.nodes:
            if not self.pool.monitor.can_read(node.name):
                continue
            uuids: list[str] = []
            for g in node.gpus:
                if not g.mig_enabled:
                    uuids.append(g.uuid)
                else:
                    uuids += [i.uuid for i in g.instances if i.uuid] + made.get(g.uuid, [])
            out[node.name] = list(dict.fromkeys(uuids))
        return out

    def read(self) -> list[tuple[OnDevice, Facts]]:
        """Every process on a watched device, with what ``/proc`` says of it (NVML and
        ``/proc``: call from a worker thread). Gone processes and MPS servers are left out."""
        found = []
        for node, uuids in self.watched().items():
            for device, procs in self.pool.monitor.processes(node, uuids).items():
                for pid, used in procs:
                    facts = self.facts(pid)
                    if facts is None or facts.command == MPS_SERVER:
                        continue
                    mib = used // MIB if used is not None else None
                    process = OnDevice(pid, device, facts.uid, mib, facts.claim, _name(facts.uid))
                    found.append((process, facts))
        return found

    def close_now(self) -> None:
        """At the hub's start, before anything is handed out: the devices in use by processes
        that do not hold them are not handed out (no warning yet; the loop's looks do that)."""
        found = [p for p, _ in self.read()]
        holdings = self._holdings()
        self.pool.set_outside_use(
            outside_reasons(p for p in found if holder_of(p, holdings.get(p.device, ())) is None)
        )

    async def look(self) -> list[tuple[str, int, str]]:
        """One pass; returns what was done: ``(action, pid, device)``, action ``warn``,
        ``stop``, ``kill`` or ``log``."""
        now = self.now()
        found = await asyncio.to_thread(self.read)
        holdings = self._holdings()
        judged = [(p, f, holder_of(p, holdings.get(p.device, ()))) for p, f in found]
        code, unknown = await self._code_uids({p.uid for p, _, h in judged if h is None})
        kinds = [(p, f, classify(p, h, code, unknown)) for p, f, h in judged]
        self.pool.set_outside_use(outside_reasons(p for p, _, k in kinds if k != "held"))
        return self._act(now, [(p, f, k) for p, f, k in kinds if k != "held"])

    # -- deciding ------------------------------------------------------------------------------
    def _holdings(self) -> dict[str, list[Holding]]:
        """Device -> how processes count for the allocations holding it (a share GPU: every
        share on it; a GPU or MIG instance: its holder), as the ledger holds them now."""
        out: dict[str, list[Holding]] = {}
        for a in list(self.pool.ledger.allocations.values()):
            holding = self.accounts.holding(a)
            for d in a.devices:
                out.setdefault(d.visible_id, []).append(holding)
        return out

    async def _code_uids(self, uids: Iterable[int]) -> tuple[frozenset[int], frozenset[int]]:
        """Which of ``uids`` run user code, and which the hub could not tell about."""
        shared = self.accounts.shared_uids
        code, unknown = set(), set()
        for uid in sorted(set(uids) - {0}):
            if uid in shared:
                code.add(uid)
                continue
            name = _name(uid)
            if not self.accounts.per_user or name.startswith("#"):
                continue
            answer = await self.is_hub_user(name)
            if answer is None:
                unknown.add(uid)
                self._once(
                    f"unknown-{uid}",
                    f"could not tell whether the account {name} is a hub user's (JupyterHub's "
                    "REST API did not answer): its processes on devices they do not hold are "
                    "not stopped until it does",
                )
            else:
                self._said.discard(f"unknown-{uid}")
                if answer:
                    code.add(uid)
        return frozenset(code), frozenset(unknown)

    def _owners(self, p: OnDevice) -> tuple[str, ...]:
        """The allocations a stray belongs to, where its user is warned: its claim's (when it
        runs as that allocation's account; none when the claim is of an allocation released
        already: a server being stopped, whose processes are reconciliation's), else, in the
        per-user mode, its account's user's notebooks."""
        allocations = list(self.pool.ledger.allocations.values())
        mine = [a for a in allocations if self.accounts.holding(a).uid == p.uid]
        if p.claim:
            return tuple(a.id for a in mine if p.claim in (a.id, a.ref))
        return tuple(a.id for a in mine if a.kind == "notebook" and a.user == p.account)

    def _act(self, now: float, found: list[tuple[OnDevice, Facts, Kind]]) -> list[Any]:
        """Update what is seen (a process on several devices is one), then deal with each."""
        here: dict[tuple[int, int], Seen] = {}
        for p, facts, kind in found:
            key = (p.pid, facts.start)
            if key in here:
                here[key].devices += (p.device,)
                continue
            seen = self.seen.get(key) or Seen(p, kind, facts.start, now)
            seen.process, seen.kind, seen.devices = p, kind, (p.device,)
            here[key] = seen
        for key in self.seen.keys() - here.keys():
            gone = self.seen[key]
            self.log.info("gpupool: process %d no longer uses %s", key[0], ", ".join(gone.devices))
        self.seen = here
        done: list[tuple[str, int, str]] = []
        for seen in sorted(here.values(), key=_order):
            if seen.noted != seen.kind:
                seen.noted = seen.kind
                done += self._note(seen, now)
            if seen.kind == "stray" and seen.stop_at is not None and now >= seen.stop_at:
                done += self._stop(seen, now)
        return done

    def _note(self, s: Seen, now: float) -> list[tuple[str, int, str]]:
        """A process newly seen as what it is: counted, logged, and a stray warned (``stop``)
        or left running (``log``)."""
        p = s.process
        what = f"process {p.pid} of {p.account} on {', '.join(s.devices)}"
        if s.kind == "outside":
            metrics.DEVICE_MISUSE.labels(action="outside").inc()
            self._event(now, "outside", s, f"{what}: not user code, never stopped")
            return []
        if s.kind != "stray":
            return []
        s.owners = self._owners(p)
        if self.in_force == "log":
            text = f"{what}, which it does not hold: left running ({KEY}.policy is log)"
            action = "log"
        else:
            s.stop_at = now + self.grace_minutes * 60
            text = f"{what}, which it does not hold: warned, stopped at {_clock(s.stop_at)}"
            action = "warn"
        self.log.warning("gpupool: %s", text)
        self._event(now, action, s, text)
        metrics.DEVICE_MISUSE.labels(action=action).inc()
        return [(action, p.pid, s.devices[0])]

    def _stop(self, s: Seen, now: float) -> list[tuple[str, int, str]]:
        """SIGTERM to a stray past its grace; SIGKILL at a later look if it is still there."""
        p = s.process
        what = f"process {p.pid} of {p.account} on {', '.join(s.devices)}"
        if s.signalled is None and self._signal(s, signal.SIGTERM):
            s.signalled = now
            text = f"stopped {what} (SIGTERM): it did not leave the device after the warning"
            action = "stop"
        elif s.signalled is not None and now > s.signalled and not s.killed:
            if not self._signal(s, signal.SIGKILL):
                return []
            s.killed = True
            text = f"killed {what} (SIGKILL): SIGTERM did not end it"
            action = "kill"
        else:
            return []
        self.log.warning("gpupool: %s", text)
        self._event(now, action, s, text)
        metrics.DEVICE_MISUSE.labels(action=action).inc()
        return [(action, p.pid, s.devices[0])]

    def _signal(self, s: Seen, sig: signal.Signals) -> bool:
        """``sig`` to a stray's process, if it may be signalled (the module's contract)."""
        pid = s.process.pid
        ids = uids(pid)
        if (
            s.kind != "stray"
            or ids is None
            or 0 in ids
            or ids[0] != s.process.uid
            or pid in (1, os.getpid())
            or process_start(pid) != s.start
        ):
            return False
        try:
            if os.getpgid(pid) == os.getpgrp():
                return False
            os.kill(pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:
            self.log.error("gpupool: not allowed to signal process %d (%s)", pid, sig.name)
            return False
        return True

    def _event(self, now: float, action: str, s: Seen, text: str) -> None:
        owners = [self.pool.ledger.allocations.get(o) for o in s.owners if o]
        refs = ", ".join(a.ref for a in owners if a is not None)
        self.events.append(
            Event(now, action, s.process.pid, s.process.account, ", ".join(s.devices), refs, text)
        )

    def _once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.log.warning("gpupool: %s", message)

    # -- the default seam ----------------------------------------------------------------------
    def _facts_from_proc(self, pid: int) -> Facts | None:
        ids, start = uids(pid), process_start(pid)
        if ids is None or start is None:
            return None
        uid = 0 if 0 in ids else ids[0]
        return Facts(uid, start, claim(pid, self.pool.hub_marker), command(pid))


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"#{uid}"


def _order(s: Seen) -> tuple[float, int]:
    return (s.since, s.process.pid)


def _clock(ts: float, fmt: str = "%H:%M UTC") -> str:
    return datetime.fromtimestamp(ts, UTC).strftime(fmt)


def _row(s: Seen) -> dict[str, Any]:
    p = s.process
    if s.kind == "outside":
        state = "never stopped: not an account that runs user code"
    elif s.kind == "unknown":
        state = "not stopped: whether the account is a hub user's is not known yet"
    elif s.signalled is not None:
        state = "stopped (SIGTERM)" + (", then killed" if s.killed else "")
    elif s.stop_at is not None:
        state = f"warned; stopped at {_clock(s.stop_at)}"
    else:
        state = "left running (policy log)"
    return {
        "pid": p.pid,
        "account": p.account,
        "kind": s.kind,
        "device": ", ".join(s.devices),
        "used_mib": "" if p.used_mib is None else p.used_mib,
        "since": _clock(s.since, "%Y-%m-%d %H:%M UTC"),
        "state": state,
    }


def warning_message(s: Seen) -> str:
    devices = ", ".join(s.devices)
    return (
        f"Your process {s.process.pid} uses {devices}, which you were not given: "
        f"another user's GPU, or one nobody holds. It will be stopped at "
        f"{_clock(s.stop_at or 0.0)} unless it ends first. Use only the devices in "
        "CUDA_VISIBLE_DEVICES (do not change it in a notebook or a terminal)."
    )


def hub_users(
    reclaimer: IdleReclaimer,
) -> Callable[[str], Awaitable[bool | None]]:
    """Whether an account name is a hub user's, asked of JupyterHub's REST API
    (``GET /users/<name>``: 200 or 404) with the reclaimer's token (its ``read:servers`` scope
    may read a user); ``None`` when it does not answer so."""

    async def ask(name: str) -> bool | None:
        if not reclaimer.hub.api_url:
            return None
        try:
            return await reclaimer.hub.user(name) is not None
        except (HTTPClientError, OSError, ValueError):
            return None

    return ask


def build_device_watch(
    pool: Pool, reclaimer: IdleReclaimer, jobs: JobManager, config: Any, log: logging.Logger
) -> DeviceWatch:
    """The hub's device watch (settings ``c.DeviceWatch``, checked now: a bad value stops the
    hub naming the key), its warnings shown through the reclaimer's ``idle.warning``."""
    accounts = code_accounts(config, jobs.backend)
    watch = DeviceWatch(pool, accounts, is_hub_user=hub_users(reclaimer), config=config, log=log)
    reclaimer.warnings.append(watch.warning)
    return watch
