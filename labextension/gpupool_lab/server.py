"""The Jupyter Server extension: the lab front end's door to the hub's gpupool API.

Vocabulary and contract:

- Every resource lives under ``<base_url>gpupool/`` of the single-user server, behind the
  server's own authentication (``@tornado.web.authenticated``; an API request without a valid
  token or cookie gets 403). The handlers forward to the hub through
  :class:`gpupool_lab.client.Client` with the server's own ``JUPYTERHUB_API_TOKEN`` (zero
  configuration), in a worker thread so the server's event loop never waits on the hub.
- **Errors** come back as ``{"message": <text>}``: an error from the hub keeps the hub's status
  and message word for word; a hub that cannot be reached is 502, a server outside JupyterHub
  (no hub URL/token) 503; our own refusals (a bad request body, a notebook that cannot run as a
  job) are 400 with the reason, an unknown job for resubmit 404.
- **Cells** speak in 0-based cell indexes, markdown cells counted, as
  :func:`gpupool_lab.convert.notebook_to_script` does: ``"all"``, ``{"upto": i}`` (cells 0..i)
  or ``{"selected": [i, ...]}``. Conversion messages speak in 1-based cell numbers ``#n``.
- **Submissions**: each ``POST gpupool/submit`` request is remembered (job id → the request, with
  the offer that was used) in ``~/.gpupool/submissions.json`` so that
  ``POST gpupool/jobs/<id>/resubmit`` converts the same notebook path again, as it is on disk
  now, with the same options. The file keeps the latest :data:`SUBMISSIONS_KEPT` entries.

Endpoints:

==========================================  ====================================================
``GET gpupool/offers``                      the hub's offers document as is
``POST gpupool/submit``                     convert a notebook and submit it → 201 and the job
``GET gpupool/jobs``                        the hub's ``{"jobs": [...]}``
``GET|DELETE gpupool/jobs/<id>``            the job / cancel it (→ the job as it is now)
``POST gpupool/jobs/<id>/resubmit``         submit a remembered submission again → 201 and job
``GET gpupool/jobs/<id>/logs?rank&offset``  ``{"text", "size", "state"}``: ``size`` is the byte
                                            offset to ask from next
``GET gpupool/allocation``                  what this server holds: ``{"label", "offer",
                                            "team", "simulated", "allocation", "idle_since",
                                            "warning"}`` (see :func:`allocation_info`)
==========================================  ====================================================
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from gpupool_lab.cli import UsageError, choose_offer, parse_duration
from gpupool_lab.client import (
    TERMINAL_STATES,
    Client,
    ClientError,
    HubError,
    NotConfigured,
)
from gpupool_lab.convert import Cells, ConversionError, notebook_to_script

__all__ = [
    "SUBMISSIONS_KEPT",
    "Reply",
    "Submissions",
    "allocation_info",
    "idle_state",
    "parse_submission",
]

SUBMISSIONS_KEPT = 500
#: the fields of a ``POST gpupool/submit`` body
SUBMIT_FIELDS = frozenset({"path", "cells", "gpus", "nodes", "offer", "team", "time_limit", "name"})
#: how long the allocation label waits for the hub before it falls back to the environment
ALLOCATION_HUB_TIMEOUT = 5.0
#: the fields of the hub's idle warning passed on to the lab
WARNING_FIELDS = ("reclaim_at", "action", "message")
#: ``NVIDIA_VISIBLE_DEVICES`` values that name no device list
NO_DEVICE_LIST = frozenset({"", "all", "none", "void"})


class Reply(tornado.web.HTTPError):
    """An answer other than success: an HTTP status and a message for the user, as is.

    An :class:`~tornado.web.HTTPError` without a log message (tornado would %-format it), so
    tornado sends it as an error reply; :meth:`GpupoolHandler.write_error` writes the body.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"HTTP {self.status}: {self.message}"


# -- the hub, from a worker thread ----------------------------------------------------------------


def _call_hub(method: str, *args: Any, timeout: float = 30.0, **kwargs: Any) -> Any:
    """``Client().<method>(*args, **kwargs)`` with a fresh client; ClientErrors become Replies."""
    try:
        client = Client(timeout=timeout)
    except NotConfigured as exc:
        raise Reply(503, str(exc)) from exc
    try:
        return getattr(client, method)(*args, **kwargs)
    except HubError as exc:
        raise Reply(exc.status, exc.message) from exc
    except ClientError as exc:  # HubUnreachable: no HTTP answer at all
        raise Reply(502, str(exc)) from exc
    finally:
        client.session.close()


