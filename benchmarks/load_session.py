"""The load benchmark's session with its hub: requests counted by outcome, and the hub's and
the pool's records read back.

Vocabulary
- *epoch*: goes up by one when the hub is killed and again when it answers; an answer to a
  request sent in another epoch (or while the hub is down) is the proxy's, counted apart
  (``down_codes``), never as the hub's.
- *fault window*: while the pool's store is made to fail; 503s from the gpupool API
  (``fault_503``) and refused spawns (``fault_spawn_503``) are expected then, not 5xx.
- *job history*: every state the admin saw each job in, in order.

Contract: every request is bounded by a timeout and answers ``None`` when nothing came back
(counted in ``errors`` by route); the readers of views answer ``None`` when a view could not be
read, never a partial one. Thread-safe: counters are changed under ``lock``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import requests

from benchmarks.load_plan import route
from benchmarks.load_views import Held

if TYPE_CHECKING:
    from tests.hub.conftest import Hub


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


class HubSession:
    """Requests to one hub (the test harness's :class:`~tests.hub.conftest.Hub`), counted, and
    the views read through them."""

    phase = "start"
    """The phase running now (the monitors name their findings by it)."""

    def __init__(self, args: argparse.Namespace, hub: Hub, homes: Path, db_url: str) -> None:
        self.args = args
        self.hub = hub
        self.homes = homes
        self.db_url = db_url
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
        self.fault_window = False
        self.fault_503 = 0
        self.fault_spawn_503 = 0
        self.job_history: dict[str, list[str]] = defaultdict(list)
        self.job_ids: dict[str, str] = {}  # job id -> phase
        self.hub_up = threading.Event()
        self.abort = ""
        self.responsiveness: dict[str, list[float]] = defaultdict(list)
        self._store: Any = None

    def say(self, msg: str) -> None:
        log(msg)

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

    @staticmethod
    def db_held_from(db: Sequence[Any]) -> tuple[Held, ...]:
        return tuple(
            Held(a.id, a.user, a.kind, a.ref, tuple(d.visible_id for d in a.devices), a.team)
            for a in db
        )

    def record_jobs(self, jobs: Iterable[Mapping[str, Any]]) -> None:
        with self.lock:
            for j in jobs:
                states = self.job_history[j["id"]]
                if not states or states[-1] != j["state"]:
                    states.append(j["state"])

    # -- waits -------------------------------------------------------------------------------
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
