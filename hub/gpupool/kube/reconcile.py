"""On Kubernetes: the pool follows the cluster's nodes live, and its ledger is compared with the
pods that exist (issue 15).

Vocabulary
- *reflector*: KubeSpawner's pattern, for ``nodes`` and ``pods``: list (a cache of API JSON and
  the list's ``resourceVersion``), then watch from that version, applying ``ADDED``/``MODIFIED``/
  ``DELETED`` events to the cache (an object that stops matching the selector comes as
  ``DELETED``); a watch the server ends (its ``timeoutSeconds``) is resumed from the last version
  seen, a ``BOOKMARK``'s included, and a ``410 Gone`` (history compacted) means list again. The
  API server is reached through one seam, :class:`gpupool.kube.nodes.ClusterAPI` (``list`` and
  ``watch``); tests point it at a stand-in.
- *gpupool pods*: pods labelled ``gpupool.io/team`` in the hub's namespace; a notebook's pod
  carries ``gpupool.io/allocation`` (its allocation's id), a job's pods ``gpupool.io/job`` (the
  job id, the ``ref`` of the job's allocations).
- *effective inventory* (:func:`effective_inventory`): the inventory the nodes give now
  (:func:`gpupool.kube.nodes.inventory_from_nodes`: cordoned nodes, CPU nodes and nodes
  whose GPUs are shared are left out), except that a node where allocations are held that the new
  form would lose (the node was removed, cordoned, relabelled to another MIG layout, or its
  allocatable shrank) stays *draining*: only the GPUs (and fixed MIG instances) those allocations
  hold, so nothing new is granted there, until they are released; then it goes.
- *lost pod*: a pod being deleted (``deletionTimestamp``) on a node that is not ready
  (:func:`gpupool.kube.nodes.not_ready_reason`): the taint eviction controller deleted it (its
  ``tolerationSeconds``, 300 s by default, passed) or someone did, and the node's kubelet will
  never confirm, so it stays Terminating while its server is gone. It counts as no pod.
- *tenant pods* (:mod:`gpupool.kube.tenants`): a third reflector, ``tenants``, lists and watches
  every namespace's pods (kept as digests); the GPUs other pods use on the pool's nodes are in
  *outside use* (:meth:`Pool.set_outside_use`), kept current on every pod or node change; the
  ledger (so every user) is told only "used outside gpupool", the pods' names ("used by pod
  ns/name") are for the admin page and the log (:mod:`gpupool.kube.tenant_view`).
  All pods are listed and filtered here rather than through a field
  selector (``spec.nodeName!=``): which pods matter is decided by their resource requests,
  which no selector can express, and one unfiltered watch never sees a pod appear or vanish
  because a field changed.
- *slices*: under DRA (``device_allocation = "dra"``) a fourth reflector, ``resourceslices``,
  lists and watches NVIDIA's DRA driver's ResourceSlices (kept as
  :func:`gpupool.kube.dra_inventory.slice_view`); the nodes' GPUs are then theirs
  (:func:`gpupool.kube.dra_inventory.inventory_from_slices`), recomputed on a node or slice change.
- *drift* (:func:`plan_drift`, the metric ``gpupool_kube_drift_total{kind}``):
  ``released``: a notebook allocation older than ``grace`` whose pod is gone and whose server
  JupyterHub no longer records (neither its ``ref`` "user/server" nor its id): released;
  ``notebook_without_pod``: such an allocation while JupyterHub's records cannot be read, or no
  record source is set: reported, never released on a guess;
  ``job_without_pods``: a job allocation older than ``grace`` without any pod of its job:
  reported (job allocations are the job manager's);
  ``unexpected_node``: a gpupool pod bound to a node other than its allocation's ``node``:
  logged and counted; for a notebook, the ledger is moved to free devices of the same model (or
  the same fixed MIG profile) on the pod's node when there are enough (``moved`` is logged),
  else reported;
  ``unknown_allocation``: a running pod naming an allocation the ledger does not know, for longer
  than ``grace`` (a pod briefly outlives its released allocation while it stops): reported;
  ``lost_node``: a notebook allocation whose only pods are *lost* while JupyterHub still records
  its server: reported (KubeGPUSpawner's ``poll`` says the server stopped, JupyterHub forgets it,
  and it is released as above).
  ``unexpected_gpu``: a gpupool HAMi share pod to which HAMi gave a GPU other than the ledger's
  (:func:`gpupool.kube.hami.pin_disagreements`, naming both): reported.
  Each finding is logged and counted once while it lasts.

Contract: every ledger change happens under the pool's lock (:meth:`Pool.deciding`): the
inventory swap builds a new :class:`Ledger` over the effective inventory (:func:`plan_swap`).
After a list it rebuilds every node and restores every allocation (quotas not re-checked, as at
start; :meth:`Ledger.rebuilt`); after a watch event (or a release on a draining node) it builds
that node's part of the inventory only (:class:`gpupool.kube.nodes.NodePart`) and restores only
the allocations on the nodes that differ, carrying every other node's state over
(:meth:`Ledger.replace_nodes`): the same ledger, by the same per-node judgement
(:func:`kept_node`), which ``tests/unit/test_node_swap.py`` checks against the full rebuild.
Allocations whose MIG instance UUIDs changed are persisted; if any allocation could not be
restored, nothing is swapped (logged). Releases go
through :meth:`Pool.release` (its listeners, the job queue, run). A pass that cannot read
JupyterHub's records releases nothing. Nothing here deletes or changes a Kubernetes object.
:meth:`KubeReconciler.stop` cancels its tasks and returns only once every one has ended (no
timeout hides one that would not, :func:`gpupool.background.stop_tasks`): the reflectors' waits
are plain ``sleep`` and watch streams closed by ``aclosing``, and the checker is a
:class:`gpupool.background.Periodic`, never ``asyncio.wait_for`` around a wait that can be
cancelled (on Python 3.11 it can swallow the cancel, CPython issue #86296).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol

from prometheus_client import Counter as PromCounter
from traitlets import Float, Integer, Unicode, default
from traitlets.config import LoggingConfigurable

from gpupool.background import Periodic, stop_tasks
from gpupool.core.draining import kept_node
from gpupool.core.errors import UnknownAllocation
from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Allocation, Device, Ledger
from gpupool.kube.api import ClusterAPI, Gone
from gpupool.kube.claim import NodeClaim
from gpupool.kube.dra_inventory import dra_node_part, slice_view
from gpupool.kube.hami import pin_disagreements, unpriced_shares
from gpupool.kube.nodes import (
    NodePart,
    assemble,
    inventory_view,
    node_part,
    not_ready_reason,
)
from gpupool.kube.readback import MigKey, read_back
from gpupool.kube.settings import default_namespace, kueue_hami_refusal
from gpupool.kube.tenant_view import changed, public_reasons
from gpupool.kube.tenants import digest, other_releases, tenant_shares, tenant_use
from gpupool.pool import Pool
from gpupool.readback import Seen

log = logging.getLogger("gpupool")

TEAM_LABEL = "gpupool.io/team"
ALLOCATION_LABEL = "gpupool.io/allocation"
JOB_LABEL = "gpupool.io/job"

DRIFT = PromCounter(
    "gpupool_kube_drift",
    "Differences found between the pool's ledger and the cluster's pods, by kind (released, "
    "notebook_without_pod, job_without_pods, unexpected_node, unknown_allocation, lost_node, "
    "unexpected_gpu).",
    ["kind"],
)


class API(Protocol):
    async def list(self, kind: str) -> tuple[list[dict[str, Any]], str]: ...

    def watch(self, kind: str, resource_version: str, timeout_s: int = ...) -> Any: ...


class HubRecord(Protocol):
    """What a JupyterHub record must say (:class:`gpupool.core.reconcile.Record`)."""

    @property
    def ref(self) -> str: ...

    @property
    def allocation(self) -> str: ...


Records = Callable[[], Awaitable[Iterable[HubRecord]]]


# -- pure: the inventory the nodes give, keeping what allocations hold ----------------------------
def effective_inventory(
    nodes: Iterable[Mapping[str, Any]], ledger: Ledger
) -> tuple[Inventory, dict[str, str]]:
    """The inventory of ``nodes`` with draining nodes kept (see the module docstring), and the
    draining nodes with why (``"gone"``, ``"not ready"``, or ``"changed"``: cordoned, shared or
    relabelled)."""
    parts = {p.name: p for p in map(node_part, nodes)}
    return effective_parts(parts, ledger, None)


def effective_parts(
    parts: Mapping[str, NodePart], ledger: Ledger, names: Iterable[str] | None
) -> tuple[Inventory, dict[str, str]]:
    """:func:`effective_inventory` from the nodes' parts (:func:`gpupool.kube.nodes.node_part`),
    judging the nodes ``names`` (``None``: every node) and every node whose part differs from
    what the ledger's inventory has of it (a draining node always does), each on its own
    (:func:`kept_node`); any other node is as the ledger has it. The same nodes and ledger give
    the same answer whichever nodes are named."""
    target = assemble(parts[name] for name in sorted(parts))
    target = replace(target, node_pools=ledger.inventory.node_pools)  # declared, not listed
    before = {n.name: n for n in ledger.inventory.nodes}
    after = {n.name: n for n in target.nodes}
    judged = set(before) | set(after) if names is None else set(names)
    judged |= {n for n in before.keys() | after.keys() if before.get(n) != after.get(n)}
    held: dict[str, list[Allocation]] = defaultdict(list)
    for a in ledger.allocations.values():
        if a.node in judged:
            held[a.node].append(a)
    draining: dict[str, str] = {}
    for name in judged & held.keys():
        kept = kept_node(after.get(name), before.get(name), held[name], ledger)
        if kept is not None:
            part = parts.get(name)
            draining[name] = "gone" if part is None else "changed" if part.ready else "not ready"
            after[name] = kept
    if not draining:
        return target, {}
    notes = tuple(
        f"node {name} is draining ({why}): only the devices its allocations hold are kept, "
        "until they are released"
        for name, why in sorted(draining.items())
    )
    inventory = Inventory(
        tuple(after[name] for name in sorted(after)),
        source=target.source,
        simulated=target.simulated,
        notes=target.notes + notes,
        node_pools=target.node_pools,
    )
    return inventory, draining


@dataclass
class Swap:
    """What a new inventory does to a ledger (:func:`plan_swap`): the ``ledger`` to put in place
    (``None``: nothing changed, or refused because of ``lost``), the ``draining`` nodes, the
    allocations whose restore ``changed`` them (to persist), and the ones ``lost``."""

    ledger: Ledger | None
    draining: dict[str, str]
    changed: list[Allocation]
    lost: list[Allocation]


def plan_swap(ledger: Ledger, parts: Mapping[str, NodePart], names: Iterable[str] | None) -> Swap:
    """The ledger over the effective inventory of ``parts`` (:func:`effective_parts`), every
    allocation kept. ``names``: the nodes whose parts changed (``None``: rebuild everything,
    :meth:`Ledger.rebuilt`); otherwise only the nodes that differ are rebuilt and only their
    allocations restored (:meth:`Ledger.replace_nodes`), with the same result."""
    inventory, draining = effective_parts(parts, ledger, names)
    if (inventory.nodes, inventory.notes) == (ledger.inventory.nodes, ledger.inventory.notes):
        return Swap(None, draining, [], [])
    if names is None:
        fresh, restored, lost = ledger.rebuilt(inventory)
    else:
        fresh, restored, lost = ledger.replace_nodes(inventory, names)
    if lost:
        return Swap(None, draining, [], lost)
    before = ledger.allocations
    return Swap(fresh, draining, [a for a in restored if a != before[a.id]], [])


def swap_inventory(pool: Pool, nodes: Iterable[Mapping[str, Any]]) -> dict[str, str] | None:
    """Put the effective inventory of ``nodes`` under ``pool``, rebuilding everything (see
    :func:`swap_parts`)."""
    return swap_parts(pool, {p.name: p for p in map(node_part, nodes)}, None)


def swap_parts(
    pool: Pool, parts: Mapping[str, NodePart], names: Iterable[str] | None
) -> dict[str, str] | None:
    """Put the effective inventory of the nodes' ``parts`` under ``pool``, keeping every
    allocation, under the pool's lock (:func:`plan_swap`: ``names``, the nodes whose parts
    changed, ``None`` for all), then tell the pool's ``on_inventory`` listeners. Returns the
    draining nodes, or ``None`` if nothing changed or the swap was refused (an allocation that
    would not restore; logged)."""
    names = None if names is None else list(names)

    def decide(ledger: Ledger) -> dict[str, str] | None:
        swap = plan_swap(ledger, parts, names)
        if swap.lost:
            pool.log.error(
                "gpupool: the cluster's nodes changed, but allocation(s) %s would not fit the "
                "new inventory; kept the old one",
                ", ".join(a.id for a in swap.lost),
            )
            return None
        if swap.ledger is None:
            return None
        if swap.changed:
            pool.store.replace(swap.changed)
        pool.ledger = swap.ledger
        return swap.draining

    draining = pool.deciding(decide)
    if draining is not None:
        for listener in pool.on_inventory:
            listener()
    return draining


# -- pure: drift between the ledger and the pods ---------------------------------------------------
@dataclass(frozen=True)
class Finding:
    """One drift (``kind``, see the module docstring); ``action`` is ``release``, ``move`` (to
    ``node``) or ``report``; ``key`` identifies it while it lasts."""

    kind: str
    action: str
    message: str
    allocation: str = ""
    node: str = ""
    key: str = ""


def plan_drift(
    ledger: Ledger,
    pods: Iterable[Mapping[str, Any]],
    records: Iterable[HubRecord] | None,
    now: float,
    grace_s: float,
    not_ready: Mapping[str, str] | None = None,
) -> list[Finding]:
    """What to do about the ledger versus ``pods`` (gpupool pods, API JSON). ``records``: the
    servers JupyterHub records, or ``None`` when they could not be read (then no release).
    ``not_ready``: the nodes that are not ready, with why (their *lost pods* count as none)."""
    not_ready = not_ready or {}
    from gpupool.kube.pods import label_value

    by_allocation: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    by_job: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if JOB_LABEL in labels:
            by_job[labels[JOB_LABEL]].append(pod)
        elif ALLOCATION_LABEL in labels:
            by_allocation[labels[ALLOCATION_LABEL]].append(pod)
    recorded = None
    if records is not None:
        recorded = set()
        for r in records:
            recorded |= {r.ref, r.allocation}
    out: list[Finding] = []
    known = set()
    for a in sorted(ledger.allocations.values(), key=lambda a: a.id):
        old = now - a.created >= grace_s
        if a.kind == "job":
            job_pods = by_job.get(label_value(a.ref), [])
            if not job_pods:
                if old:
                    out.append(_job_without_pods(a))
                continue
            bound = {_node_of(p) for p in job_pods}
            if a.node and None not in bound and a.node not in bound:
                on = ", ".join(sorted(str(n) for n in bound))
                message = (
                    f"job {a.ref}: allocation {a.id} holds devices on {a.node}, but its pods run "
                    f"on {on}; the job manager's to settle"
                )
                out.append(Finding("unexpected_node", "report", message, a.id, key=f"n:{a.id}"))
            continue
        value = label_value(a.id)
        known.add(value)
        evicted = [p for p in by_allocation.get(value, []) if _lost(p, not_ready)]
        mine = [p for p in by_allocation.get(value, []) if not _lost(p, not_ready)]
        if not mine:
            if not old:
                continue
            if evicted and recorded is not None and (a.ref in recorded or a.id in recorded):
                pod = evicted[0]
                node = str(_node_of(pod))
                message = (
                    f"notebook allocation {a.id} of {a.user} ({a.ref or '-'}): its pod "
                    f"{_pod_name(pod)} was deleted on node {node}, which {not_ready[node]}, "
                    "and stays Terminating there (the kubelet never confirms); released once "
                    "JupyterHub records the server stopped"
                )
                out.append(Finding("lost_node", "report", message, a.id, node, key=f"l:{a.id}"))
                continue
            if recorded is None:
                message = (
                    f"notebook allocation {a.id} of {a.user} ({a.ref or '-'}) has no pod, and "
                    "JupyterHub's records could not be read; left alone"
                )
                out.append(Finding("notebook_without_pod", "report", message, a.id, key=a.id))
            elif a.ref not in recorded and a.id not in recorded:
                message = (
                    f"notebook allocation {a.id} of {a.user} ({a.ref or '-'}): its pod is gone "
                    "and JupyterHub records no such server; released"
                )
                out.append(Finding("released", "release", message, a.id, key=f"r:{a.id}"))
            continue
        nodes = {n for n in (_node_of(p) for p in mine) if n}
        wrong = sorted(nodes - {a.node}) if a.node else []
        if wrong:
            message = (
                f"notebook allocation {a.id} of {a.user} ({a.ref or '-'}) holds "
                f"{a.visible_devices} on {a.node}, but its pod runs on {wrong[0]}"
            )
            out.append(Finding("unexpected_node", "move", message, a.id, wrong[0], key=f"n:{a.id}"))
    for value, pods_of in sorted(by_allocation.items()):
        if value in known:
            continue
        for pod in pods_of:
            meta, status = pod.get("metadata") or {}, pod.get("status") or {}
            if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
                continue
            message = (
                f"pod {meta.get('namespace', '')}/{meta.get('name', '')} names allocation "
                f"{value}, which the pool does not know"
            )
            out.append(Finding("unknown_allocation", "report", message, value, key=f"u:{value}"))
    for alloc_id, message, key in pin_disagreements(ledger, pods):
        out.append(Finding("unexpected_gpu", "report", message, alloc_id, key=key))
    return out


def _lost(pod: Mapping[str, Any], not_ready: Mapping[str, str]) -> bool:
    """A *lost pod* (see the module docstring)."""
    deleting = (pod.get("metadata") or {}).get("deletionTimestamp")
    return bool(deleting) and _node_of(pod) in not_ready


def _pod_name(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _job_without_pods(a: Allocation) -> Finding:
    message = (
        f"job {a.ref}: allocation {a.id} on {a.node or '-'} has no pod of its job; the job "
        "manager's to release"
    )
    return Finding("job_without_pods", "report", message, a.id, key=f"j:{a.id}")


def _node_of(pod: Mapping[str, Any]) -> str | None:
    return (pod.get("spec") or {}).get("nodeName") or None


def moved(ledger: Ledger, a: Allocation, node: str) -> Allocation | None:
    """``a`` on free devices of ``node`` like those it holds (the same model for whole GPUs, the
    same profile for fixed MIG instances), or ``None`` when ``node`` has not enough."""
    inventory = ledger.inventory
    target = next((n for n in inventory.nodes if n.name == node), None)
    if target is None or not a.devices:
        return None
    model_of = {g.uuid: g.model for g in inventory.gpus}
    busy: dict[str, set[tuple[str | None, int | None]]] = defaultdict(set)
    for other in ledger.allocations.values():
        for d in other.devices:
            busy[d.gpu].add((d.profile, d.start))
    chosen: list[Device] = []
    for d in a.devices:
        want = model_of.get(d.gpu)
        pick = None
        for g in target.gpus:
            if g.model != want:
                continue
            if d.profile is None and g.mig_mode in ("off", "flex") and not busy[g.uuid]:
                pick = Device(g.uuid)
            elif d.profile is not None and g.mig_mode == "fixed":
                free = [
                    i
                    for i in g.instances
                    if i.profile == d.profile and (i.profile, i.start) not in busy[g.uuid]
                ]
                if free and not any(p is None for p, _ in busy[g.uuid]):
                    pick = Device(g.uuid, d.profile, free[0].start, free[0].uuid)
            if pick is not None:
                busy[g.uuid].add((pick.profile, pick.start))
                break
        if pick is None:
            return None
        chosen.append(pick)
    return replace(a, devices=tuple(chosen), node=node)


def move_allocation(pool: Pool, alloc_id: str, node: str) -> Allocation | None:
    """Move an allocation's ledger entry to ``node`` (:func:`moved`), persisted, under the
    pool's lock; ``None`` if it cannot be (then nothing changed)."""

    def decide(ledger: Ledger) -> Allocation | None:
        a = ledger.allocations.get(alloc_id)
        candidate = moved(ledger, a, node) if a is not None else None
        if a is None or candidate is None:
            return None
        ledger.release(a.id)
        restored, _lost = ledger.restore([candidate])
        if not restored:
            ledger.restore([a])
            return None
        try:
            pool.store.replace(restored)
        except Exception:
            ledger.release(a.id)
            ledger.restore([a])
            raise
        return restored[0]

    return pool.deciding(decide)


