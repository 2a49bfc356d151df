"""Reconciliation, both ways, as a service of the hub: every allocation has a live holder, and
every live process of this hub that holds devices has an allocation.

Vocabulary
- *pass*: read JupyterHub's records (:mod:`gpupool.hub.records`) and this hub's processes
  (:mod:`gpupool.processes`, with the devices NVML finds them on), decide
  (:func:`gpupool.core.reconcile.plan`) under the pool's lock, then stop, release and adopt.
  :meth:`Reconciler.at_start` runs in ``setup(c)`` before JupyterHub serves anything;
  :meth:`Reconciler.periodic` every ``period`` seconds while it runs, reading JupyterHub's records
  from its REST API as the ``gpupool-reconciler`` service (:data:`SERVICE`,
  :data:`SERVICE_SCOPES`), whose token ``setup(c)`` makes at start.
- *actions*: counted in ``gpupool_reconcile_actions_total{action}``; ``reported`` ones are logged
  when they appear, not again while they last.

Contract: a pass that cannot read JupyterHub's REST API is skipped, logged and counted
(``gpupool_reconcile_failures_total``): "could not read" is never "no servers". Without an API
URL only the pass at start runs. The rules, and why each step is safe, are in
docs/architecture.md ("Reconciliation").
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from traitlets import Float
from traitlets.config import LoggingConfigurable

from gpupool import metrics
from gpupool.background import Periodic
from gpupool.core.errors import UnknownAllocation
from gpupool.core.ledger import Ledger
from gpupool.core.reconcile import Action, Proc, Record, holderless, lost_database, plan
from gpupool.hub.hub_api import HubAPI, HubUnreadable
from gpupool.hub.records import read_records, rest_records, safe_url
from gpupool.pool import Pool
from gpupool.processes import read_process, scan, stop_now, stop_soon, stoppable

SERVICE = "gpupool-reconciler"
"""The JupyterHub service the periodic passes read JupyterHub's records as."""
SERVICE_SCOPES = ["list:users", "read:users:groups", "read:servers", "admin:server_state"]
"""Its scopes: list the users with their groups and active servers, and the servers' state."""


