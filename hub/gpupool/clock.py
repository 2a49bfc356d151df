"""The one named seam for time. Everything in gpupool that needs "now" calls :func:`utcnow`
(through an attribute that tests can replace), never ``datetime.now`` or ``time.time`` directly.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path


def utcnow() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)


def iso(ts: float | None) -> str | None:
    """A POSIX timestamp as ISO 8601 in UTC (``None`` stays ``None``), as the API shows times."""
    return datetime.fromtimestamp(ts, UTC).isoformat() if ts is not None else None


class OffsetClock:
    """:func:`utcnow` moved forward by the number of seconds in a file, read at each call (a
    missing or empty file is 0). For tests and demos whose hub runs in another process: writing
    ``7200`` to the file makes the hub's time two hours later. Example::

        c.IdleReclaimer.clock = OffsetClock(".run/clock-offset")
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __call__(self) -> datetime:
        try:
            offset = float(self.path.read_text().strip() or 0)
        except FileNotFoundError:
            offset = 0.0
        return utcnow() + timedelta(seconds=offset)
