"""The load benchmark's *contested* phase: demand beyond capacity and quota, for minutes.

For ``--contested-s`` seconds (120 by default) every user of the run with a GPU role (up to
``--contested-users``) spawns a GPU server again and again, each time one of the offers their
team allows at a random count (``h100`` × 1 or 2, ``mig-3g.40gb``: some beyond the user's cap),
keeps it 1–4 s once it answers (a 202 is stopped while it still starts) and stops it; a refusal
(the pool's quota or capacity, the hub's spawn limits) is retried after 0.2–1 s. Meanwhile
``--contested-job-users`` users submit one-rank GPU jobs (1–6 s long) and cancel half of them
0–4 s later. Then everything the phase started is stopped and cancelled.

Decisions are the hub's own counts, ``GET /hub/metrics`` before and after (:func:`decisions`):
*grants* are ``gpupool_allocation_duration_seconds_count`` (one per allocation decided and
written), *refusals* ``gpupool_refusals_total`` (by kind and reason), and *releases* follow
from the gauge ``gpupool_allocations``: grants minus its growth. ``contested_decisions`` is the
sum of the three.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from benchmarks.load_plan import FINAL, TEAMS, Persona

if TYPE_CHECKING:
    from benchmarks.load import LoadRun


# -- the hub's counts (pure) ---------------------------------------------------------------------
def pool_counts(text: str) -> dict[str, float]:
    """The counts :func:`decisions` needs from a ``/hub/metrics`` text: ``grants:<kind>``,
    ``refusals:<kind>:<reason>``, ``allocations`` (summed over labels), and the store's health
    gauges where the hub has them (``store_healthy``, ``store_pending_writes``)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {"allocations": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gpupool_allocation_duration_seconds_count":
                key = f"grants:{s.labels.get('kind', '')}"
            elif s.name == "gpupool_refusals_total":
                key = f"refusals:{s.labels.get('kind', '')}:{s.labels.get('reason', '')}"
            elif s.name == "gpupool_allocations":
                key = "allocations"
            elif s.name in ("gpupool_store_healthy", "gpupool_store_pending_writes"):
                key = s.name.removeprefix("gpupool_")
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def decisions(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Grants, releases and refusals between two :func:`pool_counts`: totals and per kind."""

    def delta(prefix: str) -> dict[str, int]:
        keys = {k for k in (*before, *after) if k.startswith(prefix)}
        out = {k.removeprefix(prefix): round(after.get(k, 0.0) - before.get(k, 0.0)) for k in keys}
        return {k: v for k, v in sorted(out.items()) if v}

    grants = delta("grants:")
    refusals = delta("refusals:")
    growth = round(after.get("allocations", 0.0) - before.get("allocations", 0.0))
    releases = sum(grants.values()) - growth
    total = sum(grants.values()) + releases + sum(refusals.values())
    return {
        "decisions": total,
        "grants": sum(grants.values()),
        "releases": releases,
        "refusals": sum(refusals.values()),
        "grants_by_kind": grants,
        "refusals_by_kind_reason": refusals,
    }


def spawn_options(team: str | None, rng: random.Random) -> dict[str, Any]:
    """One GPU spawn's ``user_options`` for a member of ``team``: an offer the team allows, at a
    random count (whole GPUs 1 or 2)."""

    offers = [o for o in (TEAMS[team]["offers"] if team else []) if o != "cpu"]
    if not offers:
        return {}
    offer = rng.choice(offers)
    return {"offer": offer, "count": rng.choice((1, 1, 2)) if offer == "h100" else 1}


# -- the phase -----------------------------------------------------------------------------------
class Contested:
    def __init__(self, run: LoadRun, seconds: float, users: int, job_users: int) -> None:
        self.run = run
        self.seconds = seconds
        gpu = [p for p in run.personas if p.offer != "cpu" and p.team]
        self.spawners = gpu[:users]
        self.jobbers = [p for p in gpu if p not in self.spawners][:job_users] or gpu[:job_users]
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.spawn_answers: Counter[str] = Counter()
        self.stop_answers: Counter[str] = Counter()
        self.job_answers: Counter[str] = Counter()
        self.cancels: Counter[str] = Counter()
        self.jobs: list[tuple[str, str]] = []  # (owner, job id)

    def count(self, counter: Counter[str], status: int | None) -> None:
        with self.lock:
            counter[str(status)] += 1

    def scrape(self) -> dict[str, float] | None:
        from tests.hub.conftest import TOKEN

        r, _ = self.run.http("GET", "/hub/metrics", TOKEN, "contested", timeout=30)
        if r is None or r.status_code != 200:
            return None
        return pool_counts(r.text)

    def spawner(self, p: Persona, seed: int) -> None:
        rng = random.Random(seed)
        run = self.run
        path = f"/hub/api/users/{p.name}/server"
        token = run.tokens[p.name]
        while not self.stop.is_set():
            r, _ = run.http(
                "POST", path, token, "contested", timeout=60, json=spawn_options(p.team, rng)
            )
            status = None if r is None else r.status_code
            self.count(self.spawn_answers, status)
            if status in (201, 202):
                self.stop.wait(rng.uniform(1, 4))
                d, _ = run.http("DELETE", path, token, "contested", timeout=60)
                self.count(self.stop_answers, None if d is None else d.status_code)
                self._wait_gone(p.name, 30)
            elif status == 400:  # still stopping: look again
                self._wait_gone(p.name, 10)
            else:
                self.stop.wait(rng.uniform(0.2, 1.0))

    def _wait_gone(self, user: str, cap: float) -> None:
        end = time.monotonic() + cap
        while time.monotonic() < end:
            r = self.run.admin("GET", f"/users/{user}", "contested", timeout=30)
            if r is not None and r.status_code == 200 and not (r.json().get("servers") or {}):
                return
            time.sleep(0.3)

    def jobber(self, p: Persona, seed: int) -> None:
        rng = random.Random(seed)
        run = self.run
        token = run.tokens[p.name]
        while not self.stop.is_set():
            body = {
                "script": "import os, time\ntime.sleep(float(os.environ['LOAD_SLEEP']))\n",
                "name": "contested",
                "offer": p.offer,
                "gpus": 1,
                "time_limit": 120,
                "env": {"LOAD_SLEEP": f"{rng.uniform(1, 6):.1f}"},
            }
            r, _ = run.http("POST", "/hub/api/gpupool/jobs", token, "contested", json=body)
            status = None if r is None else r.status_code
            self.count(self.job_answers, status)
            if status == 201 and r is not None:
                job_id = r.json()["id"]
                with self.lock:
                    self.jobs.append((p.name, job_id))
                    run.job_ids[job_id] = "contested"
                if rng.random() < 0.5:
                    self.stop.wait(rng.uniform(0, 4))
                    c, _ = run.http("DELETE", f"/hub/api/gpupool/jobs/{job_id}", token, "contested")
                    self.count(self.cancels, None if c is None else c.status_code)
            self.stop.wait(rng.uniform(0.3, 1.0))

    def finish(self) -> dict[str, int]:
        """Stop the phase's servers and cancel its jobs; wait until they are gone."""
        run = self.run
        users = [p.name for p in self.spawners]
        threads = [
            threading.Thread(
                target=run.admin, args=("DELETE", f"/users/{u}/server", "contested"), daemon=True
            )
            for u in users
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        with self.lock:
            jobs = list(self.jobs)
        everything = run.all_jobs("contested") or {"jobs": []}
        states = {j["id"]: j["state"] for j in everything["jobs"]}
        open_ = [(o, j) for o, j in jobs if states.get(j) not in FINAL]
        for owner, job_id in open_:
            run.http("DELETE", f"/hub/api/gpupool/jobs/{job_id}", run.tokens[owner], "contested")
        end = time.monotonic() + run.deadline.left(90)
        while time.monotonic() < end:
            listed = run.servers("contested") or {}
            everything = run.all_jobs("contested") or {"jobs": []}
            states = {j["id"]: j["state"] for j in everything["jobs"]}
            if not any(u in listed for u in users) and all(states.get(j) in FINAL for _, j in jobs):
                break
            time.sleep(1)
        return {"servers_stopped": len(users), "jobs_cancelled_at_end": len(open_)}

    def run_phase(self) -> dict[str, Any]:
        run = self.run
        before = self.scrape()
        t0 = time.monotonic()
        seconds = min(self.seconds, run.deadline.left())
        threads: list[threading.Thread] = []
        for i, p in enumerate(self.spawners):
            threads.append(threading.Thread(target=self.spawner, args=(p, i), daemon=True))
        for i, p in enumerate(self.jobbers):
            threads.append(threading.Thread(target=self.jobber, args=(p, 1000 + i), daemon=True))
        for t in threads:
            t.start()
        end = t0 + seconds
        while time.monotonic() < end and not run.abort:
            time.sleep(0.5)
        self.stop.set()
        for t in threads:
            t.join(max(5.0, run.deadline.left(90)))
        loaded = time.monotonic() - t0
        finished = self.finish()
        after = self.scrape()
        took = time.monotonic() - t0
        counted = decisions(before, after) if before is not None and after is not None else {}
        return {
            "seconds": round(loaded, 1),
            "seconds_with_the_stop": round(took, 1),
            "spawning_users": len(self.spawners),
            "job_users": len(self.jobbers),
            **counted,
            "decisions_per_s": round(counted["decisions"] / took, 2) if counted else None,
            "spawn_answers": dict(sorted(self.spawn_answers.items())),
            "stop_answers": dict(sorted(self.stop_answers.items())),
            "job_answers": dict(sorted(self.job_answers.items())),
            "cancel_answers": dict(sorted(self.cancels.items())),
            "jobs_submitted": len(self.jobs),
            **finished,
        }


def contested(run: LoadRun) -> dict[str, Any]:
    """The contested phase (see the module's docstring)."""
    args = run.args
    return Contested(
        run, args.contested_s, args.contested_users, args.contested_job_users
    ).run_phase()


def brief(c: Mapping[str, Any], out: Callable[[str], None]) -> None:
    out(
        f"  contested: {c.get('decisions')} decisions in {c.get('seconds_with_the_stop')} s "
        f"({c.get('grants')} grants, {c.get('releases')} releases, {c.get('refusals')} "
        f"refusals); spawns {c.get('spawn_answers')}; jobs {c.get('job_answers')}"
    )
