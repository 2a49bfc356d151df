"""The load benchmark's three views of who holds which device, and their comparison.

Views: the pool's database (*db*, read with ``gpupool.store``), the REST view (*rest*:
``GET /hub/api/gpupool/allocations?all=1`` as an admin) and the live processes (*proc*:
``/proc/<pid>/environ`` of every process whose ``HOME`` is under the run's homes; servers carry
``GPUPOOL_ALLOCATION``, job processes ``GPUPOOL_JOB``, both ``CUDA_VISIBLE_DEVICES``, which is
mapped to GPU memory slots as the pool does: a whole GPU blocks all 8, a MIG instance its own).

Holders share one namespace in every view: a server and its allocation are ``alloc:<id>``, a job
and its allocation ``job:<id>``.

Findings, by what the snapshot can tell:

- *within a view* (:func:`conflicts`): two holders whose devices overlap in one view. A view is
  read at once (one database read, one REST answer, one scan of ``/proc`` that takes
  milliseconds), so a finding counts at once.
- *across views* (:func:`cross_view`), both ways: every live process's devices must belong to an
  allocation of its own holder in the db and in the rest view (it must exist —
  ``unallocated`` —, be of the process's user — ``wrong_holder`` — and cover the devices —
  ``uncovered``), no device of an allocation may be used by another holder's process
  (``other_holder``), and the db and rest views must not give one device to two holders
  (``views_disagree``). The three views are not read at one instant: a process seen with a
  device whose allocation was released a moment before (a server that is stopping), or not yet
  recorded, is a finding of one look only. **Rule**: a cross-view finding counts only once it
  has been seen in every look that could see it (both of its views read) for at least a grace
  (:class:`Persistence`; the benchmark's ``--view-grace``, 12 s by default: the job backend's
  kill grace + 2 s, as for orphans). A look that could not read one of its views (the hub
  down, the database locked) neither confirms nor clears it.
- *leaks during the run* (:func:`gone_holders`): an allocation whose holder is gone (no live
  process of it and, for a server, no JupyterHub server record), counted once so for longer than
  a grace with the hub up all the while (a hub that is down releases nothing).

Pure functions over snapshots, except :func:`live_processes` and :func:`homed` (which read
``/proc`` through ``gpupool.procfs``) and :func:`device_slots` (which builds the simulated
inventory).
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpupool import procfs

SERVER_CMD = "jupyterhub-singleuser"

Slots = dict[str, tuple[str, int]]
"""Visible id (GPU or MIG UUID) -> (GPU UUID, memory-slot mask it blocks)."""


def device_slots(spec: str) -> Slots:
    """Every visible id of the simulated inventory ``spec`` and the slots it blocks."""
    from gpupool.core.mig import geometry_for
    from gpupool.discovery import SimulatedNVML, simulated_inventory

    slots: Slots = {}
    for node in simulated_inventory(SimulatedNVML(spec)).nodes:
        for gpu in node.gpus:
            geometry = geometry_for(gpu.model)
            slots[gpu.uuid] = (gpu.uuid, geometry.full_mask if geometry else 0xFF)
            for inst in gpu.instances:
                profile = geometry.resolve(inst.profile) if geometry else None
                if inst.uuid and profile:
                    slots[inst.uuid] = (gpu.uuid, profile.mask_at(inst.start))
    return slots


def slot_cost(mask: int, total_slots: int = 8) -> float:
    """GPU-equivalents a slot mask blocks (its slots / 8)."""
    return bin(mask).count("1") / total_slots


def masks(ids: Iterable[str], slots: Slots) -> dict[str, int]:
    """GPU -> the slots ``ids`` block on it; an id ``slots`` does not know is a GPU of its own."""
    out: dict[str, int] = {}
    for vid in ids:
        if vid:
            gpu, mask = slots.get(vid, (vid, 0xFF))
            out[gpu] = out.get(gpu, 0) | mask
    return out


def conflicts(holdings: Mapping[str, Iterable[str]], slots: Slots) -> list[tuple[str, str, str]]:
    """``(gpu, holder, other holder)`` for every pair of holders whose devices overlap; an id
    ``slots`` does not know is a device of its own."""
    by_gpu: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for holder, ids in holdings.items():
        for gpu, mask in masks(ids, slots).items():
            by_gpu[gpu].append((holder, mask))
    found: set[tuple[str, str, str]] = set()
    for gpu, held in by_gpu.items():
        for i, (a, mask_a) in enumerate(held):
            for b, mask_b in held[i + 1 :]:
                if a != b and mask_a & mask_b:
                    found.add((gpu, min(a, b), max(a, b)))
    return sorted(found)


def team_use(holdings: Mapping[str, tuple[str, Iterable[str]]], slots: Slots) -> dict[str, float]:
    """GPU-equivalents per team from ``holder -> (team, visible ids)``, each device counted
    once per team."""
    per_team: dict[str, dict[str, int]] = defaultdict(dict)
    for team, ids in holdings.values():
        for gpu, mask in masks(ids, slots).items():
            per_team[team][gpu] = per_team[team].get(gpu, 0) | mask
    return {team: sum(slot_cost(m) for m in gpus.values()) for team, gpus in per_team.items()}


def over_limit(
    used: Mapping[str, float], limits: Mapping[str, float]
) -> list[tuple[str, float, float]]:
    """``(team, used, limit)`` for each team using more than its limit (a team without a limit
    has 0: only CPU)."""
    return [
        (team, round(u, 3), limits.get(team, 0.0))
        for team, u in sorted(used.items())
        if u > limits.get(team, 0.0) + 1e-9
    ]


# -- snapshots ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Held:
    """One allocation as the db or rest view shows it."""

    id: str
    user: str
    kind: str  # "notebook" or "job"
    ref: str  # "<user>/<server name>" or the job id
    devices: tuple[str, ...]
    team: str = ""

    @property
    def holder(self) -> str:
        return holder_name(self.kind, self.id, self.ref)


def holder_name(kind: str, alloc_id: str, ref: str) -> str:
    return f"job:{ref}" if kind == "job" else f"alloc:{alloc_id}"


@dataclass(frozen=True)
class Proc:
    pid: int
    kind: str  # "server" or "job"
    user: str
    holder: str  # "alloc:<id>" for servers (or "pid:<pid>" without one), "job:<id>"
    team: str
    devices: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class Snapshot:
    """One look: the allocations of the db and rest views (``None``: not read this time) and the
    live processes."""

    db: tuple[Held, ...] | None
    rest: tuple[Held, ...] | None
    procs: tuple[Proc, ...]

    def views(self) -> dict[str, tuple[Held, ...]]:
        return {v: a for v, a in (("db", self.db), ("rest", self.rest)) if a is not None}

    def read(self) -> set[str]:
        """The views this look read."""
        return {"proc", *self.views()}


def process_holdings(procs: Iterable[Proc]) -> dict[str, tuple[str, set[str]]]:
    """holder -> (user, devices of all its live processes), for processes with devices."""
    out: dict[str, tuple[str, set[str]]] = {}
    for p in procs:
        if p.devices:
            out.setdefault(p.holder, (p.user, set()))[1].update(p.devices)
    return out


Key = tuple[str, ...]


def cross_view(snap: Snapshot, slots: Slots) -> dict[Key, dict[str, Any]]:
    """The cross-view findings of one snapshot: key -> what was seen. Keys start with the kind
    and the views compared (``proc~db``, ``proc~rest``, ``db~rest``): see the module's
    docstring."""
    found: dict[Key, dict[str, Any]] = {}
    procs = process_holdings(snap.procs)
    for view, allocs in snap.views().items():
        pair = f"proc~{view}"
        by_holder = {a.holder: a for a in allocs}
        for holder, (user, devices) in procs.items():
            alloc = by_holder.get(holder)
            seen = {"holder": holder, "user": user, "devices": sorted(devices)}
            if alloc is None:
                found[("unallocated", pair, holder)] = seen
            elif alloc.user != user:
                found[("wrong_holder", pair, holder)] = {**seen, "allocation_user": alloc.user}
            else:
                held = masks(alloc.devices, slots)
                for gpu, mask in masks(devices, slots).items():
                    if mask & ~held.get(gpu, 0):
                        found[("uncovered", pair, holder, gpu)] = {
                            **seen,
                            "allocation_devices": list(alloc.devices),
                        }
        for alloc in allocs:
            held = masks(alloc.devices, slots)
            for holder, (user, devices) in procs.items():
                if holder == alloc.holder:
                    continue
                for gpu, mask in masks(devices, slots).items():
                    if mask & held.get(gpu, 0):
                        found[("other_holder", pair, alloc.holder, holder, gpu)] = {
                            "allocation": alloc.holder,
                            "allocation_user": alloc.user,
                            "process_holder": holder,
                            "process_user": user,
                            "gpu": gpu,
                        }
    views = snap.views()
    if "db" in views and "rest" in views:
        for db_alloc in views["db"]:
            held = masks(db_alloc.devices, slots)
            for rest_alloc in views["rest"]:
                if rest_alloc.holder == db_alloc.holder:
                    continue
                for gpu, mask in masks(rest_alloc.devices, slots).items():
                    if mask & held.get(gpu, 0):
                        key = ("views_disagree", "db~rest", db_alloc.holder, rest_alloc.holder, gpu)
                        found[key] = {
                            "db": db_alloc.holder,
                            "rest": rest_alloc.holder,
                            "gpu": gpu,
                        }
    return found


def views_of(key: Key) -> set[str]:
    """The views a finding's key compares (``proc~db`` -> {proc, db})."""
    return set(key[1].split("~"))