class Reconciler(LoggingConfigurable):
    """Runs the passes (see the module docstring) for one pool and JupyterHub database."""

    period = Float(
        60.0,
        config=True,
        help="""Seconds between reconciliation passes while the hub runs (0: only the pass at
        start). Example: ``c.Reconciler.period = 30``""",
    )
    stop_grace = Float(
        5.0,
        config=True,
        help="""Seconds a process stopped by reconciliation gets between SIGTERM and SIGKILL.
        Example: ``c.Reconciler.stop_grace = 10``""",
    )

    request_timeout = Float(
        10.0,
        config=True,
        help="""Seconds one call to JupyterHub's REST API may take. Example:
        ``c.Reconciler.request_timeout = 30``""",
    )
    holderless_grace = Float(
        60.0,
        config=True,
        help="""Seconds a notebook allocation may go without any holder (no live process claims
        it and JupyterHub records no server for it) before a pass releases it, while the hub
        runs. Example: ``c.Reconciler.holderless_grace = 120``""",
    )

    def __init__(
        self, pool: Pool, hub_db_url: str, api_url: str = "", token: str = "", **kwargs: Any
    ) -> None:
        """``hub_db_url``: JupyterHub's database (read at start); ``api_url``: its REST API
        (``http://127.0.0.1:8081/hub/api``) and ``token`` the :data:`SERVICE`'s, for the
        periodic passes (none without them)."""
        super().__init__(**kwargs)
        self.pool = pool
        self.hub_db_url = hub_db_url
        self.hub = HubAPI(api_url, token, self.request_timeout)
        """JupyterHub's REST API, as the :data:`SERVICE`."""
        self.background = Periodic(
            "reconciliation pass", self._pass, lambda: self.period, self.log, at_once=False
        )
        self._said: set[str] = set()
        """What the last pass reported (reported again only once it has been gone a pass)."""
        self._saying: set[str] = set()
        self._warned: set[str] = set()
        """The one-time warnings given (no REST API; no servers' state)."""
        self.kept_jobs: set[str] = set()
        """Jobs found running at start when the pool database was lost: never stopped by a pass
        (an admin decides), reported once."""
        self._holderless: dict[str, float] = {}
        """When each allocation without a holder was first seen so (monotonic seconds)."""

    # -- observing ---------------------------------------------------------------------------
    def processes(self, records: Sequence[Record]) -> list[Proc]:
        """This hub's processes: those with its marker, and the live servers JupyterHub records
        (servers started before they carried the marker)."""
        procs = {p.pid: p for p in scan(self.pool.hub_marker)}
        for r in records:
            if r.alive and r.pid is not None and r.pid not in procs:
                found = read_process(r.pid)
                if found is not None and found.allocation == r.allocation:
                    procs[r.pid] = found
        return list(procs.values())

    async def read_hub(self) -> list[dict[str, Any]] | None:
        """The users with active servers, from JupyterHub's REST API as :data:`SERVICE`; ``None``
        (logged) when it cannot be read: never taken for "no servers"."""
        if not self.hub.api_url:
            self._warn_once(
                "no-api",
                "gpupool: reconciliation while the hub runs is off: no URL of JupyterHub's REST "
                "API was given (Reconciler api_url); only the pass at start runs",
            )
            return None
        try:
            users = await self.hub.active_users()
        except HubUnreadable as e:
            metrics.RECONCILE_FAILURES.inc()
            self.log.warning(
                "gpupool: a reconciliation pass was skipped: JupyterHub's REST API could not "
                "be read (%s); nothing is released or stopped until it can be",
                e,
            )
            return None
        servers = [s for u in users for s in (u.get("servers") or {}).values()]
        if any(isinstance(s, dict) and "state" not in s for s in servers):
            self._warn_once(
                "no-state",
                f"gpupool: JupyterHub's REST API gives the {SERVICE} service no servers' state "
                "(it needs the admin:server_state scope): dead servers' allocations are not "
                "released while the hub runs",
            )
        return users

    async def hub_records(self) -> list[Record]:
        """JupyterHub's running servers from its REST API (for the Kubernetes reconciler);
        :class:`HubUnreadable` when it cannot be read or no URL was given."""
        if not self.hub.api_url:
            raise HubUnreadable("no URL of JupyterHub's REST API")
        users = await self.hub.active_users()
        return await asyncio.to_thread(rest_records, users)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.log.warning(message)

    def on_devices(self, procs: list[Proc]) -> list[Proc]:
        """``procs`` with the devices NVML finds each on."""
        ours = {p.pid for p in procs}
        found: dict[int, list[str]] = defaultdict(list)
        monitor = self.pool.monitor
        for node in self.pool.inventory.nodes:
            if not monitor.can_read(node.name):
                continue
            uuids = [g.uuid for g in node.gpus if not g.instances]
            uuids += [i.uuid for g in node.gpus for i in g.instances if i.uuid]
            for uuid, sample in monitor.sample(node.name, uuids).items():
                for pid in sample.pids:
                    if pid in ours:
                        found[pid].append(uuid)
        return [replace(p, on_devices=tuple(found[p.pid])) if p.pid in found else p for p in procs]

    def known_jobs(self, procs: list[Proc]) -> set[str]:
        """The job ids the job store knows (read only when a job's process is found)."""
        if not any(p.job for p in procs):
            return set()
        return {j.id for j in self.pool.store.load_jobs()}

    # -- the passes ----------------------------------------------------------------------------
    def at_start(self) -> list[Action]:
        """The pass at hub start, before JupyterHub serves anything: synchronous, and it
        returns once what it stopped is gone."""
        began = time.perf_counter()
        self._said, self._saying = self._saying, set()
        try:
            records = read_records(self.hub_db_url)
            procs = self.on_devices(self.processes(records))
            jobs = self.known_jobs(procs)

            def decide(ledger: Ledger) -> tuple[list[Record], list[Action]]:
                lost = lost_database(ledger, records)
                keep = bool(lost) and not jobs
                return lost, plan(
                    ledger, records, procs, jobs, at_start=True, keep_unknown_jobs=keep
                )

            lost, actions = self.pool.deciding(decide)
            if lost:
                self._lost_database(lost)
                self.kept_jobs = {p.job for p in procs if p.job and p.job not in jobs}
            self._stop_now([p for a in actions for p in a.stop])
            refused = self._carry_out(actions)
            for a in refused:  # devices taken since the decision: cannot happen at start
                self.log.error("gpupool: could not adopt %s after all; stopping it", a.message)
                self._stop_now(list(a.claim))
                metrics.RECONCILE_ACTIONS.labels(action="stopped").inc()
        except Exception:
            metrics.RECONCILE_FAILURES.inc()
            raise
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - began)
        return actions

    async def periodic(self) -> list[Action]:
        """One pass while the hub runs: JupyterHub's records from its REST API (the pass is
        skipped, logged, when it cannot be read), ``/proc`` read in a worker thread, NVML and
        the decision in the event loop, the decision under the pool's lock; what it stops gets
        ``stop_grace`` seconds without blocking the loop."""
        began = time.perf_counter()
        users = await self.read_hub()
        if users is None:
            return []
        self._said, self._saying = self._saying, set()

        def look() -> tuple[list[Record], list[Proc]]:
            records = rest_records(users)
            return records, self.processes(records)

        records, procs = await asyncio.to_thread(look)
        procs = self.on_devices(procs)
        jobs = self.known_jobs(procs) | self.kept_jobs

        def decide(ledger: Ledger) -> list[Action]:
            now = time.monotonic()
            alone = holderless(ledger, records, procs)
            self._holderless = {a: self._holderless.get(a, now) for a in alone}
            return plan(
                ledger,
                records,
                procs,
                jobs,
                at_start=False,
                holderless_since=self._holderless,
                now=now,
                grace=self.holderless_grace,
            )

        actions = self.pool.deciding(decide)
        await self._stop_soon([p for a in actions for p in a.stop])
        self._carry_out(actions)
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - began)
        return actions

    def start(self) -> None:
        """Run :meth:`periodic` every ``period`` seconds in the running event loop."""
        if self.period > 0:
            self.background.start()

    def shutting_down(self) -> None:
        """The hub is going away (its servers are being stopped): no more passes."""
        self.background.cancel()

    async def stop(self) -> None:
        await self.background.stop()

    async def _pass(self) -> None:
        """One :meth:`periodic` pass of the loop; a failure is counted and logged."""
        try:
            await self.periodic()
        except SQLAlchemyError as e:  # e.g. the job store's SQLite busy: the next pass will do
            metrics.RECONCILE_FAILURES.inc()
            self.log.warning("gpupool: a reconciliation pass could not read a database: %s", e)
        except Exception:
            metrics.RECONCILE_FAILURES.inc()
            self.log.exception("gpupool: a reconciliation pass failed")

    # -- acting --------------------------------------------------------------------------------
    def _carry_out(self, actions: list[Action]) -> list[Action]:
        """Log, count, release, then adopt (what is to be stopped is stopped already);
        returns the adoptions the ledger refused."""
        for a in actions:
            if a.adopt is not None:
                continue
            if a.action == "reported" and not self._first_time(a.message):
                continue
            self.log.log(a.level, "gpupool: %s", a.message)
            metrics.RECONCILE_ACTIONS.labels(action=a.action).inc()
            if a.release:
                with contextlib.suppress(UnknownAllocation):
                    self.pool.release(a.release)
        adoptions = [a for a in actions if a.adopt is not None]
        if not adoptions:
            return []
        adopted = {x.id for x in self.pool.adopt(a.adopt for a in adoptions if a.adopt)}
        refused = []
        for a in adoptions:
            if a.adopt is not None and a.adopt.id in adopted:
                self.log.log(a.level, "gpupool: %s", a.message)
                metrics.RECONCILE_ACTIONS.labels(action="adopted").inc()
            else:
                refused.append(a)
        return refused

    def _first_time(self, message: str) -> bool:
        """Whether ``message`` is news: not reported by the last pass as well."""
        self._saying.add(message)
        return message not in self._said

    def _stop_now(self, procs: list[Proc]) -> None:
        stop_now(stoppable(procs, self.log, self._first_time), self.stop_grace, self.log)

    async def _stop_soon(self, procs: list[Proc]) -> None:
        await stop_soon(stoppable(procs, self.log, self._first_time), self.stop_grace, self.log)

    def _lost_database(self, lost: list[Record]) -> None:
        self.log.error(
            "gpupool: the pool database %s holds no allocation, but JupyterHub's database %s "
            "records %d running server(s) holding one (%s): the pool database was deleted or "
            "emptied, and is not taken for an empty pool: each server is taken back where "
            "what it runs with is consistent, or else stopped, before anything is handed out; "
            "the history of jobs is gone, and jobs found running are left running (listed next)",
            self.pool.store.engine.url.render_as_string(hide_password=True),
            safe_url(self.hub_db_url),
            len(lost),
            ", ".join(r.ref for r in lost),
        )
        metrics.RECONCILE_ACTIONS.labels(action="reported").inc()
