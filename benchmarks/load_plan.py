"""The load benchmark's plan (pure data and helpers): the simulated pool, its teams and offers,
who asks for what, the jobs submitted, and how answers and job histories are counted.

Vocabulary
- *persona*: one user of the run (``u000``…), playing a role of :data:`ROLES`: a team (or none),
  the offer of their server and its count.
- *limit* of a team: its guarantee plus its borrowing limit, in GPU-equivalents.
- *route*: a request path without its query, user names and job ids (errors are counted by it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SPEC = "node1: 16x H100-80GB, mig=4:3g.40gb+3g.40gb, nvlink=8"
"""12 whole H100-80GB and 4 in MIG mode with two 3g.40gb instances each: 16 GPU-equivalents."""
OFFERS: dict[str, dict[str, Any]] = {
    "cpu": {"description": "CPU only"},
    "h100": {"model": "H100-80GB", "max_count": 2, "description": "Whole H100 80GB"},
    "mig-3g.40gb": {"model": "H100-80GB", "description": "Half an H100"},
}
TEAMS: dict[str, dict[str, Any]] = {
    "vision": {
        "guarantee": 4,
        "borrow_limit": 2,
        "user_cap": 1,
        "offers": ["cpu", "h100", "mig-3g.40gb"],
    },
    "nlp": {"guarantee": 2, "borrow_limit": 1, "user_cap": 0.5, "offers": ["cpu", "mig-3g.40gb"]},
    "speech": {"guarantee": 3, "user_cap": 2, "offers": ["cpu", "h100"]},
    "robotics": {
        "guarantee": 3,
        "borrow_limit": 2,
        "user_cap": 1,
        "offers": ["cpu", "h100", "mig-3g.40gb"],
    },
}
"""Limits 6 + 3 + 3 + 5 = 17 GPU-eq on a 16 GPU-eq pool: quotas and capacity both bind."""
ROLES: tuple[tuple[str | None, str, int], ...] = (
    ("vision", "h100", 1),
    ("vision", "mig-3g.40gb", 1),
    ("nlp", "mig-3g.40gb", 1),
    ("nlp", "cpu", 1),
    ("speech", "h100", 2),
    ("speech", "h100", 1),
    ("robotics", "h100", 1),
    ("robotics", "mig-3g.40gb", 1),
    (None, "cpu", 1),
    ("vision", "cpu", 1),
)
"""User i plays ``ROLES[i % 10]``: (team or none, offer, count) for their server."""
JOB_SCRIPT = "import os, time\ntime.sleep(float(os.environ.get('LOAD_SLEEP', '3')))\n"


@dataclass(frozen=True)
class Persona:
    name: str
    team: str | None
    offer: str
    count: int

    def options(self) -> dict[str, Any]:
        """The ``user_options`` of this user's spawn."""
        return {"offer": self.offer, "count": self.count} if self.offer != "cpu" else {}


def plan_users(n: int) -> list[Persona]:
    """``n`` users ``u000``… playing :data:`ROLES` in turn."""
    width = max(3, len(str(n - 1)))
    return [Persona(f"u{i:0{width}d}", *ROLES[i % len(ROLES)]) for i in range(n)]


def groups(personas: Iterable[Persona]) -> dict[str, list[str]]:
    """JupyterHub groups (= teams) and their members."""
    out: dict[str, list[str]] = {team: [] for team in TEAMS}
    for p in personas:
        if p.team:
            out[p.team].append(p.name)
    return out


def team_limits(teams: Mapping[str, Mapping[str, Any]] = TEAMS) -> dict[str, float]:
    """Each team's limit in GPU-equivalents: guarantee plus borrowing limit."""
    return {
        name: float(t.get("guarantee", 0)) + float(t.get("borrow_limit") or 0)
        for name, t in teams.items()
    }


def plan_jobs(personas: Sequence[Persona], count: int) -> list[tuple[Persona, dict[str, Any]]]:
    """``count`` job submissions: one in three on the owner's GPU offer (when they have one),
    the rest CPU-only, one rank each, owners spread over the users."""
    jobs = []
    for i in range(count):
        p = personas[(i * 7) % len(personas)]
        gpu = i % 3 == 0 and p.offer != "cpu"
        body: dict[str, Any] = {
            "script": JOB_SCRIPT,
            "name": f"load-{i}",
            "offer": p.offer if gpu else "cpu",
            "gpus": 1,
            "time_limit": 300,
        }
        jobs.append((p, body))
    return jobs


def status_class(code: int | None) -> str:
    """``201``, ``202``, ``2xx``, ``4xx``, ``5xx`` or ``error`` (no answer)."""
    if code is None:
        return "error"
    if code in (201, 202):
        return str(code)
    return f"{code // 100}xx"


def final_changes(
    history: Mapping[str, Sequence[str]], final: Iterable[str]
) -> dict[str, list[str]]:
    """Jobs whose observed states left a final state: job id -> the states seen, in order."""
    ends = set(final)
    out = {}
    for job_id, states in history.items():
        seen_final = None
        for s in states:
            if seen_final is not None and s != seen_final:
                out[job_id] = list(states)
                break
            if s in ends:
                seen_final = s
    return out


def route(path: str) -> str:
    """A request path without its query, user names and job ids (to count errors by route)."""
    path = path.split("?", 1)[0]
    path = re.sub(r"/users/[^/]+", "/users/<name>", path)
    return re.sub(r"/jobs/[^/]+", "/jobs/<id>", path)


FINAL = ("succeeded", "failed", "cancelled", "lost")
"""The states a job ends in."""
