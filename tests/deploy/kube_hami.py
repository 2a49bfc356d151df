"""Pods' schedulers, and HAMi, in the API stand-in (:mod:`tests.deploy.kube_api`).

Vocabulary
- *scheduler name*: a pod's ``spec.schedulerName``; the API server defaults it to
  ``default-scheduler`` (``SetDefaults_PodSpec`` in kubernetes ``pkg/apis/core/v1/defaults.go``).
  A pod is placed only by a scheduler running under that name: kube-scheduler queues only the
  unassigned pods one of its profiles names (``responsibleForPod`` in
  ``pkg/scheduler/eventhandlers.go``; ``frameworkForPod`` in ``pkg/scheduler/schedule_one.go``),
  so a pod naming a scheduler that does not run stays Pending, with no condition and no event,
  since no scheduler ever looks at it.
- *kube-scheduler profiles*: ``default-scheduler`` and, when a test says so, z2jh's
  user-scheduler (``scheduling.userScheduler.enabled``, on by default in z2jh 4.4.0, which then
  sets ``c.KubeSpawner.scheduler_name`` to it: ``files/hub/jupyterhub_config.py``). It is
  kube-scheduler itself (``templates/scheduling/user-scheduler/configmap.yaml`` only changes
  scoring), so its NodeResourcesFit counts every extended resource a pod requests against the
  node's allocatable (``fitsRequest`` in ``pkg/scheduler/framework/plugins/noderesources/fit.go``):
  a HAMi node does not advertise ``nvidia.com/gpumem`` (HAMi's device plugin registers
  ``nvidia.com/gpu`` only), so a HAMi share pod fails there with ``Insufficient
  nvidia.com/gpumem``. :meth:`StandIn._filter` already does that; nothing here changes it.
- *HAMi* (:class:`HAMi`, installed with :meth:`Schedulers.install_hami`), as in HAMi's ``master``
  (Project-HAMi/HAMi):

  - its mutating webhook (``Handle`` in ``pkg/scheduler/webhook.go``): a pod whose scheduler is
    set and is neither ``default-scheduler`` (with ``forceOverwriteDefaultScheduler: true``, the
    chart's default) nor HAMi's own is let through untouched, logged as "Pod already has
    different scheduler assigned"; otherwise, if a container asks for ``nvidia.com/gpu`` (its
    ``resourceCountName``; ``mutateContainerResource`` in ``pkg/device/nvidia/device.go``), the
    pod's scheduler becomes HAMi's (``--scheduler-name``, the chart's ``schedulerName:
    hami-scheduler``);
  - its scheduler: kube-scheduler with HAMi's extender, whose managed resources
    (``nvidia.com/gpu``, ``gpumem``, ``gpucores``, ...) are ``ignoredByScheduler``
    (``hami-vgpu.scheduler.managedResources`` in ``charts/hami/templates/_helpers.tpl``), so
    kube-scheduler's own filters skip them and the extender's ``Filter``
    (``pkg/scheduler/scheduler.go``) judges them per GPU, from the node's
    ``hami.io/node-nvidia-register`` annotation (JSON; ``UnMarshalNodeDevices`` in
    ``pkg/device/devices.go``) and the allocations of the node's pods. Per GPU, in the order
    ``Fit`` (``pkg/device/nvidia/device.go``) checks them: ``CardUuidMismatch`` (the pod's
    ``nvidia.com/use-gpuuuid``/``nouse-gpuuuid``, comma-separated UUIDs, ``CheckUUID`` in
    ``pkg/device/devices.go``), ``CardTimeSlicingExhausted`` (``count`` pods already),
    ``CardInsufficientMemory``, ``CardInsufficientCore``; the node's reason is
    ``GenReason``'s ``"<n>/<gpus> <reason>"`` list (``pkg/device/common/common.go``), a node
    without the annotation is ``node unregistered``. Of the GPUs that fit, the *GPU policy*
    chooses: HAMi's default ``spread`` (``--gpu-scheduler-policy``, the chart's
    ``gpuSchedulerPolicy: spread``) sorts them by score descending and ``Fit`` walks the list
    from its end, so the least used GPU is taken (score: used slots over ``count``, plus cores
    over ``devcore``, plus memory over ``devmem``, default weights; ``ComputeScore`` and
    ``Less`` in ``pkg/scheduler/policy/gpu_policy.go``); ``binpack`` takes the most used.
    Equal scores keep the annotation's order (a short list is insertion-sorted), so the last
    GPU of a tie is taken. The choice is written on the pod as ``hami.io/vgpu-devices-allocated``
    (and ``-to-allocate``): ``<uuid>,NVIDIA,<MiB>,<cores>:`` per device, ``;`` per container
    (``EncodePodSingleDevice`` in ``pkg/device/devices.go``, ``PatchAnnotations`` in
    ``pkg/device/nvidia/device.go``), with ``hami.io/vgpu-node``.

  Simplified: one container's request per pod is judged (gpupool's pods have one GPU
  container); a memory request missing means the whole GPU (``MemPercentagereq`` 100); among
  several nodes that pass, the stand-in keeps kube-scheduler's pick (HAMi's node policy,
  ``binpack`` by default, is not modelled: gpupool binds a pod to one node).

Contract: :class:`Schedulers` is the stand-in's; :meth:`StandIn._defaults_pods` and the Job
controller's pods call :meth:`Schedulers.admit`, :meth:`StandIn.schedule` asks
:meth:`Schedulers.runs` and :meth:`Schedulers.bind`, :meth:`StandIn._pick_node` asks
:meth:`Schedulers.kube_requests`, and :meth:`StandIn._filter` asks
:meth:`Schedulers.extender_filter`. Without HAMi installed and with ``default-scheduler`` pods
nothing changes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_SCHEDULER = "default-scheduler"
HAMI_SCHEDULER = "hami-scheduler"
REGISTER_ANNOTATION = "hami.io/node-nvidia-register"
ALLOCATED_ANNOTATION = "hami.io/vgpu-devices-allocated"
TO_ALLOCATE_ANNOTATION = "hami.io/vgpu-devices-to-allocate"
NODE_ANNOTATION = "hami.io/vgpu-node"
USE_UUID = "nvidia.com/use-gpuuuid"
NO_USE_UUID = "nvidia.com/nouse-gpuuuid"
SKIPPED = "pod already has different scheduler assigned"
"""HAMi's webhook's answer for a pod another scheduler is named for (``webhook.go``)."""
MANAGED = (
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpucores",
    "nvidia.com/gpumem-percentage",
)
"""HAMi's NVIDIA resources (the chart's ``resourceName``, ``resourceMem``, ``resourceCores``,
``resourceMemPercentage``), ``ignoredByScheduler`` in its kube-scheduler's extender config."""


