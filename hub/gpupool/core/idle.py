"""Idle GPU notebooks: when a notebook's GPUs count as idle, and when to warn and reclaim.

Vocabulary
- *policy*: per team, the utilisation ``threshold`` (percent) below which a GPU counts as idle,
  ``idle_after`` (seconds idle before the GPUs are reclaimed), ``warn_before`` (seconds before
  that when the user is warned) and the ``action``: ``stop`` the server, restart it on ``cpu``,
  or ``off``.
- *reading*: what one look at a notebook found: per device, utilisation (``None`` where NVML
  measures none, as on MIG devices), memory used and compute PIDs; and from the server, whether a
  kernel is busy and the newest kernel activity. Either part may be missing (``None``).
- *watch*: what the reclaimer remembers of one allocation between looks: since when it has been
  idle, when it was warned, and the previous reading (to see change on MIG devices).

Contract: pure; no I/O and no clock (``now`` is passed in). A notebook is *active* when any
whole GPU is at or above the threshold, when a MIG device's processes or memory changed since the
previous look, when a kernel is busy, or when kernel activity is newer than at the previous look.
With nothing readable at all (no device sample and no kernel answer) it counts as active:
gpupool never reclaims blind.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

Action = Literal["stop", "cpu", "off"]
ACTIONS: tuple[Action, ...] = ("stop", "cpu", "off")
MEMORY_CHANGE_BYTES = 64 << 20
"""A MIG device whose used memory moves by more than this between looks is in use."""


@dataclass(frozen=True)
class IdlePolicy:
    threshold: int = 5
    idle_after: float = 2 * 3600.0
    warn_before: float = 1800.0
    action: Action = "stop"


@dataclass(frozen=True)
class DeviceReading:
    utilisation: int | None
    memory_used: int
    pids: tuple[int, ...]


@dataclass(frozen=True)
class Reading:
    devices: Mapping[str, DeviceReading]
    kernel_busy: bool | None = None
    kernel_activity: float | None = None


@dataclass(frozen=True)
class Watch:
    idle_since: float | None = None
    warned_at: float | None = None
    last: Reading | None = None

    def reclaim_at(self, policy: IdlePolicy) -> float | None:
        """When the GPUs go, if the notebook stays idle: ``idle_after`` past the start of the
        idle stretch, and never sooner than ``warn_before`` past the warning."""
        if self.idle_since is None:
            return None
        due = self.idle_since + policy.idle_after
        return due if self.warned_at is None else max(due, self.warned_at + policy.warn_before)


Verdict = Literal["active", "idle", "warn", "reclaim"]


def is_active(reading: Reading, previous: Reading | None, threshold: int) -> bool:
    """Whether the notebook is in use (see the module docstring)."""
    if not reading.devices and reading.kernel_busy is None:
        return True
    if reading.kernel_busy:
        return True
    before = previous.kernel_activity if previous else None
    if (
        reading.kernel_activity is not None
        and before is not None
        and reading.kernel_activity > before
    ):
        return True
    for uuid, device in reading.devices.items():
        if device.utilisation is not None:
            if device.utilisation >= threshold:
                return True
            continue
        old = previous.devices.get(uuid) if previous else None
        if old is None:
            continue  # first look at a MIG device: nothing to compare with yet
        if device.pids != old.pids:
            return True
        if abs(device.memory_used - old.memory_used) > MEMORY_CHANGE_BYTES:
            return True
    return False


def observe(
    watch: Watch, reading: Reading, policy: IdlePolicy, now: float
) -> tuple[Watch, Verdict]:
    """The watch after one look at ``now``, and what to do: nothing (``active``/``idle``),
    ``warn`` (once per idle stretch, ``warn_before`` seconds before the end), or ``reclaim``.
    A notebook is always warned first and keeps the whole warning time, even when the looks
    are further apart than the policy's times."""
    if policy.action == "off" or is_active(reading, watch.last, policy.threshold):
        return Watch(last=reading), "active"
    idle_since = watch.idle_since if watch.idle_since is not None else now
    watch = replace(watch, idle_since=idle_since, last=reading)
    if watch.warned_at is None:
        if now - idle_since >= policy.idle_after - policy.warn_before:
            return replace(watch, warned_at=now), "warn"
        return watch, "idle"
    due = watch.reclaim_at(policy)
    return watch, "reclaim" if due is not None and now >= due else "idle"
