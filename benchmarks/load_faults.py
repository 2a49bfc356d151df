"""The load benchmark's fault phases: the pool's store failing, and holders killed.

**Store fault** (``--only faults``, or in a full run after the contested phase). Two GPU
servers run and two one-rank GPU jobs (one 10 s long, one long); then the store fails for
``--fault-s`` seconds (30 by default):

- ``tmpfs`` (as root, SQLite: the default there): the pool's database lives, from the hub's
  start, in a folder of the state dir on a tmpfs of its own (``mount -t tmpfs -o size=128m``);
  a file fills it until a write fails (``ENOSPC``); the fault ends when the file is removed.
- ``rename`` (otherwise, and for ``--db-url``): ``ALTER TABLE gpupool_allocations RENAME TO
  gpupool_allocations_fault`` and the same for ``gpupool_jobs`` (SQLite and PostgreSQL alike),
  and back.

During the fault the short job ends, the long one is cancelled, both servers are stopped and
two other users try to spawn (twice each). ``GET /hub/api/gpupool/health`` is read every 0.5 s
throughout (it may answer 404 on a hub without it). Once the store works again the phase waits
``--fault-grace`` seconds (20) and then counts:

- ``stranded_jobs``: the phase's jobs with no live process that the hub still reports
  ``starting`` or ``running``;
- ``leaked_on_fault``: allocations (db or rest view) whose holder is gone
  (:func:`benchmarks.load_views.gone_holders`).

While the fault lasts (and until the store is healthy again or the grace ends), a 503 to a
spawn is an expected refusal (``fault.spawn_answers``), not ``status_5xx``; a 503 from the
gpupool API is ``fault_503``; any other answer >= 500 still counts as ``status_5xx``.

**Dead holder** (``--only dead-holder``, or in a full run after the store fault):
``dead_holder_release_s``, ``--dead-holders`` times (3): a GPU server's process gets SIGKILL
and the REST view is read every 0.2 s until its allocation is gone (at most 90 s each).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.load_plan import Persona
from benchmarks.load_views import Held, gone_holders, live_processes

if TYPE_CHECKING:
    from benchmarks.load import LoadRun

TABLES = ("gpupool_allocations", "gpupool_jobs")


# -- the tmpfs ------------------------------------------------------------------------------------
@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted on ``where`` (root only); unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)], check=True
    )
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(folder: Path) -> int:
    """Write a file in ``folder`` until the file system refuses (``ENOSPC``); its size."""
    path = folder / "fill"
    written = 0
    with path.open("wb", buffering=0) as f:
        for chunk in (1 << 20, 1 << 12, 1 << 9):
            block = b"\0" * chunk
            while True:
                try:
                    written += f.write(block) or 0
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    return written


def rename_tables(db_url: str, back: bool) -> None:
    """Rename the pool's tables away (``back``: home again)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(db_url)
    try:
        with engine.begin() as conn:
            for table in TABLES:
                old, new = (f"{table}_fault", table) if back else (table, f"{table}_fault")
                conn.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))
    finally:
        engine.dispose()


