"""The JSON models of the REST API (``openapi.yaml``), which the pages reuse for their views.

Vocabulary
- *GPU-eq number*: thousandths of a GPU-equivalent (the ledger's integers) as a JSON number of
  GPU-equivalents (``1500`` → ``1.5``); ``None`` stays ``null`` (no cap).
- *job model*, *allocation model*, *offers model*, *team model*: one dict per object, exactly as
  ``openapi.yaml`` describes it (``tests/hub/test_jobs.py`` checks the routes, the schemathesis
  fuzz checks the replies).

Contract: pure functions of the pool's and the manager's state at the time of the call; no I/O
and no HTTP here (handlers in :mod:`gpupool.hub.handlers` write them, pages in
:mod:`gpupool.hub.pages_view` lay them out).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpupool.clock import iso
from gpupool.core.jobs import Job
from gpupool.core.ledger import Allocation, Ledger
from gpupool.core.quota import Team
from gpupool.core.units import fmt
from gpupool.hub.menu import menu
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.pool import Pool


def gpu_eq(milli: int | None) -> float | None:
    """Thousandths of a GPU-equivalent as a number of GPU-equivalents."""
    return None if milli is None else float(fmt(milli))


def job_model(job: Job, position: int | None) -> dict[str, Any]:
    """One job (``position``: its place in the queue, ``None`` when not queued)."""
    return {
        "id": job.id,
        "name": job.spec.name,
        "owner": job.owner,
        "team": job.team,
        "offer": job.spec.offer,
        "gpus": job.spec.gpus,
        "nodes": job.spec.nodes,
        "ranks": job.spec.ranks,
        "state": job.state,
        "reason": job.reason,
        "priority": job.spec.priority,
        "time_limit": job.spec.time_limit,
        "max_restarts": job.spec.max_restarts,
        "restarts": job.restarts,
        "created": iso(job.created),
        "started": iso(job.started),
        "finished": iso(job.finished),
        "exit_codes": {str(r): c for r, c in job.exit_codes},
        "queue_position": position,
        "devices": list(job.devices),
    }


def allocation_model(a: Allocation, reclaimer: IdleReclaimer) -> dict[str, Any]:
    """One allocation, with what the idle reclaimer knows of a GPU notebook (and of a CPU one
    while it is warned: a process of it uses a GPU it does not hold)."""
    status = reclaimer.status(a) if a.kind == "notebook" else None
    idle = status if status is not None and (a.devices or status["warning"]) else None
    return {
        "id": a.id,
        "user": a.user,
        "team": a.team,
        "offer": a.offer,
        "kind": a.kind,
        "ref": a.ref,
        "count": a.count,
        "cost": gpu_eq(a.cost_milli),
        "node": a.node,
        "devices": [d.visible_id for d in a.devices],
        "since": iso(a.created),
        **({"idle": idle} if idle is not None else {}),
    }


def offers_model(pool: Pool, user: str, groups: list[str]) -> dict[str, Any]:
    """What ``user`` may request, per team, with each line's admission verdict."""
    offers = pool.ledger.offers
    teams = []
    for m in menu(pool.ledger, user, groups):
        t = m.team
        teams.append(
            {
                "team": t.name,
                "used": gpu_eq(m.used_milli),
                "limit": gpu_eq(t.limit_milli),
                "guarantee": gpu_eq(t.guarantee_milli),
                "borrow_limit": gpu_eq(t.borrow_limit_milli),
                "left": gpu_eq(m.left_milli),
                "user_used": gpu_eq(m.user_used_milli),
                "user_cap": gpu_eq(t.user_cap_milli),
                "offers": [
                    {
                        "name": c.offer,
                        "kind": offers[c.offer].kind,
                        "label": c.label,
                        "description": c.description,
                        "count": c.count,
                        "cost": gpu_eq(c.cost_milli),
                        "free": c.free,
                        "admission": c.admission.verdict,
                        "enabled": c.enabled,
                        "reason": c.reason,
                    }
                    for c in m.choices
                ],
            }
        )
    inventory = pool.inventory
    return {"simulated": inventory.simulated, "inventory": inventory.label, "teams": teams}


def team_model(ledger: Ledger, team: Team, jobs: Iterable[Job]) -> dict[str, Any]:
    """A team's quota figures and how many of its jobs wait and run."""
    used = ledger.team_used[team.name]
    mine = [j for j in jobs if j.team == team.name]
    return {
        "name": team.name,
        "guarantee": gpu_eq(team.guarantee_milli),
        "borrow_limit": gpu_eq(team.borrow_limit_milli),
        "used": gpu_eq(used),
        "borrowed": gpu_eq(team.borrowed_milli(used)),
        "jobs_queued": sum(j.state == "queued" for j in mine),
        "jobs_running": sum(j.active for j in mine),
    }
