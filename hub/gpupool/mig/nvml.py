"""NVML's calls for the MIG instances gpupool makes: probe, create, look up, destroy.

Vocabulary
- *managed GPU* (:class:`ManagedGpu`): a GPU whose instances the pool creates: its node, UUID,
  index, model and MIG geometry.
- *session*: the node's NVML session (:class:`gpupool.discovery.nvml_session.NVMLSession`),
  held for each call here (:meth:`MigDriver.session`); NVML is initialised only where no other
  reader (the device monitor) holds it already.
- *own GPU instance*: the GPU instance of a record (:class:`gpupool.store.MigRecord`) when NVML
  still has it as recorded: same GPU-instance ID, profile and start slot. Anything else on the
  GPU is not the pool's and is never touched.

Contract: :class:`MigDriver` is the one seam over NVML for MIG instances (``pynvml``, or the
simulated NVML, per node). It keeps no state but the NVML objects; records, the ledger and the
policy live in :class:`gpupool.mig.manager.MigManager`, which calls it. A creation that
fails leaves no instance behind; NVML's errors are raised as NVML raises them unless a method
says what it returns instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import pynvml

from gpupool.core.inventory import GPU
from gpupool.core.mig import Geometry, Profile
from gpupool.discovery.machine import compute_profile_index, profile_index
from gpupool.discovery.nvml_session import NVMLSession, nvml_error, text

__all__ = ["ManagedGpu", "MigDriver", "nvml_error", "text"]


@dataclass
class ManagedGpu:
    node: str
    uuid: str
    index: int
    model: str
    geometry: Geometry


class MigDriver:
    """MIG instance calls on each node's NVML (see the module docstring)."""

    def __init__(self, nvml_by_node: Mapping[str, Any]) -> None:
        self.nvml_by_node = dict(nvml_by_node)

    def session(self, node: str) -> contextlib.AbstractContextManager[NVMLSession]:
        """``node``'s NVML session, held for a block."""
        return NVMLSession.of(self.nvml_by_node[node]).use()

    def probe(self, candidates: Iterable[tuple[str, GPU]]) -> str:
        """ "" when NVML lets this process manage MIG instances, else why not. Asks for the
        remaining capacity of one profile: NVML reserves that, like creation, for root."""
        for node, gpu in candidates:
            geometry = gpu.geometry
            assert geometry is not None
            try:
                with self.session(node) as session:
                    nvml, handle = session.nvml, session.device(gpu.uuid)
                    p = geometry.profiles[0]
                    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_index(p))
                    nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, info.id)
            except pynvml.NVMLError as e:
                if nvml_error(e) == pynvml.NVML_ERROR_NO_PERMISSION:
                    return (
                        "NVML refuses to manage MIG instances (no permission: the hub runs "
                        "neither as root nor with the MIG config capability)"
                    )
                return f"NVML cannot manage MIG instances on GPU {gpu.index} ({e})"
        return ""

    def create(self, gpu: ManagedGpu, profile: str, start: int) -> tuple[int, int, str]:
        """Create a GPU instance of ``profile`` at ``start`` and its full compute instance;
        returns the GPU- and compute-instance IDs and the MIG device's UUID."""
        p = gpu.geometry.resolve(profile)
        assert p is not None
        with self.session(gpu.node) as session:
            nvml, handle = session.nvml, session.device(gpu.uuid)
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_index(p))
            placement = pynvml.c_nvmlGpuInstancePlacement_t()
            placement.start, placement.size = start, p.memory_slots
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, placement)
            try:
                gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
                ci_info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi,
                    compute_profile_index(p),
                    pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                )
                nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
                ci_id, uuid = _mig_device(nvml, handle, gi_id)
            except BaseException:
                with contextlib.suppress(pynvml.NVMLError):
                    _destroy_gpu_instance(nvml, gi)
                raise
        return gi_id, ci_id, uuid

    def gone(self, gpu: ManagedGpu, uuid: str) -> bool:
        """Whether NVML no longer shows MIG device ``uuid`` on ``gpu`` (another NVML error: it
        is taken as there)."""
        try:
            with self.session(gpu.node) as session:
                nvml = session.nvml
                parent = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(session.device(uuid))
                return text(nvml.nvmlDeviceGetUUID(parent)) != gpu.uuid
        except pynvml.NVMLError as e:
            return bool(nvml_error(e) == pynvml.NVML_ERROR_NOT_FOUND)

    def destroy_bare(self, gpu: ManagedGpu, record: Any) -> None:
        """Destroy the own GPU instance of a record whose MIG device NVML does not show (a crash
        between creating the GPU instance and its compute instance); NVML errors are ignored."""
        if record.gpu_instance_id is None:
            return
        with contextlib.suppress(pynvml.NVMLError), self.session(gpu.node) as session:
            gi = _own_gpu_instance(session, gpu, record)
            if gi is not None:
                session.nvml.nvmlGpuInstanceDestroy(gi)

    def destroy(self, gpu: ManagedGpu, record: Any) -> str:
        """Destroy a recorded instance: ``destroyed``, ``gone`` (not there, or no longer the
        pool's), or why it could not be (processes still run on it, another NVML error)."""
        if record.gpu_instance_id is None and record.uuid is None:
            return "gone"
        try:
            with self.session(gpu.node) as session:
                nvml = session.nvml
                if record.gpu_instance_id is None:  # a crash before the IDs were recorded
                    try:
                        mig = session.device(record.uuid)
                    except pynvml.NVMLError_NotFound:
                        return "gone"
                    record = replace(record, gpu_instance_id=nvml.nvmlDeviceGetGpuInstanceId(mig))
                gi = _own_gpu_instance(session, gpu, record)
                if gi is None:
                    return "gone"
                if record.uuid is not None:
                    handle = session.device(gpu.uuid)
                    try:
                        ci_id, uuid = _mig_device(nvml, handle, record.gpu_instance_id)
                    except pynvml.NVMLError_NotFound:
                        ci_id, uuid = None, None
                    if uuid is not None and uuid != record.uuid:
                        return "gone"  # the ID was reused by an instance that is not ours
                    if ci_id is not None:
                        ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
                        nvml.nvmlComputeInstanceDestroy(ci)
                nvml.nvmlGpuInstanceDestroy(gi)
        except pynvml.NVMLError as e:
            if nvml_error(e) == pynvml.NVML_ERROR_IN_USE:
                return "processes still run on it (NVML: in use)"
            return f"NVML says: {e}"
        return "destroyed"


