"""Inside a notebook: the launcher widget, job handles, ``submit()`` and ``%%distributed``.

Vocabulary and contract:

- **choice**: one line of the hub's offers document (``GET offers``): an offer of a team with a
  count (``H100-80GB ×2 · vision``), what is free of it now, and whether the team's quota allows
  it now (``enabled``) or why not (``reason``).
- :func:`launcher` ``(path=None, **defaults)`` returns a :class:`Launcher` (an ipywidgets
  ``VBox``) with the lab dialog's choices: offer and team (the enabled choices, with free counts;
  the others listed below with their reason; each team's quota used and left), GPUs per node,
  nodes, time limit, which cells (all, up to cell #n, selected cells #a,#b), a job name, and
  Submit. Submit converts the notebook's *saved* file with
  :func:`gpupool_lab.convert.notebook_to_script` and submits it with
  :meth:`gpupool_lab.client.Client.submit`, as the CLI does. The notebook is ``path`` or, in a
  kernel started by Jupyter Server, ``$JPY_SESSION_NAME``. ``defaults`` are :func:`submit`'s
  keywords (``gpus``, ``nodes``, ``offer``, ``team``, ``time_limit``, ``cells``, ``name``).
- **cells**: the Python API (:func:`submit`, ``launcher(cells=...)``) speaks in 0-based cell
  indexes as :func:`notebook_to_script` does (``"all"``, an index: up to and including it, or a
  list of indexes); the widget's text box speaks in 1-based cell numbers ``#n``, as the
  conversion messages and the CLI's ``--cells`` do.
- **time limit**: seconds, or a duration text (``"90s"``, ``"30m"``, ``"1h30m"``).
- **default offer** (no ``offer``): the CLI's rule, :func:`gpupool_lab.cli.choose_offer`.
- :class:`Job`: a handle on one job: ``.id``, ``.status()`` (the job, fetched now),
  ``.logs(rank=0)`` (the rank's whole log as text), ``.wait(timeout=None, poll=2)`` (the final
  state; ``TimeoutError`` after ``timeout`` seconds), ``.cancel()``; it shows itself as a table
  in a notebook.
- ``%load_ext gpupool_lab`` registers the cell magic
  ``%%distributed [--gpus N] [--nodes N] [--offer O] [--team T] [--time-limit 30m] [--name X]
  [--wait]``: the cell's code runs as a job (converted like a one-cell notebook, so magics are
  refused the same way); it prints the job id and returns the :class:`Job`. ``--wait`` waits for
  the end and prints the final state and rank 0's log. Errors (the hub's, word for word, or
  conversion's) are printed on stderr and the magic returns None.
"""

from __future__ import annotations

import argparse
import contextlib
import html
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ipywidgets as widgets
from IPython.core.magic import Magics, cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from nbformat.v4 import new_code_cell, new_notebook

from gpupool_lab.cli import UsageError, choose_offer, parse_cells, parse_duration
from gpupool_lab.client import Client, ClientError
from gpupool_lab.convert import Cells, ConversionError, notebook_to_script

__all__ = ["Choice", "DistributedMagics", "Job", "Launcher", "launcher", "submit"]

DEFAULT_KEYS = frozenset({"gpus", "nodes", "offer", "team", "time_limit", "cells", "name"})
NOTEBOOK_SUFFIXES = (".ipynb", ".py")


# -- job handles ----------------------------------------------------------------------------------


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


# -- submitting -----------------------------------------------------------------------------------


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


def _seconds(time_limit: int | str | None) -> int | None:
    if isinstance(time_limit, str):
        return parse_duration(time_limit) if time_limit.strip() else None
    return time_limit


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
    """Submit a notebook (``.ipynb``, converted), a script file (``.py``) or Python source.

    ``source`` is a path (a ``Path``, or a one-line ``str`` ending in ``.ipynb``/``.py``) or
    the script's own text. Raises :class:`~gpupool_lab.convert.ConversionError`,
    :class:`~gpupool_lab.client.HubError` (the hub's message), ``FileNotFoundError`` or
    ``ValueError`` (no offer fits ``gpus``; ``cells`` for something not a notebook).
    """
    client = client or Client()
    if _is_file(source):
        path = Path(source).expanduser()
        script = _file_script(path, cells)
        filename, default_name, folder = path.name, path.stem, str(path.resolve().parent)
    else:
        if cells != "all":
            raise ValueError("cells applies to notebooks only")
        script, filename, default_name, folder = str(source), None, None, os.getcwd()
    return _submit(
        client,
        script,
        filename=filename,
        name=name or default_name,
        workdir=workdir or folder,
        offer=offer,
        gpus=gpus,
        nodes=nodes,
        team=team,
        time_limit=_seconds(time_limit),
        args=args,
        env=env,
    )


