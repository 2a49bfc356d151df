"""From a notebook's kernel: ``submit()`` a notebook, script or source, and the :class:`Job` handle.

Vocabulary and contract:

- :class:`Job`: a handle on one job of the hub: ``.id``, ``.last`` (the job as last seen, the
  hub's JSON), ``.status()`` (the job, fetched now), ``.logs(rank=0)`` (the rank's whole log as
  text), ``.wait(timeout=None, poll=2)`` (the final state; ``TimeoutError`` after ``timeout``
  seconds), ``.cancel()``; it shows itself as a table in a notebook.
- :func:`submit` ``(source, **options)``: ``source`` is a path (a ``Path``, or a one-line
  ``str`` ending in ``.ipynb``/``.py``) or the script's own Python text. A notebook is converted
  from its *saved* file by :func:`gpupool_lab.convert.notebook_to_script`; a script file or
  text is sent as it is. Options are the CLI's: ``cells`` in the index form, ``time_limit`` in
  seconds or as a duration text, and without ``offer`` the default offer; a named offer whose
  line in the offers document could never start is refused with the reason, one that would
  wait is submitted (the hub queues the job) (:mod:`gpupool_lab.options` says all three). The
  job runs in the file's folder (for text: the kernel's working folder) unless ``workdir`` says
  otherwise.
- :func:`notebook_path`: the notebook a kernel belongs to (``$JPY_SESSION_NAME``).
- Errors: :class:`~gpupool_lab.convert.ConversionError`, :class:`~gpupool_lab.client.HubError`
  (the hub's message word for word), ``FileNotFoundError``, ``ValueError`` (no offer fits, an
  offer that could never start, ``cells`` for something not a notebook, a bad duration).

Needs IPython and nbformat (for notebooks), not ipywidgets.
"""

from __future__ import annotations

import contextlib
import html
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpupool_lab.client import Client, ClientError
from gpupool_lab.convert import Cells, notebook_to_script
from gpupool_lab.options import check_offer, choose_offer
from gpupool_lab.options import time_limit as seconds

__all__ = ["Job", "notebook_path", "submit", "submit_script"]

NOTEBOOK_SUFFIXES = (".ipynb", ".py")


class Job:
    """A handle on one job of the hub; ``job`` is the hub's job (a dict) or a job id."""

    def __init__(self, job: Mapping[str, Any] | str | int, client: Client | None = None) -> None:
        self.client = client or Client()
        if isinstance(job, Mapping):
            self.id = str(job["id"])
            self.last: dict[str, Any] = dict(job)
        else:
            self.id = str(job)
            self.last = {"id": self.id}

    def status(self) -> dict[str, Any]:
        """The job as the hub has it now."""
        self.last = self.client.job(self.id)
        return dict(self.last)

    def logs(self, rank: int = 0) -> str:
        """One rank's whole log so far, as text (invalid UTF-8 replaced)."""
        data, _, state = self.client.logs(self.id, rank=rank)
        if state:
            self.last["state"] = state
        return data.decode("utf-8", errors="replace")

    def wait(self, timeout: float | None = None, poll: float = 2.0) -> str:
        """Wait until the job has ended; its final state. ``TimeoutError`` after ``timeout`` s."""
        self.last = self.client.wait(self.id, poll=poll, timeout=timeout)
        return str(self.last.get("state"))

    def cancel(self) -> dict[str, Any]:
        """Cancel the job (queued or running); the job as it is now."""
        self.last = self.client.cancel(self.id)
        return dict(self.last)

    def __repr__(self) -> str:
        parts = [repr(self.id)]
        parts += [f"{k}={self.last[k]!r}" for k in ("name", "state") if self.last.get(k)]
        return f"Job({', '.join(parts)})"

    def _repr_html_(self) -> str:
        with contextlib.suppress(ClientError):  # else: show what was last seen
            self.status()
        job = self.last
        state = str(job.get("state", "?"))
        if state == "queued" and job.get("queue_position") is not None:
            state += f" (#{job['queue_position']} in the queue)"
        rows = [
            ("job", job.get("id")),
            ("name", job.get("name")),
            ("state", state),
            ("reason", job.get("reason")),
            ("team", job.get("team")),
            ("offer", job.get("offer")),
            ("GPUs per node × nodes", _per_node(job)),
            ("ranks", job.get("ranks")),
        ]
        body = "".join(
            f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
            f"<td style='text-align:left'>{html.escape(str(v))}</td></tr>"
            for k, v in rows
            if v not in (None, "")
        )
        return f"<table class='gpupool-job'>{body}</table>"


