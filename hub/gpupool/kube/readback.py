"""On Kubernetes: which GPUs the node gave each allocation, read back from dcgm-exporter, and the
ledger re-keyed to them (issue 26, section 4).

The ledger names a node's GPUs ``k8s-<node>-gpu<i>`` (:mod:`gpupool.kube.nodes`) and places on
them lowest index first; the NVIDIA device plugin, not gpupool, chooses which GPUs a pod gets
(its ``GetPreferredAllocation``). So without a read-back the ledger's names are bookkeeping: the
admin page, per-GPU metrics and the reconciler would name a GPU the pod does not hold.

Vocabulary
- *read-back source*: NVIDIA's dcgm-exporter with its Kubernetes pod mapping, through the
  Prometheus the hub already reads for GPU use (``IdleReclaimer.dcgm_prometheus_url``). The
  exporter asks the kubelet's PodResources API (``v1.PodResourcesLister/List``,
  ``pkg/kubelet/apis/podresources`` in Kubernetes) which device IDs each pod's containers hold
  and labels the series of those devices with ``pod``, ``namespace`` and ``container``
  (dcgm-exporter ``internal/pkg/transformation/kubernetes.go``); every series also carries the
  device's ``gpu`` (its index on the node), ``UUID`` and ``Hostname``. One instant query of
  :data:`READBACK_METRIC` (one series per GPU and MIG instance of the cluster) gives them all.
  Scraped without ``honorLabels``, the exporter's ``pod``/``namespace`` arrive as
  ``exported_pod``/``exported_namespace``; both are read. No DaemonSet of gpupool's own is
  needed, nor any RBAC beyond what the exporter has.
- *seen device* (:class:`Seen`): one such device held by a pod: index, UUID, and for a MIG
  instance its GPU instance ID and profile.
- *seen by allocation* (:func:`seen_by_allocation`): the seen devices of gpupool's pods (the
  reconciler's cache: a notebook pod by its ``gpupool.io/allocation`` label, a job pod by its
  ``gpupool.io/job`` label and node) on the allocation's own node.
- *re-key* (:func:`plan_readback`): for an allocation of whole GPUs, its ledger devices become
  the inventory GPUs with the indexes the node reports (``k8s-<node>-gpu<index>``), each with
  the GPU's UUID as its ``instance`` (so ``visible_devices`` names the real GPU). An allocation
  the ledger had put on those indexes is *displaced* onto the ones vacated (its pod cannot hold
  them: the node says another pod does). The ledger's free GPUs are then the node's free GPUs,
  and the next placement is on a GPU the device plugin can really give. Where the node's
  indexes do not name whole GPUs of the inventory, only the UUIDs are recorded, paired in order.
  MIG instances and shares are not re-keyed (see docs/kubernetes.md, section 4); a MIG
  instance's parent GPU and GPU instance ID, as the node reports them, are kept for the admin
  page only (:func:`mig_reported`).

Contract: :func:`parse_seen`, :func:`seen_by_allocation` and :func:`plan_readback` are pure.
:func:`apply_readback` changes the ledger under the pool's lock: every allocation of one plan is
released and restored with its new devices, persisted, or nothing changes (logged by the
caller), then the pool's ``on_devices`` listeners hear the allocations rewritten (the job
manager records a job's new devices: its record, the jobs API and the saved job name the GPUs
read back). Quotas and costs are unchanged (the same count of the same kind on the same node).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tornado.httpclient import HTTPClientError

from gpupool.core.ledger import Allocation, Device, Ledger
from gpupool.monitors.dcgm import PrometheusError
from gpupool.pool import Pool

READBACK_METRIC = "DCGM_FI_DEV_FB_USED"
"""One series per GPU and MIG instance, in dcgm-exporter's default counters."""
ALLOCATION_LABEL = "gpupool.io/allocation"
JOB_LABEL = "gpupool.io/job"

PodKey = tuple[str, str]


@dataclass(frozen=True, order=True)
class Seen:
    """A device a pod holds, as dcgm-exporter labels it (see the module docstring)."""

    index: int
    uuid: str
    gi: int | None = None
    profile: str | None = None

    @property
    def id(self) -> str:
        """``<UUID>`` of a GPU, ``<UUID>/gi<GPU instance ID>`` of a MIG instance."""
        return self.uuid if self.gi is None else f"{self.uuid}/gi{self.gi}"


def readback_query() -> str:
    """The instant query of the read-back."""
    return READBACK_METRIC


