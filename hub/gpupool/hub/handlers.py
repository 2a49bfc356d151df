"""The REST API under ``/hub/api/gpupool/``: thin JupyterHub ``APIHandler`` s over the pool and
the job manager. The contract is ``hub/gpupool/hub/openapi.yaml``.

Vocabulary
- *scopes*: ``custom:gpupool:jobs`` lets a user (or their server's token) use the API for their
  own jobs; ``custom:gpupool:admin`` (held by JupyterHub's admin users through the
  ``gpupool-admin`` role) sees and cancels everyone's.
- A job that is not yours is answered 404, exactly like one that does not exist.

Contract: handlers only translate; decisions are the pool's and the manager's, and their errors
become HTTP statuses through :mod:`gpupool.hub.errors`, in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from jupyterhub.apihandlers.base import APIHandler
from tornado import web

from ..clock import iso
from ..core.errors import InvalidRequest, PoolError
from ..core.jobs import Job
from ..core.ledger import Allocation
from ..core.parse import check_size, whole_number
from ..core.units import fmt
from ..pool import Pool
from . import get_jobs, get_pool, get_reclaimer
from .errors import http_error
from .menu import menu
from .reclaim import IdleReclaimer

JOBS_SCOPE = "custom:gpupool:jobs"
ADMIN_SCOPE = "custom:gpupool:admin"


def _num(milli: int | None) -> float | None:
    return None if milli is None else float(fmt(milli))


def job_model(job: Job, position: int | None, pool: Pool) -> dict[str, Any]:
    """One job as the API and the pages show it (``position``: its place in the queue)."""
    devices = [
        pool.ledger.allocations[a].visible_devices
        for a in job.allocations
        if a in pool.ledger.allocations
    ]
    return {
        "id": job.id,
        "name": job.spec.name,
        "owner": job.owner,
        "team": job.team,
        "offer": job.spec.offer,
        "gpus": job.spec.gpus,
        "nodes": job.spec.nodes,
        "ranks": job.spec.ranks,
        "state": job.state,
        "reason": job.reason,
        "priority": job.spec.priority,
        "time_limit": job.spec.time_limit,
        "max_restarts": job.spec.max_restarts,
        "restarts": job.restarts,
        "created": iso(job.created),
        "started": iso(job.started),
        "finished": iso(job.finished),
        "exit_codes": {str(r): c for r, c in job.exit_codes},
        "queue_position": position,
        "devices": [d for ds in devices for d in ds.split(",") if d],
    }


def allocation_model(a: Allocation, reclaimer: IdleReclaimer) -> dict[str, Any]:
    """One allocation as the API and the pages show it, with what the idle reclaimer knows."""
    return {
        "id": a.id,
        "user": a.user,
        "team": a.team,
        "offer": a.offer,
        "kind": a.kind,
        "ref": a.ref,
        "count": a.count,
        "cost": _num(a.cost_milli),
        "node": a.node,
        "devices": [d.visible_id for d in a.devices],
        "since": iso(a.created),
        **({"idle": reclaimer.status(a)} if a.kind == "notebook" and a.devices else {}),
    }


class GPUPoolHandler(APIHandler):
    def caller(self) -> tuple[str, list[str], bool]:
        """``(name, groups, admin)`` of whoever calls, or 403 without the gpupool scope."""
        user = self.current_user
        if user is None:
            raise web.HTTPError(403, "Authentication required.")
        scopes = self.expanded_scopes
        admin = ADMIN_SCOPE in scopes
        if not admin and JOBS_SCOPE not in scopes:
            raise web.HTTPError(403, f"This token lacks the scope {JOBS_SCOPE}.")
        groups = [g.name for g in getattr(user, "groups", [])]
        return user.name, groups, admin

    def json_body(self, limit: int) -> dict[str, Any]:
        """The request's JSON object; 413 over ``limit`` bytes (checked before parsing), 400 if
        it is not a JSON object."""
        try:
            check_size(len(self.request.body), limit, "The request body")
        except PoolError as e:
            raise http_error(e) from None
        try:
            body = json.loads(self.request.body or b"{}")
        except ValueError:
            raise http_error(InvalidRequest("The request body is not valid JSON.")) from None
        if not isinstance(body, dict):
            raise http_error(InvalidRequest("The request body must be a JSON object."))
        return body

    def write_json(self, model: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(model))

    def job(self, job_id: str) -> Job:
        user, _, admin = self.caller()
        try:
            return get_jobs().get(job_id, user, admin)
        except PoolError as e:
            raise http_error(e) from None


class OffersHandler(GPUPoolHandler):
    def get(self) -> None:
        user, groups, _ = self.caller()
        pool = get_pool()
        teams = []
        for m in menu(pool.ledger, user, groups):
            t = m.team
            teams.append(
                {
                    "team": t.name,
                    "used": _num(m.used_milli),
                    "limit": _num(t.limit_milli),
                    "guarantee": _num(t.guarantee_milli),
                    "borrow_limit": _num(t.borrow_limit_milli),
                    "left": _num(m.left_milli),
                    "user_used": _num(m.user_used_milli),
                    "user_cap": _num(t.user_cap_milli),
                    "offers": [
                        {
                            "name": c.offer,
                            "kind": pool.ledger.offers[c.offer].kind,
                            "label": c.label,
                            "description": c.description,
                            "count": c.count,
                            "cost": _num(c.cost_milli),
                            "free": c.free,
                            "enabled": c.enabled,
                            "reason": c.reason,
                        }
                        for c in m.choices
                    ],
                }
            )
        inv = pool.inventory
        self.write_json({"simulated": inv.simulated, "inventory": inv.label, "teams": teams})


class TeamsHandler(GPUPoolHandler):
    def get(self) -> None:
        self.caller()
        ledger, jobs = get_pool().ledger, get_jobs().jobs.values()
        teams = []
        for t in [*ledger.teams.values(), ledger.everyone]:
            used = ledger.team_used[t.name]
            teams.append(
                {
                    "name": t.name,
                    "guarantee": _num(t.guarantee_milli),
                    "borrow_limit": _num(t.borrow_limit_milli),
                    "used": _num(used),
                    "borrowed": _num(t.borrowed_milli(used)),
                    "jobs_queued": sum(j.team == t.name and j.state == "queued" for j in jobs),
                    "jobs_running": sum(j.team == t.name and j.active for j in jobs),
                }
            )
        self.write_json({"teams": teams})


class AllocationsHandler(GPUPoolHandler):
    def get(self) -> None:
        """Your allocations (notebooks and jobs), with idle warnings; ``?all=1`` for an admin
        lists everyone's."""
        user, _, admin = self.caller()
        everyone = self.get_argument("all", "") in ("1", "true", "yes")
        if everyone and not admin:
            raise web.HTTPError(403, f"Listing everyone's allocations needs {ADMIN_SCOPE}.")
        allocations = sorted(
            get_pool().ledger.allocations.values(), key=lambda a: (a.created, a.id)
        )
        reclaimer = get_reclaimer()
        self.write_json(
            {
                "allocations": [
                    allocation_model(a, reclaimer)
                    for a in allocations
                    if everyone or a.user == user
                ]
            }
        )


