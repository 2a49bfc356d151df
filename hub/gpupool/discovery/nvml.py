"""GPU discovery through NVML: one node's GPUs, MIG instances and NVLink peers as an Inventory.

Vocabulary
- *nvml*: the ``pynvml`` module (nvidia-ml-py) or an object with the same calls and errors,
  such as :class:`~gpupool.discovery.simulated.SimulatedNVML`. Everything here goes through it.
- *MIG mode* as the inventory records it: ``off`` (NVML's MIG mode disabled or unsupported),
  ``fixed`` (enabled, with MIG devices already there) or ``dynamic`` (enabled, none yet).
- *NVLink peers*: GPUs for which ``nvmlDeviceGetP2PStatus(a, b, NVML_P2P_CAPS_INDEX_NVLINK)``
  is ``NVML_P2P_STATUS_OK``.

Contract: :func:`discover` holds the NVML session (:mod:`gpupool.discovery.nvml_session`) only
while it reads: NVML stays initialised afterwards only where another reader holds it. It fails
soft: without a usable driver it returns an empty inventory with a note and
logs one warning; a GPU NVML cannot read, or a MIG instance gpupool cannot model, is left out with
a note. MIG instances resolve to profiles by NVML profile ID and placement size, never by name
alone (names drift with drivers); only when NVML refuses GPU-instance queries (they need root)
does it fall back to the MIG device's name and a :meth:`Geometry.fit` placement, and says so.
"""

from __future__ import annotations

import logging
import socket
from collections import defaultdict
from dataclasses import replace
from typing import Any

import pynvml

from gpupool.core.inventory import GPU, Inventory, MigInstance, MigMode, Node, model_key
from gpupool.core.mig import GEOMETRIES, Geometry, Profile
from gpupool.discovery.nvml_session import NVMLSession, NVMLUnavailable, text

HINT = "Use inventory = 'simulated:<spec>' to try gpupool without GPUs."
_NO_MIG = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)

_log = logging.getLogger(__name__)


def discover(
    nvml: Any = None, node_name: str | None = None, log: logging.Logger | None = None
) -> Inventory:
    """This node's GPUs as NVML (default: the real ``pynvml``) reports them."""
    session = NVMLSession.of(nvml)
    log = log or _log
    simulated = bool(getattr(session.module, "simulated", False))
    source = "simulated" if simulated else "nvml"
    node = node_name or getattr(session.module, "node_name", None) or socket.gethostname()
    try:
        session.hold()
    except NVMLUnavailable as e:
        note = f"NVML: {e}; the pool has no GPUs. {HINT}"
        log.warning(note)
        return Inventory((), source=source, simulated=simulated, notes=(note,))
    notes: list[str] = []
    try:
        driver = text(session.nvml.nvmlSystemGetDriverVersion())
        gpus = _read_gpus(session, notes)
    finally:
        session.release()
    for note in notes:
        log.warning("NVML on %s: %s", node, note)
    kind = "simulated NVML" if simulated else "NVML"
    log.info("%s: %d GPU(s) on %s, driver %s", kind, len(gpus), node, driver)
    return Inventory((Node(node, gpus),), source=source, simulated=simulated, notes=tuple(notes))


def _read_gpus(session: NVMLSession, notes: list[str]) -> tuple[GPU, ...]:
    nvml = session.nvml
    gpus: list[GPU] = []
    handles: dict[str, Any] = {}
    for i in range(nvml.nvmlDeviceGetCount()):
        try:
            handle = session.device_at(i)
            gpu = _read_gpu(nvml, handle, notes)
        except pynvml.NVMLError as e:
            notes.append(f"GPU {i} left out: NVML says {e}")
            continue
        if gpu is not None:
            gpus.append(gpu)
            handles[gpu.uuid] = handle
    peers = _nvlink_peers(nvml, handles)
    return tuple(replace(g, nvlink_peers=frozenset(peers[g.uuid])) for g in gpus)


