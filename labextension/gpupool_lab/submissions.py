"""The lab's submit requests: checking one, submitting it, and remembering it for resubmit.

Vocabulary and contract:

- **request**: the body of ``POST gpupool/submit``, a JSON object with the fields
  :data:`SUBMIT_FIELDS`: ``path`` (the notebook's path relative to the server root), ``cells``
  in the JSON form of :mod:`gpupool_lab.options` (0-based indexes: ``"all"``, ``{"upto": i}``
  or ``{"selected": [i, ...]}``), ``gpus``, ``nodes``, ``offer``, ``team``, ``time_limit``
  (seconds, or a duration text like ``"1h30m"``) and ``name``. :func:`parse_submission` checks
  it (our refusals: :class:`~gpupool_lab.hubcall.Reply` 400 with the reason) and returns it
  normalised: the path without outer slashes, ``cells`` set, ``time_limit`` in seconds, unset
  fields left out. Numbers are the hub's to judge; its message reaches the user word for word.
- :func:`submit_notebook`: reads the notebook through the server's contents manager *as it is
  on disk now*, converts it (conversion messages speak in 1-based cell numbers ``#n``; a
  notebook that cannot run as a job is 400) and submits it from the notebook's folder; without
  an ``offer`` the request gets the default offer (:func:`gpupool_lab.options.choose_offer`),
  so what is remembered names the offer that was used.
- :class:`Submissions`: job id → the request that made it, in ``~/.gpupool/submissions.json``
  (shared by the user's servers), the latest :data:`SUBMISSIONS_KEPT` kept. A job is
  **resubmittable** here exactly when its id is in the store: its request can be submitted
  again. Jobs sent by REST, the CLI, the widget or another user are not in it.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from pathlib import Path, PurePosixPath
from typing import Any

import tornado.web
from jupyter_server.services.contents.manager import ContentsManager
from nbformat import NotebookNode

from gpupool_lab.client import Job
from gpupool_lab.convert import ConversionError, notebook_to_script
from gpupool_lab.hubcall import Reply, hub
from gpupool_lab.options import OptionError, cells_from_json, choose_offer, time_limit

__all__ = [
    "SUBMISSIONS_KEPT",
    "SUBMIT_FIELDS",
    "Request",
    "Submissions",
    "default_submissions_path",
    "parse_submission",
    "submit_notebook",
]

SUBMISSIONS_KEPT = 500
#: the fields of a ``POST gpupool/submit`` body
SUBMIT_FIELDS = frozenset({"path", "cells", "gpus", "nodes", "offer", "team", "time_limit", "name"})

#: a checked request (see the module docstring): JSON, as it is remembered
Request = dict[str, Any]


# -- checking and submitting ----------------------------------------------------------------------


def parse_submission(body: object) -> Request:
    """Check a ``POST gpupool/submit`` body; returns it normalised (see the module docstring)."""
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
    try:
        cells_from_json(request["cells"])
    except OptionError as exc:
        raise Reply(400, str(exc)) from exc
    limit = body.get("time_limit")
    if isinstance(limit, str):  # a number is the hub's to judge
        try:
            request["time_limit"] = time_limit(limit)
        except OptionError as exc:
            raise Reply(400, f"time_limit: {exc}") from exc
    return {key: value for key, value in request.items() if value is not None}


async def _notebook(contents_manager: ContentsManager, path: str) -> tuple[NotebookNode, str]:
    """The notebook node and its file name, through the server's contents manager."""
    try:
        model = contents_manager.get(path, content=True, type="notebook")
        if inspect.isawaitable(model):
            model = await model
    except tornado.web.HTTPError as exc:  # get_message: tornado's log_message doubles each %
        raise Reply(exc.status_code, exc.get_message() or f"Cannot read {path}") from exc
    return model["content"], str(model["name"])


def workdir_for(contents_manager: ContentsManager, path: str) -> str | None:
    """The notebook's folder on disk (the contents manager's ``root_dir`` + the path's folder)."""
    root = getattr(contents_manager, "root_dir", None)
    if not root:
        return None
    folder = PurePosixPath(path).parent
    return os.path.abspath(os.path.join(root, *folder.parts))


async def submit_notebook(contents_manager: ContentsManager, request: Request) -> Job:
    """Convert the notebook at ``request["path"]`` and submit it; returns the hub's job.

    ``request`` must come from :func:`parse_submission`; its ``offer`` is filled in with the
    default offer when it has none.
    """
    path = request["path"]
    nb, filename = await _notebook(contents_manager, path)
    try:
        script = notebook_to_script(nb, cells=cells_from_json(request["cells"]), name=filename)
    except ConversionError as exc:
        raise Reply(400, str(exc)) from exc
    gpus = request.get("gpus", 1)
    if not request.get("offer"):
        offers = await hub(lambda client: client.offers())
        try:
            request["offer"] = choose_offer(offers, gpus, request.get("team"))
        except OptionError as exc:
            raise Reply(400, str(exc)) from exc
    workdir = workdir_for(contents_manager, path)
    return await hub(
        lambda client: client.submit(
            script,
            name=request.get("name") or PurePosixPath(filename).stem,
            filename=filename,
            workdir=workdir,
            offer=request["offer"],
            gpus=gpus,
            nodes=request.get("nodes"),
            team=request.get("team"),
            time_limit=request.get("time_limit"),
        )
    )


# -- the store ------------------------------------------------------------------------------------


class Submissions:
    """job id → the request that made it, in a JSON file shared by the user's servers.

    Every change reads the file afresh and replaces it atomically, so two servers of one user
    (named servers share the home directory) do not lose each other's entries. A file that is
    not readable JSON counts as empty. Blocking: call it from a worker thread.
    """

    def __init__(self, path: Path, kept: int = SUBMISSIONS_KEPT) -> None:
        self.path = path
        self.kept = kept
        self.lock = threading.Lock()

    def _read(self) -> dict[str, Request]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {str(k): v for k, v in data.items() if isinstance(v, dict)}

    def get(self, job_id: str) -> Request | None:
        """The request that made ``job_id``, or None when it is not remembered here."""
        with self.lock:
            found = self._read().get(job_id)
        return dict(found) if found is not None else None

    def ids(self) -> frozenset[str]:
        """The ids of the jobs remembered here: the resubmittable ones."""
        with self.lock:
            return frozenset(self._read())

    def add(self, job_id: str, request: Request) -> None:
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
