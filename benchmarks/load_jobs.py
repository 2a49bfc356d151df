"""The load benchmark's jobs: submissions at once, and the *burst* phase.

*Burst*: ``--jobs`` jobs (:func:`~benchmarks.load_plan.plan_jobs`: a third on the owner's GPU
offer) submitted at once, a fifth cancelled by their owner 0-3 s after submission, while four
threads time ``GET /hub/api/gpupool/jobs`` (the admin following every page, three owners
reading the newest page as the jobs panel does); until every job has ended or waits in the
queue for GPUs the notebooks hold (``--burst-timeout``).
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from benchmarks.load_plan import Persona, plan_jobs
from benchmarks.stats import percentile

if TYPE_CHECKING:
    from benchmarks.load import LoadRun


def submit_jobs(
    run: LoadRun,
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
        r, elapsed = run.http("POST", "/hub/api/gpupool/jobs", run.tokens[p.name], phase, json=body)
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
            with run.lock:
                run.job_ids[job_id] = phase
        if job_id and cancel_every and i % cancel_every == 1:
            time.sleep(delays[i])
            c, _ = run.http("DELETE", f"/hub/api/gpupool/jobs/{job_id}", run.tokens[p.name], phase)
            entry["cancelled"] = None if c is None else c.status_code
        with run.lock:
            results.append(entry)

    threads = [
        threading.Thread(target=one, args=(i, p, b), daemon=True) for i, (p, b) in enumerate(plans)
    ]
    for t in threads:
        t.start()
    go.set()
    return results, threads


def burst(run: LoadRun) -> dict[str, Any]:
    rng = random.Random(run.args.seed)
    plans = plan_jobs(run.personas, run.args.jobs)
    latencies: list[float] = []
    done = threading.Event()
    owners = sorted({p.name for p, _ in plans})

    def poll(token: str) -> None:
        while not done.is_set():
            if token == run.admin_token:  # every page: the job history needs them all
                everything = run.all_jobs("burst", latencies)
                if everything is not None:
                    run.record_jobs(everything["jobs"])
            else:  # the newest page, as the jobs panel reads it
                r, elapsed = run.http("GET", "/hub/api/gpupool/jobs", token, "burst")
                if r is not None:
                    with run.lock:
                        latencies.append(elapsed)
            done.wait(0.2)

    pollers = [run.admin_token] + [run.tokens[u] for u in owners[:3]]
    threads = [threading.Thread(target=poll, args=(t,), daemon=True) for t in pollers]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    submitted, submitters = submit_jobs(run, "burst", plans, cancel_every=5, rng=rng)
    for t in submitters:
        t.join(run.deadline.left(120))
    ids = {s["id"] for s in submitted if s["id"]}
    end = time.monotonic() + run.deadline.left(run.args.burst_timeout)
    states: dict[str, str] = {}
    ended = 0
    while time.monotonic() < end and not run.abort:
        with run.lock:
            states = {i: run.job_history[i][-1] for i in ids if run.job_history.get(i)}
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