@dataclass
class Device:
    """One GPU of a HAMi node's register annotation."""

    uuid: str
    count: int
    memory: int
    cores: int


@dataclass
class HAMi:
    """HAMi installed in the cluster (see the module docstring)."""

    scheduler_name: str = HAMI_SCHEDULER
    gpu_policy: str = "spread"
    force_overwrite_default_scheduler: bool = True
    log: list[str] = field(default_factory=list)
    """The webhook's log lines (``klog``), one per pod it was asked about."""

    def admit(self, pod: dict[str, Any]) -> None:
        """HAMi's mutating webhook on a pod being created."""
        meta, spec = pod["metadata"], pod["spec"]
        name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        scheduler = spec.get("schedulerName") or ""
        if (
            scheduler
            and (scheduler != DEFAULT_SCHEDULER or not self.force_overwrite_default_scheduler)
            and scheduler != self.scheduler_name
        ):
            self.log.append(f"{name} - Pod already has different scheduler assigned")
            return
        if any(MANAGED[0] in limits(c) for c in spec.get("containers") or []):
            spec["schedulerName"] = self.scheduler_name
            self.log.append(f"{name} - scheduler set to {self.scheduler_name}")
        else:
            self.log.append(f"{name} - Allowing admission: no GPU resource found")

    def filter(
        self, pod: Mapping[str, Any], node: Mapping[str, Any], others: Iterable[Mapping[str, Any]]
    ) -> tuple[list[Device], str]:
        """The GPUs the extender gives ``pod`` on ``node`` (``others``: the pods bound there and
        not ended), or ``[]`` and the node's reason."""
        devices = register(node)
        if not devices:
            return [], "node unregistered"
        want = request(pod)
        if want is None:
            return [], ""
        count, memory, cores = want
        used = usage(others)
        annotations = pod["metadata"].get("annotations") or {}
        reasons: Counter[str] = Counter()
        fitting: list[tuple[float, int, Device]] = []
        for index, d in enumerate(devices):
            slots, mem, core = used.get(d.uuid, (0, 0, 0))
            need = memory if memory is not None else d.memory
            if not check_uuid(annotations, d.uuid):
                reasons["CardUuidMismatch"] += 1
            elif d.count <= slots:
                reasons["CardTimeSlicingExhausted"] += 1
            elif d.memory - mem < need:
                reasons["CardInsufficientMemory"] += 1
            elif 100 - core < cores:
                reasons["CardInsufficientCore"] += 1
            else:
                score = (slots + 1) / d.count + (core + cores) / 100 + (mem + need) / d.memory
                fitting.append((score, index, d))
        if len(fitting) < count:
            reasons = reasons or Counter({"AllocatedCardsInsufficientRequest": len(fitting)})
            return [], ", ".join(sorted(f"{n}/{len(devices)} {r}" for r, n in reasons.items()))
        # spread: sorted by score descending, Fit takes from the end (the least used; a tie keeps
        # the annotation's order, so its last GPU); binpack: ascending, the most used
        spread = self.gpu_policy != "binpack"
        ordered = sorted(fitting, key=lambda f: -f[0] if spread else f[0])
        return [d for _score, _i, d in reversed(ordered)][:count], ""

    def bind(self, pod: dict[str, Any], node_name: str, chosen: list[Device]) -> None:
        """The extender's annotations on the pod it placed (``Filter``, ``PatchAnnotations``)."""
        want = request(pod)
        if want is None or not chosen:
            return
        _count, memory, cores = want
        encoded = (
            "".join(
                f"{d.uuid},NVIDIA,{memory if memory is not None else d.memory},{cores}:"
                for d in chosen
            )
            + ";"
        )
        pod["metadata"].setdefault("annotations", {}).update(
            {
                NODE_ANNOTATION: node_name,
                TO_ALLOCATE_ANNOTATION: encoded,
                ALLOCATED_ANNOTATION: encoded,
            }
        )