def _submit(client: Client, script: str, *, offer: str | None, gpus: int, **fields: Any) -> Job:
    """Submit ``script`` with the default offer when none is given; the job's handle."""
    if offer is None:
        try:
            offer = choose_offer(client.offers(), gpus, fields.get("team"))
        except UsageError as exc:
            raise ValueError(str(exc)) from exc
    return Job(client.submit(script, offer=offer, gpus=gpus, **fields), client)


# -- the launcher ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """One line of the hub's offers document (see the module docstring)."""

    team: str
    offer: str
    kind: str
    label: str
    count: int
    free: int | None
    enabled: bool
    reason: str

    @property
    def text(self) -> str:
        free = "" if self.free is None else f" — {self.free} free"
        return f"{self.label} · {self.team}{free}"


def choices(offers: Mapping[str, Any]) -> list[Choice]:
    """Every choice in the hub's offers document, in the hub's order."""
    return [
        Choice(
            team=str(team.get("team", "")),
            offer=str(o.get("name", "")),
            kind=str(o.get("kind", "gpu")),
            label=str(o.get("label") or o.get("name", "")),
            count=int(o.get("count") or 1),
            free=o.get("free"),
            enabled=bool(o.get("enabled")),
            reason=str(o.get("reason") or ""),
        )
        for team in offers.get("teams", [])
        for o in team.get("offers", [])
    ]


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def quota_lines(offers: Mapping[str, Any]) -> list[str]:
    """One line per team: its quota used and left, and the user's own cap."""
    lines = []
    for t in offers.get("teams", []):
        line = (
            f"Team {t.get('team')}: {_num(t.get('used'))} of {_num(t.get('limit'))} GPU-eq "
            f"used, {_num(t.get('left'))} left"
        )
        if t.get("user_cap") is not None:
            line += f"; you use {_num(t.get('user_used'))} of your cap {_num(t.get('user_cap'))}"
        lines.append(line)
    return lines


