"""``python -m benchmarks.load [--users N] [--jobs J] [--timeout S] [--only PHASE] [--db-url URL]
[--json]``: a hub under load.

One real hub (the repository's ``jupyterhub_config.py`` through the test harness, free loopback
ports, state in a temporary directory) with a simulated pool of 16 H100-80GB (12 whole, 4 with
two fixed 3g.40gb instances each: 16 GPU-equivalents), four teams whose quotas bind, and N users
(default 90) with real JupyterLab servers (``jupyterhub-singleuser``, nothing faked) and real
torchrun jobs. The pool's database is ``--db-url`` (any SQLAlchemy URL; by default SQLite in the
state dir), set as ``c.GPUPool.db_url`` before the demo's ``setup(c)`` builds the pool. The
phases, in order:

1. *storm 1*: every user POSTs ``/hub/api/users/<name>/server`` at once with their own token
   (each POST timed); then wait until no server is pending.
2. *burst*: J jobs (``POST /hub/api/gpupool/jobs``, a third of them on GPUs, a fifth cancelled
   0-3 s after submission) while four threads time ``GET /hub/api/gpupool/jobs``; until every job
   has ended or waits in the queue for GPUs the notebooks hold.
3. *stop*: every server is stopped (DELETE, at once).
4. *storm 2 and crash*: one 40-second job, then every user spawns again while short jobs are
   submitted one a second; the REST view is read every 0.1 s and once it shows a server pending
   its spawn and a job starting at the same look, the hub gets SIGKILL (or ``--kill-after``
   seconds in; the proxy, servers and jobs live on) and is started again. Users whose server is
   not running after the restart retry once (*retry*).
5. *contested* (:mod:`benchmarks.load_contested`): for ``--contested-s`` seconds users spawn and
   stop GPU servers of various offers and submit and cancel GPU jobs, beyond capacity and quota;
   the hub's grants, releases and refusals are counted from ``/hub/metrics``.
6. *faults* (:mod:`benchmarks.load_faults`): the pool's store fails (a full tmpfs, or its tables
   renamed) while jobs end, servers stop and spawns are tried; then *dead holder*: GPU servers'
   processes are killed and the release of their allocations timed.
7. *abuse* (:mod:`benchmarks.abuse`): one user floods the hub with jobs, log followers and
   spawn retries beyond every per-user limit while another user's ``GET /jobs`` and
   ``/offers`` are timed.
8. *stop everything*: every server stopped, every job cancelled; the pool must be empty.

``--only abuse|contested|faults|dead-holder`` runs one phase on a hub of its own (then stop
everything).

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

Latencies: ``spawn_p50_s``/``spawn_p99_s`` over the POSTs of storm 1 (every answer; refusals
included), ``jobs_get_p50_s``/``jobs_get_p99_s`` over the GETs during the burst (the admin's
look follows every page), ``victim_p99_s`` over the victim's GETs during the abuse phase;
nearest-rank percentiles (:mod:`benchmarks.stats`). ``abuse_accepted_beyond_limit``: what the
hub accepted beyond the per-user limits in that phase. ``proc_scan``: what each scan of
``/proc`` cost.

Contract: loopback only; bounded in count (``--users``, ``--jobs``, ``--storm-jobs``) and time
(``--timeout`` bounds every wait; phases left when it is spent are skipped, stop and checks are
not; ``--contested-s``, ``--fault-s``); a monitor stops adding load if the machine's available
memory drops under 1.5 GiB. Always stops what it started (hub, proxy, servers, job processes:
found by this run's homes in their environment; the tmpfs is unmounted), also on failure or
Ctrl-C. Progress goes to stderr; the table (or, with ``--json``, one JSON object) to stdout:
``> benchmarks/results/load.json`` keeps it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import requests

from benchmarks.load_faults import tmpfs
from benchmarks.load_report import _brief, machine, summarize, table
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
from benchmarks.stats import percentile

ROOT = Path(__file__).resolve().parents[1]

# -- the pool, its teams and who asks for what (pure data) ------------------------------------
SPEC = "node1: 16x H100-80GB, mig=4:3g.40gb+3g.40gb, nvlink=8"
"""12 whole H100-80GB and 4 in MIG mode with two 3g.40gb instances each: 16 GPU-equivalents."""
OFFERS: dict[str, dict[str, Any]] = {
    "cpu": {"description": "CPU only"},
    "h100": {"model": "H100-80GB", "max_count": 2, "description": "Whole H100 80GB"},
    "mig-3g.40gb": {"model": "H100-80GB", "description": "Half an H100"},
}
TEAMS: dict[str, dict[str, Any]] = {
    "vision": {
        "guarantee": 4,
        "borrow_limit": 2,
        "user_cap": 1,
        "offers": ["cpu", "h100", "mig-3g.40gb"],
    },
    "nlp": {"guarantee": 2, "borrow_limit": 1, "user_cap": 0.5, "offers": ["cpu", "mig-3g.40gb"]},
    "speech": {"guarantee": 3, "user_cap": 2, "offers": ["cpu", "h100"]},
    "robotics": {
        "guarantee": 3,
        "borrow_limit": 2,
        "user_cap": 1,
        "offers": ["cpu", "h100", "mig-3g.40gb"],
    },
}
"""Limits 6 + 3 + 3 + 5 = 17 GPU-eq on a 16 GPU-eq pool: quotas and capacity both bind."""
ROLES: tuple[tuple[str | None, str, int], ...] = (
    ("vision", "h100", 1),
    ("vision", "mig-3g.40gb", 1),
    ("nlp", "mig-3g.40gb", 1),
    ("nlp", "cpu", 1),
    ("speech", "h100", 2),
    ("speech", "h100", 1),
    ("robotics", "h100", 1),
    ("robotics", "mig-3g.40gb", 1),
    (None, "cpu", 1),
    ("vision", "cpu", 1),
)
"""User i plays ``ROLES[i % 10]``: (team or none, offer, count) for their server."""
JOB_SCRIPT = "import os, time\ntime.sleep(float(os.environ.get('LOAD_SLEEP', '3')))\n"
SERVER_CMD = "jupyterhub-singleuser"


@dataclass(frozen=True)
class Persona:
    name: str
    team: str | None
    offer: str
    count: int

    def options(self) -> dict[str, Any]:
        """The ``user_options`` of this user's spawn."""
        return {"offer": self.offer, "count": self.count} if self.offer != "cpu" else {}


