"""Skipped tests counted by reason: at the end of each pytest run (``tests/conftest.py``) and at
the end of a whole ``make test``, which runs pytest several times.

``make test`` sets ``GPUPOOL_SKIPS`` to a file; each run appends one line per skipped test (its
reason) there, and ``python -m tests.skips FILE`` prints the count of them all, last.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def reasons(reports: Iterable[Any]) -> list[str]:
    """The reason of each skipped test's report (pytest's ``longrepr``: path, line, reason)."""
    out = []
    for report in reports:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        out.append(" ".join(reason.removeprefix("Skipped: ").split()))
    return out


def summary(skipped: list[str]) -> list[str]:
    """A heading and a line per reason, most frequent first (nothing when none was skipped)."""
    if not skipped:
        return []
    counts = Counter(skipped)
    return [f"{len(skipped)} skipped, by reason:"] + [
        f"{count:5d}  {reason}" for reason, count in counts.most_common()
    ]


def terminal_summary(terminalreporter: Any) -> None:
    """pytest's ``pytest_terminal_summary``: this run's count by reason, last, and recorded."""
    skipped = reasons(terminalreporter.stats.get("skipped", []))
    lines = summary(skipped)
    if lines:
        terminalreporter.section(lines[0].removesuffix(":"))
        for line in lines[1:]:
            terminalreporter.write_line(line)
    record(skipped)


def record(skipped: list[str]) -> None:
    """Append this run's reasons to ``$GPUPOOL_SKIPS`` (when ``make test`` set it)."""
    path = os.environ.get("GPUPOOL_SKIPS")
    if path and skipped:
        with open(path, "a", encoding="utf-8") as f:
            f.writelines(f"{reason}\n" for reason in skipped)


if __name__ == "__main__":
    file = Path(sys.argv[1])
    lines = summary(file.read_text(encoding="utf-8").splitlines() if file.exists() else [])
    print(
        "\n".join([f"make test: {line}" for line in lines[:1]] + lines[1:])
        or "make test: no test was skipped"
    )
