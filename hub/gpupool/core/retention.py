"""Retention: which ended jobs the hub forgets, and when.

Vocabulary
- *retention*: how long a job is kept after it ended (``JobManager.retention_days``), its row,
  script and logs alike; 0 keeps ended jobs for ever.
- *expired*: ended (a final state) longer ago than the retention. A job still queued, starting
  or running never expires, however old.

Contract: pure.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpupool.core.jobs import Job


def expired(jobs: Iterable[Job], now: float, keep_s: float) -> list[Job]:
    """The jobs of ``jobs`` that ended more than ``keep_s`` seconds before ``now``, oldest end
    first (none when ``keep_s`` is 0: keep for ever)."""
    if keep_s <= 0:
        return []
    old = [j for j in jobs if j.final and j.finished is not None and now - j.finished > keep_s]
    return sorted(old, key=lambda j: (j.finished or 0.0, j.id))
