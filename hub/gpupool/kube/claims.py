"""Dynamic Resource Allocation (DRA): the ResourceClaim that pins an allocation's GPUs by UUID,
built as pure functions over API JSON (issue 26, section 4).

Vocabulary
- *device allocation*: how a GPU pod gets its devices, the setting ``device_allocation`` of
  :class:`gpupool.kube.settings.KubeGPUSettings`: ``"device-plugin"`` (the default: extended
  resources such as ``nvidia.com/gpu``; the device plugin picks the GPU) or ``"dra"`` (a
  ResourceClaim of the ``resource.k8s.io/v1`` API, Kubernetes 1.34 and later, that NVIDIA's DRA
  driver ``gpu.nvidia.com`` serves; the claim names the GPUs).
- *slice device*: one device a ResourceSlice publishes (:class:`SliceDevice`): its pool, its
  name in the pool, the node, and the attributes NVIDIA's DRA driver gives a GPU (``type``
  ``gpu``, ``uuid``, ``productName``, ``pcieBusID``; capacity ``memory``; ``GetDevice`` in
  ``cmd/gpu-kubelet-plugin/deviceinfo.go`` of NVIDIA/k8s-dra-driver-gpu, device names
  ``gpu-<minor>``). The driver's attributes are unqualified, so CEL reads them under the
  driver's domain: ``device.attributes['gpu.nvidia.com'].uuid``.
- *node GPUs*: a node's slice devices of type ``gpu``, in PCI bus order, which is NVML's index
  order (``nvidia-smi``'s, dcgm-exporter's ``gpu`` label): the ledger's GPU with index ``i`` on a
  node (``k8s-<node>-gpu<i>``, :mod:`gpupool.kube.nodes`) is the node's ``i``-th GPU. A ledger
  GPU whose id is already a real ``GPU-…`` UUID is itself.
- *pinned UUIDs*: the UUIDs of the node GPUs the ledger gave an allocation
  (:func:`pinned_uuids`); the claim's one request asks for exactly that many devices of the
  DeviceClass ``gpu.nvidia.com`` whose ``uuid`` is one of them (:func:`make_claim`), so the
  scheduler's DRA plugin can allocate no other GPU.
- *claim reference*: the pod's ``spec.resourceClaims`` entry :data:`CLAIM_REF` naming the claim
  (``resourceClaimName``) and the notebook container's ``resources.claims`` entry of that name
  (:func:`use_claim`); the container then asks for no ``nvidia.com/*`` resource.
- *job claims*: an Indexed Job's pods share one pod template, so they cannot each name a
  claim of their own: the job gets a ResourceClaimTemplate (:func:`make_claim_template`, owned
  by the Job) from which Kubernetes' resourceclaim controller makes one claim per pod, owned by
  the pod. Its selector lists the pinned UUIDs of every node of the job, and each claim asks for
  one node's count: a pod is bound to its node (node affinity), where only that node's pinned
  GPUs match, so each pod gets exactly the GPUs the ledger holds there. One claim shared by all
  pods could not work: a claim is allocated on one node.
- *allocation result*: ``status.allocation.devices.results`` of the claim (``driver``, ``pool``,
  ``device``) as the scheduler wrote it; :func:`allocated_uuids` maps it back to UUIDs through the
  slices, and :func:`unhonoured` says where it differs from the pinned UUIDs. Once it agrees,
  the ledger's devices carry the UUIDs as their ``instance`` (:func:`with_uuids`; their
  ``visible_id``), persisted: the admin page, metrics and the reconciler name the real GPUs.

Contract: no I/O; every function is pure over API JSON or ``kubernetes_asyncio`` models. The
spawner creates the claim before its pod and owns it by the pod afterwards
(``gpupool_spawner.kube_dra``); the job backend creates the template with the (suspended) Job's
other objects, owned by the Job, before it resumes the Job (:mod:`gpupool.kube.jobs`). Whole GPUs
only: a MIG instance (DeviceClass ``mig.nvidia.com``, devices
``gpu-<minor>-mig-<profile id>-<start>-<size>``) or a share is refused under DRA with the
reason (:func:`dra_refusal`), for notebooks and jobs.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kubernetes_asyncio.client import (
    CoreV1ResourceClaim,
    V1Pod,
    V1PodResourceClaim,
)

from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Allocation
from gpupool.declarations import ConfigError
from gpupool.kube.pods import notebook_container, with_resources

DEVICE_PLUGIN = "device-plugin"
DRA = "dra"
DEVICE_ALLOCATIONS = (DEVICE_PLUGIN, DRA)
RESOURCE_API = "resource.k8s.io/v1"
NVIDIA_DRIVER = "gpu.nvidia.com"
GPU_CLASS = "gpu.nvidia.com"
"""The DeviceClass of whole GPUs NVIDIA's DRA driver's chart installs."""
MIG_CLASS = "mig.nvidia.com"
"""The DeviceClass of MIG instances (not used yet: see the contract)."""
CLAIM_REF = "gpus"
"""The name the pod and its container give the claim (``spec.resourceClaims[].name``)."""
CLAIM_SUFFIX = "-gpus"
_UUID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]*$")


class DRAError(ValueError):
    """An allocation that cannot be pinned through DRA (the message says why)."""


def check_device_allocation(value: Any, key: str) -> str:
    """``value`` if it is one of :data:`DEVICE_ALLOCATIONS`, else a ConfigError naming ``key``."""
    if value not in DEVICE_ALLOCATIONS:
        raise ConfigError(
            key, f"{value!r} is not one of {', '.join(repr(v) for v in DEVICE_ALLOCATIONS)}"
        )
    return str(value)


def claim_template_name(job_name: str) -> str:
    """The ResourceClaimTemplate of the Job named ``job_name`` (see *job claims*)."""
    return f"{job_name}{CLAIM_SUFFIX}"


def claim_name(pod_name: str) -> str:
    """The ResourceClaim of the pod named ``pod_name`` (a pod name is at most 63 characters; a
    claim's may be 253)."""
    return f"{pod_name}{CLAIM_SUFFIX}"


@dataclass(frozen=True)
class SliceDevice:
    """A *slice device*."""

    node: str
    pool: str
    name: str
    kind: str
    uuid: str
    product: str
    pcie: str


def slice_devices(slices: Iterable[Mapping[str, Any]]) -> list[SliceDevice]:
    """The devices NVIDIA's DRA driver publishes in ``slices`` (ResourceSlices, API JSON)."""
    out: list[SliceDevice] = []
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != NVIDIA_DRIVER:
            continue
        pool = str((spec.get("pool") or {}).get("name") or "")
        for device in spec.get("devices") or []:
            attrs = device.get("attributes") or {}

            def text(name: str, attrs: Mapping[str, Any] = attrs) -> str:
                value = attrs.get(name) or attrs.get(f"{NVIDIA_DRIVER}/{name}") or {}
                return str(value.get("string") or "")

            out.append(
                SliceDevice(
                    node=str(spec.get("nodeName") or ""),
                    pool=pool,
                    name=str(device.get("name") or ""),
                    kind=text("type"),
                    uuid=text("uuid"),
                    product=text("productName"),
                    pcie=text("pcieBusID"),
                )
            )
    return out


def node_gpus(devices: Iterable[SliceDevice], node: str) -> list[SliceDevice]:
    """The *node GPUs* of ``node``."""
    gpus = [d for d in devices if d.node == node and d.kind == "gpu" and d.uuid]
    return sorted(gpus, key=lambda d: (d.pcie.lower(), d.name))


def dra_refusal(allocation: Allocation) -> str | None:
    """Why ``allocation`` cannot be pinned through DRA (MIG instances and shares), or None."""
    for device in allocation.devices:
        if device.profile is not None:
            return (
                f"MIG instances ({device.profile}) cannot be given through DRA by gpupool yet; "
                "an admin must offer them through the device plugin "
                "(KubeGPUSettings.device_allocation = 'device-plugin')"
            )
        if device.share_milli is not None:
            return (
                "shares of a GPU cannot be given through DRA by gpupool yet; an admin must "
                "offer them through the device plugin or HAMi "
                "(KubeGPUSettings.device_allocation = 'device-plugin')"
            )
    return None


def pinned_uuids(
    allocation: Allocation, inventory: Inventory, devices: Sequence[SliceDevice]
) -> tuple[str, ...]:
    """The *pinned UUIDs* of ``allocation`` (whole GPUs on one node); a :class:`DRAError` says
    why there are none (a MIG instance or share, a node whose slices lack the GPU)."""
    why = dra_refusal(allocation)
    if why:
        raise DRAError(why)
    node = allocation.node or ""
    gpus = node_gpus(devices, node)
    index = {g.uuid: g.index for n in inventory.nodes if n.name == node for g in n.gpus}
    known = {d.uuid for d in gpus}
    out: list[str] = []
    for device in allocation.devices:
        if device.gpu in known:  # the ledger's name is the GPU's UUID already
            out.append(device.gpu)
            continue
        i = index.get(device.gpu)
        if i is None or i >= len(gpus):
            raise DRAError(
                f"node {node} publishes {len(gpus)} GPU(s) of driver {NVIDIA_DRIVER} in its "
                f"ResourceSlices, not GPU {device.gpu} (is NVIDIA's DRA driver running there?)"
            )
        out.append(gpus[i].uuid)
    for uuid in out:
        if not _UUID.match(uuid):
            raise DRAError(f"GPU UUID {uuid!r} of node {node} cannot be named in CEL")
    return tuple(out)


def uuid_expression(uuids: Sequence[str]) -> str:
    """The CEL selector of exactly the devices with these UUIDs."""
    listed = ", ".join(f"'{u}'" for u in uuids)
    return f"device.attributes['{NVIDIA_DRIVER}'].uuid in [{listed}]"


def claim_spec(uuids: Sequence[str], count: int) -> dict[str, Any]:
    """A claim's ``spec``: one request for ``count`` GPUs among ``uuids``."""
    exactly = {
        "deviceClassName": GPU_CLASS,
        "allocationMode": "ExactCount",
        "count": count,
        "selectors": [{"cel": {"expression": uuid_expression(uuids)}}],
    }
    return {"devices": {"requests": [{"name": CLAIM_REF, "exactly": exactly}]}}


def make_claim(
    name: str, namespace: str, uuids: Sequence[str], labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The ResourceClaim (API JSON) asking for exactly the GPUs ``uuids``."""
    return {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
        "spec": claim_spec(uuids, len(uuids)),
    }


def make_claim_template(
    name: str,
    namespace: str,
    uuids: Sequence[str],
    per_pod: int,
    owner: Mapping[str, Any],
) -> dict[str, Any]:
    """The ResourceClaimTemplate of a job (*job claims*): each pod's claim asks for ``per_pod``
    GPUs among all of the job's pinned ``uuids``; owned by the Job ``owner`` (API JSON)."""
    meta = owner["metadata"]
    return {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(meta.get("labels") or {}),
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {"spec": claim_spec(uuids, per_pod)},
    }


def job_pinned_uuids(
    allocations: Sequence[Allocation], inventory: Inventory, devices: Sequence[SliceDevice]
) -> tuple[tuple[str, ...], int]:
    """The *pinned UUIDs* of all of a job's allocations (one per node) and the GPUs each pod
    asks for; a :class:`DRAError` where the nodes' counts differ (one template for all pods)."""
    counts = {len(a.devices) for a in allocations}
    if len(counts) != 1:
        raise DRAError(
            "the job's nodes hold different numbers of GPUs, and its pods share one claim template"
        )
    uuids = tuple(u for a in allocations for u in pinned_uuids(a, inventory, devices))
    return uuids, counts.pop()


def use_claim_template(job: Mapping[str, Any], name: str) -> dict[str, Any]:
    """A copy of the Job ``job`` (API JSON) whose pods get their GPUs from a claim made from
    the template ``name`` (``resourceClaimTemplateName``) instead of ``nvidia.com/*``
    resources (see *claim reference*)."""
    out = copy.deepcopy(dict(job))
    spec = out["spec"]["template"]["spec"]
    for container in spec.get("containers") or []:
        resources = container.get("resources") or {}
        held = [
            k
            for kind in ("limits", "requests")
            for k in resources.get(kind) or {}
            if k.startswith("nvidia.com/")
        ]
        if not held:
            continue
        for kind in ("limits", "requests"):
            quantities = {
                k: v
                for k, v in (resources.get(kind) or {}).items()
                if not k.startswith("nvidia.com/")
            }
            if quantities:
                resources[kind] = quantities
            else:
                resources.pop(kind, None)
        claims = [c for c in resources.get("claims") or [] if c.get("name") != CLAIM_REF]
        resources["claims"] = [*claims, {"name": CLAIM_REF}]
        container["resources"] = resources
    refs = [r for r in spec.get("resourceClaims") or [] if r.get("name") != CLAIM_REF]
    spec["resourceClaims"] = [*refs, {"name": CLAIM_REF, "resourceClaimTemplateName": name}]
    return out


def owner_reference(pod: Mapping[str, Any]) -> dict[str, Any]:
    """An ownerReference to ``pod`` (API JSON), so the garbage collector deletes the claim with
    it."""
    meta = pod["metadata"]
    return {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}


def use_claim(pod: V1Pod, name: str) -> V1Pod:
    """A copy of ``pod`` whose notebook container gets its GPUs from the claim ``name`` (see
    *claim reference*) instead of ``nvidia.com/*`` resources."""
    out = copy.deepcopy(pod)
    container = notebook_container(out)
    container.resources = with_resources(container.resources, {})
    others = [c for c in container.resources.claims or [] if c.name != CLAIM_REF]
    container.resources.claims = [*others, CoreV1ResourceClaim(name=CLAIM_REF)]
    refs = [r for r in out.spec.resource_claims or [] if r.name != CLAIM_REF]
    out.spec.resource_claims = [*refs, V1PodResourceClaim(name=CLAIM_REF, resource_claim_name=name)]
    return out


def allocation_results(claim: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """The *allocation result* of ``claim``: (driver, pool, device) each; [] before it has one."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return [(str(r["driver"]), str(r["pool"]), str(r["device"])) for r in results]


def allocated_uuids(
    claim: Mapping[str, Any], devices: Sequence[SliceDevice]
) -> tuple[str, ...] | None:
    """The UUIDs of the devices allocated to ``claim`` (a device no slice names is given by
    name, ``<pool>/<device>``); None while it is not allocated."""
    results = allocation_results(claim)
    if not results:
        return None
    by_name = {(d.pool, d.name): d.uuid for d in devices}
    return tuple(by_name.get((pool, dev)) or f"{pool}/{dev}" for _, pool, dev in results)


def with_uuids(allocation: Allocation, uuids: Sequence[str]) -> Allocation:
    """``allocation`` with each whole GPU's UUID as its device's ``instance`` (its
    ``visible_id``), in the order of its devices (the *pinned UUIDs*' order)."""
    if len(uuids) != len(allocation.devices):
        raise DRAError(f"{len(uuids)} UUID(s) for {len(allocation.devices)} device(s)")
    devices = tuple(replace(d, instance=u) for d, u in zip(allocation.devices, uuids, strict=True))
    return replace(allocation, devices=devices)


def unhonoured(pinned: Sequence[str], allocated: Sequence[str]) -> str | None:
    """What the allocation holds that was not pinned, as a sentence, or None."""
    extra = sorted(set(allocated) - set(pinned))
    if not extra and len(allocated) == len(pinned):
        return None
    return (
        f"the claim was allocated {', '.join(allocated) or 'nothing'}, not the pinned "
        f"{', '.join(pinned)}"
    )