async def hub(method: str, *args: Any, **kwargs: Any) -> Any:
    """Call the hub without blocking the event loop (see :func:`_call_hub`)."""
    return await asyncio.to_thread(_call_hub, method, *args, **kwargs)


# -- submit requests ------------------------------------------------------------------------------


def parse_cells(value: Any) -> Cells:
    """The request's ``cells`` → :func:`notebook_to_script`'s form; :class:`Reply` 400 if bad."""
    if value is None or value == "all":
        return "all"
    if isinstance(value, dict) and len(value) == 1:
        ((kind, arg),) = value.items()
        if kind == "upto" and _whole(arg):
            return int(arg)
        if kind == "selected" and isinstance(arg, list) and arg and all(map(_whole, arg)):
            return [int(i) for i in arg]
    raise Reply(
        400,
        'cells must be "all", {"upto": index} or {"selected": [index, ...]} '
        f"(0-based cell indexes), not {json.dumps(value)}",
    )


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_time_limit(value: Any) -> Any:
    """Seconds as a number, or a duration text like ``"30m"`` or ``"1h30m"``; None for none."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except argparse.ArgumentTypeError as exc:
            raise Reply(400, f"time_limit: {exc}") from exc
    return value  # a number: the hub judges it, and its message reaches the user word for word


def parse_submission(body: Any) -> dict[str, Any]:
    """Check a ``POST gpupool/submit`` body; returns it with ``cells`` and ``time_limit`` set."""
    if not isinstance(body, dict):
        raise Reply(400, "The request body must be a JSON object.")
    unknown = sorted(set(body) - SUBMIT_FIELDS)
    if unknown:
        raise Reply(400, f"Unknown fields: {', '.join(unknown)}.")
    path = body.get("path")
    if not isinstance(path, str) or not path.strip("/"):
        raise Reply(400, "path must be the notebook's path relative to the server root.")
    request = {key: value for key, value in body.items() if value is not None}
    request["path"] = path.strip("/")
    request["cells"] = body.get("cells") or "all"
    parse_cells(request["cells"])
    request["time_limit"] = parse_time_limit(body.get("time_limit"))
    return {key: value for key, value in request.items() if value is not None}


async def _notebook(contents_manager: Any, path: str) -> tuple[Any, str]:
    """The notebook node and its file name, through the server's contents manager."""
    try:
        model = contents_manager.get(path, content=True, type="notebook")
        if inspect.isawaitable(model):
            model = await model
    except tornado.web.HTTPError as exc:
        raise Reply(exc.status_code, exc.log_message or f"Cannot read {path}") from exc
    return model["content"], str(model["name"])


def workdir_for(contents_manager: Any, path: str) -> str | None:
    """The notebook's folder on disk (the contents manager's ``root_dir`` + the path's folder)."""
    root = getattr(contents_manager, "root_dir", None)
    if not root:
        return None
    folder = PurePosixPath(path).parent
    return os.path.abspath(os.path.join(root, *folder.parts))


