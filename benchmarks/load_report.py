"""The load benchmark's report: the JSON summary of a run and its table (see
:mod:`benchmarks.load` for what each key counts)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections import Counter
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.load_plan import SPEC, final_changes
from benchmarks.stats import percentile
from benchmarks.text import align

if TYPE_CHECKING:
    from benchmarks.load import LoadRun

ROOT = Path(__file__).resolve().parents[1]


def _brief(s: Mapping[str, Any]) -> str:
    return (
        f"{s['posts']} POSTs: {s['201']}x201 {s['202']}x202 {s['4xx']}x4xx {s['5xx']}x5xx "
        f"{s['error']} errors; {s['ready_after']} ready; p50 {s['p50_s']} s, p99 {s['p99_s']} s"
    )


def meminfo_gib(key: str) -> float:
    """``key`` of ``/proc/meminfo`` (``MemTotal``, ``MemAvailable``) in GiB; infinite if the
    kernel does not tell."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / (1 << 20)
    return float("inf")


def git_state() -> tuple[str, str]:
    """The checkout's short commit and ``git status --porcelain`` of its tracked files."""
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    return head, dirty


def commit() -> str:
    """The checkout's commit, ``+changes`` when its code (Python under hub/, spawner/ or
    benchmarks/) differs from it."""
    head, dirty = git_state()
    code = [
        line[3:]
        for line in dirty.splitlines()
        if line[3:].startswith(("hub/", "spawner/", "benchmarks/")) and line.endswith(".py")
    ]
    return head + ("+changes" if code else "")


def machine() -> dict[str, Any]:
    head, dirty = git_state()
    total = meminfo_gib("MemTotal")
    import gpupool

    return {
        "cores": os.cpu_count(),
        "memory_gib": round(total, 1),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "commit": head + ("+changes" if dirty else ""),
        "uncommitted": sorted(
            line[3:] for line in dirty.splitlines() if line[3:].startswith(("hub/", "spawner/"))
        ),
        "gpupool_from": str(Path(gpupool.__file__).resolve().parents[1]),
    }


KEYS = (
    "double_owner",
    "over_quota",
    "orphans",
    "leaked",
    "leaked_during_run",
    "status_5xx",
    "final_state_changed",
    "contested_decisions",
    "killed_with_spawns_in_flight",
    "killed_with_job_starts_in_flight",
    "stranded_jobs",
    "leaked_on_fault",
    "fault_503",
    "dead_holder_release_s",
    "spawn_p50_s",
    "spawn_p99_s",
    "jobs_get_p50_s",
    "jobs_get_p99_s",
    "victim_p99_s",
    "abuse_accepted_beyond_limit",
)
"""The table's keys, in order (each defined in benchmarks/README.md)."""


def pcts(values: list[float], scale: float = 1.0, digits: int = 3) -> dict[str, Any]:
    vals = [v * scale for v in values]
    return {
        "n": len(vals),
        "p50": round(percentile(vals, 0.5), digits) if vals else None,
        "p99": round(percentile(vals, 0.99), digits) if vals else None,
        "max": round(max(vals), digits) if vals else None,
    }


