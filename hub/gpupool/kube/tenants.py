"""GPUs other pods use: every pod bound to a GPU node, in any namespace, that gpupool's ledger
does not count.

Vocabulary:

- *tenant pod*: a pod bound to a node (``spec.nodeName``), not ended (phase neither ``Succeeded``
  nor ``Failed``; a terminating one still counts, as kube-scheduler counts it until it is gone),
  that requests GPU resources, and is not one of this hub's own pods (in its namespace with
  gpupool's team label: the ledger counts those). Another gpupool release's pods are tenants.
- *GPU resources*: ``nvidia.com/gpu`` (and a GPU's share resource), ``nvidia.com/mig-<profile>``.

- *another release*: a tenant pod with gpupool's team label (:func:`other_releases`): the
  hub logs an error naming its namespace and the nodes, once per namespace while it lasts.

Contract: :func:`tenant_use` maps the ledger's devices a node's tenant pods take to why
(``"k8s-n-gpu0 is used by pod ml/train (2 GPUs on n)"``, for admins and the log); the
reconciler puts those devices in :meth:`gpupool.pool.Pool.set_outside_use`, the same *outside
use* the local device watch sets, so nothing new is placed there, with the words users may
read ("used outside gpupool", :mod:`gpupool.kube.tenant_view`). Which of a node's devices
the pod has is the device plugin's choice, unknown here: devices no allocation holds are taken
first (the count is what matters to the scheduler's NodeResourcesFit). A *HAMi tenant pod* (on
a HAMi node's GPUs, with HAMi's allocation annotation, :mod:`gpupool.kube.hami`) is the
exception: its GPUs and memory are known, so :func:`tenant_shares` gives them as *outside
shares* (only that memory of only those GPUs,
:meth:`gpupool.core.ledger.Ledger.set_outside_shares`) and :func:`tenant_use` leaves them out;
before HAMi has written the annotation, it closes as many of the node's HAMi GPUs as the pod
counts, whole."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from gpupool.core.ledger import Ledger
from gpupool.core.offers import fmt_mib
from gpupool.kube.hami import HAMI, allocated

GPU_RESOURCE = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
HAMI_SIDE_RESOURCES = ("nvidia.com/gpumem", "nvidia.com/gpucores", "nvidia.com/gpumem-percentage")
"""HAMi's resources that count no GPU (its chart's ``resourceMem``, ``resourceCores``,
``resourceMemPercentage``): on a HAMi node any other ``nvidia.com/…`` request is its count."""


def gpu_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """The pod's effective GPU requests (``nvidia.com/…``; requests, or limits where no request
    is given, as extended resources must be equal): the sum over containers, or the most any
    one init container asks where that is more (``computePodResourceRequest``)."""

    def of(container: Mapping[str, Any]) -> dict[str, int]:
        res = container.get("resources") or {}
        merged = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return {k: int(float(str(v))) for k, v in merged.items() if k.startswith("nvidia.com/")}

    spec = pod.get("spec") or {}
    total: dict[str, int] = defaultdict(int)
    for c in spec.get("containers") or []:
        for k, v in of(c).items():
            total[k] += v
    for c in spec.get("initContainers") or []:
        for k, v in of(c).items():
            total[k] = max(total[k], v)
    return {k: v for k, v in total.items() if v > 0}


def digest(pod: Mapping[str, Any]) -> dict[str, Any]:
    """What the reconciler keeps of a cluster-wide pod (all of a cluster's pods would be many):
    its metadata's name, namespace, labels and deletionTimestamp, node, phase, GPU requests,
    HAMi's allocation (``hami``: ``[[uuid, MiB], …]``, empty without one; not its
    resourceVersion: a pod's status changes, where these stay, change nothing here, and the
    reconciler skips them)."""
    meta = pod.get("metadata") or {}
    return {
        "metadata": {
            k: meta[k] for k in ("name", "namespace", "labels", "deletionTimestamp") if k in meta
        },
        "node": (pod.get("spec") or {}).get("nodeName") or "",
        "phase": (pod.get("status") or {}).get("phase") or "",
        "gpus": gpu_requests(pod),
        "hami": [list(d) for d in allocated(meta.get("annotations"))],
    }


def is_tenant(pod: Mapping[str, Any], namespace: str, own_label: str) -> bool:
    """Whether a :func:`digest` is a *tenant pod* for the hub of ``namespace``."""
    meta = pod["metadata"]
    own = meta.get("namespace") == namespace and own_label in (meta.get("labels") or {})
    return bool(pod["node"] and pod["gpus"] and pod["phase"] not in ("Succeeded", "Failed")) and (
        not own
    )


def other_releases(
    pods: Iterable[Mapping[str, Any]], nodes: Iterable[str], namespace: str, own_label: str
) -> dict[str, set[str]]:
    """Namespace -> the pool's ``nodes`` where another gpupool release (pods of another
    namespace with gpupool's label) runs GPU pods: two releases manage the same nodes."""
    names = set(nodes)
    out: dict[str, set[str]] = defaultdict(set)
    for pod in pods:
        meta = pod["metadata"]
        if (
            pod["node"] in names
            and own_label in (meta.get("labels") or {})
            and is_tenant(pod, namespace, own_label)
        ):
            out[meta.get("namespace", "")].add(pod["node"])
    return dict(out)