def _per_node(job: Mapping[str, Any]) -> str | None:
    if job.get("gpus") is None:
        return None
    return f"{job.get('gpus')} × {job.get('nodes') or 1}"


def notebook_path(path: str | os.PathLike[str] | None = None) -> Path | None:
    """``path``, else the kernel's notebook (``$JPY_SESSION_NAME``, set by Jupyter Server)."""
    if path is not None:
        return Path(path).expanduser()
    session = os.environ.get("JPY_SESSION_NAME")
    if not session:
        return None
    found = Path(session).expanduser()
    if found.is_absolute() or found.exists():
        return found
    return Path.cwd() / found.name  # an API path: the kernel runs in the notebook's folder


def _is_file(source: str | os.PathLike[str]) -> bool:
    if isinstance(source, os.PathLike):
        return True
    return "\n" not in source and source.strip().lower().endswith(NOTEBOOK_SUFFIXES)


def _file_script(path: Path, cells: Cells) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    if path.suffix.lower() == ".ipynb":
        return notebook_to_script(path, cells=cells, name=path.name)
    if path.suffix.lower() != ".py":
        raise ValueError(f"not a notebook (.ipynb) or a script (.py): {path}")
    if cells != "all":
        raise ValueError("cells applies to notebooks only")
    return path.read_text(encoding="utf-8")


def submit(
    source: str | os.PathLike[str],
    *,
    gpus: int = 1,
    nodes: int | None = None,
    offer: str | None = None,
    team: str | None = None,
    time_limit: int | str | None = None,
    name: str | None = None,
    cells: Cells = "all",
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    workdir: str | None = None,
    client: Client | None = None,
) -> Job:
    """Submit a notebook (``.ipynb``, converted), a script file (``.py``) or Python source
    (see the module docstring); the job's handle."""
    client = client or Client()
    if _is_file(source):
        path = Path(source).expanduser()
        script = _file_script(path, cells)
        filename, default_name, folder = path.name, path.stem, str(path.resolve().parent)
    else:
        if cells != "all":
            raise ValueError("cells applies to notebooks only")
        script, filename, default_name, folder = str(source), None, None, os.getcwd()
    return submit_script(
        client,
        script,
        filename=filename,
        name=name or default_name,
        workdir=workdir or folder,
        offer=offer,
        gpus=gpus,
        nodes=nodes,
        team=team,
        time_limit=seconds(time_limit),
        args=args,
        env=env,
    )


def submit_script(
    client: Client,
    script: str,
    *,
    offer: str | None,
    gpus: int,
    filename: str | None = None,
    name: str | None = None,
    workdir: str | None = None,
    nodes: int | None = None,
    team: str | None = None,
    time_limit: int | None = None,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Job:
    """Submit Python source as it is, with the default offer when none is given (a named one
    that could never start is refused: :func:`~gpupool_lab.options.check_offer`); the handle."""
    offers = client.offers()
    if offer is None:
        offer = choose_offer(offers, gpus, team)
    else:
        check_offer(offers, offer, gpus, team)
    job = client.submit(
        script,
        offer=offer,
        gpus=gpus,
        filename=filename,
        name=name,
        workdir=workdir,
        nodes=nodes,
        team=team,
        time_limit=time_limit,
        args=args,
        env=env,
    )
    return Job(job, client)