# -- the hub's watcher ----------------------------------------------------------------------------
class KubeReconciler(LoggingConfigurable):
    """Reflects ``nodes`` and ``pods`` (see the module docstring) and keeps ``pool`` in step:
    :meth:`apply_nodes` on every node change, :meth:`check` on every pod change (coalesced) and
    every ``period`` seconds. ``api``: the seam (by default a :class:`ClusterAPI` for
    ``namespace``, the nodes matching ``node_selector`` and the gpupool pods); ``records``
    reads JupyterHub's records (the REST API); without it, no notebook allocation is released
    here, only reported."""

    namespace = Unicode(
        config=True,
        help="""Namespace of the notebook and job pods compared with the ledger (default:
        KubeSpawner's ``namespace`` when configured, else the hub's own namespace in the
        cluster, else ``default``). Example: ``c.KubeReconciler.namespace = "jhub"``""",
    )
    grace = Float(
        120.0,
        config=True,
        help="""Seconds an allocation may go without its pod (a server or job starting) and a
        pod may name an allocation the pool does not know (a server stopping) before it is
        drift. Example: ``c.KubeReconciler.grace = 300``""",
    )
    period = Float(
        60.0,
        config=True,
        help="""Seconds between passes over the pods when no pod changes (every change makes
        one too). Example: ``c.KubeReconciler.period = 30``""",
    )
    watch_timeout = Integer(
        300,
        config=True,
        help="""Seconds the API server keeps one watch open (its ``timeoutSeconds``) before it
        is resumed from the last resourceVersion seen. Example:
        ``c.KubeReconciler.watch_timeout = 600``""",
    )
    retry = Float(
        5.0,
        config=True,
        help="""Seconds before a failed list or watch (API server unreachable, refused) is tried
        again. Example: ``c.KubeReconciler.retry = 10``""",
    )

    claim_seconds = Integer(
        60,
        config=True,
        help="""Seconds this release's claim on its nodes lasts unrenewed (its Lease's
        ``leaseDurationSeconds``; renewed every third of it): how long after this hub stops
        another release may take the nodes. Example: ``c.KubeReconciler.claim_seconds = 120``""",
    )

    @default("namespace")
    def _default_namespace(self) -> str:
        return default_namespace(self.config)

    def __init__(
        self,
        pool: Pool,
        api: API | None = None,
        *,
        records: Records | None = None,
        node_selector: str | None = None,
        clock: Callable[[], float] = time.time,
        dcgm: Any = None,
        dra: bool = False,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("log", pool.log)
        super().__init__(**kwargs)
        self.pool = pool
        self.api: API = api or ClusterAPI(self.namespace, node_selector, TEAM_LABEL)
        self.node_selector = node_selector
        self.claim: NodeClaim | None = None
        """This release's claim on the pool's nodes, once :meth:`claim_nodes` made it."""
        self.records = records
        self.clock = clock
        self.dcgm = dcgm
        """Where the devices the nodes gave are read back from (a
        :class:`gpupool.monitors.dcgm.DCGMSource`; :mod:`gpupool.kube.readback`), or ``None``."""
        self.nodes: dict[str, dict[str, Any]] = {}
        self.parts: dict[str, NodePart] = {}
        """What each cached node gives the inventory (:meth:`node_part`), kept with ``nodes``."""
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.tenants: dict[tuple[str, str], dict[str, Any]] = {}
        """Every namespace's pods, as :func:`gpupool.kube.tenants.digest` keeps them."""
        self.dra = dra
        """Whether GPUs are given through DRA: then a fourth reflector, ``resourceslices``,
        follows NVIDIA's DRA driver's slices, and the nodes' GPUs are theirs
        (:mod:`gpupool.kube.dra_inventory`)."""
        self.slices: dict[str, dict[str, Any]] = {}
        """Every ResourceSlice, as :func:`gpupool.kube.dra_inventory.slice_view` keeps it."""
        self._other_releases: set[str] = set()
        self.mig_reported: dict[MigKey, Seen] = {}
        """The MIG instances the nodes report for the ledger's MIG devices (read back, for the
        admin page only: :func:`gpupool.kube.readback.mig_reported`)."""
        self.outside_detail: dict[str, str] = {}
        """The devices tenant pods take -> why, naming the pod (admins and the log only; the
        ledger has the public reason, :mod:`gpupool.kube.tenant_view`)."""
        self.synced: set[str] = set()
        self.versions: dict[str, str] = {}
        """The resourceVersion each reflector's cache is at."""
        self.draining: dict[str, str] = {}
        self.reported: set[str] = set()
        self._unknown_since: dict[str, float] = {}
        self._noted: set[str] = set(pool.inventory.notes)
        self.checker = Periodic(
            "checking the pods against the ledger",
            self.check,
            lambda: self.period,
            self.log,
            at_once=False,
        )
        """A :meth:`check` pass on every change (:meth:`nudge`), and at least every
        ``period`` seconds."""
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping: asyncio.Task[None] | None = None
        self.passes = 0
        self.hami_refusal = kueue_hami_refusal(self.config)
        """Why no HAMi share is handed out ('': they are; :func:`gpupool.kube.hami.unpriced_shares`
        keeps HAMi's GPUs in outside use with it, from now on)."""
        if self.hami_refusal:
            unpriced = unpriced_shares(pool.inventory, self.hami_refusal)
            pool.set_outside_use({**pool.ledger.outside, **unpriced})

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        """Start the reflectors and the checker on the running loop."""
        if self._released not in self.pool.on_release:
            self.pool.on_release.append(self._released)
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self.reflect(kind), name=f"gpupool: watching {kind}")
                for kind in ("nodes", "pods", "tenants", *(("resourceslices",) if self.dra else ()))
            ]
            if self.claim is not None:
                renewing = self.claim.renewing(lambda: [n.name for n in self.pool.inventory.nodes])
                self._tasks.append(loop.create_task(renewing, name="gpupool: node claim"))
            self.checker.start()

    async def stop(self) -> None:
        """Cancel every task and await each to its end (no timeout: none of them holds a
        cancellation back, so this returns once they have unwound), then close the API."""
        tasks, self._tasks = self._tasks, []
        await asyncio.gather(stop_tasks(tasks, self.log), self.checker.stop())
        with contextlib.suppress(ValueError):
            self.pool.on_release.remove(self._released)
        close = getattr(self.api, "close", None)
        if close is not None:
            try:
                await close()
            except Exception as e:
                self.log.warning("gpupool: closing the Kubernetes client: %s", e)

    def claim_nodes(self, clock: Callable[[], datetime] | None = None) -> None:
        """Claim the pool's nodes for this release, at start (see :mod:`gpupool.kube.claim`):
        raises a ``ConfigError`` naming another live release that claims any of them."""
        claim = NodeClaim(self.namespace, self.node_selector, self.claim_seconds, log=self.log)
        if clock is not None:
            claim.clock = clock
        claim.acquire_now(n.name for n in self.pool.inventory.nodes)
        self.claim = claim

    def shutting_down(self) -> None:
        """The hub is going away (:func:`gpupool.hub.shutdown.watch` calls this, synchronously,
        from the loop): :meth:`stop`, on the loop, without waiting for it here."""
        if self._stopping is None and (self._tasks or self.checker.running):
            self._stopping = asyncio.get_running_loop().create_task(self.stop())

    def nudge(self) -> None:
        """Ask for a :meth:`check` pass soon (the checker coalesces requests)."""
        self.checker.kick()

    # -- the reflector ----------------------------------------------------------------------
    async def reflect(self, kind: str) -> None:
        """List, then watch from the list's version; resume after a watch ends, list again on
        410 Gone, retry after ``retry`` on any other failure (logged). The version seen last
        is :attr:`versions` ``[kind]``."""
        caches: dict[str, dict[Any, dict[str, Any]]] = {
            "nodes": self.nodes,
            "pods": self.pods,
            "tenants": self.tenants,
            "resourceslices": self.slices,
        }
        cache = caches[kind]
        key = _name if kind in ("nodes", "resourceslices") else _namespaced
        # what the cache keeps of an object: all of a gpupool pod, the part of a node the
        # inventory reads, what the tenants' count reads of any pod
        keep = {"nodes": inventory_view, "tenants": digest, "resourceslices": slice_view}.get(
            kind, lambda o: o
        )
        version = ""
        while True:
            try:
                if not version:
                    items, version = await self.api.list(kind)
                    cache.clear()
                    cache.update({key(o): keep(o) for o in items})
                    self.versions[kind] = version
                    self.synced.add(kind)
                    self._changed(kind)  # a new list: every node is rebuilt
                # closed here, also when this task is cancelled or an event cannot be applied
                async with contextlib.aclosing(
                    self.api.watch(kind, version, self.watch_timeout)
                ) as events:
                    async for event, obj in events:
                        version = str(obj["metadata"].get("resourceVersion") or version)
                        self.versions[kind] = version
                        if event == "BOOKMARK":  # only where to resume from
                            continue
                        if event == "DELETED":
                            cache.pop(key(obj), None)
                        else:
                            kept = keep(obj)
                            if cache.get(key(obj)) == kept:
                                # nothing kept changed (GFD's timestamp label, the kubelet's
                                # heartbeat, a pod's status): no new inventory, no lock taken
                                continue
                            cache[key(obj)] = kept
                        self._changed(kind, key(obj))
            except Gone as e:
                self.log.info("gpupool: watching %s: %s; listing again", kind, e)
                version = ""
            except Exception as e:
                self.log.warning(
                    "gpupool: watching %s failed (%s: %s); again in %.0f s",
                    kind,
                    type(e).__name__,
                    str(e)[:300],
                    self.retry,
                )
                await asyncio.sleep(self.retry)

    def _changed(self, kind: str, key: Any = None) -> None:
        if kind == "nodes":
            self.apply_nodes(None if key is None else [key])
        if kind == "resourceslices":  # under DRA: any node's GPUs may have moved
            self.apply_nodes()
        if kind in ("nodes", "tenants"):
            self.apply_tenants()
        self.checker.kick()

    def apply_tenants(self) -> None:
        """Put the devices *tenant pods* use in outside use (logged by the pool as they close
        and open); nothing before the first list of every namespace's pods."""
        if "tenants" not in self.synced:
            return
        detail, unpriced = self.pool.deciding(
            lambda ledger: (
                tenant_use(self.tenants.values(), ledger, self.namespace, TEAM_LABEL),
                unpriced_shares(ledger.inventory, self.hami_refusal),
            )
        )
        # users are not told other namespaces' pods; the Kueue/HAMi refusal is theirs to read
        reasons = {**public_reasons(detail), **unpriced}
        if reasons != self.pool.ledger.outside:
            self.pool.set_outside_use(reasons)
        for why in changed(self.outside_detail, detail):
            self.log.info("gpupool: outside use: %s", why)
        self.outside_detail = detail
        self.apply_tenant_shares()
        nodes = [n.name for n in self.pool.inventory.nodes]
        others = other_releases(self.tenants.values(), nodes, self.namespace, TEAM_LABEL)
        for ns, where in sorted(others.items()):
            if ns not in self._other_releases:
                self.log.error(
                    "gpupool: another gpupool release (namespace %s) runs GPU pods on this "
                    "pool's node(s) %s: two releases must not manage the same nodes; its pods' "
                    "GPUs are left out here, but give each release its own nodes "
                    "(gpupool.inventory: kubernetes:<node label selector>)",
                    ns,
                    ", ".join(sorted(where)),
                )
        self._other_releases = set(others)

    def apply_tenant_shares(self) -> None:
        """Put the memory *HAMi tenant pods* have of the pool's HAMi GPUs in outside shares
        (:func:`gpupool.kube.tenants.tenant_shares`); the ``on_inventory`` listeners hear when
        some is given back (a queued job may fit)."""
        Shares = dict[str, tuple[int, str]]

        def decide(ledger: Ledger) -> tuple[Shares, Shares]:
            shares = tenant_shares(self.tenants.values(), ledger, self.namespace, TEAM_LABEL)
            before = ledger.outside_shares
            if shares != before:
                ledger.set_outside_shares(shares)
            return before, shares

        before: Shares
        shares: Shares
        before, shares = self.pool.deciding(decide)
        for uuid, (mib, why) in sorted(shares.items()):
            if before.get(uuid, (0, ""))[0] != mib:
                self.log.warning("gpupool: not handed out: %s", why)
        if any(uuid not in shares or shares[uuid][0] < m for uuid, (m, _) in before.items()):
            for listener in self.pool.on_inventory:
                listener()

    # -- nodes --------------------------------------------------------------------------------
    def apply_nodes(self, names: Iterable[str] | None = None) -> None:
        """Swap in the inventory the cached nodes give (see :func:`swap_parts`): ``names``, the
        nodes that changed (a watch event's), are rebuilt (:meth:`node_part`) and only their
        allocations restored; ``None`` (after a list, or a ResourceSlice change) rebuilds every
        node."""
        if "nodes" not in self.synced or (self.dra and "resourceslices" not in self.synced):
            return
        if names is None or not self.parts:
            names = None
            self.parts = {name: self.node_part(name) for name in self.nodes}
        else:
            names = list(names)
            for name in names:
                if name in self.nodes:
                    self.parts[name] = self.node_part(name)
                else:
                    self.parts.pop(name, None)
        before = {n.name for n in self.pool.inventory.nodes}
        draining = swap_parts(self.pool, self.parts, names)
        if draining is None:
            return
        inventory = self.pool.inventory
        for note in inventory.notes:
            if note not in self._noted:
                self.log.warning("gpupool: %s", note)
        self._noted = set(inventory.notes)
        after = {n.name for n in inventory.nodes}
        self.draining = draining
        self.log.info(
            "gpupool: the cluster's nodes changed: now %s (added %s, gone %s, draining %s)",
            inventory.label,
            ", ".join(sorted(after - before)) or "-",
            ", ".join(sorted(before - after)) or "-",
            ", ".join(sorted(draining)) or "-",
        )

    def node_part(self, name: str) -> NodePart:
        """What the cached node ``name`` gives the inventory, from that node's facts alone (under
        DRA: and its ResourceSlices, :func:`gpupool.kube.dra_inventory.dra_node_part`)."""
        if not self.dra:
            return node_part(self.nodes[name])
        own = [s for s in self.slices.values() if (s.get("spec") or {}).get("nodeName") == name]
        return dra_node_part(self.nodes[name], own)

    def _released(self, allocation: Allocation) -> None:
        """After any release: a draining node may now go."""
        if allocation.node and allocation.node in self.draining:
            self.apply_nodes([allocation.node])

    # -- pods ---------------------------------------------------------------------------------
    async def check(self) -> list[Finding]:
        """One pass over the ledger and the cached pods (see :func:`plan_drift`); returns what
        it found new."""
        if "pods" not in self.synced:
            return []
        records: Iterable[HubRecord] | None = None
        if self.records is not None:
            try:
                records = list(await self.records())
            except Exception as e:
                self.log.warning(
                    "gpupool: could not read JupyterHub's servers (%s: %s); no pod-less "
                    "allocation is released this pass",
                    type(e).__name__,
                    e,
                )
        now = self.clock()
        pods = list(self.pods.values())
        if self.dcgm is not None:  # the devices the nodes gave, before the drift is judged
            await read_back(self.pool, self.dcgm, pods, self.log, self.mig_reported)
        not_ready = {n: why for n, obj in self.nodes.items() if (why := not_ready_reason(obj))}
        findings: list[Finding] = self.pool.deciding(
            lambda ledger: plan_drift(ledger, pods, records, now, self.grace, not_ready)
        )
        self.passes += 1
        fresh = []
        keys = set()
        for f in findings:
            keys.add(f.key)
            if f.kind == "unknown_allocation":
                since = self._unknown_since.setdefault(f.key, now)
                if now - since < self.grace:
                    continue
            if f.key in self.reported:
                continue
            fresh.append(f)
            self._act(f)
        self.reported &= keys
        self._unknown_since = {k: v for k, v in self._unknown_since.items() if k in keys}
        return fresh

    def _act(self, f: Finding) -> None:
        DRIFT.labels(kind=f.kind).inc()
        if f.action == "release":
            try:
                self.pool.release(f.allocation)
            except UnknownAllocation:
                return  # released meanwhile (the spawner's stop)
            self.log.warning("gpupool: %s", f.message)
            return
        self.reported.add(f.key)
        if f.action == "move":
            done = move_allocation(self.pool, f.allocation, f.node)
            if done is not None:
                self.log.warning(
                    "gpupool: %s; moved in the ledger to %s on %s",
                    f.message,
                    done.visible_devices,
                    f.node,
                )
                return
            self.log.warning(
                "gpupool: %s; %s has no free devices like them, so the ledger is left as is",
                f.message,
                f.node,
            )
            return
        self.log.warning("gpupool: %s", f.message)


def _name(obj: Mapping[str, Any]) -> str:
    return str(obj["metadata"]["name"])


def _namespaced(obj: Mapping[str, Any]) -> tuple[str, str]:
    meta = obj["metadata"]
    return str(meta.get("namespace", "")), str(meta["name"])