class Persistence:
    """Findings that last: one counts once it has been seen in every look that could see it for
    at least ``grace`` seconds. A look that could not see it (``covered`` false) neither confirms
    nor clears it; :meth:`reset` forgets everything pending (e.g. while the hub is down)."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.first: dict[Any, float] = {}
        self.confirmed: dict[Any, Any] = {}

    def update(
        self,
        now: float,
        found: Mapping[Any, Any],
        covered: Callable[[Any], bool] = lambda _: True,
    ) -> list[Any]:
        """Record one look at ``now``; the findings confirmed by it (each once)."""
        for key in list(self.first):
            if key not in found and covered(key):
                del self.first[key]
        new = []
        for key, seen in found.items():
            since = self.first.setdefault(key, now)
            if now - since >= self.grace and key not in self.confirmed:
                self.confirmed[key] = seen
                new.append(key)
        return new

    def reset(self) -> None:
        self.first.clear()


def gone_holders(
    allocs: Iterable[Held], procs: Iterable[Proc], server_records: Iterable[str]
) -> dict[Key, dict[str, Any]]:
    """Allocations whose holder is gone: a server's (notebook) with no live process carrying it
    and no JupyterHub server record of its ref (``user/name``), a job's with no live process of
    the job. key ``("leak", allocation id)``."""
    live = {p.holder for p in procs}
    records = set(server_records)
    out: dict[Key, dict[str, Any]] = {}
    for a in allocs:
        if a.holder in live or (a.kind != "job" and a.ref in records):
            continue
        out[("leak", a.id)] = {"id": a.id, "kind": a.kind, "ref": a.ref, "user": a.user}
    return out


# -- live processes ------------------------------------------------------------------------------
def classify(pid: int, env: Mapping[str, str], cmd: str) -> Proc | None:
    """A server (its command is ``jupyterhub-singleuser``) or a job process (``GPUPOOL_JOB``);
    ``None`` for anything else (a kernel or another child of a server: its server counts)."""
    devices = tuple(d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d)
    user = env.get("JUPYTERHUB_USER") or env.get("USER", "")
    if env.get("GPUPOOL_JOB"):
        holder, kind = f"job:{env['GPUPOOL_JOB']}", "job"
    elif SERVER_CMD in cmd:
        alloc = env.get("GPUPOOL_ALLOCATION", "")
        holder, kind = (f"alloc:{alloc}" if alloc else f"pid:{pid}"), "server"
    else:
        return None
    return Proc(pid, kind, user, holder, env.get("GPUPOOL_TEAM", ""), devices, env)


class ScanCost:
    """What the scans of ``/proc`` cost: wall seconds each, and the processes looked at."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.pids: list[int] = []

    def add(self, seconds: float, pids: int) -> None:
        if len(self.seconds) < 100_000:
            self.seconds.append(seconds)
            self.pids.append(pids)