class Launcher(widgets.VBox):
    """The launcher: the lab dialog's choices and a Submit button (see the module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        client: Client | None = None,
        **defaults: Any,
    ) -> None:
        unknown = sorted(set(defaults) - DEFAULT_KEYS)
        if unknown:
            raise TypeError(f"launcher() got unexpected keywords: {', '.join(unknown)}")
        self.path = notebook_path(path)
        self.job: Job | None = None
        self.offers: dict[str, Any] = {}
        self.client: Client | None = client
        problem = self._connect()
        self.choices = choices(self.offers)
        self._build(defaults)
        if problem:
            self._show(problem, error=True)
            self.submit_button.disabled = True
        super().__init__(children=self._layout())

    def _connect(self) -> str | None:
        """Fetch the offers; the reason it failed, or None."""
        try:
            self.client = self.client or Client()
            self.offers = self.client.offers()
        except ClientError as exc:
            return str(exc)
        return None

    # -- building ---------------------------------------------------------------------------------

    def _build(self, defaults: dict[str, Any]) -> None:
        style = {"description_width": "8em"}
        wide = widgets.Layout(width="32em")
        enabled = [c for c in self.choices if c.enabled]
        self.choice = widgets.Dropdown(
            options=[(c.text, c) for c in enabled],
            value=self._default_choice(enabled, defaults),
            description="Offer",
            style=style,
            layout=wide,
        )
        self.gpus = widgets.BoundedIntText(
            value=int(defaults.get("gpus") or self._choice_gpus(self.choice.value, 1)),
            min=1,
            max=64,
            description="GPUs per node",
            style=style,
        )
        self.nodes = widgets.BoundedIntText(
            value=int(defaults.get("nodes") or 1), min=1, max=64, description="Nodes", style=style
        )
        limit = defaults.get("time_limit")
        self.time_limit = widgets.Text(
            value="" if limit is None else str(limit),
            placeholder="e.g. 30m, 2h (empty: the hub's default)",
            description="Time limit",
            style=style,
            layout=wide,
        )
        mode, numbers = _cells_to_ui(defaults.get("cells", "all"))
        self.cells = widgets.RadioButtons(
            options=[
                ("All cells", "all"),
                ("Cells up to #", "upto"),
                ("Selected cells #", "selected"),
            ],
            value=mode,
            description="Cells",
            style=style,
        )
        self.cell_numbers = widgets.Text(
            value=numbers,
            placeholder="e.g. 4, or 1,2,5 or 1-3 (numbered from 1, markdown counted)",
            disabled=mode == "all",
            layout=wide,
        )
        stem = self.path.stem if self.path else ""
        self.name = widgets.Text(
            value=defaults.get("name") or stem, description="Job name", style=style, layout=wide
        )
        self.submit_button = widgets.Button(
            description="Submit", button_style="primary", icon="rocket"
        )
        self.status = widgets.HTML()
        self.choice.observe(self._on_choice, names="value")
        self.cells.observe(self._on_cells, names="value")
        self.submit_button.on_click(lambda _: self.submit())

    def _default_choice(self, enabled: list[Choice], defaults: dict[str, Any]) -> Choice | None:
        offer, team = defaults.get("offer"), defaults.get("team")
        gpus = int(defaults.get("gpus") or 1)
        if offer is None and self.offers:
            try:
                offer = choose_offer(self.offers, gpus, team)
            except UsageError:
                offer = None
        ranked = [
            c
            for c in enabled
            if c.offer == offer and team in (None, c.team) and (c.kind != "gpu" or c.count == gpus)
        ]
        ranked += [c for c in enabled if c.offer == offer and team in (None, c.team)]
        ranked += [c for c in enabled if team in (None, c.team)]
        return (ranked or enabled or [None])[0]

    @staticmethod
    def _choice_gpus(choice: Choice | None, current: int) -> int:
        if choice is None or choice.kind == "cpu":
            return current
        return choice.count if choice.kind == "gpu" else 1

    def _layout(self) -> list[widgets.Widget]:
        where = html.escape(self.path.name) if self.path else "(no notebook: pass path=...)"
        head = f"<b>Run distributed</b>: {where} <i>(its saved version)</i>"
        if self.offers.get("simulated"):
            head += (
                "<br><b style='color:#b45309'>SIMULATED pool</b>: "
                f"{html.escape(str(self.offers.get('inventory', '')))}"
            )
        quota = "<br>".join(html.escape(line) for line in quota_lines(self.offers))
        unavailable = [c for c in self.choices if not c.enabled]
        listed = "".join(
            f"<li>{html.escape(c.label)} · {html.escape(c.team)}: "
            f"{html.escape(c.reason or 'unavailable')}</li>"
            for c in unavailable
        )
        self.quota = widgets.HTML(quota)
        self.unavailable = widgets.HTML(
            f"<div>Not available now:<ul>{listed}</ul></div>" if listed else ""
        )
        return [
            widgets.HTML(head),
            self.quota,
            self.choice,
            self.unavailable,
            self.gpus,
            self.nodes,
            self.time_limit,
            self.cells,
            self.cell_numbers,
            self.name,
            self.submit_button,
            self.status,
        ]

    # -- events -----------------------------------------------------------------------------------

    def _on_choice(self, change: dict[str, Any]) -> None:
        self.gpus.value = self._choice_gpus(change["new"], self.gpus.value)

    def _on_cells(self, change: dict[str, Any]) -> None:
        self.cell_numbers.disabled = change["new"] == "all"

    def _show(self, message: str, *, error: bool = False) -> None:
        color = "#b91c1c" if error else "inherit"
        self.status.value = (
            f"<pre style='white-space:pre-wrap;color:{color}'>{html.escape(message)}</pre>"
        )

    def selected_cells(self) -> Cells:
        """The cells chosen, as :func:`notebook_to_script` takes them (0-based indexes)."""
        mode, text = self.cells.value, self.cell_numbers.value.strip()
        if mode == "all":
            return "all"
        chosen = parse_cells(f"upto:{text}" if mode == "upto" else text)
        return "all" if isinstance(chosen, str) else chosen  # "all" typed into the box

    def submit(self) -> Job | None:
        """Submit the notebook as chosen (what the Submit button does); the job, or None with
        the reason shown under the button."""
        choice = self.choice.value
        try:
            if self.path is None:
                raise ValueError(
                    "Which notebook? JPY_SESSION_NAME is not set: use launcher(path=...)"
                )
            if choice is None or self.client is None:
                raise ValueError("No offer is available to choose.")
            self.job = submit(
                self.path,
                gpus=self.gpus.value,
                nodes=self.nodes.value,
                offer=choice.offer,
                team=choice.team,
                time_limit=self.time_limit.value,
                name=self.name.value.strip() or None,
                cells=self.selected_cells(),
                client=self.client,
            )
        except ConversionError as exc:
            self._show(f"{self.path and self.path.name}: cannot run as a job:\n{exc}", error=True)
            return None
        except (ClientError, ValueError, OSError, argparse.ArgumentTypeError) as exc:
            self._show(str(exc), error=True)
            return None
        job = self.job.last
        self._show(f"Submitted job {job.get('id')} ({job.get('name')}): {job.get('state')}")
        return self.job


def _cells_to_ui(cells: Cells) -> tuple[str, str]:
    """Index form → the radio's value and the 1-based numbers in the text box."""
    if cells == "all":
        return "all", ""
    if isinstance(cells, int):
        return "upto", str(cells + 1)
    if isinstance(cells, Sequence):
        return "selected", ",".join(str(i + 1) for i in cells)
    raise ValueError(f'cells must be "all", an index or a list of indexes, not {cells!r}')