def plan_users(n: int) -> list[Persona]:
    """``n`` users ``u000``… playing :data:`ROLES` in turn."""
    width = max(3, len(str(n - 1)))
    return [Persona(f"u{i:0{width}d}", *ROLES[i % len(ROLES)]) for i in range(n)]


def groups(personas: Iterable[Persona]) -> dict[str, list[str]]:
    """JupyterHub groups (= teams) and their members."""
    out: dict[str, list[str]] = {team: [] for team in TEAMS}
    for p in personas:
        if p.team:
            out[p.team].append(p.name)
    return out


def team_limits(teams: Mapping[str, Mapping[str, Any]] = TEAMS) -> dict[str, float]:
    """Each team's limit in GPU-equivalents: guarantee plus borrowing limit."""
    return {
        name: float(t.get("guarantee", 0)) + float(t.get("borrow_limit") or 0)
        for name, t in teams.items()
    }


def plan_jobs(personas: Sequence[Persona], count: int) -> list[tuple[Persona, dict[str, Any]]]:
    """``count`` job submissions: one in three on the owner's GPU offer (when they have one),
    the rest CPU-only, one rank each, owners spread over the users."""
    jobs = []
    for i in range(count):
        p = personas[(i * 7) % len(personas)]
        gpu = i % 3 == 0 and p.offer != "cpu"
        body: dict[str, Any] = {
            "script": JOB_SCRIPT,
            "name": f"load-{i}",
            "offer": p.offer if gpu else "cpu",
            "gpus": 1,
            "time_limit": 300,
        }
        jobs.append((p, body))
    return jobs


def status_class(code: int | None) -> str:
    """``201``, ``202``, ``2xx``, ``4xx``, ``5xx`` or ``error`` (no answer)."""
    if code is None:
        return "error"
    if code in (201, 202):
        return str(code)
    return f"{code // 100}xx"


def final_changes(
    history: Mapping[str, Sequence[str]], final: Iterable[str]
) -> dict[str, list[str]]:
    """Jobs whose observed states left a final state: job id -> the states seen, in order."""
    ends = set(final)
    out = {}
    for job_id, states in history.items():
        seen_final = None
        for s in states:
            if seen_final is not None and s != seen_final:
                out[job_id] = list(states)
                break
            if s in ends:
                seen_final = s
    return out


def mem_available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / (1 << 20)
    return float("inf")


# -- the run -------------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"[load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        left = max(0.0, self.end - time.monotonic())
        return left if cap is None else min(cap, left)

    @property
    def spent(self) -> bool:
        return self.left() <= 0


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


