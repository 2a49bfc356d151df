"""A job's options as people type them: offer choices, durations, cell ranges, counts.

Shared by the ``gpupool`` command, the launcher widget, ``%%distributed`` and the server
extension, so each option means the same wherever it is given. Pure: no I/O, no Jupyter imports.

Vocabulary and contract:

- **choice**: one line of the hub's offers document (``GET offers``): an offer of a team with a
  count (``H100-80GB ×2 · vision``), what is free of it now, and its **admission**, the hub's
  verdict for one node (``gpupool.core.admission``): ``now`` (it would start), ``wait`` (a job
  queues, with the ``reason``) or ``never`` (it could never start, with the ``reason``).
  :func:`choices` lists them in the hub's order; :func:`verdict` reads one line's admission
  (a line from an older hub, without it, reads ``now`` when ``enabled``, else ``wait``).
- **per node**: how many of an offer a request takes on each node, by its kind (the lab
  dialog's rules, ``validate.ts``; one table tests both, ``src/__tests__/offer_kinds.json``):
  ``gpu`` and ``mig`` are *counted* (:func:`is_counted`: whole GPUs, MIG instances; the hub
  lists a line per count, and a job runs one rank on each); ``share`` is *one per node*
  (:func:`is_one_per_node`: a share job runs one process per node); ``cpu`` runs any number of
  processes per node. :meth:`Choice.fits` says which line a number per node is judged by, and
  :func:`per_node_label` what the number counts.
- **ranking**: :func:`ranked`: ``now`` lines, then ``wait``, then ``never``, each in the hub's
  order. For a job, ``wait`` is a valid choice (the hub queues it); only ``never`` is refused.
- **default offer**: :func:`default_choice` (its name: :func:`choose_offer`), the one rule for a
  job that names no offer: among the lines (of ``team``, or of all the user's teams in the hub's
  order) of the first kind of :data:`KIND_PREFERENCE` that they include (whole GPUs, else MIG
  instances, else a share, else CPU: the dialog's order) those that fit ``gpus`` per node
  (:meth:`Choice.fits`), the first in :func:`ranked` order, never a ``never`` line; when none
  fits, :class:`OptionError` with the counts offered; when every such line is ``never``,
  :class:`OptionError` with their reasons.
- **named offer**: :func:`check_offer`: the line a job of ``gpus`` per node of a named offer is
  judged by (``None`` when the document has none: the hub decides); a ``wait`` line is accepted
  (the job will queue), a ``never`` line refused with its reason, as the hub would.
- **duration**: seconds, or a text like ``"90s"``, ``"30m"``, ``"2h"``, ``"1h30m"``, ``"1d"``;
  a time limit is positive. :func:`time_limit` takes either form; empty means none.
- **cells**, in three forms that all mean :func:`gpupool_lab.convert.notebook_to_script`'s
  ``cells`` (0-based indexes, markdown cells counted): the *index form* itself (``"all"``, an
  index: up to and including it, or a list of indexes); the *text form* people type, in 1-based
  cell numbers ``#n`` as conversion messages speak (``"all"``, ``"upto:N"``, ``"1,2,5"``,
  ``"1-3,7"``; :func:`parse_cells`); and the *JSON form* of the lab's requests, in indexes
  (``"all"``, ``{"upto": i}``, ``{"selected": [i, ...]}``; :func:`cells_from_json`).
- Every parser raises :class:`OptionError` with a sentence for the user. It is a ``ValueError``
  and an ``argparse.ArgumentTypeError``, so a parser serves directly as an argparse ``type=``
  (argparse then prints the sentence).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # convert imports IPython; the command line needs it only for notebooks
    from gpupool_lab.convert import Cells

__all__ = [
    "KIND_PREFERENCE",
    "Choice",
    "OptionError",
    "cells_from_json",
    "cells_to_text",
    "check_offer",
    "choices",
    "choose_offer",
    "default_choice",
    "is_counted",
    "is_one_per_node",
    "non_negative",
    "parse_cells",
    "parse_duration",
    "per_node_label",
    "positive",
    "ranked",
    "time_limit",
    "verdict",
]

DURATION_TEXT = re.compile(r"(?:\d+[smhd]?)+")
DURATION_PART = re.compile(r"(\d+)([smhd]?)")
UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}

Verdict = Literal["now", "wait", "never"]
VERDICTS: tuple[Verdict, ...] = ("now", "wait", "never")  # best first: the ranking's order


class OptionError(argparse.ArgumentTypeError, ValueError):
    """An option that does not parse or fit, with a sentence for the user."""


# -- numbers and durations ------------------------------------------------------------------------


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise OptionError(f"not a whole number: {text!r}") from None


def positive(text: str) -> int:
    """A whole number of at least 1 (GPUs per node, nodes)."""
    value = _whole(text)
    if value < 1:
        raise OptionError(f"must be at least 1, not {value}")
    return value


def non_negative(text: str) -> int:
    """A whole number of 0 or more (restarts, a rank)."""
    value = _whole(text)
    if value < 0:
        raise OptionError(f"must be 0 or more, not {value}")
    return value


def parse_duration(text: str) -> int:
    """``"90"``, ``"90s"``, ``"30m"``, ``"2h"``, ``"1h30m"``, ``"1d"`` → seconds (positive)."""
    compact = re.sub(r"\s+", "", text.lower())
    if not DURATION_TEXT.fullmatch(compact):
        raise OptionError(f"not a duration: {text!r} (use seconds, or e.g. 30m, 2h, 1h30m)")
    seconds = sum(int(n) * UNITS[unit] for n, unit in DURATION_PART.findall(compact))
    if seconds <= 0:
        raise OptionError(f"a time limit must be positive, not {text!r}")
    return seconds


def time_limit(value: int | str | None) -> int | None:
    """A time limit as given: a duration text → seconds; blank or None → None; a number as is
    (the hub judges numbers, and its message reaches the user word for word)."""
    if isinstance(value, str):
        return parse_duration(value) if value.strip() else None
    return value


# -- cells ----------------------------------------------------------------------------------------


def parse_cells(text: str) -> Cells:
    """The text form (``all`` | ``upto:N`` | ``1,2,5`` / ``1-3,7``, 1-based) → the index form."""
    text = text.strip().lower()
    if text == "all":
        return "all"
    try:
        if text.startswith("upto:"):
            number = int(text.removeprefix("upto:"))
            if number < 1:
                raise ValueError
            return number - 1
        indexes: set[int] = set()
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            low, high = int(first), int(last or first)
            if low < 1 or high < low:
                raise ValueError
            indexes.update(range(low - 1, high))
        return sorted(indexes)
    except ValueError:
        raise OptionError(
            f"not a cell choice: {text!r} (use all, upto:N, or numbers like 1,2,5 or 1-3)"
        ) from None


def cells_from_json(value: object) -> Cells:
    """The JSON form (``"all"`` or None, ``{"upto": i}``, ``{"selected": [i, ...]}``) → the
    index form."""
    if value is None or value == "all":
        return "all"
    if isinstance(value, dict) and len(value) == 1:
        ((kind, arg),) = value.items()
        if kind == "upto" and _index(arg):
            return int(arg)
        if kind == "selected" and isinstance(arg, list) and arg and all(map(_index, arg)):
            return [int(i) for i in arg]
    raise OptionError(
        'cells must be "all", {"upto": index} or {"selected": [index, ...]} '
        f"(0-based cell indexes), not {json.dumps(value)}"
    )


def _index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def cells_to_text(cells: Cells) -> tuple[str, str]:
    """The index form → ``(mode, numbers)``: mode ``all``, ``upto`` or ``selected`` and the
    1-based numbers that go with it (``"3"``, ``"1,3"``; empty for ``all``)."""
    if cells == "all":
        return "all", ""
    if isinstance(cells, int) and not isinstance(cells, bool):
        return "upto", str(cells + 1)
    if isinstance(cells, Sequence) and not isinstance(cells, str):
        return "selected", ",".join(str(i + 1) for i in cells)
    raise OptionError(f'cells must be "all", an index or a list of indexes, not {cells!r}')


# -- offer kinds: how many per node ---------------------------------------------------------------

KIND_PREFERENCE = ("gpu", "mig", "share", "cpu")
"""The kinds a default offer is looked for in, first to last (the dialog's ``KIND_PREFERENCE``)."""
COUNTED_KINDS = ("gpu", "mig")
PER_NODE = {"gpu": "GPUs per node", "mig": "MIG instances per node"}


def is_counted(kind: str) -> bool:
    """Whether a request of ``kind`` names how many per node (whole GPUs, MIG instances): the
    hub lists a line per count, and a job runs one rank on each."""
    return kind in COUNTED_KINDS


def is_one_per_node(kind: str) -> bool:
    """Whether a request of ``kind`` takes exactly one per node: a share (a share job runs one
    process per node), and any kind this version does not know (the hub takes a count of 1).
    A CPU offer runs any number of processes per node."""
    return not is_counted(kind) and kind != "cpu"


def per_node_label(kind: str) -> str:
    """What the number per node counts for an offer of ``kind`` ("GPUs per node", ...)."""
    return PER_NODE.get(kind, "Processes per node")


# -- choices and the default offer ----------------------------------------------------------------


def verdict(line: Mapping[str, Any]) -> Verdict:
    """One line's admission (see the module docstring)."""
    given = line.get("admission")
    for known in VERDICTS:
        if given == known:
            return known
    # An older hub sends no admission, only ``enabled``: true is now; false did not tell a busy
    # pool from a request that could never start, so read it as wait and let the hub decide at
    # submit (it queues the job or refuses it with the reason).
    return "now" if line.get("enabled") else "wait"


@dataclass(frozen=True)
class Choice:
    """One line of the hub's offers document (see the module docstring)."""

    team: str
    offer: str
    kind: str
    label: str
    count: int
    free: int | None
    admission: Verdict
    reason: str

    @property
    def enabled(self) -> bool:
        """It would start now."""
        return self.admission == "now"

    @property
    def title(self) -> str:
        """``1× H100 · vision``: the line's label and team."""
        return f"{self.label} · {self.team}"

    @property
    def text(self) -> str:
        """How a list of choices shows it: the title, what is free, and for a ``wait`` line
        that a job will queue, and why."""
        free = "" if self.free is None else f" — {self.free} free"
        queue = f" (will queue: {self.reason})" if self.reason else " (will queue)"
        return f"{self.title}{free}" + (queue if self.admission == "wait" else "")

    def fits(self, gpus: int) -> bool:
        """A job of ``gpus`` per node is judged by this line (a ``cpu`` line takes any number of
        processes; any other line its own count: GPUs, MIG instances, or 1 for a share)."""
        return self.kind == "cpu" or self.count == gpus


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
            admission=verdict(o),
            reason=str(o.get("reason") or ""),
        )
        for team in offers.get("teams", [])
        for o in team.get("offers", [])
    ]


