"""MIG instances made and read through NVML, as ``nvidia-smi mig`` would (a helper module: test
modules never import each other)."""

from __future__ import annotations

from typing import Any

import pynvml

from gpupool.core.mig import GEOMETRIES
from gpupool.discovery import SimulatedNVML, discover
from gpupool.discovery.machine import compute_profile_index, profile_index

H100 = GEOMETRIES["H100-80GB"]


def placement(start: int, size: int) -> Any:
    p = pynvml.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return p


def make_gi(nvml: Any, handle: Any, name: str, start: int) -> Any:
    p = H100.by_name[name]
    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_index(p))
    return nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
        handle, info.id, placement(start, p.memory_slots)
    )


def make_instance(nvml: Any, handle: Any, name: str, start: int) -> str:
    """What ``nvidia-smi mig -cgi <profile>:<start> -C`` does: GPU instance, compute instance."""
    gi = make_gi(nvml, handle, name, start)
    p = H100.by_name[name]
    ci = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, compute_profile_index(p), pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    )
    nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci.id)
    gi_id = nvml.nvmlGpuInstanceGetInfo(gi).id
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except pynvml.NVMLError_NotFound:
            continue
        if nvml.nvmlDeviceGetGpuInstanceId(mig) == gi_id:
            return str(nvml.nvmlDeviceGetUUID(mig))
    raise AssertionError("no MIG device for the new instance")


def nvml_instances(sim: SimulatedNVML, node: str = "a") -> dict[str, tuple[str, int]]:
    """The MIG devices NVML shows on ``node`` ("a" holds the managed GPU 1)."""
    found = discover(sim.for_node(node))
    return {i.uuid or "": (i.profile, i.start) for g in found.gpus for i in g.instances}
