"""The pages' views: plain dicts built from the pool, the job manager and the reclaimer, which the
templates (``templates/gpupool-*.html``, extending JupyterHub's ``page.html``) only loop over and
print. Jinja autoescapes everything; nothing here is ever marked safe.

Vocabulary
- *view*: what :func:`admin_view` (``/hub/gpupool``) or :func:`mine_view` (``/hub/gpupool/mine``)
  returns; pure functions of their arguments and ``now``.
- *slot drawing*: each GPU as a row of its memory slots (8; 4 on an A30). A MIG instance spans
  its profile's memory slots from its start slot; a whole-GPU allocation, or a GPU with MIG off,
  is one box over the whole row. Free slots are drawn one by one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from gpupool.core.inventory import GPU
from gpupool.core.ledger import Allocation, Blocked, Device
from gpupool.core.quota import Team
from gpupool.core.units import fmt
from gpupool.hub.models import allocation_model, job_model, team_model
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool

COLOURS = 8
"""Holder colours in the slot drawing (``gp-c0`` … ``gp-c7``), one per team in a fixed order."""

IDLE_ACTIONS = {"stop": "stop", "cpu": "restart on CPU"}


# -- small formatting helpers -------------------------------------------------------------------
def _iso(ts: float | None) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds") if ts else ""


def relative(ts: float | None, now: float) -> str:
    """``"just now"``, ``"5 min ago"``, ``"2 h 5 min ago"``, ``"3 d 4 h ago"``."""
    if not ts:
        return ""
    seconds = max(0, int(now - ts))
    if seconds < 60:
        return "just now"
    minutes, hours, days = seconds // 60 % 60, seconds // 3600 % 24, seconds // 86400
    if days:
        return f"{days} d {hours} h ago" if hours else f"{days} d ago"
    if hours:
        return f"{hours} h {minutes} min ago" if minutes else f"{hours} h ago"
    return f"{minutes} min ago"


def _parse(iso: str | None) -> float | None:
    return datetime.fromisoformat(iso).timestamp() if iso else None


def _when(ts: float | None, now: float) -> dict[str, str]:
    """A time as the pages print it: relative, with the ISO time for the title attribute."""
    return {"relative": relative(ts, now), "iso": _iso(ts)}


def _utilisation(value: Any, device: str) -> str:
    if value is None:
        return "n/a (MIG)" if device.startswith("MIG-") else "n/a"
    return f"{value:g}%"


# -- the slot drawing ---------------------------------------------------------------------------
def _holder(a: Allocation, colours: Mapping[str, int]) -> dict[str, Any]:
    return {
        "user": a.user,
        "team": a.team,
        "kind": a.kind,
        "ref": a.ref,
        "allocation": a.id,
        "colour": colours.get(a.team, 0) % COLOURS,
    }


def _cell(
    start: int,
    span: int,
    label: str,
    uuid: str | None,
    holder: dict[str, Any] | None,
    profile: str = "",
) -> dict[str, Any]:
    slots = f"{start}" if span == 1 else f"{start}-{start + span - 1}"
    who = (
        f"{holder['user']} ({holder['team']}), {holder['kind']} {holder['ref']}"
        if holder
        else "free"
    )
    return {
        "start": start,
        "span": span,
        "slots": slots,
        "label": label,
        "profile": profile,
        "uuid": uuid or "",
        "holder": holder,
        "free": holder is None,
        "title": " · ".join(x for x in (label, f"slots {slots}", uuid, who) if x),
    }


def gpu_view(
    gpu: GPU,
    held: Iterable[tuple[Device, Allocation]],
    colours: Mapping[str, int],
    blocked: Iterable[Blocked] = (),
    reported: Mapping[tuple[str, str, int | None], Any] | None = None,
) -> dict[str, Any]:
    """One GPU: its facts, its memory slots as cells (sorted by start slot) and its holders;
    ``blocked``: its slots held by no allocation (a draining instance, one an admin made while
    the hub runs), shown as taken, with why; ``reported``: (allocation id, GPU, start slot) ->
    the MIG instance the node reports for a held one (Kubernetes' read-back,
    :func:`gpupool.kube.readback.mig_reported`: parent GPU index and UUID, GPU instance ID),
    shown in its cell. On a GPU whose instances gpupool creates, the
    instances it already had are an admin's, handed out as they are (labelled so)."""
    held = list(held)
    blocks = {b.start: b for b in blocked}
    geometry = gpu.geometry
    slots = geometry.memory_slots if geometry else 1
    whole = [a for d, a in held if d.profile is None]
    migs = [(d, a) for d, a in held if d.profile is not None]
    cells: list[dict[str, Any]] = []
    if (
        whole
        or geometry is None
        or gpu.mig_mode == "off"
        or (gpu.mig_mode == "flex" and not migs and not gpu.instances)
    ):
        holder = _holder(whole[0], colours) if whole else None
        label = "whole GPU" if gpu.mig_mode in ("off", "flex") or whole else "MIG"
        if gpu.mig_mode == "flex" and not whole:
            label = "whole GPU or MIG"
        shown = next((d.visible_id for d, _ in held if d.profile is None), gpu.uuid)
        cells.append(_cell(0, slots, label, shown, holder))  # a read-back UUID, where known
    else:
        taken: set[int] = set()
        matched: set[int] = set()

        def span(profile: str) -> int:
            p = geometry.resolve(profile)
            return p.memory_slots if p else 1

        for inst in gpu.instances:  # pre-created (fixed) instances, held or free
            i = next(
                (
                    i
                    for i, (d, _) in enumerate(migs)
                    if i not in matched
                    and ((d.instance and d.instance == inst.uuid) or d.start == inst.start)
                ),
                None,
            )
            holder = None
            if i is not None:
                matched.add(i)
                holder = _holder(migs[i][1], colours)
            n = span(inst.profile)
            label = inst.profile
            if gpu.mig_mode == "dynamic":  # an admin's, where gpupool makes the others
                label = f"{label} ({BLOCKED_LABELS['admin']})"
            cell = _cell(inst.start, n, label, inst.uuid, holder, inst.profile)
            if i is not None:
                d, a = migs[i]
                cell = _reported(cell, (reported or {}).get((a.id, d.gpu, d.start)))
            b = blocks.pop(inst.start, None)
            if b is not None and holder is None:
                cell = _blocked_cell(cell, b)
            cells.append(cell)
            taken.update(range(inst.start, inst.start + n))
        for i, (d, a) in enumerate(migs):  # instances created for an allocation (dynamic)
            if i in matched or d.profile is None or d.start is None:
                continue
            n = span(d.profile)
            cell = _cell(d.start, n, d.profile, d.instance, _holder(a, colours), d.profile)
            cells.append(_reported(cell, (reported or {}).get((a.id, d.gpu, d.start))))
            taken.update(range(d.start, d.start + n))
        for b in blocks.values():  # draining instances, slots MIG on demand may not use
            n = span(b.profile)
            cells.append(
                _blocked_cell(_cell(b.start, n, b.profile, b.instance, None, b.profile), b)
            )
            taken.update(range(b.start, b.start + n))
        for s in range(slots):
            if s not in taken:
                cells.append(_cell(s, 1, "free", None, None))
        cells.sort(key=lambda c: c["start"])
    holders = sorted(
        {(a.user, a.team, a.kind, a.ref) for _, a in held},
    )
    return {
        "uuid": gpu.uuid,
        "index": gpu.index,
        "model": gpu.model,
        "mig_mode": gpu.mig_mode,
        "slots": slots,
        "cells": cells,
        "holders": [
            {"user": u, "team": t, "kind": k, "ref": r, "colour": colours.get(t, 0) % COLOURS}
            for u, t, k, r in holders
        ],
    }