def summarize(run: LoadRun, cleanup: Mapping[str, int]) -> dict[str, Any]:
    from benchmarks.load_views import intervals, scan_figures

    r = run.result
    storm1 = r.get("storm1", {})
    burst = r.get("burst", {})
    final = r.get("final", {})
    crash = r.get("crash", {})
    contested = r.get("contested", {})
    fault = r.get("faults", {})
    dead = r.get("dead_holder", {})
    jobs_seen = dict(run.job_history)  # every job the admin saw, the run's and the abuse's
    changed = final_changes(jobs_seen, ("succeeded", "failed", "cancelled", "lost"))
    end_states = Counter(states[-1] for states in jobs_seen.values() if states)
    looks = {
        phase: pcts(intervals(times)) for phase, times in run.look_times.items() if len(times) > 1
    }
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "note": run.args.note,
        "machine": run.machine,
        "pool": f"simulated: {SPEC} (16 GPU-eq)",
        "database": run.db_where,
        "servers": "real JupyterLab (jupyterhub-singleuser), real torchrun jobs; nothing faked",
        "users": run.args.users,
        "only": run.args.only,
        "double_owner": len(run.double.seen),
        "over_quota": len(run.quota.seen),
        "orphans": len(run.orphans.seen),
        "leaked": final.get("leaked"),
        "leaked_during_run": len(run.leaks.confirmed),
        "status_5xx": run.statuses["5xx"],
        "final_state_changed": len(changed),
        "contested_decisions": contested.get("decisions"),
        "killed_with_spawns_in_flight": crash.get("killed_with_spawns_in_flight"),
        "killed_with_job_starts_in_flight": crash.get("killed_with_job_starts_in_flight"),
        "stranded_jobs": fault.get("stranded_jobs"),
        "leaked_on_fault": fault.get("leaked_on_fault"),
        "fault_503": run.fault_503 if fault else None,
        "dead_holder_release_s": dead.get("dead_holder_release_s"),
        "spawn_p50_s": storm1.get("p50_s"),
        "spawn_p99_s": storm1.get("p99_s"),
        "jobs_get_p50_s": burst.get("jobs_get_p50_s"),
        "jobs_get_p99_s": burst.get("jobs_get_p99_s"),
        "victim_p99_s": r.get("abuse", {}).get("victim_p99_s"),
        "abuse_accepted_beyond_limit": r.get("abuse", {}).get("abuse_accepted_beyond_limit"),
        "by_view": {"double_owner": run.double.by_view(), "over_quota": run.quota.by_view()},
        "cross_view_kinds": dict(Counter(str(k[0]) for k in run.cross.confirmed)),
        "proc_scan": scan_figures(run.scan_cost, time.monotonic() - run.started),
        "look_interval_s": looks,
        "storm1": storm1,
        "burst": burst,
        "crash": crash,
        "retry": r.get("retry", {}),
        "contested": contested,
        "faults": fault,
        "dead_holder": dead,
        "abuse": r.get("abuse", {}),
        "final": final,
        "jobs": {
            "submitted": len(run.job_ids),
            "tracked": len(jobs_seen),
            "polls": run.job_polls,
            "end_states": dict(end_states),
        },
        "http": {
            "codes": {str(k): v for k, v in sorted(run.codes.items())},
            "errors": dict(run.errors),
            "while_the_hub_was_down": {str(k): v for k, v in sorted(run.down_codes.items())},
            "fault_spawn_503": run.fault_spawn_503,
        },
        "examples": {
            "double_owner": run.double.examples,
            "over_quota": run.quota.examples,
            "orphans": run.orphans.examples,
            "leaked_during_run": list(run.leaks.confirmed.values())[:8],
            "status_5xx": run.fivexx,
            "final_state_changed": [{"job": j, "states": s} for j, s in list(changed.items())[:8]],
        },
        "phases_s": r.get("phases_s", {}),
        "total_s": r.get("total_s"),
        "min_mem_available_gib": round(run.min_mem, 2),
        "peak_live_jobs": dict(run.peaks),
        "monitor_get_s": {
            phase: pcts(times) for phase, times in run.responsiveness.items() if times
        },
        "aborted": run.abort or None,
        "error": r.get("error"),
        "cleanup_killed": dict(cleanup),
    }


