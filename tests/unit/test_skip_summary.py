"""The count of skipped tests by reason that ends each pytest run and a whole ``make test``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import skips

ROOT = Path(__file__).resolve().parents[2]


def test_reasons_are_counted_most_frequent_first() -> None:
    reports = [
        SimpleNamespace(longrepr=("a.py", 3, "Skipped: needs root")),
        SimpleNamespace(longrepr=("b.py", 9, "Skipped: needs   Debian's\nchromium")),
        SimpleNamespace(longrepr=("c.py", 1, "Skipped: needs root")),
    ]
    assert skips.summary(skips.reasons(reports)) == [
        "3 skipped, by reason:",
        "    2  needs root",
        "    1  needs Debian's chromium",
    ]
    assert skips.summary([]) == []


def make_test_summary(file: Path) -> str:
    """What ``make test`` prints last: ``python -m tests.skips FILE``."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.skips", str(file)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout


def test_the_runs_of_one_make_test_add_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / "skips"
    monkeypatch.setenv("GPUPOOL_SKIPS", str(file))
    skips.record(["needs root", "needs root"])
    skips.record(["needs root"])
    assert make_test_summary(file) == "make test: 3 skipped, by reason:\n    3  needs root\n"
    file.unlink()
    assert make_test_summary(file) == "make test: no test was skipped\n"