def _reported(cell: dict[str, Any], seen: Any) -> dict[str, Any]:
    """``cell`` with the MIG instance its node reports (a read-back ``Seen``), if any."""
    if seen is None:
        return cell
    text = f"node reports GPU {seen.index} ({seen.uuid}), GPU instance {seen.gi}"
    return {**cell, "reported": text, "title": f"{cell['title']} · {text}"}


BLOCKED_LABELS = {
    "admin": "admin's instance",
    "draining": "draining",
    "gone": "gone: destroyed outside gpupool",
    "off": "MIG on demand off",
}


def _blocked_cell(cell: dict[str, Any], blocked: Blocked) -> dict[str, Any]:
    """A cell taken by no allocation: an admin's instance gpupool leaves alone, an instance
    still draining (processes ran on it at release; destroyed once they end), or slots MIG on
    demand cannot use."""
    why = BLOCKED_LABELS.get(blocked.reason, blocked.reason)
    label = why if blocked.reason == "off" else f"{cell['label']} ({why})"
    title = " · ".join(x for x in (label, f"slots {cell['slots']}", cell["uuid"]) if x)
    return {**cell, "label": label, "free": False, "state": blocked.reason, "title": title}


# -- the views ----------------------------------------------------------------------------------
def _teams(pool: Pool) -> list[Team]:
    ledger = pool.ledger
    return [*sorted(ledger.teams.values(), key=lambda t: t.name), ledger.everyone]