def ranked(lines: Iterable[Choice]) -> list[Choice]:
    """``now`` lines, then ``wait``, then ``never``, each in the order given."""
    return sorted(lines, key=lambda c: VERDICTS.index(c.admission))


def _lines_of(offers: Mapping[str, Any], team: str | None) -> list[Choice]:
    """The lines of ``team`` (None: of every team of the user); :class:`OptionError` when the
    user is not in ``team``."""
    teams = [str(t.get("team", "")) for t in offers.get("teams", [])]
    if team is not None and team not in teams:
        known = ", ".join(teams) or "none"
        raise OptionError(f"you are not in team {team!r} (your teams: {known})")
    return [c for c in choices(offers) if team in (None, c.team)]


def _never(lines: Sequence[Choice], what: str) -> OptionError:
    """The refusal when every line of ``lines`` is ``never``: each one's reason."""
    if len(lines) == 1:
        (line,) = lines
        return OptionError(
            f"{line.title} could never start for you: {line.reason or 'unavailable'}"
        )
    why = "".join(f"\n  {c.title}: {c.reason or 'unavailable'}" for c in lines)
    return OptionError(f"{what} could never start for you:{why}")


#: A counted kind's offers and what they count, as the default offer's refusals name them.
COUNTED_WORDS = {"gpu": ("GPU", "GPU(s)"), "mig": ("MIG", "instance(s)")}


