"""``benchmarks.node_events`` measures what it says: a GFD timestamp event is skipped by the
handler now and recomputed by the one before; a GPU count change is recomputed by all three
(the full rebuild before and at 6cf11cc, the one-node rebuild now), and the inventory follows
it: the run checks the node's GPUs and the ledger's invariants."""

from __future__ import annotations

import json

import pytest

from benchmarks.node_events import after, before, main, run_one, skip


def test_irrelevant_events_are_skipped_only_by_the_handler_now() -> None:
    assert run_one(20, 100, "irrelevant", "before", before, 3).recomputed == 3
    assert run_one(20, 100, "irrelevant", "after", after, 30).recomputed == 0
    assert run_one(20, 100, "relevant", "before", before, 3).recomputed == 3
    assert run_one(20, 100, "relevant", "skip", skip, 3).recomputed == 3
    assert run_one(20, 100, "relevant", "after", after, 3).recomputed == 3


def test_the_json_names_every_run(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--json", "--nodes", "20", "--allocations", "50", "--events", "1"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["event"], r["handler"], r["events"]) for r in rows] == [
        ("irrelevant", "before", 1),
        ("irrelevant", "after", 100),
        ("relevant", "before", 1),
        ("relevant", "skip", 1),
        ("relevant", "after", 1),
    ]