def _allocation_row(
    a: Allocation, jobs: JobManager, reclaimer: IdleReclaimer, now: float
) -> dict[str, Any]:
    model = allocation_model(a, reclaimer)
    idle = model.get("idle") or {}
    utilisation = idle.get("utilisation", {})
    warning = idle.get("warning")
    devices = [
        {
            "id": d,
            "utilisation": _utilisation(utilisation[d], d) if d in utilisation else "not measured",
        }
        for d in model["devices"]
    ]
    if a.kind == "notebook":
        user, _, server = a.ref.partition("/")
        name = f"{user}'s server" if not server else f"{user}'s server {server!r}"
        action = {
            "kind": "stop",
            "label": "Stop server",
            "fields": {"user": user, "server": server},
            "confirm": f"Stop {name}? Unsaved work is lost.",
        }
        what = f"notebook {a.ref}"
    else:
        job = jobs.jobs.get(a.ref)
        label = f"{job.spec.name} ({a.ref})" if job and job.spec.name else a.ref
        action = {
            "kind": "cancel",
            "label": "Cancel job",
            "fields": {"job": a.ref},
            "confirm": f"Cancel job {label} of {a.user}? Its processes are stopped.",
        }
        what = f"job {label}" + (f" · {job.state}" if job else "")
    if warning:
        at = _parse(warning["reclaim_at"])
        when = datetime.fromtimestamp(at, UTC).strftime("%H:%M UTC") if at else "soon"
        verb = IDLE_ACTIONS.get(warning["action"], warning["action"])
        state = {"level": "warning", "text": warning["message"], "short": f"{verb} at {when}"}
    elif idle.get("idle_since"):
        since = _when(_parse(idle["idle_since"]), now)
        state = {"level": "idle", "text": f"idle since {since['relative']}"}
    elif utilisation:
        state = {"level": "active", "text": "in use"}
    elif idle:
        state = {"level": "", "text": "not checked yet"}
    else:
        state = {"level": "", "text": "—"}  # CPU only and jobs: never reclaimed
    return {
        **model,
        "what": what,
        "offer_label": f"{a.offer} ×{a.count}" if a.count > 1 else a.offer,
        "cost_label": fmt(a.cost_milli),
        "since_when": _when(a.created, now),
        "device_rows": devices,
        "state": state,
        "action": action,
    }


def _team_row(pool: Pool, team: Team, jobs: JobManager) -> dict[str, Any]:
    used = pool.ledger.team_used[team.name]
    limit = team.limit_milli
    percent = min(100, round(100 * used / limit)) if limit else 0
    counts = team_model(pool.ledger, team, jobs.jobs.values())
    return {
        "name": team.name,
        "guarantee": fmt(team.guarantee_milli),
        "borrow_limit": fmt(team.borrow_limit_milli),
        "limit": fmt(limit),
        "used": fmt(used),
        "borrowed": fmt(team.borrowed_milli(used)),
        "left": fmt(max(0, limit - used)),
        "user_cap": fmt(team.user_cap_milli) if team.user_cap_milli is not None else "—",
        "percent": percent,
        "borrowing": used > team.guarantee_milli,
        **{k: counts[k] for k in ("jobs_queued", "jobs_running")},
    }


def _pool_header(pool: Pool) -> dict[str, Any]:
    inventory = pool.inventory
    return {"label": inventory.label, "simulated": inventory.simulated, "source": inventory.source}


