"""The spawn menu: what a user may pick now, per team, with free counts and quota left.

Vocabulary
- *choice*: one pickable line of the spawn page: a team, an offer and a count (whole-GPU offers,
  and MIG offers with a ``max_count``, get one line per count; a share offer one line, labelled
  like "6 GB share of RTX3090-24GB" with its least cost on this pool), and its admission
  (:mod:`gpupool.core.admission`): granted now, or why not (it would wait, or could never start).
- *team menu*: a team's choices plus its quota figures (used, guarantee, borrow limit, left) and
  the user's own usage and cap.

Contract: pure reads of the ledger; the verdicts come from the one admission rule in the core,
and the hub still decides at spawn time (a stale page cannot grant anything).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpupool.core.admission import Admission
from gpupool.core.ledger import Ledger
from gpupool.core.offers import Offer
from gpupool.core.quota import Team


@dataclass(frozen=True)
class Choice:
    team: str
    offer: str
    count: int
    label: str
    description: str
    cost_milli: int
    free: int
    admission: Admission

    @property
    def enabled(self) -> bool:
        return self.admission.now

    @property
    def reason(self) -> str:
        return self.admission.reason

    @property
    def value(self) -> str:
        """The form value that names this choice: ``team|offer|count``."""
        return f"{self.team}|{self.offer}|{self.count}"


@dataclass(frozen=True)
class TeamMenu:
    team: Team
    used_milli: int
    user_used_milli: int
    choices: tuple[Choice, ...]

    @property
    def left_milli(self) -> int:
        return max(0, self.team.limit_milli - self.used_milli)


def team_menu(ledger: Ledger, team: Team, user: str) -> TeamMenu:
    choices = []
    for name, offer in sorted(ledger.offers.items(), key=lambda kv: _order(kv[1])):
        if not team.allows(name):
            continue
        free = ledger.placeable(offer)
        counts = range(1, offer.max_count + 1) if offer.counted else [1]
        for count in counts:
            several = offer.kind == "gpu" or len(counts) > 1  # MIG: "×N" once N may be above 1
            label = f"{offer.label} ×{count}" if several else offer.label
            admission = ledger.admit(team, user, offer, count)
            cost = ledger.unit_cost_milli(offer) * count
            choices.append(
                Choice(team.name, name, count, label, offer.description, cost, free, admission)
            )
    used, mine = ledger.team_used[team.name], ledger.user_used[team.name, user]
    return TeamMenu(team, used, mine, tuple(choices))


def menu(ledger: Ledger, user: str, groups: list[str]) -> list[TeamMenu]:
    """One team menu per team of the user (``everyone`` when in none)."""
    teams = [ledger.teams[g] for g in sorted(set(groups)) if g in ledger.teams]
    return [team_menu(ledger, t, user) for t in teams or [ledger.everyone]]


def _order(offer: Offer) -> tuple[int, int, str]:
    kind = {"cpu": 0, "mig": 1, "share": 1, "gpu": 2}[offer.kind]
    return (kind, offer.unit_cost_milli(), offer.name)
