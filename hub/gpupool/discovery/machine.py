"""The state behind the simulated NVML: machines, GPUs, MIG instances and opaque handles.

Vocabulary
- *machine*: one simulated node built from a :class:`~gpupool.discovery.spec.NodeSpec`: its GPUs,
  their MIG instances, and the utilisation and processes tests have set, by UUID.
- *handle*: :class:`Device` stands in for ``c_nvmlDevice_t`` (a whole GPU, or a MIG device when
  ``gi`` is set), :class:`GpuInstanceHandle` for ``c_nvmlGpuInstance_t``,
  :class:`ComputeInstanceHandle` for ``c_nvmlComputeInstance_t``.
- *instance*: one GPU instance; it is a MIG device (has a ``MIG-…`` UUID) once it has its one
  compute instance (``ci``), as after ``nvidia-smi mig -cgi … -C``.
- *profile index*: NVML's ``NVML_GPU_INSTANCE_PROFILE_*`` enum (``3_SLICE``), not the profile ID.

Contract: plain mutable data, no NVML semantics (those live in :mod:`.simulated`). UUIDs are
deterministic (uuid5 of node, index and GPU-instance ID, plus a creation counter for instances
created later), so a spec always yields the same ones; GPU-instance IDs are numbered from 1 in
placement order, and a created one takes the lowest free ID.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import pynvml

from gpupool.core.mig import GEOMETRIES, Geometry, Profile
from gpupool.discovery.spec import NodeSpec

_NS = uuid.UUID("6c9d1f47-3a0e-5b8e-9a55-5f1d2e7c0b11")
_SLICE_INDEX: dict[int, int] = {
    1: pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE,
    7: pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE,
}
_ME_INDEX: dict[int, int] = {
    1: pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1,
    2: pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1,
}
P2P_INDEXES = range(5)  # READ, WRITE, NVLINK, ATOMICS, PCI


def profile_index(profile: Profile) -> int:
    """The ``NVML_GPU_INSTANCE_PROFILE_*`` index of a profile (``3g.40gb`` is ``3_SLICE``)."""
    if profile.name.endswith("+me"):
        return _ME_INDEX[profile.compute_slices]
    if profile.compute_slices == 1 and profile.memory_slots == 2:
        return int(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2)
    return _SLICE_INDEX[profile.compute_slices]


_CI_INDEX: dict[int, int] = {
    1: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
    2: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
    3: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
    4: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
    7: pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
}


def compute_profile_index(profile: Profile) -> int:
    """The ``NVML_COMPUTE_INSTANCE_PROFILE_*`` index of the compute instance that takes all of a
    GPU instance's slices (``3g.40gb``: ``3_SLICE``)."""
    return _CI_INDEX[profile.compute_slices]


def error(code: int) -> pynvml.NVMLError:
    """The pynvml exception real NVML raises for ``code`` (``NVMLError_NotFound`` for 6)."""
    return pynvml.NVMLError(code)  # pynvml maps the code to its subclass


@dataclass(frozen=True)
class Device:
    """Stands in for ``c_nvmlDevice_t``: a whole GPU, or a MIG device when ``gi`` is set."""

    node: str
    index: int
    gi: int | None = None  # a MIG device handle when set

    def __repr__(self) -> str:
        mig = f"/gi{self.gi}" if self.gi is not None else ""
        return f"<simulated nvmlDevice {self.node}/{self.index}{mig}>"


@dataclass(frozen=True)
class GpuInstanceHandle:
    """Stands in for ``c_nvmlGpuInstance_t``."""

    node: str
    index: int
    gi: int


@dataclass(frozen=True)
class ComputeInstanceHandle:
    """Stands in for ``c_nvmlComputeInstance_t``."""

    node: str
    index: int
    gi: int
    ci: int


@dataclass(frozen=True)
class GpuInstanceInfo:
    """The fields of ``c_nvmlGpuInstanceInfo_t``."""

    device: Device
    id: int
    profileId: int
    placement: pynvml.c_nvmlGpuInstancePlacement_t


@dataclass
class Instance:
    """A GPU instance; with its compute instance ``ci`` (``None``: none yet) a MIG device."""

    gi: int
    profile: Profile
    start: int
    uuid: str | None
    ci: int | None = 0

    @property
    def mig_device(self) -> bool:
        return self.ci is not None and self.uuid is not None


@dataclass
class Gpu:
    """One simulated GPU; ``mig`` is its NVML MIG mode, ``instances`` its GPU instances by ID."""

    spec: NodeSpec
    index: int
    uuid: str
    mig: int
    instances: dict[int, Instance] = field(default_factory=dict)

    @property
    def geometry(self) -> Geometry | None:
        return GEOMETRIES.get(self.spec.model)


@dataclass
class Machine:
    """One simulated node; ``refs`` counts ``nvmlInit`` calls not yet shut down, ``inits`` all
    ``nvmlInit`` calls ever made (how often readers initialised NVML)."""

    spec: NodeSpec
    gpus: list[Gpu]
    refs: int = 0
    inits: int = 0
    utilisation: dict[str, tuple[int, int]] = field(default_factory=dict)
    processes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    created: int = 0
    """Instances created since the spec was built (names the next created MIG UUID)."""

    def new_mig_uuid(self, index: int, gi: int) -> str:
        self.created += 1
        return f"MIG-{uuid.uuid5(_NS, f'{self.spec.name}/{index}/{gi}/created/{self.created}')}"


def build(spec: NodeSpec) -> Machine:
    """A machine as the spec describes it, with fixed-mode instances already created."""
    gpus = []
    for i in range(spec.count):
        on = spec.mig_enabled(i)
        mig = pynvml.NVML_DEVICE_MIG_ENABLE if on else pynvml.NVML_DEVICE_MIG_DISABLE
        gpu = Gpu(spec, i, f"GPU-{uuid.uuid5(_NS, f'{spec.name}/{i}')}", mig)
        if on and spec.layout:
            for gi, (p, start) in enumerate(zip(spec.layout, spec.starts, strict=True), 1):
                mig_uuid = f"MIG-{uuid.uuid5(_NS, f'{spec.name}/{i}/{gi}')}"
                gpu.instances[gi] = Instance(gi, p, start, mig_uuid)
        gpus.append(gpu)
    return Machine(spec, gpus)
