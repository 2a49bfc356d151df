"""A simulated NVML: the ``pynvml`` calls gpupool makes, answered for GPUs that are not there.

Vocabulary
- *machine*: one simulated node with its GPUs and MIG instances (:mod:`.machine`).
- *view*: a :class:`SimulatedNVML` bound to one machine, as ``pynvml`` is bound to one host;
  :meth:`SimulatedNVML.for_node` gives the view of another machine of the same spec.
- *handle*: an opaque object standing in for ``c_nvmlDevice_t`` (a GPU or a MIG device) or
  ``c_nvmlGpuInstance_t``.

Contract: each method has pynvml's name, arguments and result shape (pynvml's own ctypes
structures where it returns one) and raises pynvml's own error classes where real NVML fails:
``NVMLError_Uninitialized`` before ``nvmlInit`` and after the last ``nvmlShutdown`` (``nvmlInit``
is counted per machine, as NVML counts it per process; handles taken before are invalid then),
``NVMLError_InvalidArgument`` for a foreign handle
or an index out of range, ``NVMLError_NotFound`` for a missing MIG device or GPU instance,
``NVMLError_NotSupported`` for utilisation of a MIG device (or of a GPU in MIG mode), and
``NVMLError_NoPermission`` for GPU-instance queries, creation and destruction when built with
``privileged=False`` (NVML reserves them for root: the simulated "not root").

MIG instances are created and destroyed as NVML does it:
``nvmlDeviceCreateGpuInstanceWithPlacement`` with a GPU-instance profile ID
(``nvmlDeviceGetGpuInstanceProfileInfo(...).id``) and a placement at one of the profile's start
slots (another start or size: ``InvalidArgument``; slots already
taken, the profile's instance count or the GPU's compute slices exhausted:
``InsufficientResources``), then ``nvmlGpuInstanceCreateComputeInstance`` with a compute-instance
profile ID (``nvmlGpuInstanceGetComputeInstanceProfileInfo``), which makes the MIG device and its
``MIG-…`` UUID; ``nvmlComputeInstanceDestroy`` refuses with ``InUse`` while processes run on the
MIG device, and ``nvmlGpuInstanceDestroy`` while the GPU instance still has a compute instance.
With a ``state_file`` the instances of MIG GPUs are kept there, so they outlive a hub restart as
they outlive it on a real machine.

Deliberate simplifications: GPU-instance IDs are numbered from 1 in placement order (a created
one takes the lowest free ID); one compute instance per GPU instance, always the full-size one
(smaller compute-instance profiles are ``NotSupported``); NVLink P2P is reported from the spec's
islands whatever the MIG mode; there is no PCIe P2P; MIG mode never changes.
"""

from __future__ import annotations

import copy
import ctypes
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pynvml

from gpupool.core.inventory import Inventory
from gpupool.core.mig import GEOMETRIES, Geometry, Profile
from gpupool.discovery.machine import (
    P2P_INDEXES,
    ComputeInstanceHandle,
    Device,
    Gpu,
    GpuInstanceHandle,
    GpuInstanceInfo,
    Instance,
    Machine,
    build,
    compute_profile_index,
    error,
    profile_index,
)
from gpupool.discovery.spec import NodeSpec, parse_spec


