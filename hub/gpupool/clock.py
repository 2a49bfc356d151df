"""The one named seam for time. Everything in gpupool that needs "now" calls :func:`utcnow`
(through an attribute that tests can replace), never ``datetime.now`` or ``time.time`` directly.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utcnow() -> datetime:
    """The current time, timezone-aware, in UTC."""
    return datetime.now(UTC)
