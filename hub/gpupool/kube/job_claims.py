"""A DRA job's pods and their claims (``device_allocation = "dra"``; vocabulary in
:mod:`gpupool.kube.claims`), pure over API JSON.

Vocabulary
- *unallocatable pod*: a job pod Pending, not bound, whose ``PodScheduled`` condition is
  ``False``, ``Unschedulable``, with the scheduler's DRA plugin's reason ``cannot allocate all
  claims`` (``Filter`` in ``pkg/scheduler/framework/plugins/dynamicresources/
  dynamicresources.go`` returns it as ``UnschedulableAndUnresolvable``: no other node helps).
  Its claim pins the GPUs the ledger holds for the job on its node; another pod (of another
  tenant, or an earlier claim not yet released) holds them, and no retry of the scheduler's
  finds others, so waiting for the start timeout only keeps the job's GPUs from everyone.
- *pod claims*: the claims Kubernetes' resourceclaim controller made for a job pod from the
  job's ResourceClaimTemplate (``handleClaim`` in ``pkg/controller/resourceclaim/
  controller.go``): owned by the pod (``ownerReferences``, ``controller: true``), so found by
  the pod's uid; their *allocation result* is what the scheduler gave the pod.

Contract: :func:`unallocatable_pods` says which pods are unallocatable, each with a sentence
naming the scheduler's message; the job backend stops such a job at once (as it does a job
stranded on a lost node, :func:`gpupool.kube.job_status.stranded_pods`), so it fails with that
reason and its GPUs are released. :func:`job_unhonoured` compares, once the job runs, the
UUIDs every pod's claims were allocated with the *pinned UUIDs* of the job's allocations on the
pod's node (:mod:`gpupool.kube.claims`): a sentence where they differ (the job then fails with
it: the ledger would count GPUs its pods do not hold), else None, and the job backend records
the UUIDs on the ledger's devices (:func:`record_uuids`), as a notebook's start does.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from gpupool.core.ledger import Allocation
from gpupool.kube.claims import SliceDevice, allocated_uuids, unhonoured, with_uuids

UNFIT = "cannot allocate all claims"


def unallocatable_pods(pods: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The *unallocatable pods* of ``pods`` by name, each with why."""
    out: dict[str, str] = {}
    for pod in pods:
        status = pod.get("status") or {}
        if status.get("phase") != "Pending" or (pod.get("spec") or {}).get("nodeName"):
            continue
        for c in status.get("conditions") or []:
            message = str(c.get("message") or "")
            if (
                c.get("type") == "PodScheduled"
                and c.get("status") == "False"
                and c.get("reason") == "Unschedulable"
                and UNFIT in message
            ):
                name = str((pod.get("metadata") or {}).get("name") or "")
                out[name] = (
                    f"Kubernetes cannot schedule pod {name} ({message.rstrip('.')}): its "
                    "ResourceClaim pins GPUs another pod holds"
                )
    return out


def pod_claims(
    pod: Mapping[str, Any], claims: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The *pod claims* of ``pod`` among ``claims`` (API JSON)."""
    uid = (pod.get("metadata") or {}).get("uid")
    return [
        c
        for c in claims
        if any(o.get("uid") == uid for o in (c.get("metadata") or {}).get("ownerReferences") or [])
    ]


def job_unhonoured(
    allocations: Sequence[Allocation],
    pinned: Mapping[str, Sequence[str]],
    pods: Sequence[Mapping[str, Any]],
    claims: Sequence[Mapping[str, Any]],
    devices: Sequence[SliceDevice],
) -> str | None:
    """Where the running ``pods``' claims hold other GPUs than the ``pinned`` UUIDs (by
    allocation id) of ``allocations`` on their nodes, as a sentence; None where they agree.
    Raises ``LookupError`` while a running pod's claim has no allocation result yet."""
    wanted: dict[str, list[str]] = defaultdict(list)
    for a in allocations:
        wanted[a.node or ""] += list(pinned[a.id])
    held: dict[str, list[str]] = defaultdict(list)
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Running":
            continue
        node = str((pod.get("spec") or {}).get("nodeName") or "")
        for claim in pod_claims(pod, claims):
            uuids = allocated_uuids(claim, devices)
            if uuids is None:
                raise LookupError(f"claim {claim['metadata'].get('name')} is not allocated yet")
            held[node] += list(uuids)
    wrong = []
    for node in sorted(held):
        # a node's pods hold a part of its pinned GPUs each: none outside them, none twice
        outside = sorted(set(held[node]) - set(wanted.get(node, ())))
        twice = len(held[node]) != len(set(held[node]))
        if outside or twice:
            why = unhonoured(wanted.get(node, ()), held[node]) or "a GPU is held twice"
            wrong.append(f"on node {node} {why}")
    return "; ".join(wrong) or None


def record_uuids(pool: Any, uuids: Mapping[str, Sequence[str]], log: logging.Logger) -> None:
    """Each allocation (by id) of ``pool``'s ledger gets ``uuids`` as its devices' ``instance``
    (persisted; the ledger unchanged where the database refuses: logged)."""

    def record(ledger: Any) -> None:
        for alloc_id, found in uuids.items():
            current = ledger.allocations.get(alloc_id)
            if current is None:
                continue
            updated = with_uuids(current, found)
            if updated == current:
                continue
            try:
                pool.store.replace([updated])
            except Exception as e:  # bookkeeping: the job runs regardless
                log.warning("gpupool: cannot record the GPUs of %s: %s", alloc_id, e)
                continue
            ledger.allocations[alloc_id] = updated

    pool.deciding(record)
