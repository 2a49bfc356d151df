"""Teams and quota arithmetic, as small pure functions over a usage snapshot.

Vocabulary
- *team*: a JupyterHub group with a *guarantee* (GPU-equivalents it can always use when the pool
  has them), a *borrow limit* (how much more it may use while others leave theirs idle), an
  optional per-user *cap*, the offers it may request (``None``: all), and the *priority range*
  its users may give their jobs (default -100 to 0: lower, not raise; admins may set any).
- *everyone*: the pseudo-team for users in no team; by default it may request only ``cpu``.
- *usage*: the GPU-equivalents a team (or user) holds now, in thousandths.
- *user limits*: what one member may have in flight at once (jobs, followed logs, starting
  servers; :mod:`gpupool.core.limits`), the hub's default with the team's own keys over it.

Contract: no I/O; every check raises a :mod:`gpupool.core.errors` error with a full sentence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpupool.core.errors import (
    InvalidRequest,
    LimitReached,
    NotATeamMember,
    OfferNotAllowed,
    QuotaExceeded,
)
from gpupool.core.limits import NO_LIMITS, LimitKey, UserLimits, check_limit
from gpupool.core.offers import Offer
from gpupool.core.parse import quoted
from gpupool.core.units import fmt

EVERYONE = "everyone"


@dataclass(frozen=True)
class Team:
    name: str
    guarantee_milli: int = 0
    borrow_limit_milli: int = 0
    user_cap_milli: int | None = None
    offers: frozenset[str] | None = None
    min_priority: int = -100
    max_priority: int = 0
    user_limits: UserLimits = NO_LIMITS
    """What one member may have in flight at once (:mod:`gpupool.core.limits`)."""

    @property
    def limit_milli(self) -> int:
        """The most this team may hold: guarantee plus borrowing limit."""
        return self.guarantee_milli + self.borrow_limit_milli

    def borrowed_milli(self, used_milli: int) -> int:
        """What of ``used_milli`` lies beyond the guarantee (borrowed, so preemptible)."""
        return max(0, used_milli - self.guarantee_milli)

    def allows(self, offer: str) -> bool:
        return self.offers is None or offer in self.offers

    def check_limit(self, key: LimitKey, in_use: int) -> None:
        """Refuse one more of ``key`` to a member who has ``in_use`` of it (HTTP 429)."""
        whose = "user in no team" if self.name == EVERYONE else f"user in team {self.name}"
        check_limit(self.user_limits, key, in_use, whose)


def member_teams(teams: Mapping[str, Team], everyone: Team, groups: Iterable[str]) -> list[Team]:
    """The teams a user in ``groups`` may charge a request to (``everyone`` when in none)."""
    return [teams[g] for g in sorted(set(groups)) if g in teams] or [everyone]


def check_limit_in_every(teams: Iterable[Team], key: LimitKey, in_use: int) -> None:
    """Refuse one more of ``key`` only when each of ``teams`` would (a member may charge a
    request to any of them), with the sentence of the loosest limit; no team refuses nothing."""
    refusals: list[tuple[int, LimitReached]] = []
    for team in teams:
        try:
            team.check_limit(key, in_use)
        except LimitReached as e:
            refusals.append((getattr(team.user_limits, key), e))
        else:
            return
    if refusals:
        raise max(refusals, key=lambda r: r[0])[1]


def resolve_team(
    teams: Mapping[str, Team], everyone: Team, groups: Iterable[str], requested: str | None
) -> Team:
    """The team a request is charged to.

    A user in exactly one team gets it by default; a user in several must name one; a user in
    none gets ``everyone``. Naming a team the user is not in is refused.
    """
    mine = sorted(g for g in set(groups) if g in teams)
    if requested:
        if requested in mine:
            return teams[requested]
        if requested == everyone.name and not mine:
            return everyone
        choices = ", ".join(mine) or "none"
        raise NotATeamMember(f"You are not in team {quoted(requested)} (your teams: {choices}).")
    if not mine:
        return everyone
    if len(mine) == 1:
        return teams[mine[0]]
    raise NotATeamMember(f"You are in several teams; choose one of: {', '.join(mine)}.")


def check_offer(team: Team, offers: Mapping[str, Offer], offer: str, count: int) -> Offer:
    """The requested offer, if it exists, the team may use it and the count is in range."""
    found = offers.get(offer)
    if found is None:
        known = ", ".join(sorted(offers)) or "none"
        raise InvalidRequest(f"Unknown offer {quoted(offer)}; offers are: {known}.")
    if not team.allows(offer):
        allowed = ", ".join(sorted(o for o in offers if team.allows(o))) or "none"
        who = "Users in no team" if team.name == EVERYONE else f"Team {team.name}"
        raise OfferNotAllowed(f"{who} may not request {offer}; allowed: {allowed}.")
    top = found.max_count if found.counted else 1
    if not 1 <= count <= top:
        raise InvalidRequest(f"Offer {offer} takes a count from 1 to {top}, not {count}.")
    return found


PRIORITY_RANGE = (-100, 100)
"""The priorities a job may have at all (what an admin may set)."""


def check_priority(team: Team, priority: int, admin: bool = False) -> None:
    """Refuse a priority outside the team's range for its users (admins: any in PRIORITY_RANGE).

    A priority orders only the team's own queued jobs (see :mod:`gpupool.core.queue`).
    """
    low, high = PRIORITY_RANGE if admin else (team.min_priority, team.max_priority)
    if low <= priority <= high:
        return
    if admin:
        raise InvalidRequest(f"priority must be a whole number from {low} to {high}.")
    if team.name == EVERYONE:
        who, whose = "Users in no team may", "their"
    else:
        who, whose = f"Team {team.name} lets its users", "the team's"
    raise InvalidRequest(
        f"{who} set a priority from {low} to {high} (higher runs first among {whose} own "
        f"jobs), not {priority}; a gpupool admin can submit the job with it or change "
        f"{whose} range."
    )


def check_quota(
    team: Team, team_used_milli: int, user_used_milli: int, cost_milli: int, what: str
) -> None:
    """Refuse ``cost_milli`` more if the team's limit or the user's cap would be passed."""
    if cost_milli == 0:
        return
    if team_used_milli + cost_milli > team.limit_milli:
        left = max(0, team.limit_milli - team_used_milli)
        raise QuotaExceeded(
            f"{what} needs {fmt(cost_milli)} GPU-eq but team {team.name} uses "
            f"{fmt(team_used_milli)} of {fmt(team.limit_milli)} GPU-eq "
            f"(guarantee {fmt(team.guarantee_milli)}, borrow limit "
            f"{fmt(team.borrow_limit_milli)}); {fmt(left)} GPU-eq left."
        )
    cap = team.user_cap_milli
    if cap is not None and user_used_milli + cost_milli > cap:
        raise QuotaExceeded(
            f"{what} needs {fmt(cost_milli)} GPU-eq but you hold {fmt(user_used_milli)} of your "
            f"{fmt(cap)} GPU-eq cap in team {team.name}."
        )