def parse_seen(payload: Any) -> dict[PodKey, list[tuple[str, Seen]]]:
    """Prometheus's instant-query JSON as (namespace, pod) -> [(node, seen device)]; series
    without a pod, or without ``gpu``/``UUID``, are left out. :class:`PrometheusError` for
    anything but a vector result."""
    if not isinstance(payload, dict) or payload.get("status") != "success":
        raise PrometheusError(f"not a Prometheus answer: {payload!r:.80}")
    data = payload.get("data") or {}
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PrometheusError(f"not a vector result: resultType {data.get('resultType')!r}")
    out: dict[PodKey, set[tuple[str, Seen]]] = {}
    for series in data["result"]:
        labels = series.get("metric") if isinstance(series, dict) else None
        if not isinstance(labels, dict):
            continue
        pod = labels.get("exported_pod") or labels.get("pod") or ""
        namespace = labels.get("exported_namespace") or labels.get("namespace") or ""
        index, gpu_uuid = str(labels.get("gpu", "")), labels.get("UUID") or ""
        if not pod or not index.isdigit() or not gpu_uuid:
            continue
        gi = str(labels.get("GPU_I_ID") or "")
        seen = Seen(
            int(index),
            gpu_uuid,
            int(gi) if gi.isdigit() else None,
            labels.get("GPU_I_PROFILE") or None,
        )
        out.setdefault((namespace, pod), set()).add((str(labels.get("Hostname", "")), seen))
    return {k: sorted(v) for k, v in out.items()}


def seen_by_allocation(
    ledger: Ledger,
    pods: Iterable[Mapping[str, Any]],
    seen: Mapping[PodKey, Sequence[tuple[str, Seen]]],
) -> dict[str, list[Seen]]:
    """Allocation id -> the devices its pods hold on its node (see the module docstring)."""
    from gpupool.kube.pods import label_value

    notebooks = {label_value(a.id): a for a in ledger.allocations.values() if a.kind != "job"}
    jobs = {(label_value(a.ref), a.node): a for a in ledger.allocations.values() if a.kind == "job"}
    out: dict[str, set[Seen]] = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        if JOB_LABEL in labels:
            a = jobs.get((labels[JOB_LABEL], node))
        else:
            a = notebooks.get(labels.get(ALLOCATION_LABEL, ""))
        held = seen.get((meta.get("namespace", ""), meta.get("name", "")), ())
        if a is None or not held:
            continue
        out.setdefault(a.id, set()).update(s for host, s in held if host == a.node == node)
    return {k: sorted(v) for k, v in out.items() if v}


def plan_readback(ledger: Ledger, alloc_id: str, seen: Sequence[Seen]) -> list[Allocation]:
    """The allocations to rewrite so that ``alloc_id`` holds what the node says it holds: the
    allocation re-keyed, and any displaced one (see the module docstring); ``[]`` if nothing
    changes or the node's answer does not fit the allocation (another count, MIG, shares)."""
    a = ledger.allocations.get(alloc_id)
    node = next((n for n in ledger.inventory.nodes if a and n.name == a.node), None)
    whole = [s for s in seen if s.gi is None]
    if a is None or node is None or len(whole) != len(a.devices) or len(seen) != len(whole):
        return []
    if any(d.profile is not None or d.share_milli is not None for d in a.devices):
        return []
    gpus = {g.uuid: g for g in node.gpus}
    by_index = {g.index: g.uuid for g in node.gpus if not g.mig_enabled and not g.share_resource}
    targets = [by_index.get(s.index) for s in whole]
    old = [d.gpu for d in a.devices]
    if any(t is None for t in targets) or len(set(targets)) != len(targets):
        paired = tuple(
            replace(d, instance=s.uuid)
            for d, s in zip(sorted(a.devices, key=lambda d: gpus[d.gpu].index), whole, strict=True)
        )
        return [replace(a, devices=paired)] if set(paired) != set(a.devices) else []
    devices = tuple(Device(str(t), instance=s.uuid) for t, s in zip(targets, whole, strict=True))
    if set(devices) == set(a.devices):
        return []
    vacated = [g for g in old if g not in targets]
    holders = {d.gpu: b for b in ledger.allocations.values() if b.id != a.id for d in b.devices}
    moved: dict[str, Allocation] = {}
    for t in targets:
        b = holders.get(str(t))
        if b is None or t in old:
            continue
        b = moved.get(b.id, b)
        if any(d.profile is not None or d.share_milli is not None for d in b.devices):
            return []
        swap = vacated.pop(0)
        moved[b.id] = replace(
            b, devices=tuple(Device(swap) if d.gpu == t else d for d in b.devices)
        )
    return [replace(a, devices=devices), *moved.values()]


MigKey = tuple[str, str, int | None]
"""A MIG device of an allocation: (allocation id, the ledger's GPU, start slot)."""