def tenant_use(
    pods: Iterable[Mapping[str, Any]], ledger: Ledger, namespace: str, own_label: str
) -> dict[str, str]:
    """Device -> why, for the devices the *tenant pods* among ``pods`` (digests) take."""
    held = {d.gpu for a in ledger.allocations.values() for d in a.devices}
    held |= {d.instance for a in ledger.allocations.values() for d in a.devices if d.instance}
    nodes = {n.name: n for n in ledger.inventory.nodes}
    out: dict[str, str] = {}
    for pod in sorted(
        pods, key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"]["name"])
    ):
        node = nodes.get(pod["node"])
        if node is None or not is_tenant(pod, namespace, own_label):
            continue
        if _hami_devices(pod, node.gpus):
            continue  # tenant_shares has it
        who = f"pod {pod['metadata'].get('namespace', '')}/{pod['metadata']['name']}"
        for resource, count in sorted(pod["gpus"].items()):
            if resource.startswith(MIG_PREFIX):
                profile = resource[len(MIG_PREFIX) :]
                devices = [
                    i.uuid
                    for g in node.gpus
                    for i in g.instances
                    if i.profile == profile and i.uuid and i.uuid not in out
                ]
                what = f"{count} {profile} instance{'s' * (count != 1)}"
            else:
                devices = [
                    g.uuid
                    for g in node.gpus
                    if not g.mig_enabled
                    and g.uuid not in out
                    and (
                        resource == (g.share_resource or GPU_RESOURCE)
                        or (resource == GPU_RESOURCE and g.share_resource is None)
                        or (g.share_resource == HAMI and resource not in HAMI_SIDE_RESOURCES)
                    )
                ]
                what = f"{count} GPU{'s' * (count != 1)}"
            devices.sort(key=lambda d: d in held)  # free ones first (a stable sort)
            for device in devices[:count]:
                out[device] = f"{device} is used by {who} ({what} on {node.name})"
    return out


def _hami_devices(pod: Mapping[str, Any], gpus: Iterable[Any]) -> list[tuple[str, int]]:
    """``(uuid, MiB)`` of a digest's HAMi allocation on the node's HAMi GPUs (``[]``: not a
    *HAMi tenant pod* with its annotation, or it names none of them)."""
    mine = {g.uuid for g in gpus if g.share_resource == HAMI}
    return [(str(u), int(m)) for u, m in pod.get("hami") or () if u in mine]


def tenant_shares(
    pods: Iterable[Mapping[str, Any]], ledger: Ledger, namespace: str, own_label: str
) -> dict[str, tuple[int, str]]:
    """GPU UUID -> (MiB, why): the memory the *HAMi tenant pods* among ``pods`` (digests) have
    of each of the pool's HAMi GPUs, as HAMi's scheduler wrote it on them."""
    nodes = {n.name: n for n in ledger.inventory.nodes}
    mib: dict[str, int] = defaultdict(int)
    who: dict[str, list[str]] = defaultdict(list)
    for pod in sorted(
        pods, key=lambda p: (p["metadata"].get("namespace", ""), p["metadata"]["name"])
    ):
        node = nodes.get(pod["node"])
        if node is None or not is_tenant(pod, namespace, own_label):
            continue
        name = f"{pod['metadata'].get('namespace', '')}/{pod['metadata']['name']}"
        for uuid, used in _hami_devices(pod, node.gpus):
            mib[uuid] += used
            who[uuid].append(f"pod {name} ({fmt_mib(used)} on {node.name})")
    return {
        uuid: (used, f"{fmt_mib(used)} of {uuid} is used by {', '.join(who[uuid])}")
        for uuid, used in mib.items()
    }
