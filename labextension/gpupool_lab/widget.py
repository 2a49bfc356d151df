"""Inside a notebook: the launcher widget, ``launcher(path=None, **defaults)``.

Vocabulary and contract:

- :func:`launcher` returns a :class:`Launcher` (an ipywidgets ``VBox``) with the lab dialog's
  choices: offer and team (the lines a job may take, in the hub's order, with free counts: those
  that would start now, and those that would wait, marked "(will queue: <reason>)"; the lines
  that could never start are listed below as unavailable, with their reason; each team's quota
  used and left), GPUs per node, nodes, time limit, which cells (all, up to cell #n, selected
  cells #a,#b), a job name, and Submit. The number per node follows the chosen line, as in the
  lab dialog (:func:`~gpupool_lab.options.per_node_label`): a GPU or MIG line's count (GPUs, MIG
  instances: one rank each), 1 for a share (fixed: a share job runs one process per node), and
  for CPU the processes, as typed. Choices, their admission, the default selection
  (:func:`~gpupool_lab.options.default_choice`'s ranking: now, then wait) and the parsing of
  durations and cell numbers are :mod:`gpupool_lab.options`'.
- Submit converts the notebook's *saved* file and submits it with :func:`gpupool_lab.job.submit`,
  as the CLI does; the job's handle is ``.job``, and the outcome (the job, or the reason it was
  refused: the hub's message word for word, or conversion's) is shown under the button.
- The notebook is ``path`` or, in a kernel started by Jupyter Server, ``$JPY_SESSION_NAME``.
- ``defaults`` (:class:`Defaults`) are :func:`~gpupool_lab.job.submit`'s keywords ``gpus``,
  ``nodes``, ``offer``, ``team``, ``time_limit``, ``cells`` (the index form) and ``name``; the
  widget's text box speaks in 1-based cell numbers ``#n``, as the conversion messages and the
  CLI's ``--cells`` do.

The job handle, ``submit()`` and ``%%distributed`` live in :mod:`gpupool_lab.job` and
:mod:`gpupool_lab.magics`; their names are importable from here too.
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping
from typing import Any, TypedDict, Unpack

import ipywidgets as widgets

from gpupool_lab.client import Client, ClientError
from gpupool_lab.convert import Cells, ConversionError
from gpupool_lab.job import Job, notebook_path, submit
from gpupool_lab.magics import DistributedMagics
from gpupool_lab.options import (
    Choice,
    OptionError,
    cells_to_text,
    choices,
    default_choice,
    is_counted,
    is_one_per_node,
    parse_cells,
    per_node_label,
    ranked,
)

__all__ = ["Choice", "Defaults", "DistributedMagics", "Job", "Launcher", "launcher", "submit"]


class Defaults(TypedDict, total=False):
    """What the launcher shows first (see the module docstring)."""

    gpus: int
    nodes: int
    offer: str
    team: str
    time_limit: int | str
    cells: Cells
    name: str


def _num(value: object) -> str:
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
        **defaults: Unpack[Defaults],
    ) -> None:
        unknown = sorted(set(defaults) - Defaults.__optional_keys__)
        if unknown:
            raise TypeError(f"launcher() got unexpected keywords: {', '.join(unknown)}")
        self.path = notebook_path(path)
        self.job: Job | None = None
        self.offers: dict[str, Any] = {}
        self.client: Client | None = client
        problem = self._connect()
        self.choices = choices(self.offers)
        self._default_note = ""
        self._build(defaults)
        if problem:
            self._show(problem, error=True)
            self.submit_button.disabled = True
        elif self._default_note:
            self._show(self._default_note)
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

    def _build(self, defaults: Defaults) -> None:
        style = {"description_width": "12em"}
        wide = widgets.Layout(width="36em")
        selectable = [c for c in self.choices if c.admission != "never"]
        self.choice = widgets.Dropdown(
            options=[(c.text, c) for c in selectable],
            value=self._default_choice(selectable, defaults),
            description="Offer",
            style=style,
            layout=wide,
        )
        self.gpus = widgets.BoundedIntText(
            value=int(defaults.get("gpus") or 1), min=1, max=64, style=style
        )
        self._fit_gpus(self.choice.value, keep=bool(defaults.get("gpus")))
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
        mode, numbers = cells_to_text(defaults.get("cells", "all"))
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

    def _default_choice(self, selectable: list[Choice], defaults: Defaults) -> Choice | None:
        """The line first selected: the named offer's best-ranked line (of ``team``; for ``gpus``
        where one fits), else the default offer's line for ``gpus`` (when there is none, why
        not is said under the button), else the best-ranked line (of ``team`` where it has
        one)."""
        offer, team = defaults.get("offer"), defaults.get("team")
        gpus = int(defaults.get("gpus") or 1)
        mine = [c for c in selectable if team in (None, c.team)]
        found: list[Choice] = []
        if offer is not None:
            named = [c for c in mine if c.offer == offer]
            found = ranked(c for c in named if c.fits(gpus)) or ranked(named)
        elif self.offers:
            try:
                found = [default_choice(self.offers, gpus, team)]
            except OptionError as exc:  # said under the button; the best other line is selected
                self._default_note = str(exc)
        found = found or ranked(mine) or ranked(selectable)
        return found[0] if found else None

    def _fit_gpus(self, choice: Choice | None, *, keep: bool = False) -> None:
        """Fit the number per node to ``choice``: its label; a counted line's count (``keep``:
        the number given instead); 1, fixed, for a share; as it is for CPU."""
        kind = choice.kind if choice is not None else "gpu"
        self.gpus.description = per_node_label(kind)
        self.gpus.disabled = is_one_per_node(kind)
        if is_one_per_node(kind):
            self.gpus.value = 1
        elif choice is not None and is_counted(kind) and not keep:
            self.gpus.value = choice.count

    def _layout(self) -> list[widgets.Widget]:
        where = html.escape(self.path.name) if self.path else "(no notebook: pass path=...)"
        head = f"<b>Run distributed</b>: {where} <i>(its saved version)</i>"
        if self.offers.get("simulated"):
            head += (
                "<br><b style='color:#b45309'>SIMULATED pool</b>: "
                f"{html.escape(str(self.offers.get('inventory', '')))}"
            )
        quota = "<br>".join(html.escape(line) for line in quota_lines(self.offers))
        unavailable = [c for c in self.choices if c.admission == "never"]
        listed = "".join(
            f"<li>{html.escape(c.title)}: {html.escape(c.reason or 'unavailable')}</li>"
            for c in unavailable
        )
        self.quota = widgets.HTML(quota)
        self.unavailable = widgets.HTML(
            f"<div>Unavailable (could never start):<ul>{listed}</ul></div>" if listed else ""
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
        self._fit_gpus(change["new"])

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
        except (ClientError, ValueError, OSError) as exc:
            self._show(str(exc), error=True)
            return None
        job = self.job.last
        self._show(f"Submitted job {job.get('id')} ({job.get('name')}): {job.get('state')}")
        return self.job


def launcher(path: str | os.PathLike[str] | None = None, **defaults: Unpack[Defaults]) -> Launcher:
    """The launcher widget for the notebook at ``path`` (default: this kernel's notebook)."""
    return Launcher(path, **defaults)