def homed(homes: Path, pids: Iterable[int]) -> Iterator[tuple[int, dict[str, str]]]:
    """Of ``pids``, the live processes (not zombies) whose ``HOME`` is under ``homes`` (this
    run's), with their environment."""
    marker = f"HOME={homes}/".encode()
    for pid in pids:
        items = procfs.environ_items(pid)
        if items is None or not any(item.startswith(marker) for item in items):
            continue
        env = procfs.parse_environ(items)
        if env.get("HOME", "").startswith(f"{homes}/") and procfs.process_start(pid) is not None:
            yield pid, env


def live_processes(homes: Path, cost: ScanCost | None = None) -> list[Proc]:
    """Servers and job processes whose ``HOME`` is under ``homes`` (this run's)."""
    t0 = time.perf_counter()
    pids = procfs.pids()
    found = []
    for pid, env in homed(homes, pids):
        proc = classify(pid, env, procfs.cmdline(pid))
        if proc is not None:
            found.append(proc)
    if cost is not None:
        cost.add(time.perf_counter() - t0, len(pids))
    return found


def scan_figures(cost: ScanCost, wall: float) -> dict[str, Any]:
    """The scans' cost: milliseconds per scan (p50, p99, max), how many, the processes each
    looked at, and the share of one core they took over ``wall`` seconds."""
    from benchmarks.stats import percentile

    ms = [s * 1000 for s in cost.seconds]
    return {
        "scans": len(ms),
        "p50_ms": round(percentile(ms, 0.5), 2) if ms else None,
        "p99_ms": round(percentile(ms, 0.99), 2) if ms else None,
        "max_ms": round(max(ms), 2) if ms else None,
        "pids_max": max(cost.pids, default=0),
        "core_share": round(sum(cost.seconds) / wall, 4) if wall > 0 else None,
    }


def intervals(times: Sequence[float]) -> list[float]:
    """The gaps between consecutive times."""
    return [b - a for a, b in itertools.pairwise(times)]
