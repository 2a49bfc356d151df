"""Device activity: what each GPU or MIG device is doing now, read through NVML.

Vocabulary
- *sample*: one reading of one device (by UUID): utilisation in percent (``None`` where NVML
  measures none: MIG devices, and GPUs in MIG mode), memory used and total in bytes, and the PIDs
  of its compute processes.
- *processes* of a device: its compute processes, ``nvmlDeviceGetComputeRunningProcesses``, as
  ``(pid, usedGpuMemory in bytes or None where NVML does not know it)``
  (:meth:`DeviceMonitor.processes`; for the share watch and the device watch).
- *monitor*: :class:`DeviceMonitor`, the one seam through which the hub reads activity; it holds
  an ``nvml`` (``pynvml`` or a :class:`~gpupool.discovery.simulated.SimulatedNVML` view) per node
  it can read. Nodes it has none for (Kubernetes nodes: NVML is on the node, not in the hub pod)
  give no samples here; the second source, :class:`gpupool.monitors.dcgm.DCGMSource`, reads
  them from NVIDIA's DCGM exporter through Prometheus (when the reclaimer's
  ``dcgm_prometheus_url`` is set) as the same :class:`DeviceSample`, with no PIDs.

Contract: the monitor is a periodic reader: it holds each node's NVML session
(:class:`~gpupool.discovery.nvml_session.NVMLSession`) from its first reading of that node until
:meth:`DeviceMonitor.close`, so NVML is initialised once, not on every sample (a node whose NVML
cannot start is tried again at the next reading). A device NVML cannot read (gone, or an NVML
error) is left out of the result rather than failing the whole reading, and the error is logged
once per device, as is a node whose NVML cannot start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pynvml

from gpupool.discovery.nvml_session import NVMLSession, NVMLUnavailable

T = TypeVar("T")

log = logging.getLogger("gpupool")


@dataclass(frozen=True)
class DeviceSample:
    uuid: str
    utilisation: int | None
    memory_used: int
    memory_total: int
    pids: tuple[int, ...]


class DeviceMonitor:
    """Reads device activity through one ``nvml`` per node (see the module docstring)."""

    def __init__(self, nvml_by_node: Mapping[str, Any] | None = None) -> None:
        self.nvml_by_node = dict(nvml_by_node or {})
        self._held: dict[str, NVMLSession] = {}
        self._holding = threading.Lock()
        self._failed: set[str] = set()

    def can_read(self, node: str | None) -> bool:
        return node is not None and node in self.nvml_by_node

    def sample(self, node: str, uuids: Iterable[str]) -> dict[str, DeviceSample]:
        """Samples of the devices ``uuids`` on ``node`` (empty where the node cannot be read)."""
        return self._each(node, uuids, _read, "NVML cannot read device")

    def processes(self, node: str, uuids: Iterable[str]) -> dict[str, list[tuple[int, int | None]]]:
        """The compute processes of the devices ``uuids`` on ``node`` with their GPU memory in
        bytes (``None`` where NVML does not report it); a device NVML cannot read is left out."""
        return self._each(node, uuids, _processes, "NVML cannot read the processes of")

    def close(self) -> None:
        """Release the NVML sessions this monitor holds (the next reading holds them again)."""
        with self._holding:
            held, self._held = self._held, {}
        for session in held.values():
            session.release()

    def _session(self, node: str) -> NVMLSession | None:
        """``node``'s NVML session, held from the first reading on (``None``: no NVML there,
        or one that cannot start, logged once)."""
        nvml = self.nvml_by_node.get(node)
        if nvml is None:
            return None
        with self._holding:
            if node not in self._held:
                session = NVMLSession.of(nvml)
                try:
                    session.hold()
                except NVMLUnavailable as e:
                    self._once(node, f"NVML on {node} cannot be read: {e}")
                    return None
                self._held[node] = session
            return self._held[node]

    def _each(
        self, node: str, uuids: Iterable[str], read: Callable[[NVMLSession, str], T], failing: str
    ) -> dict[str, T]:
        """``read(session, uuid)`` for each device of ``uuids`` on ``node``; a node or device NVML
        cannot read is logged once and left out."""
        wanted = list(uuids)
        session = self._session(node) if wanted else None
        if session is None:
            return {}
        out: dict[str, T] = {}
        for uuid in wanted:
            try:
                out[uuid] = read(session, uuid)
            except pynvml.NVMLError as e:
                self._once(uuid, f"{failing} {uuid} on {node}: {e}")
        return out

    def _once(self, key: str, message: str) -> None:
        if key not in self._failed:
            self._failed.add(key)
            log.warning("gpupool: %s", message)


def _processes(session: NVMLSession, uuid: str) -> list[tuple[int, int | None]]:
    running = session.nvml.nvmlDeviceGetComputeRunningProcesses(session.device(uuid))
    return [(int(p.pid), _used(p)) for p in running]


def _read(session: NVMLSession, uuid: str) -> DeviceSample:
    nvml, handle = session.nvml, session.device(uuid)
    try:
        utilisation: int | None = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError_NotSupported:
        utilisation = None
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    pids = tuple(sorted(int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)))
    return DeviceSample(uuid, utilisation, int(memory.used), int(memory.total), pids)


def _used(process: Any) -> int | None:
    """A process's ``usedGpuMemory`` in bytes; ``None`` where NVML does not know it (NVML reports
    ``NVML_VALUE_NOT_AVAILABLE``: no permission, or a container without the host's PIDs)."""
    used = getattr(process, "usedGpuMemory", None)
    if used is None or used == pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value:
        return None
    return int(used)
