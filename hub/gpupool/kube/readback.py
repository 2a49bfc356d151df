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
- *re-key* (:mod:`gpupool.readback`, shared with Slurm's mirror): an allocation of whole GPUs
  takes the inventory GPUs with the indexes the node reports (``k8s-<node>-gpu<index>``), each
  with the GPU's UUID as its ``instance`` (so ``visible_devices`` names the real GPU); one the
  ledger had put there is displaced onto the ones vacated. MIG instances and shares are not
  re-keyed (see docs/kubernetes.md, section 4); a MIG instance's parent GPU and GPU instance ID,
  as the node reports them, are kept for the admin page only (:func:`mig_reported`).

Contract: :func:`parse_seen`, :func:`seen_by_allocation` and :func:`mig_reported` are pure;
:func:`read_back` is one pass: query, plan and apply (:mod:`gpupool.readback`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tornado.httpclient import HTTPClientError

from gpupool.core.ledger import Allocation, Ledger
from gpupool.monitors.dcgm import PrometheusError
from gpupool.pool import Pool
from gpupool.readback import Seen, apply_readback, plan_readback

READBACK_METRIC = "DCGM_FI_DEV_FB_USED"
"""One series per GPU and MIG instance, in dcgm-exporter's default counters."""
ALLOCATION_LABEL = "gpupool.io/allocation"
JOB_LABEL = "gpupool.io/job"

PodKey = tuple[str, str]


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
