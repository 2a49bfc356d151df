"""The load benchmark's watch over its invariants: looks at the three views while the phases run,
and the orphan checks between them.

Invariants, in three views (:mod:`benchmarks.load_views`: the pool's database, the REST view,
the live processes): a monitor looks at all three every ``--monitor-interval`` seconds (0.5),
the processes alone are scanned every ``--proc-interval`` seconds (0.25), and each phase ends
with a look.

- ``double_owner``: distinct findings of two holders of one device: within one view at once
  (a whole GPU and a MIG instance on it overlap), and across views (a live process's devices
  not in an allocation of its own holder in the db or rest view, a device of an allocation used
  by another holder's process, the db and rest views giving a device to two holders) once seen
  in every look for ``--view-grace`` seconds (12): the rule is in :mod:`benchmarks.load_views`.
- ``over_quota``: distinct teams seen holding more than guarantee + borrow limit (proc: summed
  over the distinct devices of live holders of that ``GPUPOOL_TEAM``).
- ``orphans``: at checkpoints, live server processes JupyterHub does not list with that pid (or
  whose allocation the pool does not know), and jobs with live processes that are not starting
  or running; counted only if still so ``kill_grace + 2`` s later. After "stop everything",
  anything still alive is an orphan.
- ``leaked``: allocations left in the database after everything was stopped (and 30 s of grace).
  ``leaked_during_run``: allocations (db or rest view) whose holder was gone (no live process,
  no JupyterHub server record) in every look for ``--leak-grace`` seconds (15) with the hub up.
- ``status_5xx``: HTTP answers >= 500 over the whole run, except those to requests in flight
  when the hub was killed or sent before it answered again (the proxy's 503 for a dead hub:
  ``http.while_the_hub_was_down``), and 503s during the store fault (``fault_503`` from the
  gpupool API, ``http.fault_spawn_503`` for spawns); requests without an answer are
  ``http.errors``.
- ``final_state_changed``: jobs seen in a final state and later in another state; every job is
  polled as the admin every ``--jobs-poll-interval`` seconds (1) throughout, across the restart
  (not during the abuse phase, whose victim is timed).
- ``contested_decisions``, ``killed_with_spawns_in_flight``, ``killed_with_job_starts_in_flight``,
  ``stranded_jobs``, ``leaked_on_fault``, ``fault_503``, ``dead_holder_release_s``: see the
  phases' modules.


Contract: the monitors (:meth:`Watch.monitor`, :meth:`Watch.proc_watch`,
:meth:`Watch.poll_jobs`) run in threads of their own until ``stop_monitor`` is set and never
raise; a finding is counted once per distinct key (:class:`Tally`), with up to 8 examples.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.load_plan import SPEC, team_limits
from benchmarks.load_report import meminfo_gib
from benchmarks.load_session import HubSession, log
from benchmarks.load_views import (
    Held,
    Persistence,
    Proc,
    ScanCost,
    Snapshot,
    conflicts,
    cross_view,
    device_slots,
    gone_holders,
    live_processes,
    over_limit,
    team_use,
    views_of,
)

if TYPE_CHECKING:
    from tests.hub.conftest import Hub

LOW_MEMORY_GIB = 1.5
"""Below this much available memory the monitor aborts the load phases."""


@dataclass
class Tally:
    """Violations of one invariant: distinct keys, the views that saw each, examples."""

    seen: dict[Any, set[str]] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)

    def add(self, key: Any, view: str, example: Mapping[str, Any], keep: int = 8) -> None:
        if key not in self.seen:
            self.seen[key] = set()
            if len(self.examples) < keep:
                self.examples.append({"view": view, **example})
        self.seen[key].add(view)

    def by_view(self) -> dict[str, int]:
        return dict(Counter(v for views in self.seen.values() for v in views))


class Watch(HubSession):
    """A :class:`HubSession` that also watches the invariants."""

    def __init__(self, args: argparse.Namespace, hub: Hub, homes: Path, db_url: str) -> None:
        super().__init__(args, hub, homes, db_url)
        self.slots = device_slots(SPEC)
        self.limits = team_limits()
        self.double = Tally()
        self.quota = Tally()
        self.orphans = Tally()
        self.cross = Persistence(args.view_grace)
        self.leaks = Persistence(args.leak_grace)
        self.scan_cost = ScanCost()
        self.look_times: dict[str, list[float]] = defaultdict(list)
        self.looks = 0
        self.job_polls = 0
        self.stop_monitor = threading.Event()
        self.min_mem = meminfo_gib("MemAvailable")
        self.kill_grace = 10.0  # the job backend's, set when the run starts
        self.peaks: dict[str, int] = {}  # phase -> most jobs with live processes at one look

    # -- looks -------------------------------------------------------------------------------
    def look(self, phase: str) -> None:
        """One look at every view: double owners (within a view and across views), teams over
        quota, and (every fourth look, with the hub up) allocations whose holder is gone."""
        now = time.monotonic()
        with self.lock:
            self.look_times[phase].append(now)
            self.looks += 1
            leak_look = self.looks % 4 == 1
        procs = live_processes(self.homes, self.scan_cost)
        db_raw = self.db_allocations()
        db = None if db_raw is None else self.db_held_from(db_raw)
        rest: list[Held] | None = None
        up = self.hub_up.is_set()
        if up:
            rest = self.rest_allocations(phase, timed=True)
            teams = self.pool_admin("/teams", phase, timed=True)
            if teams is not None:
                used = Counter({t["name"]: t["used"] or 0 for t in teams["teams"]})
                self._record_quota("rest", used, phase)
        if db_raw is not None:
            db_used: Counter[str] = Counter()
            for a in db_raw:
                db_used[a.team] += a.cost_milli / 1000
            self._record_quota("db", db_used, phase)
        snap = Snapshot(db, None if rest is None else tuple(rest), tuple(procs))
        for view, allocs in snap.views().items():
            self._record_conflicts(view, {a.holder: a.devices for a in allocs}, phase)
        self._proc_checks(procs, phase)
        read = snap.read()
        found = cross_view(snap, self.slots)
        for key in self.cross.update(now, found, lambda k: views_of(k) <= read):
            with self.lock:
                self.double.add(key, key[1], {"phase": phase, "kind": key[0], **found[key]})
        if not up or self.fault_window:
            self.leaks.reset()  # a hub that is down (or a store that fails) releases nothing
        elif leak_look:
            records = self.server_records(phase)
            if records is not None:
                gone: dict[Any, dict[str, Any]] = {}
                for view, allocs in snap.views().items():
                    for key, seen in gone_holders(allocs, procs, records).items():
                        gone[(*key, view)] = {"phase": phase, "view": view, **seen}
                self.leaks.update(now, gone, lambda k: k[-1] in read)

    def _proc_checks(self, procs: Sequence[Proc], phase: str) -> None:
        """The process view alone: overlapping devices of live holders (at once: one scan is one
        instant), teams over quota, the most jobs alive."""
        with self.lock:
            jobs_alive = len({p.holder for p in procs if p.kind == "job"})
            self.peaks[phase] = max(self.peaks.get(phase, 0), jobs_alive)
        holders: dict[str, set[str]] = defaultdict(set)
        teams_of: dict[str, str] = {}
        for p in procs:
            holders[p.holder].update(p.devices)
            teams_of[p.holder] = p.team
        self._record_conflicts("proc", holders, phase, procs)
        used_proc = team_use({h: (teams_of[h], ids) for h, ids in holders.items()}, self.slots)
        self._record_quota("proc", used_proc, phase)

    def _record_conflicts(
        self,
        view: str,
        holdings: Mapping[str, Iterable[str]],
        phase: str,
        procs: Sequence[Proc] = (),
    ) -> None:
        for gpu, a, b in conflicts(holdings, self.slots):
            pids = {h: [p.pid for p in procs if p.holder == h] for h in (a, b)} if procs else {}
            users = {h: sorted({p.user for p in procs if p.holder == h}) for h in (a, b)}
            with self.lock:
                self.double.add(
                    (gpu, a, b),
                    view,
                    {
                        "phase": phase,
                        "gpu": gpu,
                        "holders": [a, b],
                        **({"pids": pids, "users": users} if procs else {}),
                    },
                )

    def _record_quota(self, view: str, used: Mapping[str, float], phase: str) -> None:
        for team, u, limit in over_limit(used, self.limits):
            with self.lock:
                self.quota.add(
                    team, view, {"phase": phase, "team": team, "used": u, "limit": limit}
                )

    def monitor(self) -> None:
        """All three views every ``--monitor-interval`` seconds (from the start of one look to
        the start of the next; a look slower than that starts the next at once)."""
        while not self.stop_monitor.is_set():
            t0 = time.monotonic()
            try:
                self.look(self.phase)
            except Exception as e:  # never let the monitor kill the run
                log(f"  (monitor: {type(e).__name__}: {e})")
            mem = meminfo_gib("MemAvailable")
            self.min_mem = min(self.min_mem, mem)
            if mem < LOW_MEMORY_GIB and not self.abort:
                self.abort = f"available memory fell to {mem:.2f} GiB during {self.phase}"
                log(f"ABORTING the load phases: {self.abort}")
            self.stop_monitor.wait(max(0.0, self.args.monitor_interval - (time.monotonic() - t0)))

    def proc_watch(self) -> None:
        """The process view alone every ``--proc-interval`` seconds (cheap: one /proc scan)."""
        while not self.stop_monitor.wait(self.args.proc_interval):
            try:
                self._proc_checks(live_processes(self.homes, self.scan_cost), self.phase)
            except Exception as e:
                log(f"  (process watch: {type(e).__name__}: {e})")

    def poll_jobs(self) -> None:
        """Every job, as the admin, every ``--jobs-poll-interval`` seconds, across restarts
        (paused during the abuse phase, whose victim is timed)."""
        while not self.stop_monitor.wait(self.args.jobs_poll_interval):
            if self.phase == "abuse" or not self.hub_up.is_set():
                continue
            everything = self.all_jobs("jobs-poll")
            if everything is not None:
                self.record_jobs(everything["jobs"])
                with self.lock:
                    self.job_polls += 1

    # -- orphans ------------------------------------------------------------------------------
    def orphan_candidates(self, phase: str, everything_stopped: bool) -> dict[str, dict[str, Any]]:
        procs = live_processes(self.homes, self.scan_cost)
        if everything_stopped:
            servers: dict[str, dict[str, Any]] = {}
            allocs: set[str] = set()
            active: set[str] = set()
        else:
            listed = self.servers(phase)
            rest = self.pool_admin("/allocations?all=1", phase)
            jobs = self.all_jobs(phase)
            if listed is None or rest is None or jobs is None:
                log("  (orphan check skipped: the hub did not answer)")
                return {}
            servers, allocs = listed, {a["id"] for a in rest["allocations"]}
            active = {j["id"] for j in jobs["jobs"] if j["state"] in ("starting", "running")}
        found: dict[str, dict[str, Any]] = {}
        for p in procs:
            if p.kind == "server":
                server = servers.get(p.user)
                pid = (server or {}).get("state", {}).get("pid")
                alloc = p.env.get("GPUPOOL_ALLOCATION", "")
                if server is None:
                    why = f"JupyterHub lists no server for {p.user}"
                elif pid != p.pid:
                    why = f"JupyterHub's server for {p.user} is pid {pid}"
                elif alloc and alloc not in allocs:
                    why = f"allocation {alloc} is unknown to the pool"
                else:
                    continue
                key = f"server pid {p.pid}"
            else:
                job_id = p.holder.removeprefix("job:")
                if job_id in active:
                    continue
                why = f"job {job_id} is not starting or running"
                key = p.holder
            entry = found.setdefault(
                key,
                {
                    "kind": p.kind,
                    "user": p.user,
                    "holder": p.holder,
                    "pids": [],
                    "CUDA_VISIBLE_DEVICES": ",".join(p.devices),
                    "why": why,
                },
            )
            entry["pids"].append(p.pid)
        return found

    def check_orphans(self, phase: str, everything_stopped: bool = False) -> int:
        first = self.orphan_candidates(phase, everything_stopped)
        if not first:
            return 0
        log(f"  {len(first)} orphan candidates; looking again in {self.kill_grace + 2:.0f} s")
        time.sleep(self.kill_grace + 2)
        second = self.orphan_candidates(phase, everything_stopped)
        still = {k: v for k, v in second.items() if k in first}
        for key, entry in still.items():
            self.orphans.add(key, "proc", {"phase": phase, **entry})
        return len(still)