class JobsHandler(GPUPoolHandler):
    def get(self) -> None:
        user, _, admin = self.caller()
        manager, pool = get_jobs(), get_pool()
        positions = manager.queue_positions()
        jobs = manager.visible(user, admin)
        self.write_json({"jobs": [job_model(j, positions.get(j.id), pool) for j in jobs]})

    def post(self) -> None:
        user, groups, admin = self.caller()
        manager = get_jobs()
        try:
            body = self.json_body(manager.max_submission_bytes)
            job = manager.submit(user, groups, body, admin=admin)
        except PoolError as e:
            raise http_error(e) from None
        self.write_json(job_model(job, manager.queue_position(job), get_pool()), 201)


class JobHandler(GPUPoolHandler):
    def get(self, job_id: str) -> None:
        job = self.job(job_id)
        self.write_json(job_model(job, get_jobs().queue_position(job), get_pool()))

    async def delete(self, job_id: str) -> None:
        user, _, admin = self.caller()
        try:
            job = await get_jobs().cancel(job_id, user, admin)
        except PoolError as e:
            raise http_error(e) from None
        self.write_json(job_model(job, None, get_pool()))


class JobLogsHandler(GPUPoolHandler):
    async def get(self, job_id: str) -> None:
        job = self.job(job_id)
        try:
            rank = whole_number(self.get_argument("rank", "0"), "rank", 0, job.spec.ranks - 1)
            offset = whole_number(self.get_argument("offset", "0"), "offset", 0)
        except PoolError as e:
            raise http_error(e) from None
        manager = get_jobs()
        data, size = manager.backend.read_log(job, rank, offset)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.set_header("X-Gpupool-Log-Size", str(size))
        self.set_header("X-Gpupool-Job-State", job.state)
        if self.get_argument("follow", "") not in ("1", "true", "yes"):
            self.finish(data)
            return
        while not self.client_left.is_set():  # until the job has ended and its log is drained
            if data:
                self.write(data)
                await self.flush()
                offset += len(data)
            job = manager.jobs[job.id]
            if job.final and not data:
                self.finish()
                return
            if not data:  # wait for more, or for the client to leave
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.client_left.wait(), 0.5)
            data, _ = manager.backend.read_log(job, rank, offset)
        self.log.info("gpupool: the client following job %s's log left; stopped", job.id)

    async def prepare(self) -> None:
        self.client_left = asyncio.Event()
        await super().prepare()

    def on_connection_close(self) -> None:
        self.client_left.set()


def handlers() -> list[tuple[str, type[GPUPoolHandler]]]:
    """The routes for ``c.JupyterHub.extra_handlers`` (served under ``/hub``)."""
    return [
        (r"/api/gpupool/offers", OffersHandler),
        (r"/api/gpupool/teams", TeamsHandler),
        (r"/api/gpupool/allocations", AllocationsHandler),
        (r"/api/gpupool/jobs", JobsHandler),
        (r"/api/gpupool/jobs/([^/]+)", JobHandler),
        (r"/api/gpupool/jobs/([^/]+)/logs", JobLogsHandler),
    ]