def _read_gpu(nvml: Any, handle: Any, notes: list[str]) -> GPU | None:
    index = nvml.nvmlDeviceGetIndex(handle)
    name = text(nvml.nvmlDeviceGetName(handle))
    memory_mib = nvml.nvmlDeviceGetMemoryInfo(handle).total >> 20
    model = model_key(name, memory_mib)
    mig_on = _mig_enabled(nvml, handle, index, notes)
    geometry = GEOMETRIES.get(model) if mig_on is not None else None
    if mig_on and geometry is None:
        notes.append(
            f"GPU {index} ({name}) left out: MIG is on, but gpupool has no MIG geometry for {model}"
        )
        return None
    instances: tuple[MigInstance, ...] = ()
    if mig_on and geometry is not None:
        instances = _read_instances(nvml, handle, index, geometry, notes)
    mode: MigMode = "off" if not mig_on else "fixed" if instances else "dynamic"
    return GPU(
        uuid=text(nvml.nvmlDeviceGetUUID(handle)),
        index=index,
        model=model,
        memory_mib=memory_mib,
        mig_capable=geometry is not None,
        mig_mode=mode,
        instances=instances,
        product_name=name,
    )


def _mig_enabled(nvml: Any, handle: Any, index: int, notes: list[str]) -> bool | None:
    """Whether MIG is on now; ``None`` where the GPU has no MIG mode at all."""
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except _NO_MIG:
        return None
    on = bool(current == pynvml.NVML_DEVICE_MIG_ENABLE)
    if pending != current:
        notes.append(
            f"GPU {index}: a MIG mode change is pending until the GPU is reset; "
            f"using the current mode ({'on' if on else 'off'})"
        )
    return on


def _read_instances(
    nvml: Any, handle: Any, index: int, geometry: Geometry, notes: list[str]
) -> tuple[MigInstance, ...]:
    placed: list[MigInstance] = []
    unplaced: list[tuple[Profile, str]] = []
    seen: set[int] = set()
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
        except pynvml.NVMLError_NotFound:
            continue
        uuid, gi = text(nvml.nvmlDeviceGetUUID(mig)), nvml.nvmlDeviceGetGpuInstanceId(mig)
        if gi in seen:
            notes.append(
                f"GPU {index}: GPU instance {gi} has several compute instances; "
                f"gpupool hands out the first only, not {uuid}"
            )
            continue
        seen.add(gi)
        profile, start = _instance_profile(nvml, handle, mig, gi, geometry)
        if profile is None:
            notes.append(
                f"GPU {index}: MIG device {uuid} has a GPU-instance profile gpupool "
                f"does not know for {geometry.model}; left out"
            )
        elif start is None:
            unplaced.append((profile, uuid))
        else:
            placed.append(MigInstance(profile.name, start, uuid))
    if unplaced:
        placed += _guess_starts(geometry, placed, unplaced, index, notes)
    return tuple(sorted(placed, key=lambda m: m.start))


def _instance_profile(
    nvml: Any, handle: Any, mig: Any, gi: int, geometry: Geometry
) -> tuple[Profile | None, int | None]:
    """The profile and start slot of a MIG device's GPU instance (start ``None``: unknown)."""
    try:
        info = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(handle, gi))
    except pynvml.NVMLError_NoPermission:
        shown = text(nvml.nvmlDeviceGetName(mig)).rpartition(" MIG ")[2]
        return geometry.resolve(shown), None
    size = info.placement.size
    return geometry.resolve(profile_id=info.profileId, memory_slots=size), info.placement.start


def _guess_starts(
    geometry: Geometry,
    placed: list[MigInstance],
    unplaced: list[tuple[Profile, str]],
    index: int,
    notes: list[str],
) -> list[MigInstance]:
    occupied = [(geometry.by_name[m.profile], m.start) for m in placed]
    fit = geometry.fit([p for p, _ in unplaced], occupied)
    if fit is None:
        notes.append(
            f"GPU {index}: NVML needs root to read MIG placements and the MIG devices "
            "do not fit the geometry; their instances are left out"
        )
        return []
    notes.append(
        f"GPU {index}: NVML needs root to read MIG placements; start slots of "
        f"{len(unplaced)} instance(s) are assumed, not read"
    )
    uuids: dict[Profile, list[str]] = defaultdict(list)
    for p, uuid in unplaced:
        uuids[p].append(uuid)
    return [MigInstance(p.name, start, uuids[p].pop(0)) for p, start in fit]


def _nvlink_peers(nvml: Any, handles: dict[str, Any]) -> dict[str, set[str]]:
    peers: dict[str, set[str]] = {uuid: set() for uuid in handles}
    items = list(handles.items())
    for n, (a, ha) in enumerate(items):
        for b, hb in items[n + 1 :]:
            try:
                status = nvml.nvmlDeviceGetP2PStatus(ha, hb, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            except pynvml.NVMLError:
                continue
            if status == pynvml.NVML_P2P_STATUS_OK:
                peers[a].add(b)
                peers[b].add(a)
    return peers