class Schedulers:
    """The schedulers running in the stand-in's cluster, and HAMi when installed."""

    def __init__(self) -> None:
        self.running: set[str] = {DEFAULT_SCHEDULER}
        self.hami: HAMi | None = None

    def install_hami(self, **settings: Any) -> HAMi:
        """HAMi's webhook and scheduler (its chart's defaults unless ``settings`` say)."""
        self.hami = HAMi(**settings)
        self.running.add(self.hami.scheduler_name)
        return self.hami

    def admit(self, pod: dict[str, Any]) -> None:
        """What pod admission does here: the API server's default scheduler name, then HAMi's
        webhook when installed."""
        spec = pod["spec"]
        if not spec.get("schedulerName"):
            spec["schedulerName"] = DEFAULT_SCHEDULER
        if self.hami is not None:
            self.hami.admit(pod)

    def runs(self, pod: Mapping[str, Any]) -> bool:
        """Whether a scheduler runs for ``pod``'s scheduler name."""
        return (pod["spec"].get("schedulerName") or DEFAULT_SCHEDULER) in self.running

    def _hami_for(self, pod: Mapping[str, Any]) -> HAMi | None:
        hami = self.hami
        if hami is not None and pod["spec"].get("schedulerName") == hami.scheduler_name:
            return hami
        return None

    def kube_requests(self, pod: Mapping[str, Any], requests: dict[str, float]) -> dict[str, float]:
        """What kube-scheduler's own filters count for ``pod`` (HAMi's scheduler ignores the
        resources its extender manages)."""
        if self._hami_for(pod) is None:
            return requests
        return {r: n for r, n in requests.items() if r not in MANAGED}

    def extender_filter(
        self, pod: Mapping[str, Any], node: Mapping[str, Any], bound: Iterable[Mapping[str, Any]]
    ) -> list[str]:
        """The extender's reason for refusing ``node`` (``[]``: it fits, or no extender);
        ``bound``: the pods bound to a node and not ended, other than ``pod``."""
        hami = self._hami_for(pod)
        if hami is None:
            return []
        _chosen, reason = hami.filter(pod, node, on_node(bound, node))
        return [reason] if reason else []

    def bind(
        self, pod: dict[str, Any], node: Mapping[str, Any], bound: Iterable[Mapping[str, Any]]
    ) -> None:
        """The extender's annotations on a pod its scheduler placed on ``node``."""
        hami = self._hami_for(pod)
        if hami is not None:
            chosen, _reason = hami.filter(pod, node, on_node(bound, node))
            hami.bind(pod, node["metadata"]["name"], chosen)


