"""The ``gpupool`` command's readable output: the hub's JSON as aligned text.

Vocabulary and contract:

- :func:`table`: aligned columns, two spaces apart; a column whose values are all numbers (or
  unset) is right-aligned, any other left-aligned; unset (``None``) shows as ``-``, booleans as
  ``yes``/``no``, floats in their shortest form (``2.5``, ``4``).
- Text from the hub is another user's text (an admin lists everyone's jobs), so it is shown
  :func:`visible`: a control character (a terminal escape, a carriage return, a line break) or
  a bidirectional control (which reorders what follows it) prints as its escape (``\\x1b``,
  ``\\u202e``), never raw: one job is one line, and no table can move the cursor, retitle the
  terminal or disguise what follows.
- Times are the hub's ISO 8601 timestamps shown as ``YYYY-MM-DD HH:MM:SS`` in the hub's zone.
- A job's **state** reads ``queued #N`` while it has a queue position; its **GPUs** read
  ``G×N`` (GPUs per node × nodes) when it spans more than one node.
- An offer line's **availability** (``gpupool offers``) reads ``yes`` (it would start now),
  ``queues: <reason>`` (a job waits in the queue) or ``no: <reason>`` (it could never start),
  after the line's admission as :func:`gpupool_lab.options.verdict` reads it.
- Each ``format_*`` takes what :class:`gpupool_lab.client.Client` returns and never fails on a
  missing field (it shows ``-``), so a newer or older hub still prints.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from gpupool_lab.options import verdict

__all__ = [
    "availability",
    "format_job",
    "format_jobs",
    "format_offers",
    "format_teams",
    "state",
    "table",
    "visible",
]

Json = Mapping[str, Any]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Aligned columns (see the module docstring)."""
    cells = [[cell(v) for v in row] for row in rows]
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) or row[i] is None for row in rows)
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if right else v.ljust(w)
            for v, w, right in zip(values, widths, numeric, strict=True)
        ]
        return "  ".join(padded).rstrip()

    return "\n".join([line(list(headers)), *(line(r) for r in cells)])


def cell(value: object) -> str:
    """One value as a table shows it."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    return visible(str(value))


_RAW = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Control characters (C0, DEL, C1), the line and paragraph separators, and the bidirectional
controls."""


def visible(text: str) -> str:
    """``text`` with each character a terminal would obey (see the module docstring) as its
    escape: ``\\x1b``, ``\\u202e``."""
    return _RAW.sub(lambda m: _escape(ord(m.group())), text)


def _escape(code: int) -> str:
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def when(value: str | None) -> str:
    """An ISO 8601 timestamp as ``YYYY-MM-DD HH:MM:SS`` (the hub's zone), ``-`` when unset."""
    if not value:
        return "-"
    return value.replace("T", " ")[:19]


def state(job: Json) -> str:
    """The job's state, with its queue position while it is queued."""
    current = str(job.get("state", "?"))
    if current == "queued" and job.get("queue_position") is not None:
        return f"queued #{job['queue_position']}"
    return current


def _gpus(job: Json) -> str:
    nodes = job.get("nodes") or 1
    return f"{job.get('gpus')}×{nodes}" if nodes != 1 else str(job.get("gpus"))


def format_jobs(jobs: Sequence[Json]) -> str:
    if not jobs:
        return "No jobs."
    rows = [
        [
            str(j.get("id")),
            j.get("name") or "-",
            j.get("owner") or "-",
            j.get("team") or "-",
            j.get("offer") or "-",
            _gpus(j),
            state(j),
            when(j.get("created")),
        ]
        for j in jobs
    ]
    headers = ["ID", "NAME", "OWNER", "TEAM", "OFFER", "GPUS", "STATE", "CREATED"]
    return table(headers, rows)


def format_job(job: Json) -> str:
    codes = job.get("exit_codes") or {}
    exit_codes = ", ".join(f"rank {r}: {c}" for r, c in sorted(codes.items(), key=_rank_key))
    limit = job.get("time_limit")
    fields = [
        ("id", job.get("id")),
        ("name", job.get("name")),
        ("owner", job.get("owner")),
        ("team", job.get("team")),
        ("offer", job.get("offer")),
        ("gpus per node", job.get("gpus")),
        ("nodes", job.get("nodes")),
        ("ranks", job.get("ranks")),
        ("state", state(job)),
        ("reason", job.get("reason") or None),
        ("priority", job.get("priority")),
        ("time limit", f"{limit} s" if limit else None),
        ("restarts", f"{job.get('restarts', 0)} of {job.get('max_restarts', 0)}"),
        ("devices", ", ".join(job.get("devices") or []) or None),
        ("created", when(job.get("created"))),
        ("started", when(job.get("started"))),
        ("finished", when(job.get("finished"))),
        ("exit codes", exit_codes or None),
    ]
    width = max(len(k) for k, _ in fields)
    return "\n".join(f"{k + ':':<{width + 1}} {cell(v)}" for k, v in fields)


def _rank_key(item: tuple[str, object]) -> tuple[int, str]:
    return (int(item[0]), "") if str(item[0]).isdigit() else (1 << 30, str(item[0]))


def availability(line: Json) -> str:
    """An offer line's availability (see the module docstring)."""
    found, reason = verdict(line), str(line.get("reason") or "")
    if found == "now":
        return "yes"
    if found == "wait":
        return f"queues: {reason}" if reason else "queues"
    return f"no: {reason or 'unavailable'}"


def format_offers(doc: Json) -> str:
    out = [f"Inventory: {cell(doc.get('inventory', '?'))}"]
    if doc.get("simulated"):
        out[0] += "  (SIMULATED: no real GPUs behind these offers)"
    for team in doc.get("teams", []):
        out.append("")
        cap = team.get("user_cap")
        out.append(
            f"Team {cell(team.get('team'))}: {cell(team.get('used'))} of {cell(team.get('limit'))} "
            f"GPU-eq used (guarantee {cell(team.get('guarantee'))}, may borrow "
            f"{cell(team.get('borrow_limit'))}), {cell(team.get('left'))} left; "
            f"you use {cell(team.get('user_used'))}"
            + (f" of your cap {cell(cap)}" if cap is not None else "")
        )
        rows = [
            [
                o.get("name"),
                o.get("kind"),
                o.get("label"),
                o.get("count"),
                o.get("cost"),
                o.get("free"),
                availability(o),
            ]
            for o in team.get("offers", [])
        ]
        headers = ["OFFER", "KIND", "LABEL", "COUNT", "COST", "FREE", "AVAILABLE"]
        out.append(table(headers, rows) if rows else "(no offers)")
    return "\n".join(out)


def format_teams(teams: Sequence[Json]) -> str:
    if not teams:
        return "No teams."
    rows = [
        [
            t.get("name"),
            t.get("guarantee"),
            t.get("borrow_limit"),
            t.get("used"),
            t.get("borrowed"),
            t.get("jobs_queued"),
            t.get("jobs_running"),
        ]
        for t in teams
    ]
    headers = ["TEAM", "GUARANTEE", "BORROW LIMIT", "USED", "BORROWED", "QUEUED", "RUNNING"]
    return table(headers, rows)