class SimulatedNVML:
    """The ``pynvml`` module for the machines of a spec, bound to one of them (see module doc)."""

    simulated = True

    def __init__(
        self,
        spec: str | Sequence[NodeSpec],
        *,
        node: str | None = None,
        driver_version: str = "550.127.05",
        privileged: bool = True,
        activity_file: str | Path | None = None,
        state_file: str | Path | None = None,
    ) -> None:
        specs = parse_spec(spec) if isinstance(spec, str) else tuple(spec)
        self.activity_file = Path(activity_file) if activity_file else None
        self.state_file = Path(state_file) if state_file else None
        self._machines = {s.name: build(s) for s in specs}
        if self.state_file is not None:
            self._load_state(self.state_file)
        self._names: dict[str, str] = {}  # profile name -> name the "driver" shows
        self.driver_version = driver_version
        self.privileged = privileged
        self.node_name = node or specs[0].name
        if self.node_name not in self._machines:
            raise KeyError(f"no simulated node {self.node_name!r}")

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(self._machines)

    def for_node(self, name: str) -> SimulatedNVML:
        """The view of machine ``name``; it shares state with this one."""
        if name not in self._machines:
            raise KeyError(f"no simulated node {name!r} (nodes: {', '.join(self._machines)})")
        view = copy.copy(self)
        view.node_name = name
        return view

    # -- test hooks (no NVML counterpart) ------------------------------------------------------

    def set_utilisation(self, uuid: str, gpu: int, memory: int = 0) -> None:
        """What ``nvmlDeviceGetUtilizationRates`` reports for a GPU from now on."""
        self._owner(uuid).utilisation[uuid] = (gpu, memory)

    def set_processes(self, uuid: str, pids: Iterable[int], used_mib: int = 1024) -> None:
        """The compute processes running on a GPU or MIG device (by UUID) from now on."""
        self._owner(uuid).processes[uuid] = [(pid, used_mib << 20) for pid in pids]

    def _load_activity(self, path: Path) -> None:
        """Apply an activity file: ``{uuid: {"gpu": 37, "memory": 10, "pids": [4242],
        "used_mib": 2048}}`` (all keys optional), so a test or a demo can drive a hub that runs
        in another process. Read at every call that reports activity (utilisation, memory,
        processes; as a real driver reports the moment's, however long NVML stays initialised);
        a missing file means no activity, a half-written one (not JSON yet) the last activity
        read, and UUIDs not on this spec's machines are ignored."""
        try:
            activity = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        for uuid, state in activity.items():
            try:
                machine = self._owner(uuid)
            except KeyError:
                continue
            machine.utilisation[uuid] = (int(state.get("gpu", 0)), int(state.get("memory", 0)))
            used = int(state.get("used_mib", 1024)) << 20
            machine.processes[uuid] = [(int(pid), used) for pid in state.get("pids", [])]

    @property
    def init_count(self) -> int:
        """How many times ``nvmlInit`` was called on this view's machine (by any view)."""
        return self._machines[self.node_name].inits

    def rename_profile(self, profile: str, shown_as: str) -> None:
        """Make the "driver" name a profile differently (``3g.40gb`` as ``3g.39gb``)."""
        self._names[profile] = shown_as

    def _owner(self, uuid: str) -> Machine:
        for m in self._machines.values():
            if any(uuid in (g.uuid, *(i.uuid for i in g.instances.values())) for g in m.gpus):
                return m
        raise KeyError(f"no simulated GPU or MIG device {uuid!r}")

    # -- the "driver" state across hub restarts (no NVML counterpart) --------------------------

    def _load_state(self, path: Path) -> None:
        """The MIG instances of a state file this simulation wrote before (missing: the spec's)."""
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            return
        for name, saved in state.items():
            m = self._machines.get(name)
            if m is None:
                continue
            m.created = int(saved.get("created", 0))
            for gpu in m.gpus:
                rows = saved.get("gpus", {}).get(gpu.uuid)
                if rows is None or gpu.geometry is None or not gpu.mig:
                    continue
                gpu.instances = {
                    int(gi): Instance(int(gi), gpu.geometry.by_name[prof], int(start), uuid, ci)
                    for gi, prof, start, ci, uuid in rows
                }

    def _save_state(self) -> None:
        if self.state_file is None:
            return
        state = {
            name: {
                "created": m.created,
                "gpus": {
                    g.uuid: [
                        [i.gi, i.profile.name, i.start, i.ci, i.uuid]
                        for i in sorted(g.instances.values(), key=lambda i: i.gi)
                    ]
                    for g in m.gpus
                    if g.mig
                },
            }
            for name, m in self._machines.items()
        }
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    # -- lookups shared by the NVML calls ------------------------------------------------------

    def _machine(self) -> Machine:
        m = self._machines[self.node_name]
        if m.refs == 0:
            raise error(pynvml.NVML_ERROR_UNINITIALIZED)
        return m

    def _activity(self) -> Machine:
        """The machine, with the activity file applied (its utilisation and processes now)."""
        m = self._machine()
        if self.activity_file is not None:
            self._load_activity(self.activity_file)
        return m

    def _resolve(self, handle: object) -> tuple[Gpu, Instance | None]:
        m = self._machine()
        if not isinstance(handle, Device) or handle.node != self.node_name:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not 0 <= handle.index < len(m.gpus):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = m.gpus[handle.index]
        if handle.gi is None:
            return gpu, None
        inst = gpu.instances.get(handle.gi)
        if inst is None or not inst.mig_device:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # a destroyed instance's handle
        return gpu, inst

    def _gpu(self, handle: object) -> Gpu:
        """A whole-GPU handle's GPU; MIG device handles do not support the call."""
        gpu, inst = self._resolve(handle)
        if inst is not None:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu

    def _mig_on(self, handle: object) -> tuple[Gpu, Geometry]:
        """A whole GPU in MIG mode, and its geometry; others do not support the call."""
        gpu = self._gpu(handle)
        if gpu.geometry is None or not gpu.mig:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return gpu, gpu.geometry

    def _shown(self, profile: Profile) -> str:
        return self._names.get(profile.name, profile.name)

    # -- system and devices --------------------------------------------------------------------

    def nvmlInit(self) -> None:
        m = self._machines[self.node_name]
        m.refs += 1
        m.inits += 1

    def nvmlShutdown(self) -> None:
        self._machine().refs -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._machine()
        return self.driver_version

    def nvmlDeviceGetCount(self) -> int:
        return len(self._machine().gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Device:
        if not 0 <= index < len(self._machine().gpus):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return Device(self.node_name, index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Device:
        for gpu in self._machine().gpus:
            if gpu.uuid == uuid:
                return Device(self.node_name, gpu.index)
            for inst in gpu.instances.values():
                if inst.mig_device and inst.uuid == uuid:
                    return Device(self.node_name, gpu.index, inst.gi)
        raise error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle: object) -> int:
        return self._gpu(handle).index

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        gpu, inst = self._resolve(handle)
        return (inst.uuid or "") if inst else gpu.uuid  # a resolved MIG device has its UUID

    def nvmlDeviceGetName(self, handle: object) -> str:
        gpu, inst = self._resolve(handle)
        name = gpu.spec.product_name
        return f"{name} MIG {self._shown(inst.profile)}" if inst else name

    def nvmlDeviceGetMemoryInfo(self, handle: object, version: int | None = None) -> Any:
        gpu, inst = self._resolve(handle)
        total = gpu.spec.memory_mib << 20
        if inst is not None:
            total = total * inst.profile.memory_slots // GEOMETRIES[gpu.spec.model].memory_slots
        used = sum(p.usedGpuMemory for p in self.nvmlDeviceGetComputeRunningProcesses(handle))
        return pynvml.c_nvmlMemory_t(total=total, free=max(total - used, 0), used=used)

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> Any:
        gpu = self._gpu(handle)  # MIG devices: NotSupported
        if gpu.mig:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # nvidia-smi shows N/A in MIG mode
        rates = self._activity().utilisation.get(gpu.uuid, (0, 0))
        return pynvml.c_nvmlUtilization_t(gpu=rates[0], memory=rates[1])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: object) -> list[Any]:
        gpu, inst = self._resolve(handle)
        owners: list[tuple[str, int | None]] = (
            [(inst.uuid or "", inst.gi)] if inst else [(gpu.uuid, None)]
        )
        if inst is None:
            owners += [(i.uuid, i.gi) for i in gpu.instances.values() if i.uuid]
        na = pynvml.NVML_VALUE_NOT_AVAILABLE_uint.value
        procs = self._activity().processes
        return [
            pynvml.nvmlFriendlyObject(
                {
                    "pid": pid,
                    "usedGpuMemory": used,
                    "gpuInstanceId": na if gi is None else gi,
                    "computeInstanceId": na if gi is None else 0,
                }
            )
            for uuid, gi in owners
            for pid, used in procs.get(uuid, [])
        ]

    def nvmlDeviceGetP2PStatus(self, device1: object, device2: object, p2pIndex: int) -> int:
        a, b = self._gpu(device1), self._gpu(device2)
        if p2pIndex not in P2P_INDEXES:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        island = a.spec.island
        if a is not b and island(a.index) is not None and island(a.index) == island(b.index):
            return int(pynvml.NVML_P2P_STATUS_OK)
        return int(pynvml.NVML_P2P_STATUS_NOT_SUPPORTED)

    # -- MIG -----------------------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, handle: object) -> list[int]:
        gpu = self._gpu(handle)
        if gpu.geometry is None:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [gpu.mig, gpu.mig]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: object) -> int:
        gpu = self._gpu(handle)
        return gpu.geometry.compute_slices if gpu.geometry and gpu.mig else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: object, index: int) -> Device:
        gpu, geometry = self._mig_on(device)
        if not 0 <= index < geometry.compute_slices:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gis = sorted(gi for gi, inst in gpu.instances.items() if inst.mig_device)
        if index >= len(gis):
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        return Device(self.node_name, gpu.index, gis[index])

    def nvmlDeviceIsMigDeviceHandle(self, device: object) -> ctypes.c_uint:
        return ctypes.c_uint(self._resolve(device)[1] is not None)  # pynvml returns the c_uint

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, migDevice: object) -> Device:
        gpu, inst = self._resolve(migDevice)
        if inst is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return Device(self.node_name, gpu.index)

    def nvmlDeviceGetGpuInstanceId(self, device: object) -> int:
        inst = self._resolve(device)[1]
        if inst is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return inst.gi

    def nvmlDeviceGetComputeInstanceId(self, device: object) -> int:
        inst = self._resolve(device)[1]
        if inst is None or inst.ci is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return inst.ci

    def nvmlDeviceGetGpuInstanceById(self, device: object, gpuInstanceId: int) -> GpuInstanceHandle:
        gpu, _ = self._mig_on(device)
        if not self.privileged:
            raise error(pynvml.NVML_ERROR_NO_PERMISSION)
        if gpuInstanceId not in gpu.instances:
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        return GpuInstanceHandle(self.node_name, gpu.index, gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: object) -> GpuInstanceInfo:
        m = self._machine()
        gi = gpuInstance
        if not isinstance(gi, GpuInstanceHandle) or gi.node != self.node_name:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        inst = m.gpus[gi.index].instances.get(gi.gi)
        if inst is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        placement = pynvml.c_nvmlGpuInstancePlacement_t(inst.start, inst.profile.memory_slots)
        device = Device(self.node_name, gi.index)
        return GpuInstanceInfo(device, inst.gi, inst.profile.profile_id, placement)

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: object, profile: int, version: int = 2
    ) -> Any:
        gpu, geometry = self._mig_on(device)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        found = [p for p in geometry.profiles if profile_index(p) == profile]
        if not found:
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if version not in (1, 2):
            raise error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # as pynvml itself does
        p = found[0]
        info = (
            pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlGpuInstanceProfileInfo_t()
        )
        info.id, info.sliceCount, info.instanceCount = p.profile_id, p.compute_slices, p.max_count
        info.memorySizeMB = gpu.spec.memory_mib * p.memory_slots // geometry.memory_slots
        if version == 2:
            info.name = f"MIG {self._shown(p)}".encode()
        return info

    # -- MIG management (root only) ------------------------------------------------------------

    def _root(self) -> None:
        if not self.privileged:
            raise error(pynvml.NVML_ERROR_NO_PERMISSION)

    def _gi(self, gpuInstance: object) -> tuple[Gpu, Instance]:
        """A GPU-instance handle's GPU and instance; ``InvalidArgument`` once it is destroyed."""
        m = self._machine()
        h = gpuInstance
        if not isinstance(h, GpuInstanceHandle) or h.node != self.node_name:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = m.gpus[h.index]
        inst = gpu.instances.get(h.gi)
        if inst is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, inst

    @staticmethod
    def _by_id(geometry: Geometry, profileId: int) -> Profile:
        found = geometry.by_id.get(profileId)
        if found is None:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return found

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, device: object, profileId: int) -> int:
        gpu, geometry = self._mig_on(device)
        self._root()
        p = self._by_id(geometry, profileId)
        mask = 0
        for inst in gpu.instances.values():
            mask |= inst.profile.mask_at(inst.start)
        return self._fits(gpu, geometry, p, mask)

    @staticmethod
    def _fits(gpu: Gpu, geometry: Geometry, p: Profile, mask: int) -> int:
        same = sum(i.profile == p for i in gpu.instances.values())
        compute = sum(i.profile.compute_slices for i in gpu.instances.values())
        by_slots = geometry.max_fit[p][mask]
        by_compute = (geometry.compute_slices - compute) // p.compute_slices
        return max(0, min(by_slots, p.max_count - same, by_compute))

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: object, profileId: int, placement: Any
    ) -> GpuInstanceHandle:
        gpu, geometry = self._mig_on(device)
        self._root()
        p = self._by_id(geometry, profileId)
        start, size = int(placement.start), int(placement.size)
        if start not in p.starts or size != p.memory_slots:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        mask = 0
        for inst in gpu.instances.values():
            mask |= inst.profile.mask_at(inst.start)
        if mask & p.mask_at(start) or not self._fits(gpu, geometry, p, mask):
            raise error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi = next(i for i in range(1, len(gpu.instances) + 2) if i not in gpu.instances)
        gpu.instances[gi] = Instance(gi, p, start, None, None)
        self._save_state()
        return GpuInstanceHandle(self.node_name, gpu.index, gi)

    def nvmlGpuInstanceDestroy(self, gpuInstance: object) -> int:
        gpu, inst = self._gi(gpuInstance)
        self._root()
        if inst.ci is not None:
            raise error(pynvml.NVML_ERROR_IN_USE)  # its compute instances must go first
        del gpu.instances[inst.gi]
        self._save_state()
        return int(pynvml.NVML_SUCCESS)

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: object, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        _gpu, inst = self._gi(device)
        if not 0 <= profile < pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if profile != compute_profile_index(inst.profile):
            raise error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # only the full-size one is simulated
        if version not in (1, 2):
            raise error(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)  # as pynvml itself does
        info = (
            pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
            if version == 2
            else pynvml.c_nvmlComputeInstanceProfileInfo_t()
        )
        info.id, info.sliceCount, info.instanceCount = profile, inst.profile.compute_slices, 1
        info.multiprocessorCount = 16 * inst.profile.compute_slices
        if version == 2:
            info.name = f"MIG {self._shown(inst.profile)}".encode()
        return info

    def nvmlGpuInstanceCreateComputeInstance(
        self, gpuInstance: object, profileId: int
    ) -> ComputeInstanceHandle:
        gpu, inst = self._gi(gpuInstance)
        self._root()
        if profileId != compute_profile_index(inst.profile):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if inst.ci is not None:
            raise error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)  # its slices are all in use
        inst.ci = 0
        inst.uuid = self._machine().new_mig_uuid(gpu.index, inst.gi)
        self._save_state()
        return ComputeInstanceHandle(self.node_name, gpu.index, inst.gi, 0)

    def nvmlGpuInstanceGetComputeInstanceById(
        self, gpuInstance: object, computeInstanceId: int
    ) -> ComputeInstanceHandle:
        gpu, inst = self._gi(gpuInstance)
        self._root()
        if inst.ci is None or inst.ci != computeInstanceId:
            raise error(pynvml.NVML_ERROR_NOT_FOUND)
        return ComputeInstanceHandle(self.node_name, gpu.index, inst.gi, inst.ci)

    def nvmlComputeInstanceDestroy(self, computeInstance: object) -> int:
        h = computeInstance
        if not isinstance(h, ComputeInstanceHandle):
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        _gpu, inst = self._gi(GpuInstanceHandle(h.node, h.index, h.gi))
        if inst.ci != h.ci:
            raise error(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # a destroyed one's handle
        self._root()
        machine = self._activity()
        if inst.uuid and machine.processes.get(inst.uuid):
            raise error(pynvml.NVML_ERROR_IN_USE)
        machine.processes.pop(inst.uuid or "", None)
        machine.utilisation.pop(inst.uuid or "", None)
        inst.ci, inst.uuid = None, None
        self._save_state()
        return int(pynvml.NVML_SUCCESS)


def simulated_inventory(spec: str | SimulatedNVML, log: Any = None) -> Inventory:
    """The inventory of a simulated spec (or of a :class:`SimulatedNVML` already built), found
    by :func:`discover` one node at a time."""
    from gpupool.discovery.nvml import discover

    sim = (
        spec if isinstance(spec, SimulatedNVML) else SimulatedNVML(spec.removeprefix("simulated:"))
    )
    found = [discover(sim.for_node(n), node_name=n, log=log) for n in sim.node_names]
    return Inventory(
        nodes=tuple(node for inv in found for node in inv.nodes),
        source="simulated",
        simulated=True,
        notes=tuple(note for inv in found for note in inv.notes),
    )