def _mig_device(nvml: Any, handle: Any, gi_id: int) -> tuple[int, str]:
    """The compute-instance ID and UUID of the MIG device of GPU instance ``gi_id``."""
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except pynvml.NVMLError_NotFound:
            continue
        if nvml.nvmlDeviceGetGpuInstanceId(mig) == gi_id:
            return int(nvml.nvmlDeviceGetComputeInstanceId(mig)), text(nvml.nvmlDeviceGetUUID(mig))
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)


def _destroy_gpu_instance(nvml: Any, gi: Any) -> None:
    """Destroy a GPU instance just made here (with its compute instance, if any)."""
    with contextlib.suppress(pynvml.NVMLError):
        ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, 0)
        nvml.nvmlComputeInstanceDestroy(ci)
    nvml.nvmlGpuInstanceDestroy(gi)


def _own_gpu_instance(session: NVMLSession, gpu: ManagedGpu, record: Any) -> Any:
    """The GPU instance of ``record`` if NVML still has it as recorded (same ID, profile and
    start), else ``None``: an instance that is not the pool's is never touched."""
    nvml, handle = session.nvml, session.device(gpu.uuid)
    try:
        gi = nvml.nvmlDeviceGetGpuInstanceById(handle, record.gpu_instance_id)
    except pynvml.NVMLError as e:
        if nvml_error(e) in (pynvml.NVML_ERROR_NOT_FOUND, pynvml.NVML_ERROR_INVALID_ARGUMENT):
            return None
        raise
    info = nvml.nvmlGpuInstanceGetInfo(gi)
    p: Profile | None = gpu.geometry.resolve(
        profile_id=int(info.profileId), memory_slots=int(info.placement.size)
    )
    if p is None or p.name != record.profile or int(info.placement.start) != record.start:
        return None
    return gi
