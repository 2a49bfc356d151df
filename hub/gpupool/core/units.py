"""GPU-equivalents, DESIGN.md's one quota unit, kept as integer thousandths ("milli").

A whole GPU is 1000; a MIG instance is its memory slots over the GPU's slots (3g.40gb = 500,
1g.10gb = 125). Integers keep sums exact, so a quota of 4 holds exactly eight 3g instances.
"""

from __future__ import annotations

GPU_MILLI = 1000


def to_milli(gpu_eq: float) -> int:
    """``2.5`` GPU-equivalents as 2500."""
    return round(gpu_eq * GPU_MILLI)


def fmt(milli: int) -> str:
    """Thousandths as a short human number: 3500 → ``"3.5"``, 125 → ``"0.125"``, 4000 → ``"4"``."""
    whole, frac = divmod(milli, GPU_MILLI)
    if not frac:
        return str(whole)
    return f"{milli / GPU_MILLI:.3f}".rstrip("0")
