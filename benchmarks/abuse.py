"""The *abuse* phase of ``benchmarks.load``: one user floods the hub while another is timed.

``python -m benchmarks.load --only abuse [--abuse-jobs 300] [--abuse-followers 300]
[--abuse-spawns 10] [--spawn-retries 5] [--hold 10] [--hub-pythonpath DIRS] [--json]`` runs it on
its own (a hub of the load benchmark's pool and users); a full ``benchmarks.load`` run ends with
it, before everything is stopped.

One user, the *attacker* (a member of a team), goes past every per-user limit on purpose, one
flood after another:

1. *jobs*: ``--abuse-jobs`` submissions of a 1 MiB script (a comment, then a long sleep on the
   CPU-only offer), eight at a time;
2. *followers*: ``--abuse-followers`` live log streams (``?follow=1``) of one of its jobs,
   opened one after another and all held open for ``--hold`` seconds;
3. *spawn retries*: ``--abuse-spawns`` named servers started at once, each refused start sent
   again at once, up to ``--spawn-retries`` times, until one of its servers is up (so every
   acceptance counted was one more server starting at once).

All the while the *victim*, a user of another team, asks ``GET /jobs`` and ``GET /offers`` in
turn, ten a second at a fixed rate whether or not earlier answers came, each timed from when it
was due (so a stall of the hub counts for every request it held up).

Then, with the victim no longer timed, the attacker's jobs are cancelled and the jobs flood is
sent and cancelled ``--memory-rounds`` (2) more times: the hub's memory round after round says
whether anything is kept per job (a hub that keeps jobs' scripts grows by each round's accepted
scripts; the allocator's own high-water mark levels off). ``python -m benchmarks.abuse`` measures
the job manager alone the same way, without a hub: its Python heap after each round
(``tracemalloc``), which no allocator or JupyterHub memory blurs.

Keys: ``victim_p99_s`` (also p50, max, count) over the victim's requests during the floods;
``abuse_accepted_beyond_limit``: what the hub accepted beyond the limits in force
(``GPUPool.user_limits``, the defaults of the gpupool this benchmark is part of), summed over
jobs (201s beyond the room the attacker had, less jobs that ended meanwhile), followers (streams
answered 200 beyond the limit) and spawns (the most of its servers starting at once beyond the
limit, by the hub's log: a start counts from the pool's grant until JupyterHub says it is up or
failed; a server that came up frees a place, so a later start is no excess). Also: every answer's
status per flood, the hub's resident memory (``VmRSS``) before, after the floods, after the
attacker's jobs were cancelled and after each further round, the pool database's size, how often
the hub logged "Event loop was unresponsive", and per flood the victim's figures and how long
the hub's event loop (its main thread) ran on a CPU and waited, runnable, for one
(``/proc/<pid>/schedstat``: a wait long against the run means the machine's other processes,
not the hub's work, held it up).

Contract: loopback only, bounded in count (the options) and time (each wait has a deadline);
stops what it started (streams, jobs, servers). ``--hub-pythonpath`` puts folders first on the
hub's ``PYTHONPATH``: e.g. a ``git archive`` of an older gpupool, to measure it with the same
benchmark (the limits counted against stay this version's).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from benchmarks.stats import percentile

SCRIPT_BYTES = 1 << 20
"""The size of each flood job's script: the most a job may send."""
FINAL = ("succeeded", "failed", "cancelled", "lost")


def flood_script(size: int = SCRIPT_BYTES) -> str:
    """A script of ``size`` bytes: a comment, then a sleep of an hour."""
    tail = "\nimport time\ntime.sleep(3600)\n"
    return "#" + "x" * (size - 1 - len(tail)) + tail


def hub_limits() -> dict[str, int]:
    """The per-user limits a hub of this gpupool applies by default."""
    from gpupool.config import GPUPool

    defaults = GPUPool().trait_defaults("user_limits")
    assert isinstance(defaults, dict)
    return {str(k): int(v) for k, v in defaults.items()}