async def submit_notebook(contents_manager: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Convert the notebook at ``request["path"]`` and submit it; returns the hub's job.

    ``request`` must come from :func:`parse_submission`; its ``offer`` is filled in with the
    default offer (the CLI's rule, :func:`gpupool_lab.cli.choose_offer`) when it has none.
    """
    path = request["path"]
    nb, filename = await _notebook(contents_manager, path)
    try:
        script = notebook_to_script(nb, cells=parse_cells(request["cells"]), name=filename)
    except ConversionError as exc:
        raise Reply(400, str(exc)) from exc
    gpus = request.get("gpus", 1)
    if not request.get("offer"):
        offers = await hub("offers")
        try:
            request["offer"] = choose_offer(offers, gpus, request.get("team"))
        except UsageError as exc:
            raise Reply(400, str(exc)) from exc
    job: dict[str, Any] = await hub(
        "submit",
        script,
        name=request.get("name") or PurePosixPath(filename).stem,
        filename=filename,
        workdir=workdir_for(contents_manager, path),
        offer=request["offer"],
        gpus=gpus,
        nodes=request.get("nodes"),
        team=request.get("team"),
        time_limit=request.get("time_limit"),
    )
    return job


# -- remembered submissions -----------------------------------------------------------------------


class Submissions:
    """job id → the submit request that made it, in a JSON file shared by the user's servers.

    Every change reads the file afresh and replaces it atomically, so two servers of one user
    (named servers share the home directory) do not lose each other's entries. A file that is
    not readable JSON counts as empty.
    """

    def __init__(self, path: Path, kept: int = SUBMISSIONS_KEPT) -> None:
        self.path = path
        self.kept = kept
        self.lock = threading.Lock()

    def _read(self) -> dict[str, dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, job_id: str) -> dict[str, Any] | None:
        with self.lock:
            found = self._read().get(job_id)
        return dict(found) if isinstance(found, dict) else None

    def add(self, job_id: str, request: dict[str, Any]) -> None:
        with self.lock:
            data = self._read()
            data.pop(job_id, None)
            data[job_id] = request
            data = dict(list(data.items())[-self.kept :])
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            temporary.write_text(json.dumps(data, indent=1), encoding="utf-8")
            os.replace(temporary, self.path)


def default_submissions_path() -> Path:
    return Path.home() / ".gpupool" / "submissions.json"


# -- the allocation label -------------------------------------------------------------------------


def visible_devices(env: Mapping[str, str]) -> list[str]:
    """The device entries this server sees: ``CUDA_VISIBLE_DEVICES`` (``NVIDIA_VISIBLE_DEVICES``
    where only the container runtime names them, as on Kubernetes)."""
    for key in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = env.get(key, "")
        if value.strip().lower() not in NO_DEVICE_LIST:
            return [d.strip() for d in value.split(",") if d.strip()]
    return []


def _hub_choices(offers: Mapping[str, Any] | None, offer: str, team: str) -> list[dict[str, Any]]:
    """The hub's choices for ``offer``: the team's first, else any team's."""
    if not offers or not offer:
        return []
    teams = [t for t in offers.get("teams", []) if isinstance(t, dict)]
    teams.sort(key=lambda t: t.get("team") != team)  # stable: the server's team first
    return [o for t in teams for o in t.get("offers", []) if o.get("name") == offer]


def _strip_count(label: str) -> str:
    """``"H100-80GB ×2"`` → ``"H100-80GB"`` (the hub's whole-GPU labels end in ``×N``)."""
    base, sep, count = label.rpartition(" ×")
    return base if sep and count.isdigit() else label


def offer_label(offer: str, devices: int, choices: list[dict[str, Any]]) -> tuple[str, str]:
    """``(label, kind)`` of what the server holds, from the hub's choices or, without them, by
    the offer name's conventions (``cpu``, ``mig-<profile>``)."""
    if choices:
        kind = str(choices[0].get("kind", "gpu"))
        if kind != "gpu":
            return str(choices[0].get("label") or offer), kind
        same = [c for c in choices if c.get("count") == devices]
        if same:
            return str(same[0].get("label")), kind
        base = _strip_count(str(choices[0].get("label") or offer))
        return (f"{base} ×{devices}" if devices else base), kind
    if not offer or offer == "cpu" or (not devices and offer.startswith("cpu")):
        return "CPU only", "cpu"
    if offer.startswith("mig-"):
        return f"MIG {offer.removeprefix('mig-')}", "mig"
    return (f"{offer} ×{devices}" if devices else offer), "gpu"


def idle_state(allocations: Sequence[Any] | None, allocation_id: str) -> dict[str, Any]:
    """``{"idle_since", "warning"}`` of this server's allocation (``id == allocation_id``) among
    the hub's ``allocations``: the idle reclaimer's ``idle_since`` (ISO time or None) and its
    warning, ``{"reclaim_at", "action", "message"}`` or None. None for both when the hub did not
    answer (``allocations`` None), the allocation is not listed or has no ``idle`` (a CPU one)."""
    found: Mapping[str, Any] = {}
    if allocation_id:
        for allocation in allocations or ():
            if isinstance(allocation, Mapping) and str(allocation.get("id")) == allocation_id:
                idle = allocation.get("idle")
                found = idle if isinstance(idle, Mapping) else {}
                break
    warning = found.get("warning")
    if not isinstance(warning, Mapping) or not all(
        isinstance(warning.get(key), str) for key in WARNING_FIELDS
    ):
        warning = None
    idle_since = found.get("idle_since")
    return {
        "idle_since": idle_since if isinstance(idle_since, str) else None,
        "warning": {key: warning[key] for key in WARNING_FIELDS} if warning else None,
    }


def allocation_info(
    env: Mapping[str, str],
    offers: Mapping[str, Any] | None,
    allocations: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """What this server holds, for the lab's status: ``{"label", "offer", "team", "simulated",
    "allocation", "idle_since", "warning"}``. ``offers`` is the hub's offers document, or None
    when the hub did not answer; the label then comes from the environment alone.
    ``allocations`` is the hub's list of the user's allocations, or None when the hub did not
    answer; ``idle_since`` and ``warning`` come from it (see :func:`idle_state`).

    Labels: ``"H100-80GB ×1 · vision"`` (whole GPUs: the hub's label for the number of visible
    devices), ``"MIG 3g.40gb · nlp"``, ``"CPU only"``.
    """
    offer, team = env.get("GPUPOOL_OFFER", ""), env.get("GPUPOOL_TEAM", "")
    allocation_id = env.get("GPUPOOL_ALLOCATION", "")
    devices = len(visible_devices(env))
    label, kind = offer_label(offer, devices, _hub_choices(offers, offer, team))
    if kind != "cpu" and team:
        label += f" · {team}"
    simulated_env = env.get("GPUPOOL_SIMULATED")
    if simulated_env is not None and simulated_env != "":
        simulated = simulated_env.strip().lower() in ("1", "true", "yes")
    else:
        simulated = bool(offers and offers.get("simulated"))
    return {
        "label": label,
        "offer": offer,
        "team": team,
        "simulated": simulated,
        "allocation": allocation_id,
        **idle_state(allocations, allocation_id),
    }


# -- handlers -------------------------------------------------------------------------------------


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

    def reply(self, value: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(value))

    def json_body(self) -> Any:
        try:
            return json.loads(self.request.body or b"{}")
        except ValueError as exc:
            raise Reply(400, "The request body is not valid JSON.") from exc


class OffersHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        self.reply(await hub("offers"))


class SubmitHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def post(self) -> None:
        request = parse_submission(self.json_body())
        job = await submit_notebook(self.contents_manager, request)
        await asyncio.to_thread(self.submissions.add, str(job.get("id")), request)
        self.reply(job, 201)


class JobsHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        self.reply({"jobs": await hub("jobs")})


class JobHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def get(self, job_id: str) -> None:
        self.reply(await hub("job", job_id))

    @tornado.web.authenticated
    async def delete(self, job_id: str) -> None:
        self.reply(await hub("cancel", job_id))


class ResubmitHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def post(self, job_id: str) -> None:
        request = await asyncio.to_thread(self.submissions.get, job_id)
        if request is None:
            raise Reply(404, f"No submission of job {job_id} is remembered here to resubmit.")
        job = await submit_notebook(self.contents_manager, parse_submission(request))
        await asyncio.to_thread(self.submissions.add, str(job.get("id")), request)
        self.reply(job, 201)


class LogsHandler(GpupoolHandler):
    @tornado.web.authenticated
    async def get(self, job_id: str) -> None:
        try:
            rank = int(self.get_query_argument("rank", "0"))
            offset = int(self.get_query_argument("offset", "0"))
        except ValueError as exc:
            raise Reply(400, "rank and offset must be whole numbers") from exc
        data, size, state = await hub("logs", job_id, rank, offset)
        self.reply(log_reply(data, offset, size, state))


def log_reply(data: bytes, offset: int, size: int, state: str) -> dict[str, Any]:
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

    async def _offers(self) -> Any:
        try:
            return await hub("offers", timeout=ALLOCATION_HUB_TIMEOUT)
        except Exception as exc:  # the label must show even without the hub
            self.log.warning("gpupool: allocation label without the hub: %s", exc)
            return None

    async def _allocations(self, allocation_id: str) -> Any:
        if not allocation_id:
            return None  # nothing of this server's for the reclaimer to watch
        try:
            return await hub("allocations", timeout=ALLOCATION_HUB_TIMEOUT)
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


def _load_jupyter_server_extension(serverapp: Any) -> None:
    """Register the handlers under ``<base_url>gpupool/``."""
    web_app = serverapp.web_app
    base_url = web_app.settings["base_url"]
    web_app.settings.setdefault("gpupool_submissions", Submissions(default_submissions_path()))
    handlers = [
        (url_path_join(base_url, "gpupool", *parts) + "/?", handler) for parts, handler in ROUTES
    ]
    web_app.add_handlers(".*$", handlers)
    serverapp.log.info("gpupool: handlers at %sgpupool/", base_url)