def table(s: Mapping[str, Any]) -> str:
    def fmt(v: Any) -> str:
        return "-" if v is None else str(v)

    rows = [["invariant / figure", "value"]]
    for key in KEYS:
        rows.append([key, fmt(s.get(key))])
    out = [align(rows), ""]
    spawn_rows = [
        [
            "storm",
            "POSTs",
            "201",
            "202",
            "4xx",
            "5xx",
            "no answer",
            "ready after",
            "202 then not running",
            "p50 s",
            "p99 s",
        ]
    ]
    for name, sp in (
        ("storm 1", s["storm1"]),
        ("storm 2 (kill -9)", s["crash"].get("spawns")),
        ("retry after restart", s["retry"]),
    ):
        if sp:
            spawn_rows.append(
                [
                    name,
                    *(
                        fmt(sp.get(k))
                        for k in (
                            "posts",
                            "201",
                            "202",
                            "4xx",
                            "5xx",
                            "error",
                            "ready_after",
                            "202_then_not_running",
                            "p50_s",
                            "p99_s",
                        )
                    ),
                ]
            )
    out += [align(spawn_rows)]
    if s["crash"]:
        out.append("(storm 2's 5xx: the proxy's 503 for the killed hub, not in status_5xx)")
    out.append("")
    b = s["burst"]
    if b:
        out.append(
            f"burst: {b['submitted']} jobs ({b['cancel_requests']} cancelled by their owner), "
            f"states at its end {b['states_at_end']}, {b['jobs_get_requests']} GET /jobs: "
            f"p50 {b['jobs_get_p50_s']} s, p99 {b['jobs_get_p99_s']} s, max {b['jobs_get_max_s']} s"
        )
    c = s["crash"]
    if c:
        out.append(
            f"kill -9 {c['killed_after_s']} s into storm 2: "
            f"{c['posts_unanswered_at_kill']} spawn POSTs "
            f"unanswered, {c['server_processes_at_kill']} server processes, "
            f"{c['jobs_alive_at_kill']} jobs alive; hub answering again after "
            f"{c['hub_up_again_s']} s"
        )
    if c:
        out.append(
            f"  killed with {c.get('killed_with_spawns_in_flight')} spawns pending and "
            f"{c.get('killed_with_job_starts_in_flight')} jobs starting (REST view, "
            f"{c.get('in_flight_look_age_s')} s before the kill)"
        )
    k = s["contested"]
    if k:
        out.append(
            f"contested, {k.get('seconds')} s: {k.get('decisions')} decisions "
            f"({k.get('grants')} grants {k.get('grants_by_kind')}, {k.get('releases')} releases, "
            f"{k.get('refusals')} refusals {k.get('refusals_by_kind_reason')}); "
            f"{k.get('decisions_per_s')}/s; spawn answers {k.get('spawn_answers')}, "
            f"jobs {k.get('job_answers')}"
        )
    f = s["faults"]
    if f:
        out.append(
            f"store fault ({f.get('mode')}, {f.get('fault_s')} s): spawns "
            f"{f.get('spawn_answers')}, stops {f.get('stop_answers')}, health "
            f"{f.get('health_answers')}, healthy again "
            f"after {f.get('healthy_again_after_s')} s; jobs after {f.get('job_states_after')}"
        )
    d = s["dead_holder"]
    if d:
        out.append(f"dead holders: released after {d.get('each_s')} s")
    ps = s["proc_scan"]
    out.append(
        f"/proc scans: {ps['scans']}, p50 {ps['p50_ms']} ms, p99 {ps['p99_ms']} ms, max "
        f"{ps['max_ms']} ms over up to {ps['pids_max']} processes ({ps['core_share']} of a core); "
        f"look intervals (s): "
        + ", ".join(f"{ph} p50 {v['p50']} max {v['max']}" for ph, v in s["look_interval_s"].items())
    )
    if s["abuse"]:
        from benchmarks.abuse import table as abuse_table

        out.append(abuse_table(s["abuse"]))
    out.append(f"jobs over the run: {s['jobs']}; HTTP: {s['http']['codes']}")
    if s["http"]["errors"]:
        out.append(f"requests without an answer: {s['http']['errors']}")
    looks = ", ".join(
        f"{phase} p99 {m['p99']} s (max {m['max']} s)" for phase, m in s["monitor_get_s"].items()
    )
    out.append(f"the hub's responsiveness (monitor's GETs): {looks}")
    out.append(f"phases (s): {s['phases_s']}; total {s['total_s']} s")
    out.append(f"machine and code: {s['machine']}{'; ' + s['note'] if s['note'] else ''}")
    for key in (
        "double_owner",
        "over_quota",
        "orphans",
        "leaked_during_run",
        "status_5xx",
        "final_state_changed",
    ):
        for ex in s["examples"][key][:3]:
            out.append(f"  e.g. {key}: {json.dumps(ex)}")
    if s["final"].get("leaked_examples"):
        out.append(f"  e.g. leaked: {json.dumps(s['final']['leaked_examples'][0])}")
    if s["aborted"]:
        out.append(f"ABORTED: {s['aborted']}")
    return "\n".join(out)
