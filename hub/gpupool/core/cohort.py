"""Kueue's cohort rule, which the hub's admission also applies when Kueue admits GPU pods.

Vocabulary
- *cohort*: the teams whose Kueue ClusterQueues share one Kueue cohort (the Helm chart's
  ``kueue.cohort``: every team, and ``everyone`` when it has quota). Each team's *quota* there is
  its ClusterQueue's ``nominalQuota`` (the team's guarantee) and ``borrowingLimit`` (its borrow
  limit) of the GPU-equivalent resource; ``lendingLimit`` is Kueue's and optional (the chart
  sets none).
- *room*: how much more Kueue admits for a team now, given what every team of the cohort holds:
  Kueue's ``available`` for a ClusterQueue whose cohort has no parent
  (kueue ``pkg/cache/scheduler/resource_node.go``: ``available``, ``localQuota``,
  ``accumulateFromChild``; clamped at 0 by ``ClusterQueueSnapshot.Available``). A team may use
  beyond its guarantee only what the cohort's other members leave unused of their nominal
  quota, and at most its borrowing limit.
- *most*: what Kueue could ever admit for a team, the cohort empty (``potentialAvailable``); a
  request above it is never admitted (``fitsResourceQuota`` in kueue
  ``pkg/scheduler/flavorassigner/flavorassigner.go``: ``ExceedsMaxQuota``).

Contract: pure. All amounts are thousandths of a GPU-equivalent (Kueue counts the chart's
resource in these units, see docs/kubernetes.md section 5). :func:`check_cohort` raises
:class:`QuotaExceeded` with a sentence naming the cohort, as :func:`gpupool.core.quota.
check_quota` does for the team's own limit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpupool.core.errors import QuotaExceeded
from gpupool.core.quota import Team
from gpupool.core.units import fmt


@dataclass(frozen=True)
class Quota:
    """One ClusterQueue's quota of the GPU-equivalent resource (Kueue's ``ResourceQuota``)."""

    nominal: int
    borrowing_limit: int | None = None
    """``None``: no limit (Kueue's default: borrow all the cohort lends)."""
    lending_limit: int | None = None
    """``None``: lends all its unused nominal quota (Kueue's default)."""

    def local(self) -> int:
        """What the cohort never sees (``localQuota``): nominal beyond the lending limit."""
        return 0 if self.lending_limit is None else max(0, self.nominal - self.lending_limit)


@dataclass(frozen=True)
class Cohort:
    """A Kueue cohort of one ClusterQueue per team (see *cohort*)."""

    name: str
    quotas: Mapping[str, Quota] = field(default_factory=dict)

    @classmethod
    def of_teams(cls, name: str, teams: Iterable[Team], everyone: Team | None = None) -> Cohort:
        """The cohort the Helm chart renders from the teams' declarations (its
        ``gpupool.queueTeams``): a ClusterQueue per team, and one for ``everyone`` when it has
        quota; nominal quota = guarantee, borrowing limit = borrow limit."""
        members = list(teams)
        if everyone is not None and everyone.limit_milli:
            members.append(everyone)
        return cls(name, {t.name: Quota(t.guarantee_milli, t.borrow_limit_milli) for t in members})

    def nominal(self) -> int:
        """The cohort's nominal quota: what its members lend (Kueue's cohort ``SubtreeQuota``)."""
        return sum(q.nominal - q.local() for q in self.quotas.values())

    def in_use(self, used: Mapping[str, int]) -> int:
        """What counts against :meth:`nominal` (the cohort's ``Usage``: each member's use beyond
        its local quota)."""
        return sum(max(0, used.get(t, 0) - q.local()) for t, q in self.quotas.items())

    def room(self, team: str, used: Mapping[str, int]) -> int:
        """See *room*: Kueue's ``available`` for ``team``'s ClusterQueue (0 with none)."""
        quota = self.quotas.get(team)
        if quota is None:
            return 0
        mine, local = used.get(team, 0), quota.local()
        parent = self.nominal() - self.in_use(used)
        if quota.borrowing_limit is not None:
            stored = quota.nominal - local
            used_in_parent = max(0, mine - local)
            parent = min(stored - used_in_parent + quota.borrowing_limit, parent)
        return max(0, max(0, local - mine) + parent)

    def most(self, team: str) -> int:
        """See *most*: Kueue's ``potentialAvailable`` for ``team``'s ClusterQueue."""
        quota = self.quotas.get(team)
        if quota is None:
            return 0
        most = quota.local() + self.nominal()
        if quota.borrowing_limit is not None:
            most = min(quota.nominal + quota.borrowing_limit, most)
        return most

    def why(self, team: str, used: Mapping[str, int]) -> str:
        """Why ``team`` gets no more than its :meth:`room`, as a phrase."""
        quota = self.quotas.get(team)
        if quota is None:
            return f"Kueue's cohort {self.name} has no ClusterQueue for team {team}"
        held = (
            f"Kueue's cohort {self.name}: {fmt(self.in_use(used))} of {fmt(self.nominal())} "
            "GPU-eq nominal quota in use"
        )
        if used.get(team, 0) < quota.nominal:
            return (
                f"{held}; others borrow what {team} lends until Kueue reclaims it from "
                "lower-priority workloads"
            )
        return f"{held}; {team} may borrow only what others leave unused"


def cohort_verdict(
    cohort: Cohort, team: str, used: Mapping[str, int], cost: int
) -> tuple[str, str]:
    """``("now", "")``, ``("wait", why)`` or ``("never", why)`` for ``cost`` more for ``team``
    under Kueue's cohort rule alone (see *room* and *most*)."""
    if cost <= 0:
        return "now", ""
    most = cohort.most(team)
    if cost > most:
        return "never", (
            f"Kueue's cohort {cohort.name} can admit at most {fmt(most)} GPU-eq for team {team}"
        )
    if cost > cohort.room(team, used):
        return "wait", cohort.why(team, used)
    return "now", ""


def check_cohort(
    cohort: Cohort | None, team: str, used: Mapping[str, int], cost: int, what: str
) -> None:
    """Refuse ``cost`` more for ``team`` when Kueue's cohort would not admit it now."""
    if cohort is None:
        return
    verdict, why = cohort_verdict(cohort, team, used, cost)
    if verdict != "now":
        raise QuotaExceeded(f"{what} needs {fmt(cost)} GPU-eq but {why}.")