def rss_mib(pid: int) -> float | None:
    """The resident memory of process ``pid`` in MiB (``None`` if it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    rss = [line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")]
    return round(int(rss[0]) / 1024, 1) if rss else None


def loop_times(pid: int) -> tuple[float, float]:
    """Seconds the main thread of process ``pid`` (the hub's event loop) has run on a CPU, and
    has waited, runnable, for one (``/proc/<pid>/schedstat``); zeros if it is gone."""
    try:
        ran, waited, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(ran) / 1e9, int(waited) / 1e9


def most_starting(log: str, user: str) -> int:
    """The most servers of ``user`` starting at once, by the hub's log (one event loop, so its
    lines are in the order things happened): a start begins when the pool grants it ("gpupool:
    allocated ... notebook <user>/<server>") and ends when JupyterHub says it is up ("User
    <user>:<server> took ... seconds to start") or that it failed ("... failed to start", "Error
    starting"); a start JupyterHub refused before the pool was asked never counts."""
    who = re.escape(user)
    begin = re.compile(rf"gpupool: allocated \S+ to {who} \([^)]*notebook {who}/([^)\s]+)\)")
    end = re.compile(
        rf"User {who}:(\S+) took [\d.]+ seconds to start"
        rf"|(?:Error starting|Unhandled error starting) {who}:(\S+?)'?s? server"
        rf"|{who}:(\S+) failed to start"
    )
    starting: set[str] = set()
    most = 0
    for line in log.splitlines():
        if m := begin.search(line):
            starting.add(m.group(1))
            most = max(most, len(starting))
        elif m := end.search(line):
            starting.discard(next(g for g in m.groups() if g))
    return most


def beyond(accepted: int, room: int, freed: int = 0) -> int:
    """Acceptances beyond ``room`` (what the limit left), less ``freed`` places that came free
    meanwhile."""
    return max(0, accepted - room - freed)


class Victim:
    """Asks ``GET /jobs`` and ``GET /offers`` in turn at a fixed rate, one every ``interval`` s
    whether or not earlier answers came (open loop), until stopped. Each time is from when the
    request was due, so a stall counts once for every request it held up, not once."""

    def __init__(self, url: str, token: str, interval: float = 0.1) -> None:
        self.url, self.token, self.interval = url, token, interval
        self.times: list[float] = []
        self.dues: list[float] = []
        self.codes: Counter[int] = Counter()
        self.errors = 0
        self.lock = threading.Lock()
        self.local = threading.local()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        paths = ["/hub/api/gpupool/jobs", "/hub/api/gpupool/offers"]
        start = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            i = 0
            while True:
                due = start + i * self.interval
                if self.stop.wait(max(0.0, due - time.perf_counter())):
                    break
                pool.submit(self._one, paths[i % 2], due)
                i += 1

    def _one(self, path: str, due: float) -> None:
        session = getattr(self.local, "session", None)
        if session is None:
            session = self.local.session = requests.Session()
            session.headers["Authorization"] = f"token {self.token}"
        try:
            code: int | None = session.get(self.url + path, timeout=120).status_code
        except requests.RequestException:
            code = None
        with self.lock:
            self.times.append(time.perf_counter() - due)
            self.dues.append(due)
            if code is None:
                self.errors += 1
            else:
                self.codes[code] += 1

    def figures(self, since: float = 0.0, until: float = float("inf")) -> dict[str, Any]:
        """The figures of the requests due from ``since`` to ``until`` (perf_counter)."""
        t = [x for x, due in zip(self.times, self.dues, strict=True) if since <= due < until]
        return {
            "requests": len(t),
            "p50_s": round(percentile(t, 0.5), 3) if t else None,
            "p99_s": round(percentile(t, 0.99), 3) if t else None,
            "max_s": round(max(t), 3) if t else None,
            "codes": {str(k): v for k, v in sorted(self.codes.items())},
            "errors": self.errors,
        }


class Abuse:
    """One abuse phase against a running hub (``hub``: :class:`tests.hub.conftest.Hub`)."""

    def __init__(
        self,
        hub: Any,
        attacker: tuple[str, str],
        victim: tuple[str, str],
        args: Any,
        log: Callable[[str], None],
    ) -> None:
        self.hub, self.args, self.log = hub, args, log
        (self.attacker, self.attacker_token), (self.victim, self.victim_token) = attacker, victim
        self.limits = hub_limits()
        self.accepted_jobs: list[str] = []
        self.spawned: list[str] = []

    # -- HTTP as the attacker ------------------------------------------------------------------
    def call(self, method: str, path: str, **kw: Any) -> requests.Response | None:
        headers = {"Authorization": f"token {self.attacker_token}", **kw.pop("headers", {})}
        try:
            return requests.request(
                method,
                f"{self.hub.url}{path}",
                headers=headers,
                timeout=kw.pop("timeout", 60),
                **kw,
            )
        except requests.RequestException:
            return None

    def jobs(self, token: str) -> list[dict[str, Any]]:
        """Every job of ``token``'s user, page by page (a hub before paging: its one list)."""
        out: list[dict[str, Any]] = []
        params: dict[str, Any] = {"limit": 500}
        while True:
            r = requests.get(
                f"{self.hub.url}/hub/api/gpupool/jobs",
                params=params,
                headers={"Authorization": f"token {token}"},
                timeout=60,
            )
            page = r.json()
            out += page["jobs"]
            if not page.get("next"):
                return out
            params["cursor"] = page["next"]

    def open_jobs(self) -> list[dict[str, Any]]:
        return [j for j in self.jobs(self.attacker_token) if j["state"] not in FINAL]

    # -- the floods ----------------------------------------------------------------------------
    def flood_jobs(self) -> dict[str, Any]:
        before = {j["id"] for j in self.open_jobs()}
        body = json.dumps(
            {"script": flood_script(), "offer": "cpu", "name": "flood", "time_limit": 3600}
        ).encode()  # encoded once: the attacker's CPU is not the hub's to share
        codes: Counter[str] = Counter()
        accepted: list[str] = []
        lock = threading.Lock()

        def one(_: int) -> None:
            r = self.call(
                "POST",
                "/hub/api/gpupool/jobs",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with lock:
                codes[str(None if r is None else r.status_code)] += 1
                if r is not None and r.status_code == 201:
                    accepted.append(r.json()["id"])

        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(self.args.abuse_jobs)))
        now = {j["id"]: j["state"] for j in self.jobs(self.attacker_token)}
        ended = sum(1 for i in accepted if now.get(i) in FINAL)
        room = max(0, self.limits["jobs"] - len(before))
        self.accepted_jobs = accepted
        return {
            "posted": self.args.abuse_jobs,
            "codes": dict(codes),
            "accepted": len(accepted),
            "room_before": room,
            "ended_meanwhile": ended,
            "beyond_limit": beyond(len(accepted), room, ended),
            "s": round(time.monotonic() - t0, 1),
        }

    def flood_followers(self) -> dict[str, Any]:
        target = next(iter(self.accepted_jobs), None) or self._a_job()
        codes: Counter[str] = Counter()
        held: list[requests.Response] = []
        lock = threading.Lock()
        url = f"{self.hub.url}/hub/api/gpupool/jobs/{target}/logs"

        def one(_: int) -> None:
            try:
                r = requests.get(
                    url,
                    params={"follow": 1},
                    headers={"Authorization": f"token {self.attacker_token}"},
                    stream=True,
                    timeout=(30, None),
                )
            except requests.RequestException:
                with lock:
                    codes["None"] += 1
                return
            with lock:
                codes[str(r.status_code)] += 1
                if r.status_code == 200:
                    held.append(r)
                else:
                    r.close()

        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(one, range(self.args.abuse_followers)))
        opened = time.monotonic() - t0
        time.sleep(self.args.hold)  # the streams stay open while the victim is timed
        accepted = len(held)
        for r in held:
            r.close()
        return {
            "opened": self.args.abuse_followers,
            "codes": dict(codes),
            "accepted": accepted,
            "beyond_limit": beyond(accepted, self.limits["log_followers"]),
            "open_s": round(opened, 1),
            "held_s": self.args.hold,
            "s": round(time.monotonic() - t0, 1),
        }

    def _a_job(self) -> str:
        r = self.call("POST", "/hub/api/gpupool/jobs", json={"script": flood_script(100)})
        assert r is not None and r.status_code == 201, r and r.text
        return str(r.json()["id"])

    def flood_spawns(self) -> dict[str, Any]:
        names = [f"abuse-{i}" for i in range(self.args.abuse_spawns)]
        codes: Counter[str] = Counter()
        at_once: list[str] = []
        lock = threading.Lock()
        started = threading.Event()  # one of them is up: its place came free
        t0 = time.monotonic()

        def watch() -> None:
            while not started.is_set() and time.monotonic() - t0 < 300:
                if self._any_ready(set(names)):
                    started.set()
                started.wait(0.5)

        def one(name: str) -> None:
            for _ in range(1 + self.args.spawn_retries):  # refused: again at once
                if started.is_set():
                    return
                r = self.call(
                    "POST", f"/hub/api/users/{self.attacker}/servers/{name}", json={}, timeout=120
                )
                code = None if r is None else r.status_code
                with lock:
                    codes[str(code)] += 1
                if code in (201, 202):
                    with lock:
                        at_once.append(name)  # sent while none was up
                    if code == 201:
                        started.set()
                    return

        log_start = self.hub.log.stat().st_size
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with ThreadPoolExecutor(len(names)) as pool:
            list(pool.map(one, names))
        started.set()
        watcher.join(5)
        self._wait_started(names, deadline=time.monotonic() + 120)
        logged = self.hub.log.read_bytes()[log_start:].decode(errors="replace")
        peak = most_starting(logged, self.attacker)
        figures = {
            "servers": len(names),
            "retries": self.args.spawn_retries,
            "posts": sum(codes.values()),
            "codes": dict(codes),
            "accepted": len(at_once),
            "most_starting_at_once": peak,
            "beyond_limit": beyond(peak, self.limits["spawns"]),
            "s": round(time.monotonic() - t0, 1),
        }
        self.spawned = names  # stopped after the timed floods
        return figures

    def _wait_started(self, names: list[str], deadline: float) -> None:
        """Until none of ``names`` is still starting (each is up, or failed)."""
        while time.monotonic() < deadline:
            servers = self._servers()
            if not any(servers.get(n, {}).get("pending") == "spawn" for n in names):
                return
            time.sleep(0.5)

    def _servers(self) -> dict[str, Any]:
        r = self.hub.api("GET", f"/users/{self.attacker}")
        return dict(r.json().get("servers", {})) if r.ok else {}

    def _any_ready(self, names: set[str]) -> bool:
        servers = self._servers()
        return any(servers.get(n, {}).get("ready") for n in names)

    def _stop_servers(self, names: list[str]) -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            mine = {n: s for n, s in self._servers().items() if n in names}
            if not mine:
                return
            for name, server in mine.items():
                if not server.get("pending"):  # a start in flight cannot be stopped yet
                    self.hub.api("DELETE", f"/users/{self.attacker}/servers/{name}")
            time.sleep(1)
        self.log("  abuse: the attacker's servers were not all gone after 180 s")

    def cancel_jobs(self) -> int:
        mine = self.open_jobs()
        for job in mine:
            self.call("DELETE", f"/hub/api/gpupool/jobs/{job['id']}")
        deadline = time.monotonic() + 120
        while self.open_jobs() and time.monotonic() < deadline:
            time.sleep(1)
        return len(mine)

    # -- everything ----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        hub = self.hub
        pid = hub.proc.pid
        db = hub.state / "gpupool.sqlite"  # absent when the pool's database is elsewhere

        def db_mib() -> float | None:
            return round(db.stat().st_size / (1 << 20), 1) if db.is_file() else None

        log_start = hub.log.stat().st_size
        out: dict[str, Any] = {
            "attacker": self.attacker,
            "victim": self.victim,
            "limits": self.limits,
            "rss_mib": {"before": rss_mib(pid)},
            "db_mib": {"before": db_mib()},
        }
        requests.post(
            f"{hub.url}/hub/api/gpupool/jobs",
            json={"script": "print('mine')", "offer": "cpu", "name": "victim's"},
            headers={"Authorization": f"token {self.victim_token}"},
            timeout=60,
        )  # the victim's list is not empty
        victim = Victim(hub.url, self.victim_token)
        windows: dict[str, tuple[float, float]] = {}
        victim.thread.start()
        try:
            for name, flood in (
                ("jobs", self.flood_jobs),
                ("followers", self.flood_followers),
                ("spawns", self.flood_spawns),
            ):
                self.log(f"  abuse: {name} flood")
                t0, (ran, waited) = time.perf_counter(), loop_times(pid)
                out[name] = flood()
                windows[name] = (t0, time.perf_counter())
                out[name]["window_s"] = round(windows[name][1] - t0, 1)
                ran_after, waited_after = loop_times(pid)
                out[name]["hub_loop_ran_s"] = round(ran_after - ran, 2)
                out[name]["hub_loop_waited_s"] = round(waited_after - waited, 2)
                self.log(f"  abuse: {name}: {out[name]}")
        finally:
            victim.stop.set()
            victim.thread.join(150)
            self._stop_servers(self.spawned)
        out["rss_mib"]["after_floods"] = rss_mib(pid)
        out["db_mib"]["after_floods"] = db_mib()
        out["attacker_jobs_cancelled"] = self.cancel_jobs()
        out["rss_mib"]["after_cancel"] = rss_mib(pid)
        out["rss_mib"]["after_rounds"] = []
        for _ in range(self.args.memory_rounds):
            self.log("  abuse: the jobs flood again (memory only: is anything kept per job?)")
            self.flood_jobs()
            self.cancel_jobs()
            out["rss_mib"]["after_rounds"].append(rss_mib(pid))
        out["victim"] = victim.figures()
        for name, (since, until) in windows.items():
            out[name]["victim"] = victim.figures(since, until)
        logged = hub.log.read_bytes()[log_start:].decode(errors="replace")
        out["event_loop_unresponsive"] = logged.count("Event loop was unresponsive")
        out["tracebacks"] = logged.count("Traceback")
        out["victim_p99_s"] = out["victim"]["p99_s"]
        out["abuse_accepted_beyond_limit"] = sum(
            out[k]["beyond_limit"] for k in ("jobs", "followers", "spawns")
        )
        return out