def launcher(path: str | os.PathLike[str] | None = None, **defaults: Any) -> Launcher:
    """The launcher widget for the notebook at ``path`` (default: this kernel's notebook)."""
    return Launcher(path, **defaults)


# -- %%distributed --------------------------------------------------------------------------------


@magics_class
class DistributedMagics(Magics):
    """``%%distributed``: run the cell's code as a multi-GPU job (see the module docstring)."""

    @magic_arguments()
    @argument("--gpus", type=int, default=1, help="GPUs (processes) per node; default 1")
    @argument("--nodes", type=int, default=None, help="nodes; default 1")
    @argument("--offer", default=None, help="the offer (default: as the gpupool CLI chooses)")
    @argument("--team", default=None, help="the team to charge")
    @argument("--time-limit", type=parse_duration, default=None, help="e.g. 30m, 2h, 1h30m")
    @argument("--name", default=None, help="the job's name")
    @argument("--wait", action="store_true", help="wait for the end; print rank 0's log")
    @argument("--poll", type=float, default=2.0, help=argparse.SUPPRESS)
    @cell_magic
    def distributed(self, line: str, cell: str) -> Job | None:
        args = parse_argstring(self.distributed, line)
        notebook = notebook_path()
        stem = notebook.stem if notebook else "notebook"
        try:
            script = notebook_to_script(
                new_notebook(cells=[new_code_cell(cell)]), name=f"{stem} %%distributed cell"
            )
            job = _submit(
                Client(),
                script,
                filename=f"{stem}_cell.py",
                name=args.name or f"{stem}-cell",
                workdir=os.getcwd(),
                offer=args.offer,
                gpus=args.gpus,
                nodes=args.nodes,
                team=args.team,
                time_limit=args.time_limit,
            )
            print(f"Submitted job {job.id} ({job.last.get('name')}): {job.last.get('state')}")
            if args.wait:
                _wait_and_show(job, args.poll)
        except ConversionError as exc:
            print(f"%%distributed: this cell cannot run as a job:\n{exc}", file=sys.stderr)
            return None
        except (ClientError, ValueError) as exc:
            print(exc, file=sys.stderr)
            return None
        return job


def _wait_and_show(job: Job, poll: float) -> None:
    print(f"Waiting for job {job.id} to end (interrupting stops waiting, not the job)…")
    state = job.wait(poll=poll)
    reason = job.last.get("reason")
    print(f"Job {job.id} {state}" + (f": {reason}" if reason else ""))
    log = job.logs(0)
    if log:
        print(f"--- rank 0 ---\n{log}", end="" if log.endswith("\n") else "\n")
