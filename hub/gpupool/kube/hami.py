"""What HAMi's scheduler gave pods, read back from their annotations (issue 26, section 3).

Vocabulary
- *HAMi allocation*: a pod's ``hami.io/vgpu-devices-allocated`` annotation, written by HAMi's
  scheduler extender when it places the pod (``Filter`` in ``pkg/scheduler/scheduler.go``,
  ``PatchAnnotations`` in ``pkg/device/nvidia/device.go``), before the pod is bound:
  ``<uuid>,<type>,<MiB>,<cores>:`` per device, ``;`` per container (``EncodePodSingleDevice``
  and ``EncodeContainerDevices`` in HAMi's ``pkg/device/devices.go``; ``DecodePodDevices``
  reads it back). :func:`allocated` gives ``(uuid, MiB)`` per device, over all containers.
- *unpriced shares*: with Kueue admitting gpupool's pods and HAMi's count ``nvidia.com/gpu``,
  Kueue never admits a HAMi share pod (the ClusterQueues cover no ``nvidia.com/gpumem`` without
  the chart's ``kueue.hami``): :func:`unpriced_shares` closes HAMi's GPUs with that reason.
- *pin disagreement*: one of gpupool's own HAMi share pods whose HAMi allocation names a GPU
  other than the ledger's (HAMi ignored ``nvidia.com/use-gpuuuid``: an older HAMi, or an
  admin's change of its webhook); reported by the reconciler as drift ``unexpected_gpu``.

Contract: pure functions over API JSON and the ledger; nothing here changes either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Allocation, Ledger

ALLOCATED_ANNOTATION = "hami.io/vgpu-devices-allocated"
HAMI = "hami"
"""The share resource the inventory gives a HAMi node's GPUs (:mod:`gpupool.kube.nodes`)."""
ALLOCATION_LABEL = "gpupool.io/allocation"
JOB_LABEL = "gpupool.io/job"


def allocated(annotations: Mapping[str, str] | None) -> list[tuple[str, int]]:
    """``(uuid, MiB)`` of each device of a *HAMi allocation* (``[]``: none, or unreadable)."""
    text = (annotations or {}).get(ALLOCATED_ANNOTATION) or ""
    out = []
    for container in text.split(";"):
        for device in container.split(":"):
            fields = device.split(",")
            if len(fields) == 4 and fields[0] and fields[2].strip().isdigit():
                out.append((fields[0], int(fields[2])))
    return out


def unpriced_shares(inventory: Inventory, refusal: str) -> dict[str, str]:
    """GPU UUID -> why, for every HAMi GPU of ``inventory`` while ``refusal`` says why no HAMi
    share is handed out ('': none; :func:`gpupool.kube.settings.kueue_hami_refusal`): the
    reconciler keeps them in outside use, so a share is refused at once with the reason, never
    left to wait for Kueue's admission until the start timeout."""
    if not refusal:
        return {}
    return {
        g.uuid: f"the GPUs of HAMi nodes: {refusal}"
        for n in inventory.nodes
        for g in n.gpus
        if g.share_resource == HAMI
    }


def hami_gpus(ledger: Ledger, allocation: Allocation) -> set[str]:
    """The HAMi GPUs (by UUID) ``allocation`` holds shares of."""
    gpus = {g.uuid: g for g in ledger.inventory.gpus}
    return {
        d.gpu
        for d in allocation.devices
        if d.share_milli is not None
        and (gpu := gpus.get(d.gpu)) is not None
        and gpu.share_resource == HAMI
    }


def pin_disagreements(
    ledger: Ledger, pods: Iterable[Mapping[str, Any]]
) -> list[tuple[str, str, str]]:
    """``(allocation id, message, key)`` for each of gpupool's pods (``pods``: API JSON) with a
    *pin disagreement*: its HAMi allocation names a GPU none of its allocation(s) hold."""
    from gpupool.kube.pods import label_value

    by_value = {label_value(a.id): a for a in ledger.allocations.values()}
    by_job: dict[str, list[Allocation]] = {}
    for a in ledger.allocations.values():
        if a.kind == "job":
            by_job.setdefault(label_value(a.ref), []).append(a)
    out = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        given = allocated(meta.get("annotations"))
        if not given:
            continue
        labels = meta.get("labels") or {}
        if JOB_LABEL in labels:
            mine = by_job.get(labels[JOB_LABEL], [])
        else:
            one = by_value.get(labels.get(ALLOCATION_LABEL, ""))
            mine = [one] if one is not None else []
        node = (pod.get("spec") or {}).get("nodeName")
        held: set[str] = set()
        for a in mine:
            if not node or a.node in (None, node):
                held |= hami_gpus(ledger, a)
        wrong = sorted({uuid for uuid, _mib in given} - held)
        if not held or not wrong:
            continue
        first = mine[0]
        name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        message = (
            f"pod {name} ({first.kind} allocation {first.id} of {first.user}): HAMi gave it GPU "
            f"{', '.join(wrong)}, but the ledger holds {', '.join(sorted(held))} for it "
            "(HAMi did not honour nvidia.com/use-gpuuuid: an older HAMi, or its webhook "
            "changed?); the ledger's count of that GPU is off until the pod ends"
        )
        out.append((first.id, message, f"g:{name}"))
    return out
