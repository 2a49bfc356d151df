"""What the store owes: releases and job states that happened but could not be written yet.

Vocabulary
- *owed write*: a release (an allocation id to delete) or a job's newest row that the database
  refused. Kept in memory, in order, and *paid* (written, all in one transaction:
  :meth:`Store.settle`) by the next retry; retries back off from ``first_retry_s`` doubling to
  ``max_retry_s``. A newer row of a job replaces the one owed for it.
- *healthy*: nothing owed and the last write succeeded. *unhealthy* carries the *problem* (the
  database's own words, one line) and *since* when.
- *grant*: a write that hands something out (an allocation, a new job, an adopted server). It
  first pays what is owed, then writes; when either fails it is refused with
  :class:`StoreUnavailable` (HTTP 503, one sentence): nothing is handed out that the database
  does not know, so a restart can never hand it out twice.

Contract: what happened (a server stopped, a job ended) is never undone because it could not be
written: the ledger and the job list in memory move on at once and the write follows, so the
ledger and the store disagree only while the outbox says so (:meth:`health`, the health
endpoint, ``gpupool_store_healthy``). Every write goes through one lock; the caller's clock is
the one time seam (``clock``, monotonic seconds).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError

from gpupool.clock import iso, utcnow
from gpupool.core.errors import PoolError
from gpupool.core.jobs import Job

T = TypeVar("T")
STORE_FAULTS = (SQLAlchemyError, OSError)
"""What a failed database write raises (the driver's errors come wrapped by SQLAlchemy)."""
ROW_ERRORS = (IntegrityError, DataError)
"""What a grant's own row caused (a duplicate id, a value too long): raised as it is, and the
database is not taken for unhealthy (it works; the row was wrong)."""


class StoreUnavailable(PoolError):
    """Nothing can be granted now: the database cannot record it (HTTP 503)."""

    code = "store_unavailable"


def fault_text(error: BaseException, limit: int = 160) -> str:
    """The database's own words for ``error``, one line (SQLAlchemy's wrapper adds the SQL and
    a link: only the driver's message is kept)."""
    orig = getattr(error, "orig", None)
    text = str(orig if orig is not None else error) or type(error).__name__
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


class Outbox:
    def __init__(
        self,
        settle: Callable[[list[str], list[Job]], None],
        probe: Callable[[], None],
        where: str,
        logger: logging.Logger,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], datetime] = utcnow,
        first_retry_s: float = 1.0,
        max_retry_s: float = 30.0,
    ) -> None:
        """``settle(release_ids, jobs)`` writes both in one transaction; ``probe()`` makes a
        write and rolls it back (to learn, with nothing owed, that the database works again);
        ``where`` names the database in the log and on the admin page (never with a password)."""
        self._settle = settle
        self._probe = probe
        self.where = where
        self.log = logger
        self.clock = clock
        self.wall_clock = wall_clock
        self.first_retry_s = first_retry_s
        self.max_retry_s = max_retry_s
        self._releases: dict[str, None] = {}
        self._jobs: dict[str, Job] = {}
        self.problem: str | None = None
        self.since: datetime | None = None
        self._delay = first_retry_s
        self.next_try = 0.0
        self._lock = threading.RLock()

    # -- what happened -------------------------------------------------------------------------
    def release(self, alloc_ids: Iterable[str]) -> bool:
        """Delete these allocations' rows, now or owed; True when written now."""
        with self._lock:
            self._releases.update(dict.fromkeys(alloc_ids))
            return self._pay_unless_waiting()

    def save_jobs(self, jobs: Iterable[Job]) -> bool:
        """Write these jobs' rows, now or owed (the newest row of each wins); True when written
        now."""
        with self._lock:
            for job in jobs:
                self._jobs.pop(job.id, None)
                self._jobs[job.id] = job
            return self._pay_unless_waiting()

    def _pay_unless_waiting(self) -> bool:
        """Pay now when healthy; while unhealthy the retry pays (the database is not hammered
        once per event), except when it is due."""
        if self.problem is not None and self.clock() < self.next_try:
            return False
        return self.pay()

    # -- what is handed out --------------------------------------------------------------------
    def grant(self, write: Callable[[], T]) -> T:
        """Pay what is owed, then ``write()``; :class:`StoreUnavailable` (the caller undoes
        the grant) when the database refuses either."""
        with self._lock:
            if not self.pay():
                raise StoreUnavailable(self.refusal())
            try:
                done = write()
            except ROW_ERRORS:
                raise
            except STORE_FAULTS as e:
                self._failed(e)
                raise StoreUnavailable(self.refusal()) from None
            if self.problem is not None:
                self._recovered(0)
            return done

    def refusal(self) -> str:
        """The sentence a refused grant carries."""
        return (
            f"Nothing can be handed out right now: gpupool's database cannot record it "
            f"({self.problem}). Try again in a minute; an admin sees the cause on the admin "
            "page and in /hub/api/gpupool/health."
        )

    # -- paying ----------------------------------------------------------------------------------
    def pay(self, *, probe: bool = False) -> bool:
        """Write everything owed in one transaction; True when nothing is owed now. With nothing
        owed after a failure, ``probe`` checks that the database takes writes again."""
        with self._lock:
            releases, jobs = list(self._releases), list(self._jobs.values())
            try:
                if releases or jobs:
                    self._settle(releases, jobs)
                elif self.problem is not None and probe:
                    self._probe()
                elif self.problem is not None:
                    return True  # nothing owed: a grant's own write will tell
            except STORE_FAULTS as e:
                self._failed(e)
                return False
            for alloc_id in releases:
                self._releases.pop(alloc_id, None)
            for job in jobs:
                if self._jobs.get(job.id) is job:
                    del self._jobs[job.id]
            self._recovered(len(releases) + len(jobs))
            return True

    def retry_due(self) -> bool:
        """Pay (or probe) when unhealthy and the retry is due; True when healthy after. The hub
        calls this every second; the backoff decides when it writes."""
        with self._lock:
            if self.healthy:
                return True
            if self.clock() < self.next_try:
                return False
            return self.pay(probe=True)

    def _failed(self, error: BaseException) -> None:
        text = fault_text(error)
        first = self.problem is None
        if first:
            self.since = self.wall_clock()
            self._delay = self.first_retry_s
        else:
            self._delay = min(self._delay * 2, self.max_retry_s)
        self.next_try = self.clock() + self._delay
        if first or text != self.problem:
            self.log.error(
                "gpupool: the pool's database %s cannot be written (%s): %d write(s) owed, "
                "retried every %g s at most; new allocations and jobs are refused (503) until it "
                "works. Free disk space or repair the database.",
                self.where,
                text,
                self.owed,
                self.max_retry_s,
            )
        self.problem = text

    def _recovered(self, paid: int) -> None:
        if self.problem is not None:
            self.log.warning(
                "gpupool: the pool's database %s works again (after %s): %d owed write(s) made",
                self.where,
                self.problem,
                paid,
            )
        self.problem = None
        self.since = None
        self._delay = self.first_retry_s

    # -- what it reports -------------------------------------------------------------------------
    @property
    def owed(self) -> int:
        return len(self._releases) + len(self._jobs)

    @property
    def healthy(self) -> bool:
        return self.problem is None and not self.owed

    def health(self) -> dict[str, Any]:
        """The store's health: ``healthy``, ``pending_writes``, ``since`` (ISO time or null),
        ``problem`` (the database's words or null) and ``database`` (where)."""
        with self._lock:
            return {
                "healthy": self.healthy,
                "pending_writes": self.owed,
                "since": iso(self.since.timestamp()) if self.since else None,
                "problem": self.problem,
                "database": self.where,
            }