def mig_reported(ledger: Ledger, found: Mapping[str, Sequence[Seen]]) -> dict[MigKey, Seen]:
    """For display only (the admin page's cell): each MIG device of an allocation of ``found``
    (:func:`seen_by_allocation`) with the instance its node reports (parent GPU index and UUID,
    GPU instance ID), paired in order (the ledger's by GPU and slot, the node's by index and
    GPU instance ID). Nothing is re-keyed: the ledger's layout of a MIG node is a packing of
    its counts, not the node's. Where the counts differ nothing is paired."""
    out: dict[MigKey, Seen] = {}
    for alloc_id, seen in found.items():
        a = ledger.allocations.get(alloc_id)
        migs = sorted(
            (d for d in a.devices if d.profile is not None) if a else (),
            key=lambda d: (d.gpu, d.start or 0),
        )
        instances = sorted(s for s in seen if s.gi is not None)
        if a is None or not migs or len(migs) != len(instances):
            continue
        for d, s in zip(migs, instances, strict=True):
            out[a.id, d.gpu, d.start] = s
    return out


def apply_readback(pool: Pool, plan: Sequence[Allocation]) -> bool:
    """Rewrite the allocations of ``plan`` (:func:`plan_readback`) in the ledger and the store,
    under the pool's lock; all or nothing. False if they would not restore (then nothing
    changed)."""
    if not plan:
        return False

    def decide(ledger: Ledger) -> list[Allocation] | None:
        before = [ledger.allocations.get(a.id) for a in plan]
        if any(b is None for b in before):
            return None
        for a in plan:
            ledger.release(a.id)
        restored, lost = ledger.restore(plan)
        if lost:
            for a in restored:
                ledger.release(a.id)
            ledger.restore([b for b in before if b is not None])
            return None
        try:
            pool.store.replace(restored)
        except Exception:
            for a in restored:
                ledger.release(a.id)
            ledger.restore([b for b in before if b is not None])
            raise
        return restored

    restored: list[Allocation] | None = pool.deciding(decide)
    if restored is None:
        return False
    for listener in pool.on_devices:  # a job's recorded devices follow (its manager listens)
        listener(restored)
    return True


def _plan(ledger: Ledger, alloc_id: str, seen: Sequence[Seen]) -> list[Allocation]:
    return plan_readback(ledger, alloc_id, seen)


async def read_back(
    pool: Pool,
    source: Any,
    pods: Iterable[Mapping[str, Any]],
    log: logging.Logger,
    mig: dict[MigKey, Seen] | None = None,
) -> list[str]:
    """One read-back pass: query ``source`` (a :class:`gpupool.monitors.dcgm.DCGMSource`),
    re-key every allocation of ``pods`` (gpupool's pods, API JSON) whose devices the node named
    otherwise; returns the ids of the allocations rewritten (each logged). ``mig``, where given,
    is refilled with the MIG instances the nodes report (:func:`mig_reported`, display only).
    A failed query changes nothing (one line in the log; :attr:`DCGMSource.failing` says
    why)."""
    try:
        seen = parse_seen(await source.answer(readback_query()))
    except (HTTPClientError, OSError, PrometheusError, TimeoutError) as e:
        reason = str(e) or type(e).__name__
        level = logging.DEBUG if source.failing is not None else logging.WARNING
        source.failing = reason
        log.log(level, "gpupool: devices not read back this pass (Prometheus: %s)", reason)
        return []
    source.failing = None
    pods = list(pods)
    found: dict[str, list[Seen]] = pool.deciding(
        lambda ledger: seen_by_allocation(ledger, pods, seen)
    )
    if mig is not None:
        reported: dict[MigKey, Seen] = pool.deciding(lambda ledger: mig_reported(ledger, found))
        mig.clear()
        mig.update(reported)
    done = []
    for alloc_id, devices in sorted(found.items()):
        before = pool.ledger.allocations.get(alloc_id)
        plan: list[Allocation] = pool.deciding(
            functools.partial(_plan, alloc_id=alloc_id, seen=devices)
        )
        if not plan or before is None:
            continue
        if not apply_readback(pool, plan):
            log.warning(
                "gpupool: allocation %s holds %s on %s (read back from DCGM), which the ledger "
                "could not take over; left as is",
                alloc_id,
                ", ".join(s.id for s in devices),
                before.node,
            )
            continue
        after = pool.ledger.allocations[alloc_id]
        others = ", ".join(f"{b.id} to {b.visible_devices}" for b in plan[1:])
        log.info(
            "gpupool: allocation %s holds %s on %s (read back from DCGM); the ledger had %s%s",
            alloc_id,
            after.visible_devices,
            after.node,
            ",".join(d.gpu for d in before.devices),
            f"; moved {others}" if others else "",
        )
        done.append(alloc_id)
    return done
