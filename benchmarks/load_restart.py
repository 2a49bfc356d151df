"""The load benchmark's *storm 2 and crash*: the hub killed with spawns and job starts in flight.

One 40-second job first (so that a job runs across the crash), then every user spawns again
while short jobs are submitted one a second; the REST view is read every 0.1 s, and once it
shows a server pending its spawn and a job starting at the same look the hub gets SIGKILL (or
``--kill-after`` seconds in; the proxy, servers and jobs live on) and is started again.

Vocabulary
- *in flight*: servers JupyterHub lists as pending their spawn, and jobs ``starting`` (the
  newest 200, as the admin), at one look (:func:`in_flight`).
- ``killed_with_spawns_in_flight`` / ``killed_with_job_starts_in_flight``: what the last look
  before the kill showed (``in_flight_look_age_s`` before it).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any

from benchmarks.load_jobs import submit_jobs
from benchmarks.load_plan import plan_jobs
from benchmarks.load_session import log
from benchmarks.load_spawns import spawn_summary, storm
from benchmarks.load_views import live_processes

if TYPE_CHECKING:
    from benchmarks.load import LoadRun


def in_flight(run: LoadRun, phase: str) -> tuple[list[str], list[str]] | None:
    """The REST view of what is in flight: servers pending their spawn (JupyterHub's
    ``GET /users?state=active``) and jobs ``starting`` (the newest 200 jobs, as the admin);
    ``None`` if either did not answer."""
    r = run.admin("GET", "/users?state=active&limit=500", phase, timeout=10)
    j, _ = run.http("GET", "/hub/api/gpupool/jobs?limit=200", run.admin_token, phase, timeout=10)
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


def crash_storm(run: LoadRun) -> dict[str, Any]:
    """One 40 s job, then storm 2 with short jobs submitted one a second; SIGKILL to the hub
    once the REST view shows a spawn pending and a job starting at one look (or
    ``--kill-after`` s have passed); restart; settle."""
    assert run.hub.proc is not None
    plans = plan_jobs(run.personas[1:], max(1, run.args.storm_jobs))
    long_ = [(plans[0][0], {**plans[0][1], "name": "storm-long", "env": {"LOAD_SLEEP": "40"}})]
    submitted, submitters = submit_jobs(run, "storm2", long_)
    for t in submitters:
        t.join(run.deadline.left(60))
    mine = {f"job:{s['id']}" for s in submitted if s["id"]}
    end = time.monotonic() + run.deadline.left(30)
    while mine and time.monotonic() < end:  # so that a job runs across the crash
        if mine & {p.holder for p in live_processes(run.homes, run.scan_cost)}:
            break
        time.sleep(0.5)
    since = run.log_offset()
    t0 = time.monotonic()
    results, join = storm(run, "storm2", run.personas)
    killed = threading.Event()
    trickled: list[dict[str, Any]] = []

    def trickle() -> None:  # job starts to be in flight when the hub dies
        for i, (p, body) in enumerate(plans[1:]):
            if killed.wait(1.0):
                return
            sent, threads = submit_jobs(
                run, "storm2", [(p, {**body, "name": f"storm-{i}", "env": {"LOAD_SLEEP": "1"}})]
            )
            for t in threads:
                t.join(30)
            trickled.extend(sent)

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    end = t0 + run.args.kill_after
    flight: tuple[list[str], list[str]] = ([], [])
    seen = time.monotonic()
    looks = 0
    while time.monotonic() < end:
        now = in_flight(run, "storm2")
        looks += 1
        if now is not None:
            flight, seen = now, time.monotonic()
            if flight[0] and flight[1]:
                break
        time.sleep(0.1)
    killed_at = time.monotonic() - t0
    with run.lock:
        unanswered = len(run.personas) - len(results)
    procs = live_processes(run.homes, run.scan_cost)
    run.hub_up.clear()
    run.epoch += 1
    os.kill(run.hub.proc.pid, signal.SIGKILL)
    run.hub.proc.wait()
    killed.set()
    age = time.monotonic() - seen
    log(
        f"  SIGKILL to the hub (pid {run.hub.proc.pid}) {killed_at:.1f} s into the storm, "
        f"with {len(flight[0])} spawns pending and {len(flight[1])} jobs starting "
        f"({age:.2f} s before), {unanswered} spawn POSTs unanswered, "
        f"{sum(p.kind == 'server' for p in procs)} server processes and "
        f"{len({p.holder for p in procs if p.kind == 'job'})} jobs alive"
    )
    t1 = time.monotonic()
    run.hub.start()
    restart = time.monotonic() - t1
    run.epoch += 1
    run.hub_up.set()
    join(run.deadline.left(run.args.request_timeout))
    trickler.join(30)
    log(f"  hub answering again after {restart:.1f} s")
    servers = run.settle("restart", 180)
    summary = spawn_summary(run, results, servers, since)
    return {
        "killed_after_s": round(killed_at, 1),
        "killed_with_spawns_in_flight": len(flight[0]),
        "killed_with_job_starts_in_flight": len(flight[1]),
        "in_flight_look_age_s": round(age, 2),
        "in_flight_looks": looks,
        "in_flight_examples": {"spawns": flight[0][:8], "jobs": flight[1][:8]},
        "posts_unanswered_at_kill": unanswered,
        "server_processes_at_kill": sum(p.kind == "server" for p in procs),
        "jobs_alive_at_kill": len({p.holder for p in procs if p.kind == "job"}),
        "storm_jobs_accepted": sum(1 for s in [*submitted, *trickled] if s["id"]),
        "hub_up_again_s": round(restart, 1),
        "servers_listed_after_restart": len(servers),
        "spawns": summary,
    }
