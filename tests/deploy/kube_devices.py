"""The NVIDIA device plugin in the API stand-in: which of a node's devices a started pod gets,
and what the node then says about it (issue 26, section 4).

On a real node the kubelet's device manager asks the device plugin which devices to give a
container (``GetPreferredAllocation``), then ``Allocate`` s them; the scheduler only counted.
gpupool's ledger names devices ``k8s-<node>-gpu<i>`` (bookkeeping, lowest index first), so the
node and the ledger disagree unless the hub reads back what the node gave. This module is that
node side, driven by :meth:`tests.deploy.kube_api.StandIn._start` (one call, when a bound pod's
containers start):

- *devices of a node*: what the plugin advertises, from the node's ``allocatable`` (as the
  plugin registers them: ``nvidia.com/gpu`` and, under the ``mixed`` MIG strategy,
  ``nvidia.com/mig-<profile>``). Device IDs follow the plugin's default ``uuid`` ID strategy:
  ``GPU-<uuid>`` for a whole GPU, ``MIG-<uuid>`` for a MIG instance (``internal/rm/
  nvml_devices.go``). Here the GPUs holding MIG instances come first on the node (indexes 0..),
  the whole GPUs after: the physical layout is the node's, not gpupool's packing
  (:func:`gpupool.kube.nodes.pack_instances` puts whole GPUs first).
- *the choice*: the plugin's, not gpupool's. NVIDIA's ``getPreferredAllocation``
  (``internal/rm/nvml_manager.go``) asks ``gpuallocator.NewBestEffortPolicy()`` for whole GPUs
  (NVLink scores) and ``greedyAlloc`` (``internal/rm/allocate.go``; it takes a bucket's *last*
  candidate) for MIG instances and replicas. The stand-in models neither score; it takes the
  node's free devices of the resource from the end of its list (highest index first), an order
  that is not the ledger's, so a test sees them disagree.
- *what the node says*: :meth:`DevicePlugin.pod_resources` answers as the kubelet's
  PodResources API does (``v1.PodResourcesLister/List``, ``pkg/kubelet/apis/podresources``:
  per pod and container, ``devices`` with ``resource_name`` and ``device_ids``);
  :meth:`DevicePlugin.dcgm_series` as NVIDIA's dcgm-exporter does with its Kubernetes pod mapping
  (it reads that same PodResources API, ``internal/pkg/transformation/kubernetes.go``, and puts
  ``pod``, ``namespace``, ``container`` on the series of each device a pod holds; a MIG
  instance's series carries its parent GPU's ``UUID``, ``GPU_I_ID`` and ``GPU_I_PROFILE``).
- *the container's environment*: :meth:`DevicePlugin.container_env`, as ``getAllocateResponse``
  (``internal/plugin/server.go``) leaves it: under ``envvar``, ``NVIDIA_VISIBLE_DEVICES`` lists the
  device IDs; under CDI (``cdi-cri``, the GPU Operator's default since v25.10) the response names
  CDI devices (``nvidia.com/gpu=<id>``, :meth:`DevicePlugin.cdi_devices`) and sets no variable,
  and the CDI spec ``nvidia-ctk cdi generate`` writes (NVIDIA/nvidia-container-toolkit) sets
  ``NVIDIA_VISIBLE_DEVICES=void`` in its common container edits. The image's own
  ``NVIDIA_VISIBLE_DEVICES=all`` (CUDA images) is replaced by it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
CDI_KIND = "nvidia.com/gpu"
DEVICE_LIST_STRATEGIES = ("envvar", "cdi-cri")


@dataclass(frozen=True)
class NodeDevice:
    """One device the plugin advertises: its ID, the resource, the physical GPU's index and UUID
    on the node, and for a MIG instance its GPU instance ID and profile."""

    id: str
    resource: str
    index: int
    gpu_uuid: str
    gi: int | None = None
    profile: str | None = None


def _uuid(*parts: object) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(map(str, parts))))


MIG_SLOTS = {"1g": 1, "2g": 2, "3g": 4, "4g": 4, "7g": 8}
"""Memory slots (of 8) of a MIG profile by its compute part; a ``1g`` with double memory
(``1g.20gb`` on an 80 GB GPU, ``1g.10gb`` on a 40 GB one) takes 2, see :func:`_slots`."""


def _slots(profile: str) -> int:
    compute, _, memory = profile.partition(".")
    size = MIG_SLOTS.get(compute, 8)
    if compute == "1g" and memory.rstrip("gb.me").isdigit() and int(memory.rstrip("gb.me")) >= 20:
        size = 2
    return size


def node_devices(node: Mapping[str, Any]) -> list[NodeDevice]:
    """The devices the plugin advertises on ``node`` (API JSON): its MIG instances laid out on
    its first GPUs (``nvidia.com/gpu.count`` less the whole GPUs), largest first, each on the
    emptiest GPU with room (8 memory slots, 7 compute slices; so ``all-balanced`` on an
    A100-80GB gives each GPU 3g + 2g + 2 × 1g), GPU instance IDs from 1 per GPU; then its whole
    GPUs."""
    name = node["metadata"]["name"]
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    wanted = [
        resource[len(MIG_PREFIX) :]
        for resource in sorted(r for r in allocatable if r.startswith(MIG_PREFIX))
        for _ in range(int(allocatable[resource]))
    ]
    wanted.sort(key=lambda p: (-_slots(p), p))
    labels = node["metadata"].get("labels") or {}
    count = int(labels.get("nvidia.com/gpu.count", 0)) - int(allocatable.get(GPU, 0))
    used: list[list[int]] = [[0, 0, 0] for _ in range(max(count, 0))]
    out: list[NodeDevice] = []
    for profile in wanted:
        slots, compute = _slots(profile), int(profile.split("g", 1)[0])
        room = [
            (m - 8, i) for i, (m, c, _) in enumerate(used) if m + slots <= 8 and c + compute <= 7
        ]
        gpu = min(room)[1] if room else len(used)  # the emptiest GPU first
        if gpu == len(used):
            used.append([0, 0, 0])
        used[gpu][0] += slots
        used[gpu][1] += compute
        used[gpu][2] += 1
        gi = used[gpu][2]
        parent = f"GPU-{_uuid(name, 'gpu', gpu)}"
        resource = MIG_PREFIX + profile
        out.append(NodeDevice(f"MIG-{_uuid(name, gpu, gi)}", resource, gpu, parent, gi, profile))
    for i in range(int(allocatable.get(GPU, 0))):
        parent = f"GPU-{_uuid(name, 'gpu', len(used) + i)}"
        out.append(NodeDevice(parent, GPU, len(used) + i, parent))
    return out


def pod_device_requests(pod: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Container name -> device resource -> count (limits, as the device manager reads them)."""
    out: dict[str, dict[str, int]] = {}
    for c in pod["spec"].get("containers") or []:
        limits = (c.get("resources") or {}).get("limits") or {}
        wanted = {
            r: int(str(v))
            for r, v in limits.items()
            if (r == GPU or r.startswith(MIG_PREFIX)) and int(str(v)) > 0
        }
        if wanted:
            out[c["name"]] = wanted
    return out


