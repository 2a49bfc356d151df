"""Plain aligned text tables for the benchmarks' terminal output.

Contract: pure; the first row is the header, underlined with dashes; columns named in ``left``
are left-aligned, the rest (numbers) right-aligned.
"""

from __future__ import annotations

from collections.abc import Container, Sequence


def align(rows: Sequence[Sequence[str]], left: Container[int] = (0,)) -> str:
    """``rows`` (header first) as aligned lines joined by newlines."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        cells = [
            cell.ljust(width) if j in left else cell.rjust(width)
            for j, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
