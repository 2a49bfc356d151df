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

Contract: :func:`unallocatable_pods` says which pods are unallocatable, each with a sentence
naming the scheduler's message; the job backend stops such a job at once (as it does a job
stranded on a lost node, :func:`gpupool.kube.job_status.stranded_pods`), so it fails with that
reason and its GPUs are released.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
