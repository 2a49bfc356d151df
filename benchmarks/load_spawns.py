"""The load benchmark's spawn storms: every user asks for their server at the same instant.

*Storm 1* (every user, on an empty pool) and the *retry* after the restart (the users whose
server is not running) are :func:`spawn_round`; storm 2 is :func:`storm` too, with the hub
killed while it runs (:mod:`benchmarks.load_restart`).

Vocabulary
- *202 then not running*: a spawn JupyterHub accepted (202: it starts in the background) whose
  server was not ready once nothing was pending; *refused by the pool* when the hub logged the
  pool's refusal of it (``gpupool: refused <user>/<server>: <why>``).
- percentiles are nearest-rank (:mod:`benchmarks.stats`), over every answer (refusals included).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from benchmarks.load_plan import Persona, status_class
from benchmarks.load_report import _brief
from benchmarks.load_session import log
from benchmarks.stats import percentile

if TYPE_CHECKING:
    from benchmarks.load import LoadRun


def spawn_round(run: LoadRun, phase: str, users: Sequence[Persona]) -> dict[str, Any]:
    """A storm of ``users``, the wait until nothing is pending, and its summary."""
    since = run.log_offset()
    results, join = storm(run, phase, users)
    join(run.deadline.left(run.args.request_timeout + 5))
    servers = run.settle(phase, 300)
    summary = spawn_summary(run, results, servers, since)
    log(f"  {phase}: {_brief(summary)}")
    return summary


def storm(
    run: LoadRun, phase: str, users: Sequence[Persona]
) -> tuple[list[dict[str, Any]], Callable[[float], None]]:
    """Every one of ``users`` POSTs a spawn at the same moment; returns the (filling) list of
    results and a join function."""
    go = threading.Event()
    results: list[dict[str, Any]] = []

    def one(p: Persona) -> None:
        go.wait()
        r, elapsed = run.http(
            "POST",
            f"/hub/api/users/{p.name}/server",
            run.tokens[p.name],
            phase,
            timeout=run.args.request_timeout,
            json=p.options(),
        )
        message = ""
        if r is not None and r.status_code >= 400:
            with contextlib.suppress(ValueError):
                message = str(r.json().get("message", ""))[:200]
        with run.lock:
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


def refusals_logged(run: LoadRun, since: int) -> dict[str, str]:
    """user -> the pool's last refusal of their server logged by the hub after ``since``."""
    marker = "gpupool: refused "
    found = {}
    with contextlib.suppress(OSError), run.hub.log.open("rb") as f:
        f.seek(since)
        for raw in f:
            line = raw.decode(errors="replace")
            if marker in line:
                ref, _, message = line.split(marker, 1)[1].partition(": ")
                found[ref.split("/", 1)[0]] = message.strip()[:300]
    return found


def spawn_summary(
    run: LoadRun,
    results: Sequence[dict[str, Any]],
    servers: Mapping[str, Mapping[str, Any]],
    log_since: int,
) -> dict[str, Any]:
    classes = Counter(status_class(r["status"]) for r in results)
    ready = {u for u, s in servers.items() if s.get("ready")}
    late_fail = [r["user"] for r in results if r["status"] == 202 and r["user"] not in ready]
    refused = refusals_logged(run, log_since)
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