def table(a: dict[str, Any]) -> str:
    """The phase's figures as lines of text."""
    v = a["victim"]
    rss, db = a["rss_mib"], a["db_mib"]
    lines = [
        f"abuse: victim_p99_s {a['victim_p99_s']} (p50 {v['p50_s']}, max {v['max_s']}, "
        f"{v['requests']} requests: {v['codes']}); abuse_accepted_beyond_limit "
        f"{a['abuse_accepted_beyond_limit']} (limits {a['limits']})",
    ]
    for name in ("jobs", "followers", "spawns"):
        f = a[name]
        lines.append(
            f"  {name}: {f['accepted']} accepted, {f['beyond_limit']} beyond the limit; "
            f"answers {f['codes']}; the victim meanwhile: p99 {f['victim']['p99_s']} s, "
            f"max {f['victim']['max_s']} s; the hub's loop ran {f['hub_loop_ran_s']} s and "
            f"waited {f['hub_loop_waited_s']} s for a CPU in {f['window_s']} s"
        )
    lines.append(
        f"  hub RSS MiB: before {rss['before']}, after the floods {rss['after_floods']}, after "
        f"cancelling {rss['after_cancel']}, after each jobs flood and cancel again "
        f"{rss['after_rounds']}; pool database MiB: {db['before']} -> "
        f"{db['after_floods']}; 'Event loop was unresponsive' {a['event_loop_unresponsive']} "
        f"times, {a['tracebacks']} tracebacks"
    )
    return "\n".join(lines)


