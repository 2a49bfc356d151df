"""The REST API under ``/hub/api/gpupool/``: thin JupyterHub ``APIHandler`` s over the pool and
the job manager. The contract is ``hub/gpupool/hub/openapi.yaml``.

Vocabulary
- *scopes* (:mod:`gpupool.hub.scopes`): ``custom:gpupool:jobs`` lets a user (or their server's
  token) use the API for their own jobs; ``custom:gpupool:admin`` sees and cancels everyone's.
- A job that is not yours is answered 404, exactly like one that does not exist.
- ``GET /health`` needs no token: 200 while the pool's database takes writes, 503 while it owes
  some (:mod:`gpupool.store.outbox`); new allocations and jobs are refused with 503 meanwhile.
- ``GET /jobs`` answers a page, newest first (:mod:`gpupool.core.paging`); submissions and
  followed logs past a per-user limit are 429 (:mod:`gpupool.core.limits`), a submission before
  its body is parsed when the user has no room in any team.
- *hub objects*: the pool, job manager and reclaimer, from the hub's tornado settings
  (:mod:`gpupool.hub.objects`).

Contract: handlers only translate; decisions are the pool's and the manager's, and the pool
errors they raise become HTTP statuses in one place, :meth:`GPUPoolHandler.write_error` (through
:mod:`gpupool.hub.errors`); a refusal is logged as one INFO line, never as an uncaught error.
JSON bodies come from :mod:`gpupool.hub.models`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from jupyterhub.apihandlers.base import APIHandler
from tornado import web
from tornado.iostream import StreamClosedError

from gpupool.core.errors import PoolError
from gpupool.core.jobs import Job
from gpupool.core.paging import page_limit
from gpupool.core.parse import clip, parse_json_object, whole_number
from gpupool.hub.errors import http_error
from gpupool.hub.models import allocation_model, job_model, offers_model, team_model
from gpupool.hub.objects import HubObjects, hub_objects
from gpupool.hub.scopes import ADMIN_SCOPE, JOBS_SCOPE

AUTH_QUERY = ("token", "_xsrf")
"""Query parameters JupyterHub itself reads on any API request (a token; the XSRF check)."""


class GPUPoolHandler(APIHandler):
    query_names: tuple[str, ...] = ()
    """The query parameters this resource reads (as ``openapi.yaml`` lists them); any other is
    refused with 400 before anything happens, so a misspelt ``limt=5`` is not silently
    ignored."""

    async def prepare(self) -> None:
        await super().prepare()
        unknown = sorted(set(self.request.query_arguments) - {*self.query_names, *AUTH_QUERY})
        if unknown:
            takes = ", ".join(self.query_names) or "none"
            raise web.HTTPError(
                400, f"unknown query parameter {clip(unknown[0], 60)}: this resource takes {takes}"
            )

    @property
    def gpupool(self) -> HubObjects:
        return hub_objects(self.settings)

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
        """The request's JSON object (:func:`gpupool.core.parse.parse_json_object`): 413 over
        ``limit`` bytes, 400 nested too deep (both before parsing), or not a JSON object."""
        return parse_json_object(self.request.body, limit)

    def write_json(self, model: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(model))

    def job(self, job_id: str) -> Job:
        user, _, admin = self.caller()
        return self.gpupool.jobs.get(job_id, user, admin)

    def job_json(self, job: Job) -> dict[str, Any]:
        return job_model(job, self.gpupool.jobs.queue_position(job))

    # -- errors, in one place ---------------------------------------------------------------
    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        if isinstance(value, PoolError):  # a refusal, not a fault
            what = clip(self.request.path, 200)
            self.log.info("gpupool: refused %s %s: %s", self.request.method, what, value.message)
            return
        super().log_exception(typ, value, tb)

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        exc_info = kwargs.get("exc_info")
        if exc_info and isinstance(exc_info[1], PoolError):
            error = http_error(exc_info[1])
            kwargs["exc_info"] = (type(error), error, exc_info[2])
            status_code = error.status_code
        super().send_error(status_code, **kwargs)


class OffersHandler(GPUPoolHandler):
    def get(self) -> None:
        user, groups, _ = self.caller()
        self.write_json(offers_model(self.gpupool.pool, user, groups))


class TeamsHandler(GPUPoolHandler):
    def get(self) -> None:
        self.caller()
        ledger, jobs = self.gpupool.pool.ledger, list(self.gpupool.jobs.jobs.values())
        teams = [team_model(ledger, t, jobs) for t in [*ledger.teams.values(), ledger.everyone]]
        self.write_json({"teams": teams})


class AllocationsHandler(GPUPoolHandler):
    query_names = ("all",)

    def get(self) -> None:
        """Your allocations (notebooks and jobs), with idle warnings; ``?all=1`` for an admin
        lists everyone's."""
        user, _, admin = self.caller()
        everyone = self.get_argument("all", "") in ("1", "true", "yes")
        if everyone and not admin:
            raise web.HTTPError(403, f"Listing everyone's allocations needs {ADMIN_SCOPE}.")
        hub = self.gpupool
        allocations = sorted(hub.pool.ledger.allocations.values(), key=lambda a: (a.created, a.id))
        self.write_json(
            {
                "allocations": [
                    allocation_model(a, hub.reclaimer)
                    for a in allocations
                    if everyone or a.user == user
                ]
            }
        )