class DevicePlugin:
    """The plugin on every node of a :class:`tests.deploy.kube_api.StandIn` (see the module
    docstring); ``strategy`` is its device-list strategy (``cdi-cri`` or ``envvar``)."""

    def __init__(self, strategy: str = "cdi-cri") -> None:
        assert strategy in DEVICE_LIST_STRATEGIES, strategy
        self.strategy = strategy
        self.given: dict[tuple[str, str], dict[str, list[NodeDevice]]] = {}
        """(namespace, pod) -> container -> the devices it was given."""

    def allocate(
        self, pod: Mapping[str, Any], node: Mapping[str, Any], live: Iterable[Mapping[str, Any]]
    ) -> None:
        """Give ``pod``'s containers devices from ``node``'s free ones (``live``: the pods bound
        and not ended), as the device manager and plugin do when the pod starts."""
        meta = pod["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        wanted = pod_device_requests(pod)
        if not wanted or key in self.given:
            return
        taken = {
            d.id
            for p in live
            if (p["metadata"].get("namespace", ""), p["metadata"]["name"]) != key
            for devices in self.given.get(
                (p["metadata"].get("namespace", ""), p["metadata"]["name"]), {}
            ).values()
            for d in devices
        }
        free = [d for d in node_devices(node) if d.id not in taken]
        given: dict[str, list[NodeDevice]] = {}
        for container, resources in sorted(wanted.items()):
            chosen: list[NodeDevice] = []
            for resource, count in sorted(resources.items()):
                candidates = [d for d in free if d.resource == resource]
                assert len(candidates) >= count, f"kubelet: not enough {resource} on the node"
                picked = candidates[::-1][:count]  # from the end: not the ledger's order
                chosen += picked
                free = [d for d in free if d not in picked]
            given[container] = chosen
        self.given[key] = given

    def devices_of(self, namespace: str, name: str) -> list[NodeDevice]:
        return [d for ds in self.given.get((namespace, name), {}).values() for d in ds]

    def container_env(self, namespace: str, name: str, container: str) -> dict[str, str]:
        """The variables the device plugin's response and the CDI spec put in ``container``."""
        devices = self.given.get((namespace, name), {}).get(container)
        if not devices:
            return {}
        if self.strategy == "envvar":
            return {"NVIDIA_VISIBLE_DEVICES": ",".join(d.id for d in devices)}
        return {"NVIDIA_VISIBLE_DEVICES": "void"}

    def cdi_devices(self, namespace: str, name: str, container: str) -> list[str]:
        """The CDI device names of the plugin's response (``cdi-cri``; none under envvar)."""
        if self.strategy == "envvar":
            return []
        devices = self.given.get((namespace, name), {}).get(container) or []
        return [f"{CDI_KIND}={d.id}" for d in devices]

    def pod_resources(self, node: str, pods: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        """``v1.PodResourcesLister/List`` on ``node`` (its JSON form), for the bound ``pods``."""
        out = []
        for p in pods:
            meta = p["metadata"]
            if p["spec"].get("nodeName") != node:
                continue
            given = self.given.get((meta.get("namespace", ""), meta["name"]), {})
            containers = []
            for c in p["spec"].get("containers") or []:
                by_resource: dict[str, list[str]] = {}
                for d in given.get(c["name"], []):
                    by_resource.setdefault(d.resource, []).append(d.id)
                containers.append(
                    {
                        "name": c["name"],
                        "devices": [
                            {"resource_name": r, "device_ids": ids}
                            for r, ids in sorted(by_resource.items())
                        ],
                    }
                )
            out.append(
                {
                    "name": meta["name"],
                    "namespace": meta.get("namespace", ""),
                    "containers": containers,
                }
            )
        return {"pod_resources": out}

    def dcgm_series(
        self, nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
    ) -> list[tuple[dict[str, str], float]]:
        """One ``DCGM_FI_DEV_FB_USED`` series per device of every node (labels as
        dcgm-exporter's, see :func:`tests.prometheus.dcgm_series`), with the pod mapping of the
        device's holder among ``pods`` (bound, not ended)."""
        from tests.prometheus import dcgm_series

        holder: dict[str, tuple[str, str, str]] = {}
        for p in pods:
            meta = p["metadata"]
            for container, devices in self.given.get(
                (meta.get("namespace", ""), meta["name"]), {}
            ).items():
                for d in devices:
                    holder[d.id] = (meta.get("namespace", ""), meta["name"], container)
        out = []
        for node in nodes:
            host = node["metadata"]["name"]
            for d in node_devices(node):
                ns, pod, container = holder.get(d.id, ("", "", ""))
                labels = dcgm_series(
                    "DCGM_FI_DEV_FB_USED",
                    gpu=d.index,
                    uuid=d.gpu_uuid,
                    host=host,
                    mig=(d.profile, d.gi) if d.profile and d.gi is not None else None,
                    pod=pod,
                    namespace=ns or "jhub",
                    container=container or "notebook",
                )
                out.append((labels, 1024.0 if pod else 0.0))
        return out
