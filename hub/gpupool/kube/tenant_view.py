"""Other tenants' GPU pods as the hub words them: admins see which pod of which namespace takes
which of the pool's GPUs; users see only that a GPU is used outside gpupool (issue 26, §2).

Vocabulary
- *detail*: device -> the reason :func:`gpupool.kube.tenants.tenant_use` words, naming the pod
  (``"k8s-n-gpu0 is used by pod ml/train (2 GPUs on n)"``): for the admin page and the hub's
  log only (:attr:`gpupool.kube.reconcile.KubeReconciler.outside_detail`).
- *public reason*: device -> ``"k8s-n-gpu0 is used outside gpupool"``: what the ledger's
  *outside use* holds, so every refusal, wait reason and page a user sees says no more. The
  design's tenancy rule: users see only their own; another namespace's pods are not theirs
  (their names often name a person or a project).

Contract: pure functions of their arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpupool.core.inventory import Inventory

PUBLIC = "{device} is used outside gpupool"


def public_reasons(detail: Mapping[str, str]) -> dict[str, str]:
    """The *public reason* of each device of ``detail``."""
    return {device: PUBLIC.format(device=device) for device in detail}


def changed(before: Mapping[str, str], after: Mapping[str, str]) -> list[str]:
    """The reasons of ``after`` that ``before`` did not have (to log once, in device order)."""
    return [why for device, why in sorted(after.items()) if before.get(device) != why]


def outside_pods_rows(inventory: Inventory, detail: Mapping[str, str]) -> list[dict[str, Any]]:
    """The admin page's rows, one per device of ``detail``: its node, the GPU's index (and the
    MIG instance's profile), the device and why (naming the pod), by node and GPU index."""
    where: dict[str, tuple[str, int, str]] = {}
    for node in inventory.nodes:
        for g in node.gpus:
            where[g.uuid] = (node.name, g.index, "")
            for inst in g.instances:
                if inst.uuid:
                    where[inst.uuid] = (node.name, g.index, inst.profile)
    rows = []
    for device, why in detail.items():
        name, index, profile = where.get(device, ("", -1, ""))
        rows.append(
            {
                "node": name,
                "gpu": "" if index < 0 else index,
                "profile": profile,
                "device": device,
                "reason": why,
            }
        )
    rows.sort(key=lambda r: (r["node"], r["gpu"] if r["gpu"] != "" else -1, r["device"]))
    return rows
