"""Device activity through (simulated) NVML, the activity file, the offset clock, and the idle
policies' config checks."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pynvml
import pytest

from gpupool.clock import OffsetClock, utcnow
from gpupool.declarations import ConfigError
from gpupool.discovery import SimulatedNVML
from gpupool.hub.reclaim import parse_policies
from gpupool.monitors.activity import DeviceMonitor

SPEC = "n1: 2x H100-80GB, mig=1:3g.40gb+3g.40gb"


def uuids(sim: SimulatedNVML) -> tuple[str, str]:
    sim.nvmlInit()
    try:
        whole = sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetHandleByIndex(0))
        parent = sim.nvmlDeviceGetHandleByIndex(1)
        mig = sim.nvmlDeviceGetUUID(sim.nvmlDeviceGetMigDeviceHandleByIndex(parent, 0))
    finally:
        sim.nvmlShutdown()
    return whole, mig


def test_the_monitor_reads_gpus_and_mig_devices_as_nvml_reports_them(tmp_path: Path) -> None:
    activity = tmp_path / "activity.json"
    sim = SimulatedNVML(SPEC, activity_file=activity)
    whole, mig = uuids(sim)
    monitor = DeviceMonitor({"n1": sim})
    idle = monitor.sample("n1", [whole, mig])
    assert idle[whole].utilisation == 0 and idle[whole].pids == ()
    assert idle[mig].utilisation is None  # NVML measures none on MIG devices
    assert idle[mig].memory_total * 2 == idle[whole].memory_total  # 3g.40gb: 4 of 8 slots

    activity.write_text(json.dumps({whole: {"gpu": 87}, mig: {"pids": [4242], "used_mib": 2048}}))
    busy = monitor.sample("n1", [whole, mig])
    assert busy[whole].utilisation == 87
    assert busy[mig].pids == (4242,) and busy[mig].memory_used == 2048 << 20


def test_unreadable_devices_and_nodes_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    sim = SimulatedNVML(SPEC)
    whole, _ = uuids(sim)
    monitor = DeviceMonitor({"n1": sim})
    assert set(monitor.sample("n1", [whole, "GPU-gone"])) == {whole}
    assert monitor.sample("elsewhere", [whole]) == {}
    assert not monitor.can_read("elsewhere") and monitor.can_read("n1")
    assert "GPU-gone" in caplog.text
    # the monitor holds NVML until it is closed, and leaves it shut down then
    sim.nvmlDeviceGetCount()
    monitor.close()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        sim.nvmlDeviceGetCount()


def test_sampling_initialises_nvml_once_not_per_sample(tmp_path: Path) -> None:
    activity = tmp_path / "activity.json"
    sim = SimulatedNVML(SPEC, activity_file=activity)
    whole, mig = uuids(sim)
    before = sim.init_count
    monitor = DeviceMonitor({"n1": sim})
    for gpu in (10, 20, 30, 40, 50):
        activity.write_text(json.dumps({whole: {"gpu": gpu}, mig: {"pids": [gpu]}}))
        sample = monitor.sample("n1", [whole, mig])
        assert sample[whole].utilisation == gpu  # each sample reads the moment's activity
        assert monitor.processes("n1", [mig]) == {mig: [(gpu, 1024 << 20)]}
    assert sim.init_count - before == 1
    monitor.close()
    monitor.sample("n1", [whole])  # closed: the next reading holds NVML again
    assert sim.init_count - before == 2


def test_a_node_whose_nvml_cannot_start_is_logged_once_and_tried_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Flaky(SimulatedNVML):
        broken = True

        def nvmlInit(self) -> None:
            if self.broken:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
            super().nvmlInit()

    sim = Flaky(SPEC)
    monitor = DeviceMonitor({"n1": sim})
    assert monitor.sample("n1", ["GPU-x"]) == {} and monitor.processes("n1", ["GPU-x"]) == {}
    said = [r.getMessage() for r in caplog.records if "cannot be read" in r.getMessage()]
    assert said == [
        "gpupool: NVML on n1 cannot be read: no NVIDIA driver found (Driver Not Loaded)"
    ]
    sim.broken = False
    whole, _ = uuids(sim)
    assert set(monitor.sample("n1", [whole])) == {whole}


def test_the_offset_clock_moves_time_by_the_file(tmp_path: Path) -> None:
    path = tmp_path / "offset"
    clock = OffsetClock(path)
    assert abs((clock() - utcnow()).total_seconds()) < 5
    path.write_text("7200")
    assert abs((clock() - utcnow()) - timedelta(hours=2)) < timedelta(seconds=5)


def test_policies_merge_team_over_star_over_defaults() -> None:
    policies = parse_policies({"*": {"idle_minutes": 60}, "nlp": {"action": "cpu"}})
    assert policies["nlp"].idle_after == 3600 and policies["nlp"].action == "cpu"
    assert policies["*"].warn_before == 1800 and policies["*"].threshold == 5


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"nlp": {"action": "delete"}}, "IdleReclaimer.policies['nlp'].action"),
        ({"*": {"idle_minutes": -1}}, "IdleReclaimer.policies['*'].idle_minutes"),
        ({"nlp": {"idle_mins": 5}}, "IdleReclaimer.policies['nlp']"),
        ({"nlp": {"warn_minutes": 200}}, "IdleReclaimer.policies['nlp'].warn_minutes"),
        ({"nlp": 5}, "IdleReclaimer.policies['nlp']"),
    ],
)
def test_bad_policies_name_the_key(value: dict[str, object], path: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_policies(value)
    assert str(refused.value).startswith(path)