def admin_view(
    pool: Pool,
    jobs: JobManager,
    reclaimer: IdleReclaimer,
    now: float,
    reported: Mapping[tuple[str, str, int | None], Any] | None = None,
) -> dict[str, Any]:
    """Everything the admin page shows: the pool, each GPU's slots, allocations, teams, queue;
    ``reported``: the MIG instances the nodes report (see :func:`gpu_view`)."""
    ledger = pool.ledger
    teams = _teams(pool)
    colours = {t.name: i for i, t in enumerate(teams)}
    allocations = sorted(ledger.allocations.values(), key=lambda a: (a.created, a.id))
    on_gpu: dict[str, list[tuple[Device, Allocation]]] = {}
    for a in allocations:
        for d in a.devices:
            on_gpu.setdefault(d.gpu, []).append((d, a))
    blocked: dict[str, list[Blocked]] = {}
    for b in ledger.blocked.values():
        blocked.setdefault(b.gpu, []).append(b)
    nodes = [
        {
            "name": node.name,
            "gpus": [
                gpu_view(g, on_gpu.get(g.uuid, []), colours, blocked.get(g.uuid, ()), reported)
                for g in node.gpus
            ],
        }
        for node in pool.inventory.nodes
    ]
    positions = jobs.queue_positions()
    queue = []
    for job_id, position in sorted(positions.items(), key=lambda item: item[1]):
        job = jobs.jobs[job_id]
        queue.append(
            {
                **job_model(job, position),
                "shape": f"{job.spec.offer} ×{job.spec.gpus} ×{job.spec.nodes}",
                "waiting": _when(job.created, now),
                "action": {
                    "kind": "cancel",
                    "label": "Cancel job",
                    "fields": {"job": job.id},
                    "confirm": f"Cancel queued job {job.id} of {job.owner}?",
                },
            }
        )
    team_rows = []
    for t in teams:
        policy = reclaimer.policy(t.name)
        row = _team_row(pool, t, jobs)
        row["colour"] = colours[t.name] % COLOURS
        row["idle_policy"] = (
            "off"
            if policy.action == "off"
            else f"{IDLE_ACTIONS.get(policy.action, policy.action)} after "
            f"{policy.idle_after / 60:g} min below {policy.threshold}%"
        )
        team_rows.append(row)
    return {
        "pool": _pool_header(pool),
        "store": pool.writes.health(),
        "job_network": {
            "private": jobs.backend.private_network,
            "text": jobs.backend.network_note,
        },
        "mig": pool.mig.view(ledger) if pool.mig is not None else None,
        "activity": reclaimer.activity(),
        "nodes": nodes,
        "allocations": [_allocation_row(a, jobs, reclaimer, now) for a in allocations],
        "teams": team_rows,
        "queue": queue,
        "totals": {
            "gpus": len(pool.inventory.gpus),
            "allocations": len(allocations),
            "queued": len(queue),
        },
    }


def mine_view(
    pool: Pool,
    jobs: JobManager,
    reclaimer: IdleReclaimer,
    user: str,
    groups: Iterable[str],
    now: float,
) -> dict[str, Any]:
    """What "My GPUs" shows ``user``: their allocations, their unfinished jobs, their teams."""
    ledger = pool.ledger
    allocations = sorted(
        (a for a in ledger.allocations.values() if a.user == user),
        key=lambda a: (a.created, a.id),
    )
    rows = []
    for a in allocations:
        row = _allocation_row(a, jobs, reclaimer, now)
        row.pop("action")  # users stop their own server from the hub's home page
        rows.append(row)
    positions = jobs.queue_positions()
    waiting = []
    for job in sorted(jobs.jobs.values(), key=lambda j: j.created):
        if job.owner != user or job.state != "queued":
            continue
        waiting.append(
            {
                "id": job.id,
                "name": job.spec.name,
                "team": job.team,
                "shape": f"{job.spec.offer} ×{job.spec.gpus} ×{job.spec.nodes}",
                "position": positions.get(job.id),
                "reason": job.reason,
                "waiting": _when(job.created, now),
            }
        )
    mine = sorted(set(groups) & set(ledger.teams)) or [ledger.everyone.name]
    teams = []
    for name in mine:
        team = ledger.team(name)
        row = _team_row(pool, team, jobs)
        row["mine"] = fmt(ledger.user_used[team.name, user])
        teams.append(row)
    return {
        "pool": _pool_header(pool),
        "user": user,
        "allocations": rows,
        "queued": waiting,
        "teams": teams,
    }
