"""The Jupyter Server extension: the lab front end's door to the hub's gpupool API.

Vocabulary and contract:

- Every resource lives under ``<base_url>gpupool/`` of the single-user server, behind the
  server's own authentication (``@tornado.web.authenticated``; an API request without a valid
  token or cookie gets 403). The handlers forward to the hub as :mod:`gpupool_lab.hubcall` says
  (the server's own token, in a worker thread).
- **Errors** come back as ``{"message": <text>}``: an error from the hub keeps the hub's status
  and message word for word; a hub that cannot be reached is 502, a server outside JupyterHub
  (no hub URL/token) 503; our own refusals (a bad request body, one nested too deeply for
  the parser, a notebook that cannot run as a job) are 400 with the reason, resubmitting a
  job that is not resubmittable 404 with the reason.
- **Jobs** are the hub's, each with one field of ours added: ``"resubmittable"`` (a boolean),
  true exactly when ``POST gpupool/jobs/<id>/resubmit`` has a request to submit again: the job
  was sent through ``POST gpupool/submit`` (the lab's dialog) or resubmit by one of this user's
  servers, among the latest :data:`~gpupool_lab.submissions.SUBMISSIONS_KEPT`
  (:mod:`gpupool_lab.submissions` remembers those requests). Jobs sent by REST, the CLI, the
  widget or another user have ``"resubmittable": false``, and resubmit answers them 404 with
  the reason. A resubmittable job's resubmit can still be refused as a submit is (the notebook
  is gone or no longer converts: 404/400; the hub refuses: its answer).
- **Submit requests** and cells: :mod:`gpupool_lab.submissions` (0-based cell indexes:
  ``"all"``, ``{"upto": i}`` or ``{"selected": [i, ...]}``). Resubmit converts the same notebook
  path again, as it is on disk now, with the same options.
- The allocation label: :mod:`gpupool_lab.allocation`.

Endpoints:

==========================================  ====================================================
``GET gpupool/offers``                      the hub's offers document as is
``POST gpupool/submit``                     convert a notebook and submit it → 201 and the job
``GET gpupool/jobs?limit&cursor``           ``{"jobs": [...], "next"}``: a page of the
                                            hub's, newest first, with ``resubmittable``
``GET|DELETE gpupool/jobs/<id>``            the job / cancel it (→ the job as it is now)
``POST gpupool/jobs/<id>/resubmit``         submit a remembered request again → 201 and the job
``GET gpupool/jobs/<id>/logs?rank&offset``  ``{"text", "size", "state"}``: ``size`` is the byte
                                            offset to ask from next
``GET gpupool/allocation``                  what this server holds: ``{"label", "offer",
                                            "team", "simulated", "allocation", "idle_since",
                                            "warning"}``
==========================================  ====================================================
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from gpupool_lab.allocation import allocation_info, idle_state
from gpupool_lab.client import TERMINAL_STATES, Client, Job
from gpupool_lab.hubcall import Reply, hub
from gpupool_lab.submissions import (
    SUBMISSIONS_KEPT,
    Submissions,
    default_submissions_path,
    parse_submission,
    submit_notebook,
)

if TYPE_CHECKING:
    from jupyter_server.serverapp import ServerApp

__all__ = [
    "SUBMISSIONS_KEPT",
    "Reply",
    "Submissions",
    "allocation_info",
    "idle_state",
    "log_reply",
    "parse_submission",
    "resubmittable",
]

#: how long the allocation label waits for the hub before it falls back to the environment
ALLOCATION_HUB_TIMEOUT = 5.0


def resubmittable(job: Job, remembered: Collection[str]) -> Job:
    """The hub's job with ``"resubmittable"``: whether its id is among the ``remembered`` ones."""
    return {**job, "resubmittable": str(job.get("id")) in remembered}


class GpupoolHandler(APIHandler):
    """Base: a :class:`Reply` raised anywhere becomes its status and ``{"message"}``."""

    @property
    def submissions(self) -> Submissions:
        found = self.settings.get("gpupool_submissions")
        if not isinstance(found, Submissions):
            raise Reply(500, "the gpupool server extension is not loaded")
        return found

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, Reply):
            self.set_header("Content-Type", "application/json")
            self.finish(json.dumps({"message": exc.message}))
            return
        super().write_error(status_code, **kwargs)

    def reply(self, value: Mapping[str, object], status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(value))

    def json_body(self) -> object:
        try:
            body: object = json.loads(self.request.body or b"{}")
        except ValueError as exc:
            raise Reply(400, "The request body is not valid JSON.") from exc
        except RecursionError:  # json's parser checks its depth: a clean refusal, not a crash
            raise Reply(400, "The request body nests arrays and objects too deeply.") from None
        return body

    async def remembered(self) -> frozenset[str]:
        """The ids of the resubmittable jobs."""
        return await asyncio.to_thread(self.submissions.ids)


class OffersHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        self.reply(await hub(Client.offers))


class SubmitHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def post(self) -> None:
        request = parse_submission(self.json_body())
        job = await submit_notebook(self.contents_manager, request)
        await asyncio.to_thread(self.submissions.add, str(job.get("id")), request)
        self.reply({**job, "resubmittable": True}, 201)


class JobsHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        """One page of the hub's jobs, newest first (``limit`` and ``cursor`` passed on)."""
        limit = self.get_argument("limit", "") or None
        cursor = self.get_argument("cursor", "") or None
        (jobs, after), remembered = await asyncio.gather(
            hub(lambda client: client.jobs_page(limit, cursor)), self.remembered()
        )
        self.reply({"jobs": [resubmittable(job, remembered) for job in jobs], "next": after})


class JobHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def get(self, job_id: str) -> None:
        job, remembered = await asyncio.gather(
            hub(lambda client: client.job(job_id)), self.remembered()
        )
        self.reply(resubmittable(job, remembered))

    @tornado.web.authenticated
    async def delete(self, job_id: str) -> None:
        job, remembered = await asyncio.gather(
            hub(lambda client: client.cancel(job_id)), self.remembered()
        )
        self.reply(resubmittable(job, remembered))


class ResubmitHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def post(self, job_id: str) -> None:
        request = await asyncio.to_thread(self.submissions.get, job_id)
        if request is None:
            raise Reply(
                404,
                f"Job {job_id} cannot be resubmitted from JupyterLab: no notebook and options "
                "are remembered for it (only for your latest jobs sent from the Run distributed "
                "dialog). Submit it again the way it was sent.",
            )
        job = await submit_notebook(self.contents_manager, parse_submission(request))
        await asyncio.to_thread(self.submissions.add, str(job.get("id")), request)
        self.reply({**job, "resubmittable": True}, 201)


class LogsHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def get(self, job_id: str) -> None:
        try:
            rank = int(self.get_query_argument("rank", "0"))
            offset = int(self.get_query_argument("offset", "0"))
        except ValueError as exc:
            raise Reply(400, "rank and offset must be whole numbers") from exc
        data, size, state = await hub(lambda client: client.logs(job_id, rank, offset))
        self.reply(log_reply(data, offset, size, state))


def log_reply(data: bytes, offset: int, size: int, state: str) -> dict[str, str | int]:
    """``{"text", "size", "state"}``; ``size`` is where the next read starts: right after the
    bytes returned (the hub's size may be older than its read). While the job runs, a UTF-8
    character cut at the end of ``data`` is held back so the next read gets it whole."""
    complete = data if state in TERMINAL_STATES else _complete_utf8(data)
    if complete or len(complete) < len(data):
        size = offset + len(complete)
    return {"text": complete.decode("utf-8", errors="replace"), "size": size, "state": state}


def _complete_utf8(data: bytes) -> bytes:
    """``data`` without a trailing, incomplete UTF-8 sequence (at most 3 bytes held back)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # a lead byte (or ASCII): is its sequence complete?
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4
            if byte & 0x80 and byte & 0xF8 != 0xF8 and need > back:
                return data[:-back]
            return data
    return data


class AllocationHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        offers, allocations = await asyncio.gather(
            self._offers(), self._allocations(os.environ.get("GPUPOOL_ALLOCATION", ""))
        )
        self.reply(allocation_info(os.environ, offers, allocations))

    async def _offers(self) -> dict[str, Any] | None:
        try:
            return await hub(Client.offers, timeout=ALLOCATION_HUB_TIMEOUT)
        except Exception as exc:  # the label must show even without the hub
            self.log.warning("gpupool: allocation label without the hub: %s", exc)
            return None

    async def _allocations(self, allocation_id: str) -> list[dict[str, Any]] | None:
        if not allocation_id:
            return None  # nothing of this server's for the reclaimer to watch
        try:
            return await hub(Client.allocations, timeout=ALLOCATION_HUB_TIMEOUT)
        except Exception as exc:  # no idle warning known: the label still shows
            self.log.debug("gpupool: no idle warning from the hub: %s", exc)
            return None


# -- the extension --------------------------------------------------------------------------------

JOB = r"(?P<job_id>[^/]+)"
ROUTES: list[tuple[tuple[str, ...], type[GpupoolHandler]]] = [
    (("offers",), OffersHandler),
    (("submit",), SubmitHandler),
    (("jobs",), JobsHandler),
    (("jobs", JOB), JobHandler),
    (("jobs", JOB, "resubmit"), ResubmitHandler),
    (("jobs", JOB, "logs"), LogsHandler),
    (("allocation",), AllocationHandler),
]


def _load_jupyter_server_extension(serverapp: ServerApp) -> None:
    """Register the handlers under ``<base_url>gpupool/``."""
    web_app = serverapp.web_app
    base_url = web_app.settings["base_url"]
    web_app.settings.setdefault("gpupool_submissions", Submissions(default_submissions_path()))
    handlers = [
        (url_path_join(base_url, "gpupool", *parts) + "/?", handler) for parts, handler in ROUTES
    ]
    web_app.add_handlers(".*$", handlers)
    serverapp.log.info("gpupool: handlers at %sgpupool/", base_url)
