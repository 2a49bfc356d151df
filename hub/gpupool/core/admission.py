"""Admission: whether a request could never start, fits now, or would wait — one rule.

Vocabulary
- *request*: ``count`` of one offer per node (GPUs of a whole-GPU offer, instances of a MIG
  offer, one share of a GPU without MIG, or processes of the CPU offer) on ``nodes`` nodes,
  charged to a team for a user.
- *verdict*: ``now`` (grantable at this moment), ``wait`` (within the team's limit and the
  user's cap, but the quota is in use or the devices are busy, or in use outside the pool: a
  job queues, a notebook is refused with the reason) or ``never`` (the team may not use the
  offer, the offer does not come in that count, the request is larger than the team's limit
  or the user's cap, or larger than any node of the pool can ever hold, or, when a job's nodes
  must be different machines, it asks for more nodes than the pool has machines that can hold
  one), or more than Kueue's cohort can ever admit for the team.
- *cohort*: with Kueue admitting GPU pods, its cohort rule too (:mod:`gpupool.core.cohort`): a
  team may use beyond its guarantee only what the other teams leave unused of theirs, so a
  request within the team's limit still *waits* (cause ``quota``) while the cohort is used up.
- *scale-up*: a declared autoscaled node pool (:class:`gpupool.core.inventory.NodePool`) whose
  node could hold what no present node can: the request *waits* for it, with that reason and
  cause ``scale-up`` (after the quota's own waits: a request the quota holds back asks for no
  node).
- *free*: how many of the offer the pool can place now for one request (:meth:`Ledger.placeable`;
  for several MIG instances, the most on one node); *capacity*: the same on an empty pool
  (:meth:`Ledger.capacity`).
- *cost*: one unit's GPU-equivalents times count times nodes; the unit cost is the usage's
  ``unit_cost`` when given (the least a share by size costs on the pool's GPUs,
  :meth:`Ledger.unit_cost_milli`), else the offer's own.

Contract: pure and total; :func:`admit` never raises. The spawn page, the REST offers document,
the job manager's submit and the JupyterLab dialog (through the offers document) all use it, so
a hand-made request gets the answer the page showed. The allocator still decides at the moment
of granting (``Ledger.allocate``), under the pool's lock; a verdict is a snapshot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from gpupool.core.cohort import Cohort, cohort_verdict
from gpupool.core.errors import (
    InvalidRequest,
    NoCapacity,
    OfferNotAllowed,
    PoolError,
    QuotaExceeded,
)
from gpupool.core.offers import Offer
from gpupool.core.quota import Team
from gpupool.core.units import fmt

Verdict = Literal["now", "wait", "never"]
VERDICTS: tuple[Verdict, ...] = ("now", "wait", "never")
Cause = Literal["", "offer", "count", "quota", "capacity", "scale-up"]
_ERRORS: dict[str, type[PoolError]] = {
    "offer": OfferNotAllowed,
    "count": InvalidRequest,
    "quota": QuotaExceeded,
    "capacity": NoCapacity,
    "scale-up": NoCapacity,
}


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    reason: str = ""
    """Why not now, as a phrase a researcher can act on (empty for ``now``)."""
    cause: Cause = ""
    """What stands in the way: the team's offers, a count the offer does not take, the quota
    (team limit or user cap), the devices, or devices only a node pool's new node could hold
    (``scale-up``; empty for ``now``)."""

    @property
    def now(self) -> bool:
        return self.verdict == "now"

    def error(self, message: str) -> PoolError:
        """The pool error a refusal for this cause raises, with ``message``."""
        return _ERRORS.get(self.cause, InvalidRequest)(message)


@dataclass(frozen=True)
class Usage:
    """The snapshot a verdict is taken on, in thousandths of a GPU-equivalent and devices."""

    team_used: int
    user_used: int
    free: int
    capacity: int
    machines: int | None = None
    """Nodes that could each hold the request with nothing held (asked for jobs whose nodes must
    be different machines; ``None``: not asked)."""
    scale_up: str = ""
    """A node pool that could add a node holding the request (empty: none)."""
    machines_later: int = 0
    """``machines`` once every declared node pool that holds the request is at its maximum."""
    unit_cost: int | None = None
    """What one unit of the offer costs on this pool (``None``: the offer's own cost)."""
    outside: tuple[str, ...] = ()
    """Why devices that could serve the offer are not handed out now: each is in use by a
    process that does not hold it (:mod:`gpupool.core.holders`)."""
    cohort: Cohort | None = None
    """Kueue's cohort when Kueue admits GPU pods (``None``: the hub's quota alone)."""
    cohort_used: Mapping[str, int] = field(default_factory=dict)
    """What each team of the cohort holds, in thousandths."""


def admit(team: Team, offer: Offer, count: int, nodes: int, usage: Usage) -> Admission:
    """The verdict on ``count`` of ``offer`` per node on ``nodes`` nodes for ``team``'s user."""
    if not team.allows(offer.name):
        allowed = ", ".join(sorted(team.offers or ())) or "none"
        why = f"team {team.name} may not request {offer.name}; allowed: {allowed}"
        return Admission("never", why, "offer")
    if offer.counted and not 1 <= count <= offer.max_count:
        what = "GPUs" if offer.kind == "gpu" else f"{offer.profile} instances"
        return Admission(
            "never", f"{offer.name} takes 1 to {offer.max_count} {what} per node", "count"
        )
    unit = offer.unit_cost_milli() if usage.unit_cost is None else usage.unit_cost
    cost = unit * count * nodes
    need = f"needs {fmt(cost)} GPU-eq"
    cap = team.user_cap_milli
    if cost > team.limit_milli:
        why = f"{need}; team {team.name} may hold at most {fmt(team.limit_milli)}"
        return Admission("never", why, "quota")
    if cap is not None and cost > cap:
        return Admission("never", f"{need}; your cap in team {team.name} is {fmt(cap)}", "quota")
    kueue, kueue_why = "now", ""
    if usage.cohort is not None:
        kueue, kueue_why = cohort_verdict(usage.cohort, team.name, usage.cohort_used, cost)
        if kueue == "never":
            return Admission("never", f"{need}; {kueue_why}", "quota")
    devices = offer.kind != "cpu"
    too_few = usage.machines is not None and usage.machines < nodes
    scale_up = None
    if devices and (usage.capacity < count or too_few):
        later = usage.machines is None or usage.machines_later >= nodes
        if usage.scale_up and later:
            why = f"node pool {usage.scale_up} has to add a node first (it is autoscaled)"
            scale_up = Admission("wait", why, "scale-up")
        elif usage.capacity < count:
            most = f"at most {usage.capacity}" if usage.capacity else "none"
            why = f"this pool holds {most} of {offer.name} on one node"
            return Admission("never", why, "capacity")
        else:
            why = (
                f"its {nodes} nodes must be different machines, and this pool has "
                f"{usage.machines} that can hold {count} of {offer.name}"
            )
            return Admission("never", why, "capacity")
    if cost and usage.team_used + cost > team.limit_milli:
        left = max(0, team.limit_milli - usage.team_used)
        return Admission("wait", f"{need}; team {team.name} has {fmt(left)} left", "quota")
    if cost and cap is not None and usage.user_used + cost > cap:
        left = max(0, cap - usage.user_used)
        return Admission("wait", f"{need}; you have {fmt(left)} of your cap left", "quota")
    if kueue == "wait":
        return Admission("wait", f"{need}; {kueue_why}", "quota")
    if scale_up:
        return scale_up
    if devices and usage.free < count:
        why = "none free right now" if usage.free == 0 else f"only {usage.free} free on one node"
        return Admission("wait", "; ".join((why, *usage.outside)), "capacity")
    return Admission("now")
