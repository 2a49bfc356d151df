"""Small statistics shared by the benchmarks.

Contract: pure functions over plain numbers. Percentiles are *nearest-rank* (the smallest value
with at least ``q`` of the sample at or below it), so they are always observed values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 1]; 0.0 for an empty sample."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return float(ordered[rank - 1])


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean; 0.0 for an empty sample."""
    return sum(values) / len(values) if values else 0.0