class LoadRun:
    def __init__(
        self, args: argparse.Namespace, state: Path, homes: Path, fault_mode: str = "rename"
    ) -> None:
        from tests.hub.conftest import Hub  # the harness: real hub, real proxy, real servers

        self.args = args
        self.personas = plan_users(args.users)
        self.by_name = {p.name: p for p in self.personas}
        self.slots = device_slots(SPEC)
        self.limits = team_limits()
        self.homes = homes
        self.fault_mode = fault_mode
        self.pool_db_dir = state / "pooldb"  # a tmpfs of its own in the tmpfs fault mode
        self.db_url: str = args.db_url or f"sqlite:///{self.pool_db_dir / 'gpupool.sqlite'}"
        self.pool_db_dir.mkdir(parents=True, exist_ok=True)
        if not args.db_url:  # where the abuse phase looks for the database's size
            (state / "gpupool.sqlite").symlink_to(self.pool_db_dir / "gpupool.sqlite")
        self.started = time.monotonic()
        self.db_where = _describe(self.db_url)
        self.hub = Hub(state, homes, extra_config=self._extra_config(), prelude=self._prelude())
        self.hub.env["GPUPOOL_INVENTORY"] = f"simulated:{SPEC}"
        if args.hub_pythonpath:  # another gpupool for the hub (e.g. an older one)
            first = [str(Path(d).resolve()) for d in args.hub_pythonpath.split(os.pathsep)]
            self.hub.env["PYTHONPATH"] = os.pathsep.join(
                [*first, os.environ.get("PYTHONPATH", "")]
            ).rstrip(os.pathsep)
        self.deadline = Deadline(args.timeout)
        self.lock = threading.Lock()
        self.statuses: Counter[str] = Counter()
        self.codes: Counter[int] = Counter()
        self.down_codes: Counter[int] = Counter()
        self.epoch = 0  # +1 when the hub is killed and when it answers again
        self.errors: Counter[str] = Counter()
        self.fivexx: list[dict[str, Any]] = []
        self.tokens: dict[str, str] = {}
        self.admin_token = ""
        self.double = Tally()
        self.quota = Tally()
        self.orphans = Tally()
        self.cross = Persistence(args.view_grace)
        self.leaks = Persistence(args.leak_grace)
        self.fault_window = False
        self.fault_503 = 0
        self.fault_spawn_503 = 0
        self.scan_cost = ScanCost()
        self.look_times: dict[str, list[float]] = defaultdict(list)
        self.looks = 0
        self.job_polls = 0
        self.job_history: dict[str, list[str]] = defaultdict(list)
        self.job_ids: dict[str, str] = {}  # job id -> phase
        self.hub_up = threading.Event()
        self.stop_monitor = threading.Event()
        self.abort = ""
        self.min_mem = mem_available_gib()
        self.result: dict[str, Any] = {"phases_s": {}}
        self.kill_grace = 10.0
        self.machine: dict[str, Any] = {}
        self.responsiveness: dict[str, list[float]] = defaultdict(list)
        self.peaks: dict[str, int] = {}  # phase -> most jobs with live processes at one look
        self._store: Any = None

    def say(self, msg: str) -> None:
        log(msg)

    # -- config ------------------------------------------------------------------------------
    def _prelude(self) -> str:
        """Config run before the demo's: the demo sets its own teams, offers and database right
        before ``setup(c)``, so the benchmark's are put in by wrapping ``setup`` (in the hub
        process)."""
        return (
            "import gpupool.hub as _gpupool_hub\n"
            "_gpupool_setup = _gpupool_hub.setup\n"
            "def _load_setup(c, *args, **kwargs):\n"
            f"    c.GPUPool.offers = {OFFERS!r}\n"
            f"    c.GPUPool.teams = {TEAMS!r}\n"
            "    c.GPUPool.everyone = {'offers': ['cpu']}\n"
            f"    c.GPUPool.db_url = {self.db_url!r}\n"
            "    return _gpupool_setup(c, *args, **kwargs)\n"
            "_gpupool_hub.setup = _load_setup\n"
        )

    def _extra_config(self) -> str:
        users = sorted(p.name for p in self.personas)
        return (
            f"c.Authenticator.allowed_users = set({users!r})\n"
            f"c.JupyterHub.load_groups = "
            f"{ {t: {'users': m} for t, m in groups(self.personas).items()}!r}\n"
            "c.JupyterHub.allow_named_servers = True\n"  # the abuse phase's spawn flood
            # JupyterHub's own poll interval (the test harness polls every second): a dead
            # server must be noticed by the spawner's exit watch (dead_holder_release_s)
            "c.Spawner.poll_interval = 30\n"
        )

    # -- HTTP, counted -------------------------------------------------------------------------
    def http(
        self, method: str, path: str, token: str, phase: str, timeout: float = 60, **kw: Any
    ) -> tuple[requests.Response | None, float]:
        t0 = time.perf_counter()
        epoch = self.epoch
        try:
            r = requests.request(
                method,
                f"{self.hub.url}{path}",
                headers={"Authorization": f"token {token}"} if token else {},
                timeout=timeout,
                **kw,
            )
        except requests.RequestException as e:
            with self.lock:
                self.errors[f"{phase}: {method} {route(path)}: {type(e).__name__}"] += 1
            return None, time.perf_counter() - t0
        elapsed = time.perf_counter() - t0
        with self.lock:
            if epoch != self.epoch or not self.hub_up.is_set():
                # sent to, or answered by, a hub that was killed meanwhile: the proxy's 502/503
                # for a dead hub, counted apart from the hub's own answers
                self.down_codes[r.status_code] += 1
                return r, elapsed
            self.codes[r.status_code] += 1
            if route(path) == "/hub/api/gpupool/health":
                return r, elapsed  # 503 while the store is unhealthy: by design
            if r.status_code == 503 and self.fault_window:
                if path.startswith("/hub/api/gpupool/"):
                    self.fault_503 += 1
                    return r, elapsed
                if method == "POST" and route(path) == "/hub/api/users/<name>/server":
                    self.fault_spawn_503 += 1  # an expected refusal while the store is down
                    return r, elapsed
            if r.status_code >= 500:
                self.statuses["5xx"] += 1
                if len(self.fivexx) < 10:
                    self.fivexx.append(
                        {
                            "phase": phase,
                            "request": f"{method} {path}",
                            "status": r.status_code,
                            "body": r.text[:300],
                        }
                    )
        return r, elapsed

    def admin(self, method: str, path: str, phase: str, **kw: Any) -> requests.Response | None:
        """As the harness's admin service (servers, users, tokens)."""
        from tests.hub.conftest import TOKEN

        return self.http(method, f"/hub/api{path}", TOKEN, phase, **kw)[0]

    def pool_admin(self, path: str, phase: str, timed: bool = False) -> Any:
        """A gpupool GET as the admin user (``custom:gpupool:admin``); ``None`` if no answer.
        ``timed``: its latency counts for the phase's responsiveness (the monitor's looks)."""
        r, elapsed = self.http(
            "GET", f"/hub/api/gpupool{path}", self.admin_token, phase, timeout=30
        )
        if timed and (r is not None or elapsed >= 30):
            with self.lock:
                self.responsiveness[phase].append(elapsed)
        return r.json() if r is not None and r.status_code == 200 else None

    # -- views ---------------------------------------------------------------------------------
    def all_jobs(
        self, phase: str, latencies: list[float] | None = None
    ) -> dict[str, list[dict[str, Any]]] | None:
        """Every job, as the admin user sees them (``GET /jobs`` answers a page at a time,
        newest first: followed to the last page); ``None`` if a page got no answer. Each page's
        latency goes to ``latencies``."""
        jobs: list[dict[str, Any]] = []
        cursor = ""
        while True:
            query = f"?limit=500&cursor={quote(cursor)}" if cursor else "?limit=500"
            r, elapsed = self.http(
                "GET", f"/hub/api/gpupool/jobs{query}", self.admin_token, phase, timeout=30
            )
            if latencies is not None and r is not None:
                with self.lock:
                    latencies.append(elapsed)
            if r is None or r.status_code != 200:
                return None
            page = r.json()
            jobs += page["jobs"]
            cursor = page.get("next") or ""
            if not cursor:
                return {"jobs": jobs}

    def all_servers(self, phase: str) -> dict[str, dict[str, Any]] | None:
        """Every server JupyterHub has a record of, named ``<user>/<server name>`` (``None`` if
        it does not answer)."""
        out: dict[str, dict[str, Any]] = {}
        offset = 0
        while True:
            r = self.admin("GET", f"/users?offset={offset}&limit=200", phase, timeout=60)
            if r is None or r.status_code != 200:
                return None
            page = r.json()
            for u in page:
                for name, server in (u.get("servers") or {}).items():
                    out[f"{u['name']}/{name}"] = server
            if len(page) < 200:
                return out
            offset += 200

    def servers(self, phase: str) -> dict[str, dict[str, Any]] | None:
        """Every user's default server as JupyterHub lists it (``None`` if it does not answer)."""
        listed = self.all_servers(phase)
        if listed is None:
            return None
        return {ref[:-1]: s for ref, s in listed.items() if ref.endswith("/")}

    def server_records(self, phase: str) -> set[str] | None:
        listed = self.all_servers(phase)
        return None if listed is None else set(listed)

    def db_allocations(self) -> list[Any] | None:
        """The pool's database, read with ``gpupool.store`` (``None`` if it cannot be read)."""
        from gpupool.store import Store

        if self.db_url.startswith("sqlite:///") and not Path(self.db_url[10:]).exists():
            return None
        try:
            if self._store is None:
                self._store = Store(self.db_url, upgrade=False)
            return list(self._store.load())
        except Exception as e:  # locked, half-written, or its tables renamed by the fault
            if self._store is not None:
                with contextlib.suppress(Exception):
                    self._store.close()
                self._store = None
            if not self.fault_window:
                log(f"  (the pool database could not be read: {type(e).__name__})")
            return None

    def db_held(self) -> tuple[Held, ...] | None:
        db = self.db_allocations()
        return None if db is None else self.db_held_from(db)

    def rest_allocations(self, phase: str, timed: bool = False) -> list[Held] | None:
        from benchmarks.load_faults import holders_of

        rest = self.pool_admin("/allocations?all=1", phase, timed=timed)
        return None if rest is None else holders_of(rest["allocations"])

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

    @staticmethod
    def db_held_from(db: Sequence[Any]) -> tuple[Held, ...]:
        return tuple(
            Held(a.id, a.user, a.kind, a.ref, tuple(d.visible_id for d in a.devices), a.team)
            for a in db
        )

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
            mem = mem_available_gib()
            self.min_mem = min(self.min_mem, mem)
            if mem < 1.5 and not self.abort:
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

    phase = "start"

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

    # -- phases ------------------------------------------------------------------------------
    def storm(
        self, phase: str, users: Sequence[Persona]
    ) -> tuple[list[dict[str, Any]], Callable[[float], None]]:
        """Every one of ``users`` POSTs a spawn at the same moment; returns the (filling) list of
        results and a join function."""
        go = threading.Event()
        results: list[dict[str, Any]] = []

        def one(p: Persona) -> None:
            go.wait()
            r, elapsed = self.http(
                "POST",
                f"/hub/api/users/{p.name}/server",
                self.tokens[p.name],
                phase,
                timeout=self.args.request_timeout,
                json=p.options(),
            )
            message = ""
            if r is not None and r.status_code >= 400:
                with contextlib.suppress(ValueError):
                    message = str(r.json().get("message", ""))[:200]
            with self.lock:
                results.append(
                    {
                        "user": p.name,
                        "status": None if r is None else r.status_code,
                        "s": elapsed,
                        "message": message,
                    }
                )

        threads = [threading.Thread(target=one, args=(p,), daemon=True) for p in users]
        for t in threads:
            t.start()
        go.set()

        def join(timeout: float) -> None:
            end = time.monotonic() + timeout
            for t in threads:
                t.join(max(0.0, end - time.monotonic()))

        return results, join

    def settle(self, phase: str, cap: float) -> dict[str, dict[str, Any]]:
        """Wait until no server is pending (and no job is starting); the servers then."""
        end = time.monotonic() + self.deadline.left(cap)
        servers: dict[str, dict[str, Any]] = {}
        pending: list[str] = []
        starting: list[str] = []
        while True:
            listed = self.servers(phase)
            jobs = self.all_jobs(phase)
            if listed is not None:
                servers = listed
                pending = [u for u, s in listed.items() if s.get("pending")]
                starting = [
                    j["id"] for j in (jobs or {}).get("jobs", []) if j["state"] == "starting"
                ]
                if not pending and not starting and jobs is not None:
                    return servers
            if time.monotonic() > end:
                log(
                    f"  {phase}: still pending when the wait ended: {len(pending)} servers, "
                    f"{len(starting)} jobs starting"
                )
                return servers
            time.sleep(1)

    def log_offset(self) -> int:
        """Where the hub's log ends now (to read what a phase logged)."""
        try:
            return self.hub.log.stat().st_size
        except OSError:
            return 0

    def refusals_logged(self, since: int) -> dict[str, str]:
        """user -> the pool's last refusal of their server logged by the hub after ``since``."""
        marker = "gpupool: refused "
        found = {}
        with contextlib.suppress(OSError), self.hub.log.open("rb") as f:
            f.seek(since)
            for raw in f:
                line = raw.decode(errors="replace")
                if marker in line:
                    ref, _, message = line.split(marker, 1)[1].partition(": ")
                    found[ref.split("/", 1)[0]] = message.strip()[:300]
        return found

    def spawn_summary(
        self,
        results: Sequence[dict[str, Any]],
        servers: Mapping[str, Mapping[str, Any]],
        log_since: int,
    ) -> dict[str, Any]:
        classes = Counter(status_class(r["status"]) for r in results)
        ready = {u for u, s in servers.items() if s.get("ready")}
        late_fail = [r["user"] for r in results if r["status"] == 202 and r["user"] not in ready]
        refused = self.refusals_logged(log_since)
        late_refused = [u for u in late_fail if u in refused]
        refusals = Counter(
            r["status"] for r in results if r["status"] is not None and r["status"] >= 400
        )

        def pct(cls: str, q: float) -> float | None:
            times = [r["s"] for r in results if status_class(r["status"]) == cls]
            return round(percentile(times, q), 3) if times else None

        return {
            "posts": len(results),
            **{k: classes.get(k, 0) for k in ("201", "202", "2xx", "4xx", "5xx", "error")},
            "refusals": {str(k): v for k, v in sorted(refusals.items())},
            "ready_after": len(ready),
            "202_then_not_running": len(late_fail),
            "202_then_refused_by_pool": len(late_refused),
            "202_then_refused_example": (
                f"{late_refused[0]}: {refused[late_refused[0]]}" if late_refused else ""
            ),
            "p50_s": round(percentile([r["s"] for r in results], 0.5), 3),
            "p99_s": round(percentile([r["s"] for r in results], 0.99), 3),
            "max_s": round(max((r["s"] for r in results), default=0.0), 3),
            "p50_202_s": pct("202", 0.5),
            "p50_4xx_s": pct("4xx", 0.5),
            "p99_4xx_s": pct("4xx", 0.99),
            "refusal_example": next((r["message"] for r in results if r["message"]), ""),
        }

    def submit_jobs(
        self,
        phase: str,
        plans: Sequence[tuple[Persona, dict[str, Any]]],
        cancel_every: int = 0,
        rng: random.Random | None = None,
    ) -> tuple[list[dict[str, Any]], list[threading.Thread]]:
        """Submit ``plans`` at once (one thread each); every ``cancel_every``-th is cancelled by
        its owner 0-3 s after its submission."""
        go = threading.Event()
        results: list[dict[str, Any]] = []
        delays = [(rng or random.Random(0)).uniform(0, 3) for _ in plans]

        def one(i: int, p: Persona, body: dict[str, Any]) -> None:
            go.wait()
            r, elapsed = self.http(
                "POST", "/hub/api/gpupool/jobs", self.tokens[p.name], phase, json=body
            )
            job_id = r.json().get("id") if r is not None and r.status_code == 201 else None
            entry = {
                "i": i,
                "user": p.name,
                "offer": body["offer"],
                "id": job_id,
                "status": None if r is None else r.status_code,
                "s": elapsed,
            }
            if job_id:
                with self.lock:
                    self.job_ids[job_id] = phase
            if job_id and cancel_every and i % cancel_every == 1:
                time.sleep(delays[i])
                c, _ = self.http(
                    "DELETE", f"/hub/api/gpupool/jobs/{job_id}", self.tokens[p.name], phase
                )
                entry["cancelled"] = None if c is None else c.status_code
            with self.lock:
                results.append(entry)

        threads = [
            threading.Thread(target=one, args=(i, p, b), daemon=True)
            for i, (p, b) in enumerate(plans)
        ]
        for t in threads:
            t.start()
        go.set()
        return results, threads

    def record_jobs(self, jobs: Iterable[Mapping[str, Any]]) -> None:
        with self.lock:
            for j in jobs:
                states = self.job_history[j["id"]]
                if not states or states[-1] != j["state"]:
                    states.append(j["state"])

    def burst(self) -> dict[str, Any]:
        rng = random.Random(self.args.seed)
        plans = plan_jobs(self.personas, self.args.jobs)
        latencies: list[float] = []
        done = threading.Event()
        owners = sorted({p.name for p, _ in plans})

        def poll(token: str) -> None:
            while not done.is_set():
                if token == self.admin_token:  # every page: the job history needs them all
                    everything = self.all_jobs("burst", latencies)
                    if everything is not None:
                        self.record_jobs(everything["jobs"])
                else:  # the newest page, as the jobs panel reads it
                    r, elapsed = self.http("GET", "/hub/api/gpupool/jobs", token, "burst")
                    if r is not None:
                        with self.lock:
                            latencies.append(elapsed)
                done.wait(0.2)

        pollers = [self.admin_token] + [self.tokens[u] for u in owners[:3]]
        threads = [threading.Thread(target=poll, args=(t,), daemon=True) for t in pollers]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        submitted, submitters = self.submit_jobs("burst", plans, cancel_every=5, rng=rng)
        for t in submitters:
            t.join(self.deadline.left(120))
        ids = {s["id"] for s in submitted if s["id"]}
        end = time.monotonic() + self.deadline.left(self.args.burst_timeout)
        states: dict[str, str] = {}
        ended = 0
        while time.monotonic() < end and not self.abort:
            with self.lock:
                states = {i: self.job_history[i][-1] for i in ids if self.job_history.get(i)}
            open_ = [s for s in states.values() if s in ("starting", "running")]
            waiting = [s for s in states.values() if s == "queued"]
            ended = len(states) - len(open_) - len(waiting)
            if len(states) == len(ids) and not open_:
                break  # the rest waits for GPUs the notebooks hold
            time.sleep(1)
        done.set()
        for t in threads:
            t.join(30)
        elapsed = time.monotonic() - t0
        final = Counter(states.values())
        return {
            "submitted": len(plans),
            "accepted": len(ids),
            "submit_statuses": dict(Counter(str(s["status"]) for s in submitted)),
            "cancel_requests": sum("cancelled" in s for s in submitted),
            "states_at_end": dict(final),
            "ended": ended,
            "s": round(elapsed, 1),
            "jobs_get_requests": len(latencies),
            "jobs_get_p50_s": round(percentile(latencies, 0.5), 3),
            "jobs_get_p99_s": round(percentile(latencies, 0.99), 3),
            "jobs_get_max_s": round(max(latencies, default=0.0), 3),
        }

    def stop_servers(self, phase: str) -> int:
        listed = self.servers(phase) or {}
        users = sorted(listed)
        threads = [
            threading.Thread(
                target=self.admin, args=("DELETE", f"/users/{u}/server", phase), daemon=True
            )
            for u in users
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.deadline.left(120))
        end = time.monotonic() + self.deadline.left(120)
        while time.monotonic() < end:
            if self.servers(phase) == {}:
                break
            time.sleep(1)
        return len(users)

    def in_flight(self, phase: str) -> tuple[list[str], list[str]] | None:
        """The REST view of what is in flight: servers pending their spawn (JupyterHub's
        ``GET /users?state=active``) and jobs ``starting`` (the newest 200 jobs, as the admin);
        ``None`` if either did not answer."""
        r = self.admin("GET", "/users?state=active&limit=500", phase, timeout=10)
        j, _ = self.http(
            "GET", "/hub/api/gpupool/jobs?limit=200", self.admin_token, phase, timeout=10
        )
        if r is None or r.status_code != 200 or j is None or j.status_code != 200:
            return None
        pending = [
            f"{u['name']}/{name}"
            for u in r.json()
            for name, s in (u.get("servers") or {}).items()
            if s.get("pending") == "spawn"
        ]
        starting = [job["id"] for job in j.json()["jobs"] if job["state"] == "starting"]
        return pending, starting

    def crash_storm(self) -> dict[str, Any]:
        """One 40 s job, then storm 2 with short jobs submitted one a second; SIGKILL to the hub
        once the REST view shows a spawn pending and a job starting at one look (or
        ``--kill-after`` s have passed); restart; settle."""
        assert self.hub.proc is not None
        plans = plan_jobs(self.personas[1:], max(1, self.args.storm_jobs))
        long_ = [(plans[0][0], {**plans[0][1], "name": "storm-long", "env": {"LOAD_SLEEP": "40"}})]
        submitted, submitters = self.submit_jobs("storm2", long_)
        for t in submitters:
            t.join(self.deadline.left(60))
        mine = {f"job:{s['id']}" for s in submitted if s["id"]}
        end = time.monotonic() + self.deadline.left(30)
        while mine and time.monotonic() < end:  # so that a job runs across the crash
            if mine & {p.holder for p in live_processes(self.homes, self.scan_cost)}:
                break
            time.sleep(0.5)
        since = self.log_offset()
        t0 = time.monotonic()
        results, join = self.storm("storm2", self.personas)
        killed = threading.Event()
        trickled: list[dict[str, Any]] = []

        def trickle() -> None:  # job starts to be in flight when the hub dies
            for i, (p, body) in enumerate(plans[1:]):
                if killed.wait(1.0):
                    return
                sent, threads = self.submit_jobs(
                    "storm2", [(p, {**body, "name": f"storm-{i}", "env": {"LOAD_SLEEP": "1"}})]
                )
                for t in threads:
                    t.join(30)
                trickled.extend(sent)

        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        end = t0 + self.args.kill_after
        flight: tuple[list[str], list[str]] = ([], [])
        seen = time.monotonic()
        looks = 0
        while time.monotonic() < end:
            now = self.in_flight("storm2")
            looks += 1
            if now is not None:
                flight, seen = now, time.monotonic()
                if flight[0] and flight[1]:
                    break
            time.sleep(0.1)
        killed_at = time.monotonic() - t0
        with self.lock:
            in_flight = len(self.personas) - len(results)
        procs = live_processes(self.homes, self.scan_cost)
        self.hub_up.clear()
        self.epoch += 1
        os.kill(self.hub.proc.pid, signal.SIGKILL)
        self.hub.proc.wait()
        killed.set()
        age = time.monotonic() - seen
        log(
            f"  SIGKILL to the hub (pid {self.hub.proc.pid}) {killed_at:.1f} s into the storm, "
            f"with {len(flight[0])} spawns pending and {len(flight[1])} jobs starting "
            f"({age:.2f} s before), {in_flight} spawn POSTs unanswered, "
            f"{sum(p.kind == 'server' for p in procs)} server processes and "
            f"{len({p.holder for p in procs if p.kind == 'job'})} jobs alive"
        )
        t1 = time.monotonic()
        self.hub.start()
        restart = time.monotonic() - t1
        self.epoch += 1
        self.hub_up.set()
        join(self.deadline.left(self.args.request_timeout))
        trickler.join(30)
        log(f"  hub answering again after {restart:.1f} s")
        servers = self.settle("restart", 180)
        summary = self.spawn_summary(results, servers, since)
        return {
            "killed_after_s": round(killed_at, 1),
            "killed_with_spawns_in_flight": len(flight[0]),
            "killed_with_job_starts_in_flight": len(flight[1]),
            "in_flight_look_age_s": round(age, 2),
            "in_flight_looks": looks,
            "in_flight_examples": {"spawns": flight[0][:8], "jobs": flight[1][:8]},
            "posts_unanswered_at_kill": in_flight,
            "server_processes_at_kill": sum(p.kind == "server" for p in procs),
            "jobs_alive_at_kill": len({p.holder for p in procs if p.kind == "job"}),
            "storm_jobs_accepted": sum(1 for s in [*submitted, *trickled] if s["id"]),
            "hub_up_again_s": round(restart, 1),
            "servers_listed_after_restart": len(servers),
            "spawns": summary,
        }

    # -- everything --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        timings = self.result["phases_s"]

        @contextlib.contextmanager
        def phase(name: str) -> Iterator[None]:
            self.phase = name
            log(f"phase {name}")
            t0 = time.monotonic()
            try:
                yield
            finally:
                timings[name] = round(time.monotonic() - t0, 1)

        def go() -> bool:
            return not self.abort and not self.deadline.spent

        from benchmarks.load_contested import brief, contested
        from benchmarks.load_faults import dead_holder, store_fault
        from gpupool.jobs.local import LocalJobBackend

        self.kill_grace = float(LocalJobBackend.kill_grace.default_value)  # the demo's
        only = self.args.only
        with phase("start"):
            self.hub.start()
            self.hub_up.set()
            self.admin_token = self.hub.token("admin", ["custom:gpupool:admin"])
            for p in self.abuse_pair() if only == "abuse" else self.personas:
                self.tokens[p.name] = self.hub.token(p.name, ["self", "custom:gpupool:jobs"])
        threads = [
            threading.Thread(target=f, daemon=True)
            for f in (self.monitor, self.proc_watch, self.poll_jobs)
        ]
        for t in threads:
            t.start()
        interrupted = False
        try:
            if only is None:
                self.main_phases(phase, go)
            if only in (None, "contested") and go():
                with phase("contested"):
                    self.result["contested"] = contested(self)
                    brief(self.result["contested"], log)
                with phase("check-contested"):
                    self.look("check-contested")
                    self.check_orphans("check-contested")
            if only in (None, "faults") and go():
                with phase("faults"):
                    self.result["faults"] = store_fault(self)
                    f = self.result["faults"]
                    log(
                        f"  store fault: stranded_jobs {f.get('stranded_jobs')}, "
                        f"leaked_on_fault {f.get('leaked_on_fault')}, fault_503 {self.fault_503}"
                    )
            if only in (None, "dead-holder") and go():
                with phase("dead-holder"):
                    self.result["dead_holder"] = dead_holder(self)
            if only in (None, "abuse") and go():
                with phase("abuse"):
                    self.result["abuse"] = self.abuse()
        except (KeyboardInterrupt, SystemExit):
            interrupted = True  # Ctrl-C or SIGTERM: no orderly stop, straight to the cleanup
            raise
        finally:
            if not interrupted:  # also after a failed phase: what it left is measured too
                with phase("stop-all"):
                    self.result["final"] = self.stop_everything()
            self.stop_monitor.set()
            for t in threads:
                t.join(30)
        self.result["total_s"] = round(time.monotonic() - started, 1)
        return self.result

    def main_phases(
        self,
        phase: Callable[[str], contextlib.AbstractContextManager[None]],
        go: Callable[[], bool],
    ) -> None:
        """Storm 1, the burst, storm 2 with the crash, the retry (each with its checkpoint)."""
        with phase("storm1"):
            since = self.log_offset()
            results, join = self.storm("storm1", self.personas)
            join(self.deadline.left(self.args.request_timeout + 5))
            servers = self.settle("storm1", 300)
            self.result["storm1"] = self.spawn_summary(results, servers, since)
            log(f"  storm 1: {_brief(self.result['storm1'])}")
        with phase("check-storm1"):
            self.look("check-storm1")
            self.check_orphans("check-storm1")
        if go():
            with phase("burst"):
                self.result["burst"] = self.burst()
                log(
                    f"  burst: {self.result['burst']['states_at_end']}, GET /jobs p99 "
                    f"{self.result['burst']['jobs_get_p99_s']} s"
                )
            with phase("check-burst"):
                self.look("check-burst")
                self.check_orphans("check-burst")
        with phase("stop1"):
            self.stop_servers("stop1")
        if go():
            with phase("storm2-crash"):
                self.result["crash"] = self.crash_storm()
                log(f"  storm 2: {_brief(self.result['crash']['spawns'])}")
            with phase("retry"):
                listed = self.servers("retry") or {}
                again = [p for p in self.personas if p.name not in listed]
                since = self.log_offset()
                results, join = self.storm("retry", again)
                join(self.deadline.left(self.args.request_timeout + 5))
                servers = self.settle("retry", 300)
                self.result["retry"] = self.spawn_summary(results, servers, since)
                log(f"  retry: {_brief(self.result['retry'])}")
            with phase("check-restart"):
                self.look("check-restart")
                self.check_orphans("check-restart")
        with phase("stop2"):  # the contested phase starts from an empty pool
            self.stop_servers("stop2")

    def abuse_pair(self) -> tuple[Persona, Persona]:
        """The abuse phase's attacker (the first user of team vision) and victim (the first
        of team nlp)."""
        return (
            next(p for p in self.personas if p.team == "vision"),
            next(p for p in self.personas if p.team == "nlp"),
        )

    def abuse(self) -> dict[str, Any]:
        """The abuse phase (:mod:`benchmarks.abuse`)."""
        from benchmarks.abuse import Abuse

        attacker, victim = self.abuse_pair()
        return Abuse(
            self.hub,
            (attacker.name, self.tokens[attacker.name]),
            (victim.name, self.tokens[victim.name]),
            self.args,
            log,
        ).run()

    def stop_everything(self) -> dict[str, Any]:
        """Stop every server, cancel every job; then what is left: allocations and processes."""
        out: dict[str, Any] = {}
        if not self.hub_up.is_set():
            return {"skipped": "the hub is not up"}
        stopped = self.stop_servers("stop-all")
        jobs = self.all_jobs("stop-all") or {"jobs": []}
        self.record_jobs(jobs["jobs"])
        open_ = [
            j["id"]
            for j in jobs["jobs"]
            if j["state"] not in ("succeeded", "failed", "cancelled", "lost")
        ]
        for job_id in open_:
            self.http("DELETE", f"/hub/api/gpupool/jobs/{job_id}", self.admin_token, "stop-all")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            now = self.all_jobs("stop-all")
            if now is not None:
                self.record_jobs(now["jobs"])
                if all(
                    j["state"] in ("succeeded", "failed", "cancelled", "lost") for j in now["jobs"]
                ):
                    break
            time.sleep(1)
        end = time.monotonic() + 30
        db = self.db_allocations() or []
        while db and time.monotonic() < end:
            time.sleep(1)
            db = self.db_allocations() or []
        self.look("stop-all")
        rest = self.pool_admin("/allocations?all=1", "stop-all")
        out.update(
            servers_stopped=stopped,
            jobs_cancelled=len(open_),
            leaked=len(db),
            leaked_rest=None if rest is None else len(rest["allocations"]),
            leaked_examples=[
                {
                    "id": a.id,
                    "kind": a.kind,
                    "ref": a.ref,
                    "team": a.team,
                    "offer": a.offer,
                    "devices": [d.visible_id for d in a.devices],
                }
                for a in db[:8]
            ],
        )
        out["orphans_after_stop"] = self.check_orphans("stop-all", everything_stopped=True)
        jobs = self.all_jobs("stop-all") or {"jobs": []}
        out["job_states"] = dict(Counter(j["state"] for j in jobs["jobs"]))
        return out

    def cleanup(self) -> dict[str, int]:
        """Stop the hub and proxy, then end every process of this run still alive."""
        killed = {"hub": 0, "proxy": 0, "servers": 0, "job_processes": 0}
        proc = self.hub.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                killed["hub"] = 1
        pidfile = self.hub.state / "jupyterhub-proxy.pid"
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().strip())
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"configurable-http-proxy" in cmd:
                os.kill(pid, signal.SIGKILL)
                killed["proxy"] = 1
        for p in live_processes(self.homes, self.scan_cost):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
                killed["servers" if p.kind == "server" else "job_processes"] += 1
        for entry in os.scandir("/proc"):  # anything else with this run's homes (job shells)
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    raw = Path(f"/proc/{entry.name}/environ").read_bytes()
                    if f"HOME={self.homes}/".encode() in raw:
                        os.kill(int(entry.name), signal.SIGKILL)
                        killed["job_processes"] += 1
        return killed