# -- the store fault ------------------------------------------------------------------------------
class StoreFault:
    def __init__(self, run: LoadRun) -> None:
        self.run = run
        self.args = run.args
        gpu = [p for p in run.personas if p.offer != "cpu" and p.team and p.count == 1]
        teams: dict[str, Persona] = {}
        for p in gpu:
            teams.setdefault(p.team or "", p)
        firsts = list(teams.values())
        rest = [p for p in gpu if p not in firsts]
        self.servers = firsts[:2]
        self.tryers = (firsts[2:] + rest)[:2]
        self.jobbers = (rest[2:] + firsts)[:2]
        self.health: list[dict[str, Any]] = []
        self.stop_health = threading.Event()
        self.events: list[str] = []
        self.t0 = 0.0

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic() - self.t0:.1f} s: {what}")
        self.run.say(f"  fault: {what}")

    def watch_health(self) -> None:
        while not self.stop_health.wait(0.5):
            r, _ = self.run.http("GET", "/hub/api/gpupool/health", "", "faults", timeout=10)
            entry: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 1)}
            entry["status"] = None if r is None else r.status_code
            if r is not None and r.status_code in (200, 503):
                with contextlib.suppress(ValueError, AttributeError):
                    store = r.json().get("store", {})
                    entry.update(healthy=store.get("healthy"), pending=store.get("pending_writes"))
            self.health.append(entry)

    def healthy_now(self) -> bool | None:
        """The last health answer: True, False, or None (no health endpoint)."""
        for entry in reversed(self.health):
            if entry["status"] == 404:
                return None
            if "healthy" in entry:
                return bool(entry["healthy"]) and not entry.get("pending")
        return None

    def break_store(self) -> dict[str, Any]:
        run = self.run
        if run.fault_mode == "tmpfs":
            return {"filled_bytes": fill(run.pool_db_dir)}
        rename_tables(run.db_url, back=False)
        return {"renamed": list(TABLES)}

    def repair_store(self) -> None:
        run = self.run
        if run.fault_mode == "tmpfs":
            (run.pool_db_dir / "fill").unlink(missing_ok=True)
        else:
            rename_tables(run.db_url, back=True)

    def spawn(self, p: Persona) -> int | None:
        r, _ = self.run.http(
            "POST",
            f"/hub/api/users/{p.name}/server",
            self.run.tokens[p.name],
            "faults",
            timeout=60,
            json=p.options(),
        )
        return None if r is None else r.status_code

    def submit(self, p: Persona, seconds: float) -> str | None:
        body = {
            "script": "import os, time\ntime.sleep(float(os.environ['LOAD_SLEEP']))\n",
            "name": "fault",
            "offer": p.offer,
            "gpus": 1,
            "time_limit": 600,
            "env": {"LOAD_SLEEP": str(seconds)},
        }
        r, _ = self.run.http(
            "POST", "/hub/api/gpupool/jobs", self.run.tokens[p.name], "faults", json=body
        )
        if r is None or r.status_code != 201:
            return None
        job_id: str = r.json()["id"]
        self.run.job_ids[job_id] = "faults"
        return job_id

    def job_states(self) -> dict[str, str]:
        everything = self.run.all_jobs("faults") or {"jobs": []}
        self.run.record_jobs(everything["jobs"])
        return {j["id"]: j["state"] for j in everything["jobs"]}

    def run_phase(self) -> dict[str, Any]:
        run = self.run
        self.t0 = time.monotonic()
        watcher = threading.Thread(target=self.watch_health, daemon=True)
        watcher.start()
        out: dict[str, Any] = {"mode": run.fault_mode, "fault_s": self.args.fault_s}
        try:
            out.update(self._run(out))
        finally:
            self.stop_health.set()
            watcher.join(15)
            run.fault_window = False
        statuses = Counter(str(h["status"]) for h in self.health)
        out["health_answers"] = dict(statuses)
        out["health_unhealthy_seen"] = sum(1 for h in self.health if h.get("healthy") is False)
        out["health_most_pending_writes"] = max(
            (h.get("pending") or 0 for h in self.health), default=0
        )
        out["events"] = self.events
        return out

    def _run(self, out: dict[str, Any]) -> dict[str, Any]:
        run = self.run
        # ready: two GPU servers up, two GPU jobs running
        spawned = {p.name: self.spawn(p) for p in self.servers}
        short = self.submit(self.jobbers[0], 10)
        long_ = self.submit(self.jobbers[-1], 300)
        jobs = [j for j in (short, long_) if j]
        end = time.monotonic() + run.deadline.left(90)
        while time.monotonic() < end:
            listed = run.servers("faults") or {}
            ready = [p.name for p in self.servers if listed.get(p.name, {}).get("ready")]
            states = self.job_states()
            running = [j for j in jobs if states.get(j) == "running"]
            if len(ready) == len(self.servers) and len(running) == len(jobs):
                break
            time.sleep(0.5)
        self.note(f"ready: servers {ready} (answers {spawned}), jobs running {running} of {jobs}")
        out.update(servers_up=len(ready), jobs_running=len(running))
        # the fault
        run.fault_window = True
        out.update(self.break_store())
        self.note(f"store broken ({run.fault_mode})")
        fault_end = time.monotonic() + self.args.fault_s
        time.sleep(2)
        if long_:
            c, _ = run.http(
                "DELETE",
                f"/hub/api/gpupool/jobs/{long_}",
                run.tokens[self.jobbers[-1].name],
                "faults",
            )
            out["cancel_answer"] = None if c is None else c.status_code
            self.note(f"cancelled job {long_}: {out['cancel_answer']}")
        stops = {}
        for p in self.servers:
            d = run.admin("DELETE", f"/users/{p.name}/server", "faults", timeout=60)
            stops[p.name] = None if d is None else d.status_code
        out["stop_answers"] = stops
        self.note(f"servers stopped: {stops}")
        spawns: Counter[str] = Counter()
        for round_ in range(2):
            for p in self.tryers:
                spawns[str(self.spawn(p))] += 1
            self.note(f"spawns tried (round {round_ + 1}): {dict(spawns)}")
            time.sleep(min(5.0, max(0.0, fault_end - time.monotonic())))
        out["spawn_answers"] = dict(spawns)
        out["spawns_granted_during_fault"] = spawns.get("201", 0) + spawns.get("202", 0)
        while time.monotonic() < fault_end:
            time.sleep(0.5)
        states = self.job_states()
        out["job_states_in_fault"] = {j: states.get(j) for j in jobs}
        self.repair_store()
        repaired = time.monotonic()
        self.note("store works again")
        # the grace: until healthy (when the hub says), at most --fault-grace s
        grace_end = repaired + self.args.fault_grace
        while time.monotonic() < grace_end:
            if self.healthy_now():
                run.fault_window = False
            time.sleep(0.5)
        run.fault_window = False
        out["healthy_again_after_s"] = self._healthy_after(repaired)
        # what is left
        states = self.job_states()
        alive = {p.holder for p in live_processes(run.homes, run.scan_cost)}
        stranded = [
            j for j in jobs if states.get(j) in ("starting", "running") and f"job:{j}" not in alive
        ]
        out["job_states_after"] = {j: states.get(j) for j in jobs}
        out["stranded_jobs"] = len(stranded)
        out["stranded_examples"] = stranded
        leaked = self.leaks()
        out["leaked_on_fault"] = len(leaked)
        out["leaked_examples"] = leaked[:8]
        for p in self.tryers:  # whatever the tries started
            run.admin("DELETE", f"/users/{p.name}/server", "faults", timeout=60)
        return out

    def _healthy_after(self, repaired: float) -> float | None:
        since = repaired - self.t0
        for h in self.health:
            if h["t"] >= since and h.get("healthy") and not h.get("pending"):
                return round(float(h["t"]) - since, 1)
        return None

    def leaks(self) -> list[dict[str, Any]]:
        run = self.run
        records = run.server_records("faults")
        procs = live_processes(run.homes, run.scan_cost)
        found: dict[str, dict[str, Any]] = {}
        rest = run.rest_allocations("faults")
        for view, allocs in (("db", run.db_held()), ("rest", rest)):
            if allocs is None or records is None:
                continue
            for (_, alloc_id), seen in gone_holders(allocs, procs, records).items():
                entry = found.setdefault(alloc_id, {**seen, "views": []})
                entry["views"].append(view)
        return list(found.values())