def on_node(pods: Iterable[Mapping[str, Any]], node: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [p for p in pods if p["spec"].get("nodeName") == node["metadata"]["name"]]


# -- reading HAMi's annotations ----------------------------------------------------------------
def limits(container: Mapping[str, Any]) -> dict[str, Any]:
    return dict((container.get("resources") or {}).get("limits") or {})


def register(node: Mapping[str, Any]) -> list[Device]:
    """The GPUs of a node's ``hami.io/node-nvidia-register`` annotation (JSON), in its order."""
    text = (node["metadata"].get("annotations") or {}).get(REGISTER_ANNOTATION)
    if not text:
        return []
    return [
        Device(
            str(d["id"]),
            int(d.get("count", 10)),
            int(d.get("devmem", 0)),
            int(d.get("devcore", 100)),
        )
        for d in json.loads(text)
        if d.get("health", True)
    ]


def request(pod: Mapping[str, Any]) -> tuple[int, int | None, int] | None:
    """The pod's GPU request as HAMi reads it (``GenerateResourceRequests``): GPUs, MiB each
    (None: the whole GPU), cores in percent; None without ``nvidia.com/gpu``."""
    for container in pod["spec"].get("containers") or []:
        found = limits(container)
        if MANAGED[0] in found:
            memory = found.get(MANAGED[1])
            return (
                int(found[MANAGED[0]]),
                int(memory) if memory is not None else None,
                int(found.get(MANAGED[2], 0)),
            )
    return None


def allocated(pod: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """``(uuid, MiB, cores)`` of each device in a pod's ``hami.io/vgpu-devices-allocated``."""
    text = (pod["metadata"].get("annotations") or {}).get(ALLOCATED_ANNOTATION) or ""
    out = []
    for container in text.split(";"):
        for device in container.split(":"):
            fields = device.split(",")
            if len(fields) == 4:
                out.append((fields[0], int(fields[2]), int(fields[3])))
    return out


def usage(pods: Iterable[Mapping[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """Pods, MiB and cores in use on each GPU (by UUID), from the pods' allocations (HAMi's
    scheduler rebuilds its usage from them: ``getNodesUsage`` in ``pkg/scheduler/scheduler.go``)."""
    out: dict[str, tuple[int, int, int]] = {}
    for pod in pods:
        for uuid, memory, cores in allocated(pod):
            slots, mem, core = out.get(uuid, (0, 0, 0))
            out[uuid] = (slots + 1, mem + memory, core + cores)
    return out


def check_uuid(annotations: Mapping[str, str], uuid: str) -> bool:
    """HAMi's ``CheckUUID``: a device passes the pod's use/no-use lists (empty: no constraint)."""

    def listed(key: str) -> bool:
        return uuid in {u.strip() for u in annotations.get(key, "").split(",")}

    if annotations.get(USE_UUID, "").strip() and not listed(USE_UUID):
        return False
    return not (annotations.get(NO_USE_UUID, "").strip() and listed(NO_USE_UUID))