def heap_rounds(rounds: int = 3, jobs: int = 32) -> list[dict[str, float]]:
    """The job manager's own memory, without a hub around it: ``rounds`` times, ``jobs`` jobs of
    a 1 MiB script submitted (queued behind a held GPU) and cancelled; after each round the
    Python heap still allocated (``tracemalloc``, after a collection) and this process's RSS.
    What the hub keeps per ended job shows as heap growing round by round."""
    import asyncio
    import gc
    import os
    import tempfile
    import tracemalloc

    from traitlets.config import Config

    from gpupool.config import GPUPool
    from gpupool.jobs.manager import JobManager
    from gpupool.pool import Pool
    from tests.accounts import shared_mode

    c = Config()
    c.GPUPool.inventory = "simulated:n: 1x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tempfile.mkdtemp(prefix='gpupool-heap-')}/pool.sqlite"
    c.GPUPool.offers = {"gpu": {"kind": "gpu"}}
    c.GPUPool.teams = {"a": {"guarantee": 1}}  # 32 jobs: within the default jobs limit
    shared_mode(c)
    m = JobManager(Pool.from_config(GPUPool(config=c)), config=c)
    m.pool.allocate("holder", ["a"], "gpu", 1, team="a")  # every job waits
    body = json.dumps({"script": flood_script(), "offer": "gpu"}).encode()

    async def one_round() -> None:
        ids = [m.submit("ann", ["a"], json.loads(body)).id for _ in range(jobs)]
        await m.schedule_pass()
        for job_id in ids:
            await m.cancel(job_id, "ann", False)

    tracemalloc.start()
    out = []
    for _ in range(rounds):
        asyncio.run(one_round())
        gc.collect()
        heap, peak = tracemalloc.get_traced_memory()
        out.append(
            {
                "heap_mib": round(heap / (1 << 20), 1),
                "peak_mib": round(peak / (1 << 20), 1),
                "rss_mib": rss_mib(os.getpid()) or 0.0,
            }
        )
    tracemalloc.stop()
    return out


if __name__ == "__main__":
    print(json.dumps({"rounds": heap_rounds()}, indent=2))