def store_fault(run: LoadRun) -> dict[str, Any]:
    return StoreFault(run).run_phase()


# -- the dead holder ------------------------------------------------------------------------------
def dead_holder(run: LoadRun) -> dict[str, Any]:
    """SIGKILL to a GPU server's process, ``--dead-holders`` times; seconds until its allocation
    leaves the REST view, each."""
    gpu = [p for p in run.personas if p.offer != "cpu" and p.team and p.count == 1]
    teams: dict[str, Persona] = {}
    for p in reversed(gpu):  # other users than the store fault's
        teams.setdefault(p.team or "", p)
    users = list(teams.values())[: run.args.dead_holders]
    each: list[float | None] = []
    notes: list[str] = []
    for p in users:
        if run.deadline.spent or run.abort:
            break
        r, _ = run.http(
            "POST",
            f"/hub/api/users/{p.name}/server",
            run.tokens[p.name],
            "dead-holder",
            timeout=60,
            json=p.options(),
        )
        victim = None
        end = time.monotonic() + run.deadline.left(60)
        while time.monotonic() < end and victim is None:
            listed = run.servers("dead-holder") or {}
            if listed.get(p.name, {}).get("ready"):
                victim = next(
                    (
                        q
                        for q in live_processes(run.homes, run.scan_cost)
                        if q.kind == "server" and q.user == p.name and q.devices
                    ),
                    None,
                )
            time.sleep(0.3)
        if victim is None:
            notes.append(
                f"{p.name}: no GPU server came up ({None if r is None else r.status_code})"
            )
            continue
        alloc = victim.holder.removeprefix("alloc:")
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        gone_after = None
        while time.monotonic() - t0 < 90:
            allocs = run.rest_allocations("dead-holder")
            if allocs is not None and all(a.id != alloc for a in allocs):
                gone_after = time.monotonic() - t0
                break
            time.sleep(0.2)
        each.append(None if gone_after is None else round(gone_after, 2))
        notes.append(f"{p.name}: pid {victim.pid}, allocation {alloc}: {each[-1]} s")
        run.say(f"  dead holder {notes[-1]}")
        run.admin("DELETE", f"/users/{p.name}/server", "dead-holder", timeout=60)
    measured = [s for s in each if s is not None]
    return {
        "dead_holder_release_s": max(measured) if measured else None,
        "each_s": each,
        "not_released_within_90_s": sum(1 for s in each if s is None),
        "notes": notes,
    }


def holders_of(allocs: list[dict[str, Any]]) -> list[Held]:
    """The REST view's allocations as :class:`Held`."""
    return [
        Held(a["id"], a["user"], a["kind"], a["ref"], tuple(a["devices"]), a.get("team", ""))
        for a in allocs
    ]
