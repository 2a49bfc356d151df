"""The one NVML session: holds counted as NVML counts ``nvmlInit``, handles only while held, an NVML
that cannot start as gpupool's error, and every reader calling NVML only inside the session."""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gpupool.discovery import NVMLSession, NVMLUnavailable, SimulatedNVML, discover
from gpupool.mig.nvml import ManagedGpu, MigDriver
from gpupool.monitors.activity import DeviceMonitor
from gpupool.store import MigRecord

ROOT = Path(__file__).resolve().parents[2]
SPEC = "n: 1x H100-80GB, mig=1"
SESSION_MODULE = "gpupool.discovery.nvml_session"
PYTHON_SCRIPT = b"#!/usr/bin/env python"


def test_holds_are_counted_and_the_last_release_shuts_nvml_down() -> None:
    sim = SimulatedNVML(SPEC)
    session = NVMLSession.of(sim)
    assert NVMLSession.of(sim) is session and NVMLSession.of(sim.for_node("n")) is not session
    with session.use(), session.use():
        handle = session.device_at(0)
        assert session.device(sim.nvmlDeviceGetUUID(handle)) == handle
    assert sim.init_count == 1 and not session.held
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetUUID(handle)  # a handle is invalid after the last shutdown
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        session.device_at(0)  # and none is taken outside a hold
    with pytest.raises(RuntimeError):
        session.release()


def test_the_session_shares_nvml_with_its_other_users() -> None:
    sim = SimulatedNVML(SPEC)
    sim.nvmlInit()  # someone else in the process (an admin's tool) holds NVML too
    with NVMLSession.of(sim).use():
        pass
    sim.nvmlDeviceGetCount()  # our shutdown did not end theirs
    sim.nvmlShutdown()


@pytest.mark.parametrize(
    ("code", "says"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "no NVIDIA driver found (Driver Not Loaded)"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "could not start ("),
    ],
)
def test_an_nvml_that_cannot_start_is_nvml_unavailable(code: int, says: str) -> None:
    class NoDriver(SimulatedNVML):
        def nvmlInit(self) -> None:
            raise pynvml.NVMLError(code)

    session = NVMLSession.of(NoDriver(SPEC))
    with pytest.raises(NVMLUnavailable) as refused:
        session.hold()
    assert str(refused.value).startswith(says)
    assert isinstance(refused.value, pynvml.NVMLError) and refused.value.value == code
    assert not session.held


def _init_and_shutdown_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute | ast.Name):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            if name in ("nvmlInit", "nvmlInitWithFlags", "nvmlShutdown"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} calls {name}")
    return found


def test_only_the_session_initialises_and_shuts_down_nvml() -> None:
    sources = [
        *(ROOT / "hub" / "gpupool").rglob("*.py"),
        *(ROOT / "spawner").rglob("*.py"),
        *(ROOT / "labextension" / "gpupool_lab").rglob("*.py"),
        *(ROOT / "benchmarks").rglob("*.py"),
        *(
            p
            for p in (ROOT / "scripts").iterdir()
            if p.read_bytes().startswith(b"#!/usr/bin/env python")
        ),
    ]
    session = ROOT / "hub" / "gpupool" / "discovery" / "nvml_session.py"
    assert _init_and_shutdown_calls(session)  # the check sees a call where there is one
    wrong = [c for path in sources if path != session for c in _init_and_shutdown_calls(path)]
    assert wrong == []


class Watched:
    """A simulated NVML view that records every use of NVML outside its session: ``nvmlInit``
    or ``nvmlShutdown`` called by anything but the session, any other call while the session
    is not held."""

    def __init__(self, sim: SimulatedNVML) -> None:
        self._sim = sim
        self.outside: list[str] = []
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._sim, name)
        if not name.startswith("nvml"):
            return found

        def call(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_globals.get("__name__")
            self.calls += 1
            if name in ("nvmlInit", "nvmlShutdown"):
                if caller != SESSION_MODULE:
                    self.outside.append(f"{caller} calls {name}")
            elif not NVMLSession.of(self).held:
                self.outside.append(f"{caller} calls {name} outside the session")
            return found(*args, **kwargs)

        return call


def test_every_reader_calls_nvml_inside_the_session() -> None:
    sim = SimulatedNVML(SPEC)
    watched = Watched(sim)
    (gpu,) = discover(watched).gpus
    assert gpu.geometry is not None
    driver = MigDriver({"n": watched})
    assert driver.probe([("n", gpu)]) == ""
    managed = ManagedGpu("n", gpu.uuid, gpu.index, gpu.model, gpu.geometry)
    gi, ci, uuid = driver.create(managed, "3g.40gb", 0)
    assert not driver.gone(managed, uuid)
    monitor = DeviceMonitor({"n": watched})
    assert set(monitor.sample("n", [gpu.uuid, uuid])) == {gpu.uuid, uuid}
    assert monitor.processes("n", [uuid]) == {uuid: []}
    record = MigRecord("n", gpu.uuid, 0, "3g.40gb", "live", 0.0, gi, ci, uuid)
    assert driver.destroy(managed, record) == "destroyed"
    driver.destroy_bare(managed, record)
    monitor.close()
    assert watched.calls > 20 and watched.outside == []
    # and the watch itself fails a reader that goes round the session
    sim.nvmlInit()
    watched.nvmlDeviceGetCount()
    assert watched.outside == [f"{__name__} calls nvmlDeviceGetCount outside the session"]