def default_choice(offers: Mapping[str, Any], gpus: int, team: str | None = None) -> Choice:
    """The default line for a job of ``gpus`` per node (the rule is in the module docstring);
    :class:`OptionError` when no line fits, only ``never`` lines do, or the user is not in
    ``team``."""
    lines = _lines_of(offers, team)
    kind = next((k for k in KIND_PREFERENCE if any(c.kind == k for c in lines)), "gpu")
    of_kind = [c for c in lines if c.kind == kind]
    candidates = [c for c in of_kind if c.fits(gpus)]
    hint = "; pass --offer (see: gpupool offers)"
    if not candidates and is_one_per_node(kind):
        raise OptionError(f"{of_kind[0].label} runs 1 process per node, not {gpus}{hint}")
    if not candidates:
        offered, unit = COUNTED_WORDS[kind]
        counts = sorted({c.count for c in of_kind})
        raise OptionError(
            f"no {offered} offer comes with {gpus} {unit} per node"
            + (f" (counts offered: {', '.join(map(str, counts))})" if counts else "")
            + hint
        )
    best = ranked(candidates)[0]
    if best.admission == "never":
        what = {
            "gpu": f"every offer with {gpus} GPU(s) per node",
            "mig": f"every MIG offer with {gpus} instance(s) per node",
            "cpu": "every CPU offer",
        }.get(kind, f"every {kind} offer")
        raise _never(candidates, what)
    return best


def choose_offer(offers: Mapping[str, Any], gpus: int, team: str | None = None) -> str:
    """The default offer's name for ``gpus`` processes per node (:func:`default_choice`)."""
    return default_choice(offers, gpus, team).offer


def check_offer(
    offers: Mapping[str, Any], offer: str, gpus: int, team: str | None = None
) -> Choice | None:
    """The line a job of ``gpus`` per node of the named ``offer`` is judged by: the best-ranked
    of the lines that fit it (of ``team``, or of every team of the user); None when the
    document has none (an unknown team, offer or count: the hub decides, and says why).
    :class:`OptionError` with the reasons when every such line is ``never``."""
    fitting = [
        c for c in choices(offers) if c.offer == offer and team in (None, c.team) and c.fits(gpus)
    ]
    if not fitting:
        return None
    best = ranked(fitting)[0]
    if best.admission == "never":
        raise _never(fitting, f"{offer} with {gpus} per node in every team of yours")
    return best