def route(path: str) -> str:
    """A request path without its query, user names and job ids (to count errors by route)."""
    path = path.split("?", 1)[0]
    path = re.sub(r"/users/[^/]+", "/users/<name>", path)
    return re.sub(r"/jobs/[^/]+", "/jobs/<id>", path)


def fault_mode(args: argparse.Namespace) -> str:
    """``tmpfs`` when asked, or (``auto``) as root on the default SQLite database with
    ``mount`` at hand; else ``rename``."""
    if args.fault != "auto":
        return str(args.fault)
    root = os.geteuid() == 0 and not args.db_url and shutil.which("mount") is not None
    return "tmpfs" if root else "rename"


def _describe(url: str) -> str:
    from gpupool.store import describe

    return describe(url)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=90, help="users spawning at once (90)")
    parser.add_argument("--jobs", type=int, default=64, help="jobs in the burst (64)")
    parser.add_argument(
        "--storm-jobs",
        type=int,
        default=8,
        help="jobs with storm 2: one of 40 s, the rest of 1 s one a second until the kill (8)",
    )
    parser.add_argument(
        "--kill-after",
        type=float,
        default=60.0,
        help="SIGKILL the hub this many s into storm 2 if no spawn and job start overlap (60)",
    )

    parser.add_argument(
        "--timeout",
        type=float,
        default=900,
        help="bound on all the waits together, in seconds (900)",
    )
    parser.add_argument("--burst-timeout", type=float, default=180)
    parser.add_argument("--request-timeout", type=float, default=120)
    parser.add_argument(
        "--monitor-interval", type=float, default=0.5, help="seconds between looks (0.5)"
    )
    parser.add_argument(
        "--proc-interval", type=float, default=0.25, help="seconds between /proc scans (0.25)"
    )
    parser.add_argument(
        "--view-grace", type=float, default=12.0, help="a cross-view finding must last (12)"
    )
    parser.add_argument(
        "--leak-grace", type=float, default=15.0, help="a holder must stay gone (15)"
    )
    parser.add_argument("--jobs-poll-interval", type=float, default=1.0)
    parser.add_argument(
        "--db-url", default="", help="the pool's database (any SQLAlchemy URL; SQLite by default)"
    )
    parser.add_argument(
        "--contested-s", type=float, default=120.0, help="the contested phase's length (120)"
    )
    parser.add_argument("--contested-users", type=int, default=24, help="users spawning (24)")
    parser.add_argument(
        "--contested-job-users", type=int, default=4, help="users submitting jobs (4)"
    )
    parser.add_argument(
        "--fault",
        choices=["auto", "tmpfs", "rename"],
        default="auto",
        help="how the store fails: a full tmpfs (root, SQLite) or renamed tables (auto)",
    )
    parser.add_argument("--fault-s", type=float, default=30.0, help="the store fault lasts (30)")
    parser.add_argument(
        "--fault-grace", type=float, default=45.0, help="then counted this much later (45)"
    )
    parser.add_argument("--tmpfs-size", default="128m", help="the tmpfs of the tmpfs fault")
    parser.add_argument("--dead-holders", type=int, default=3, help="servers killed (3)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", metavar="DIR", help="keep the hub's state and log in DIR")
    parser.add_argument("--note", default="", help="a note stored in the JSON (what was run)")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    parser.add_argument(
        "--only",
        choices=["abuse", "contested", "faults", "dead-holder"],
        help="run only this phase (on a hub of its own)",
    )
    parser.add_argument("--abuse-jobs", type=int, default=300, help="jobs the attacker posts")
    parser.add_argument(
        "--abuse-followers", type=int, default=300, help="log streams the attacker opens"
    )
    parser.add_argument(
        "--abuse-spawns", type=int, default=10, help="named servers the attacker starts at once"
    )
    parser.add_argument("--spawn-retries", type=int, default=5, help="retries of each refusal")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds streams stay open")
    parser.add_argument(
        "--memory-rounds", type=int, default=2, help="jobs floods after, for memory only"
    )
    parser.add_argument(
        "--hub-pythonpath",
        metavar="DIRS",
        help="folders (':'-separated) first on the hub's PYTHONPATH: another gpupool",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.users <= 500 or not 0 <= args.jobs <= 1000 or not 1 <= args.storm_jobs <= 100:
        parser.error("--users 1..500, --jobs 0..1000, --storm-jobs 1..100")
    if not (
        0 <= args.abuse_jobs <= 2000
        and 0 <= args.abuse_followers <= 2000
        and 1 <= args.abuse_spawns <= 100
        and 0 <= args.spawn_retries <= 100
    ):
        parser.error("--abuse-jobs and --abuse-followers 0..2000, --abuse-spawns 1..100")
    if not (
        0 < args.contested_s <= 1800
        and 0 <= args.contested_users <= 200
        and 0 <= args.contested_job_users <= 50
        and 0 < args.fault_s <= 600
        and 0 <= args.fault_grace <= 600
        and 1 <= args.dead_holders <= 10
        and args.monitor_interval > 0
        and args.proc_interval > 0
    ):
        parser.error(
            "--contested-s 0..1800, --contested-users 0..200, --contested-job-users 0..50, "
            "--fault-s 0..600, --fault-grace 0..600, --dead-holders 1..10, intervals > 0"
        )
    sys.path.insert(0, str(ROOT))
    from tests.accounts import homes

    info = machine()
    with contextlib.ExitStack() as stack:
        if args.keep:
            tmp = tempfile.mkdtemp(prefix="gpupool-load-", dir=args.keep)
            log(f"the hub's state and log stay in {tmp}")
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="gpupool-load-"))
        home_root = stack.enter_context(homes())
        mode = fault_mode(args)
        if mode == "tmpfs" and args.only in (None, "faults"):
            stack.enter_context(tmpfs(Path(tmp) / "pooldb", args.tmpfs_size))
        run = LoadRun(args, Path(tmp), home_root, mode)
        run.machine = info
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        cleanup: dict[str, int] = {}
        try:
            run.run()
        except BaseException as e:
            run.result["error"] = f"{type(e).__name__}: {e}"
            log(f"FAILED: {run.result['error']}")
            if not isinstance(e, Exception):
                raise
        finally:
            cleanup = run.cleanup()
            signal.signal(signal.SIGTERM, previous)
            if cleanup and any(cleanup.values()):
                log(f"cleanup ended {cleanup}")
        summary = summarize(run, cleanup)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(table(summary))
    return 1 if summary["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