class JobsHandler(GPUPoolHandler):
    query_names = ("limit", "cursor")

    def get(self) -> None:
        """A page of your jobs (an admin: everyone's), newest first: ``?limit=&cursor=``."""
        user, _, admin = self.caller()
        manager = self.gpupool.jobs
        limit = page_limit(self.get_argument("limit", None))
        jobs, after = manager.listing(user, admin, limit, self.get_argument("cursor", "") or None)
        positions = manager.queue_positions()
        self.write_json({"jobs": [job_model(j, positions.get(j.id)) for j in jobs], "next": after})

    def post(self) -> None:
        user, groups, admin = self.caller()
        manager = self.gpupool.jobs
        manager.check_room(user, groups)  # a user at their limit: 429 before parsing the body
        body = self.json_body(manager.max_submission_bytes)
        job = manager.submit(user, groups, body, admin=admin)
        self.write_json(self.job_json(job), 201)


class JobHandler(GPUPoolHandler):
    def get(self, job_id: str) -> None:
        self.write_json(self.job_json(self.job(job_id)))

    async def delete(self, job_id: str) -> None:
        user, _, admin = self.caller()
        job = await self.gpupool.jobs.cancel(job_id, user, admin)
        self.write_json(job_model(job, None))


class JobLogsHandler(GPUPoolHandler):
    query_names = ("rank", "offset", "follow")

    async def get(self, job_id: str) -> None:
        user, _, admin = self.caller()
        manager = self.gpupool.jobs
        job = manager.get(job_id, user, admin)
        rank = whole_number(self.get_argument("rank", "0"), "rank", 0, job.spec.ranks - 1)
        offset = whole_number(self.get_argument("offset", "0"), "offset", 0)
        follow = self.get_argument("follow", "") in ("1", "true", "yes")
        with manager.following(user, job) if follow else contextlib.nullcontext():
            data, size = await manager.read_log(job, rank, offset)
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.set_header("X-Gpupool-Log-Size", str(size))
            self.set_header("X-Gpupool-Job-State", job.state)
            if not follow:
                self.finish(data)
                return
            await self._stream(job, rank, offset + len(data), data)

    async def _stream(self, job: Job, rank: int, offset: int, first: bytes) -> None:
        """Send ``first``, then the log as it grows until the job has ended; a client that
        leaves (before or while a chunk is sent) ends it with one INFO line."""
        chunks = self.gpupool.jobs.follow_log(job, rank, offset, self.client_left)
        try:
            async with contextlib.aclosing(chunks):
                self.write(first)
                await self.flush()
                async for chunk in chunks:
                    self.write(chunk)
                    await self.flush()
        except StreamClosedError:  # it left between our look and the write
            self.client_left.set()
        if self.client_left.is_set() and self.gpupool.jobs.stopping:  # the hub's own leaving
            self.log.info("gpupool: the hub shuts down; it stopped sending job %s's log", job.id)
        elif self.client_left.is_set():
            self.log.info("gpupool: the client following job %s's log left; stopped", job.id)
        else:
            self.finish()

    async def prepare(self) -> None:
        self.client_left = asyncio.Event()
        await super().prepare()

    def on_connection_close(self) -> None:
        self.client_left.set()


class HealthHandler(GPUPoolHandler):
    def get(self) -> None:
        """Whether the pool's database takes writes (200) or not (503): for load balancers and
        probes, without a token. An admin's token also gets the database's words and where it
        is."""
        health = self.gpupool.pool.writes.health()
        store = {k: health[k] for k in ("healthy", "pending_writes", "since")}
        if self.current_user is not None and ADMIN_SCOPE in self.expanded_scopes:
            store.update(problem=health["problem"], database=health["database"])
        self.write_json({"store": store}, 200 if health["healthy"] else 503)


def handlers() -> list[tuple[str, type[GPUPoolHandler]]]:
    """The routes for ``c.JupyterHub.extra_handlers`` (served under ``/hub``)."""
    return [
        (r"/api/gpupool/health", HealthHandler),
        (r"/api/gpupool/offers", OffersHandler),
        (r"/api/gpupool/teams", TeamsHandler),
        (r"/api/gpupool/allocations", AllocationsHandler),
        (r"/api/gpupool/jobs", JobsHandler),
        (r"/api/gpupool/jobs/([^/]+)", JobHandler),
        (r"/api/gpupool/jobs/([^/]+)/logs", JobLogsHandler),
    ]
