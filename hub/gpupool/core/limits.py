"""Per-user limits on volume: what one user may have in flight at once, whatever their quota.

Vocabulary
- *user limits* (:class:`UserLimits`): the most ``jobs`` one user has queued or running
  (queued, starting or running), ``log_followers`` (job logs they follow, ``?follow=1``, open at
  once) and ``spawns`` (their notebook servers starting at once); 0 means no limit. The hub's
  default is ``GPUPool.user_limits``; a team's ``user_limits`` overrides keys of it, and a
  request is held to the limits of the team it is charged to (a log: the job's team).
- *in use*: what the user has now, over all their teams.

Contract: pure. :func:`check_limit` raises :class:`~gpupool.core.errors.LimitReached` (HTTP 429)
whose sentence names the limit, what is in use and what to do, before anything is stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Literal

from gpupool.core.errors import LimitReached

LimitKey = Literal["jobs", "log_followers", "spawns"]

_WHAT: dict[str, tuple[str, str, str]] = {
    "jobs": (
        "job queued or running",
        "jobs queued or running",
        "Wait until one ends, or cancel one.",
    ),
    "log_followers": (
        "followed log open",
        "followed logs open",
        "Close one (another tab or terminal follows it).",
    ),
    "spawns": ("server starting", "servers starting", "Wait until it has started."),
}
"""Per key: what one of it is called, what several are, and what the user can do."""


@dataclass(frozen=True)
class UserLimits:
    jobs: int = 0
    log_followers: int = 0
    spawns: int = 0

    def overridden(self, given: Mapping[str, int]) -> UserLimits:
        """These limits with the keys of ``given`` (a team's ``user_limits``) in their place."""
        return replace(self, **dict(given))


LIMIT_KEYS: tuple[str, ...] = tuple(f.name for f in fields(UserLimits))
NO_LIMITS = UserLimits()
"""No limit on anything (a team built without the hub's settings, in tests)."""


def check_limit(limits: UserLimits, key: LimitKey, in_use: int, whose: str) -> None:
    """Refuse one more of ``key`` for a user who has ``in_use`` of it, held to ``limits``, which
    are ``whose`` ("user in team vision"); 0 is no limit. Callers go through
    :meth:`gpupool.core.quota.Team.check_limit`."""
    limit: int = getattr(limits, key)
    if not limit or in_use < limit:
        return
    one, several, advice = _WHAT[key]
    if key == "spawns" and in_use > 1:
        advice = "Wait until one has started."
    raise LimitReached(
        f"You have {in_use} {one if in_use == 1 else several}; the limit is {limit} per "
        f"{whose}. {advice}"
    )
