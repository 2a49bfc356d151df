"""The idle rules (``gpupool.core.idle``): what counts as in use, warning first, then reclaim."""

from __future__ import annotations

import pytest

from gpupool.core.idle import (
    MEMORY_CHANGE_BYTES,
    DeviceReading,
    IdlePolicy,
    Reading,
    Watch,
    is_active,
    observe,
)

POLICY = IdlePolicy(threshold=5, idle_after=3600, warn_before=900, action="stop")
GPU = "GPU-1"
MIG = "MIG-1"


def gpu(utilisation: int) -> Reading:
    return Reading({GPU: DeviceReading(utilisation, 1 << 30, (10,))})


def mig(memory: int, pids: tuple[int, ...] = (10,), busy: bool | None = False) -> Reading:
    return Reading({MIG: DeviceReading(None, memory, pids)}, kernel_busy=busy)


def run(readings: list[tuple[float, Reading]], policy: IdlePolicy = POLICY) -> list[str]:
    watch, verdicts = Watch(), []
    for now, reading in readings:
        watch, verdict = observe(watch, reading, policy, now)
        verdicts.append(verdict)
    return verdicts


def test_an_idle_gpu_is_warned_then_reclaimed_on_time() -> None:
    looks = [(t, gpu(0)) for t in (0, 1000, 2700, 3000, 3599, 3600, 3700)]
    assert run(looks) == ["idle", "idle", "warn", "idle", "idle", "reclaim", "reclaim"]


def test_use_resets_the_idle_stretch_and_the_warning() -> None:
    looks = [(0, gpu(0)), (2700, gpu(0)), (2800, gpu(50)), (3600, gpu(0)), (6300, gpu(0))]
    assert run(looks) == ["idle", "warn", "active", "idle", "warn"]


def test_the_warning_always_comes_first_and_lasts_its_whole_time() -> None:
    """Looks far apart (or a jump of the clock) never skip the warning."""
    looks = [(0, gpu(0)), (10_000, gpu(0)), (10_500, gpu(0)), (10_900, gpu(0))]
    assert run(looks) == ["idle", "warn", "idle", "reclaim"]


def test_a_busy_kernel_is_in_use_whatever_the_gpu_says() -> None:
    reading = Reading({GPU: DeviceReading(0, 0, ())}, kernel_busy=True)
    assert is_active(reading, None, 5)


def test_newer_kernel_activity_is_use() -> None:
    before = Reading({GPU: DeviceReading(0, 0, ())}, False, 100.0)
    after = Reading({GPU: DeviceReading(0, 0, ())}, False, 160.0)
    assert is_active(after, before, 5)
    assert not is_active(before, before, 5)


@pytest.mark.parametrize(
    ("before", "after", "active"),
    [
        (mig(1 << 30), mig(1 << 30), False),
        (mig(1 << 30), mig((1 << 30) + MEMORY_CHANGE_BYTES + 1), True),
        (mig(1 << 30), mig((1 << 30) + 1024), False),
        (mig(1 << 30, (10,)), mig(1 << 30, (10, 11)), True),
    ],
)
def test_mig_devices_count_as_used_when_processes_or_memory_change(
    before: Reading, after: Reading, active: bool
) -> None:
    """NVML measures no utilisation on MIG devices: change is the signal."""
    assert is_active(after, before, 5) is active


def test_nothing_readable_is_never_reclaimed() -> None:
    blind = Reading({})
    assert run([(0, blind), (10_000, blind), (20_000, blind)]) == ["active"] * 3


def test_policy_off_never_warns() -> None:
    off = IdlePolicy(action="off")
    assert run([(0, gpu(0)), (100_000, gpu(0))], off) == ["active", "active"]


def test_reclaim_at_is_the_later_of_the_deadline_and_the_warning_end() -> None:
    watch = Watch(idle_since=0.0, warned_at=10_000.0)
    assert watch.reclaim_at(POLICY) == 10_900.0
    assert Watch(idle_since=0.0).reclaim_at(POLICY) == 3600.0
    assert Watch().reclaim_at(POLICY) is None
