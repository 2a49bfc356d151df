"""A job's options as people type them (``gpupool_lab.options``): the parsing the CLI, the
widget, ``%%distributed`` and the server extension share, and the offer lines' admission (the
default offer's ranking, a named offer's check)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool_lab import options
from gpupool_lab.command import main as cli
from gpupool_lab.options import (
    OptionError,
    cells_from_json,
    cells_to_text,
    check_offer,
    choices,
    choose_offer,
    default_choice,
    non_negative,
    parse_cells,
    parse_duration,
    positive,
    time_limit,
    verdict,
)
from tests.lab.fake_hub import OFFERS, offer


def test_the_cli_parses_with_the_shared_parsers() -> None:
    assert cli.parse_cells is parse_cells and cli.parse_duration is parse_duration
    assert cli.choose_offer is options.choose_offer
    assert issubclass(cli.UsageError, OptionError)


def test_an_option_error_is_a_value_error_and_speaks_to_argparse() -> None:
    assert issubclass(OptionError, ValueError)
    parser = argparse.ArgumentParser(prog="p", exit_on_error=False)
    parser.add_argument("--n", type=positive)
    with pytest.raises(argparse.ArgumentError, match="argument --n: must be at least 1, not 0"):
        parser.parse_args(["--n", "0"])


def test_numbers_and_durations() -> None:
    assert (positive("3"), non_negative("0")) == (3, 0)
    with pytest.raises(OptionError, match="not a whole number: 'x'"):
        positive("x")
    with pytest.raises(OptionError, match="must be 0 or more, not -1"):
        non_negative("-1")
    assert parse_duration(" 1h 30m ") == 5400
    with pytest.raises(OptionError, match="a time limit must be positive, not '0m'"):
        parse_duration("0m")
    assert [time_limit(v) for v in ("2h", "", "  ", None, 90)] == [7200, None, None, None, 90]
    with pytest.raises(OptionError, match="not a duration: 'soon'"):
        time_limit("soon")


def test_cells_in_their_three_forms() -> None:
    assert [parse_cells(t) for t in ("all", " ALL ", "upto:1", "3,1-2")] == [
        "all",
        "all",
        0,
        [0, 1, 2],
    ]
    for bad in ("upto:0", "0", "3-1", "1,,2", ""):
        with pytest.raises(OptionError, match="not a cell choice"):
            parse_cells(bad)
    assert [cells_from_json(v) for v in (None, "all", {"upto": 2}, {"selected": [3, 0]})] == [
        "all",
        "all",
        2,
        [3, 0],
    ]
    for bad in ({"upto": True}, {"selected": []}, {"upto": 1, "selected": [1]}, "1,2", 3):
        with pytest.raises(OptionError, match=r'cells must be "all", \{"upto": index\}'):
            cells_from_json(bad)
    assert [cells_to_text(c) for c in ("all", 2, [0, 2])] == [
        ("all", ""),
        ("upto", "3"),
        ("selected", "1,3"),
    ]
    with pytest.raises(OptionError, match="an index or a list of indexes"):
        cells_to_text("some")  # type: ignore[arg-type]


@given(st.sets(st.integers(min_value=0, max_value=200), min_size=1))
def test_cell_numbers_typed_back_give_the_same_cells(indexes: set[int]) -> None:
    mode, numbers = cells_to_text(sorted(indexes))
    assert mode == "selected" and parse_cells(numbers) == sorted(indexes)


@given(st.integers(min_value=0, max_value=10_000))
def test_up_to_a_cell_typed_back_gives_the_same_cell(index: int) -> None:
    mode, number = cells_to_text(index)
    assert (mode, parse_cells(f"upto:{number}")) == ("upto", index)


def test_choices_are_the_offers_documents_lines_in_order() -> None:
    lines = choices(OFFERS)
    assert [(c.team, c.offer, c.count, c.admission) for c in lines] == [
        ("vision", "cpu", 1, "now"),
        ("vision", "h100", 1, "now"),
        ("vision", "h100", 2, "now"),
        ("vision", "h100", 3, "wait"),
        ("vision", "h100", 4, "never"),
        ("vision", "h100-mig-3g", 1, "now"),
        ("nlp", "h100-nlp", 1, "now"),
        ("nlp", "h100-nlp", 2, "now"),
    ]
    assert [c.enabled for c in lines[2:5]] == [True, False, False]
    assert lines[1].text == "1× H100 · vision — 2 free"
    assert lines[3].text == (
        "3× H100 · vision — 2 free (will queue: needs 3 GPU-eq; team vision has 2.5 left)"
    )
    assert lines[4].reason == "needs 4 GPU-eq; your cap in team vision is 3"


def document(*teams: tuple[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """An offers document of ``(team, lines)``."""
    return {"teams": [{"team": name, "offers": lines} for name, lines in teams]}


def busy(name: str, count: int = 2) -> dict[str, Any]:
    return offer(name, "gpu", count, float(count), 0, "none free right now")


def over(name: str, count: int = 2) -> dict[str, Any]:
    why = f"needs {count} GPU-eq; your cap in team t is 1"
    return offer(name, "gpu", count, float(count), 2, why, "never")


def test_a_line_from_an_older_hub_reads_enabled_as_now_and_disabled_as_wait() -> None:
    old = [
        {k: v for k, v in o.items() if k != "admission"}
        for o in (busy("a"), offer("b", "gpu", 2, 2.0, 2))
    ]
    assert [verdict(o) for o in old] == ["wait", "now"]
    assert verdict(over("c")) == "never" and verdict({"admission": "maybe"}) == "wait"
    doc = document(("t", old))
    assert choose_offer(doc, 2) == "b"
    assert [c.admission for c in choices(doc)] == ["wait", "now"]
    only_disabled = document(("t", old[:1]))
    assert choose_offer(only_disabled, 2) == "a"  # the hub decides: queue it or refuse it
    line = check_offer(only_disabled, "a", 2)
    assert line is not None and line.admission == "wait"


def test_the_default_offer_ranks_now_then_wait_and_never_picks_never() -> None:
    assert choose_offer(OFFERS, 1) == "h100"
    assert choose_offer(OFFERS, 2, "nlp") == "h100-nlp"
    assert choose_offer(OFFERS, 3) == "h100"  # it would wait: the job queues
    doc = document(
        ("a", [busy("a-busy"), over("a-over")]), ("b", [offer("b-now", "gpu", 2, 2.0, 2)])
    )
    assert choose_offer(doc, 2) == "b-now"  # now, though another team's line comes first
    assert choose_offer(doc, 2, "a") == "a-busy"  # wait before never
    chosen = default_choice(document(("a", [over("a-over")]), ("b", [busy("b-busy")])), 2)
    assert (chosen.team, chosen.offer, chosen.admission) == ("b", "b-busy", "wait")
    first = document(("a", [busy("first"), busy("second")]))
    assert choose_offer(first, 2) == "first"  # among equals: the hub's order


def test_only_never_lines_are_refused_with_their_reasons() -> None:
    with pytest.raises(
        OptionError,
        match=r"^4× H100 · vision could never start for you: needs 4 GPU-eq; your cap in team "
        r"vision is 3$",
    ):
        choose_offer(OFFERS, 4)
    doc = document(("a", [over("x")]), ("b", [over("y")]))
    with pytest.raises(OptionError) as info:
        choose_offer(doc, 2)
    assert str(info.value) == (
        "every offer with 2 GPU(s) per node could never start for you:\n"
        "  2× H100 · a: needs 2 GPU-eq; your cap in team t is 1\n"
        "  2× H100 · b: needs 2 GPU-eq; your cap in team t is 1"
    )
    cpu = document(("t", [offer("cpu", "cpu", 1, 0.0, 1, "team t may not request cpu", "never")]))
    with pytest.raises(OptionError, match="CPU only · t could never start for you: team t may"):
        choose_offer(cpu, 4)
    with pytest.raises(OptionError, match=r"no GPU offer comes with 5 GPU\(s\) per node"):
        choose_offer(OFFERS, 5)
    with pytest.raises(OptionError, match="you are not in team 'audio'"):
        choose_offer(OFFERS, 1, "audio")


def test_a_named_offer_that_would_wait_is_accepted_one_that_never_could_refused() -> None:
    line = check_offer(OFFERS, "h100", 3)
    assert line is not None and (line.team, line.admission) == ("vision", "wait")
    assert line.reason == "needs 3 GPU-eq; team vision has 2.5 left"
    assert check_offer(OFFERS, "h100", 2, "vision") == choices(OFFERS)[2]
    with pytest.raises(OptionError, match=r"^4× H100 · vision could never start for you: needs 4"):
        check_offer(OFFERS, "h100", 4)
    found = check_offer(OFFERS, "cpu", 8)  # a CPU line takes any number of processes
    assert found is not None and found.admission == "now"
    # no line to judge by: the hub decides (an unknown offer, count or team)
    assert [
        check_offer(OFFERS, *args)  # type: ignore[arg-type]
        for args in (("a100", 1), ("h100", 5), ("h100", 1, "nlp"), ("h100", 1, "audio"))
    ] == [None, None, None, None]
    doc = document(("a", [over("x")]), ("b", [busy("x")]))
    found = check_offer(doc, "x", 2)  # no team named: the best line of the user's teams
    assert found is not None and (found.team, found.admission) == ("b", "wait")
    with pytest.raises(OptionError, match="2× H100 · a could never start for you"):
        check_offer(doc, "x", 2, "a")


#: How many per node each offer kind takes: the table the lab's TypeScript tests read too
#: (``validate.spec.ts``), so the dialog and the CLI, the launcher and ``submit()`` agree.
KINDS = json.loads(
    (Path(__file__).parents[2] / "labextension/src/__tests__/offer_kinds.json").read_text()
)


def line(name: str, kind: str, count: int = 1, admission: str = "now") -> dict[str, Any]:
    """A line of ``kind``, labelled as the hub labels it (whole GPUs and MIG instances: "×N")."""
    base = {
        "cpu": "CPU only",
        "gpu": "H100",
        "mig": "MIG 1g.10gb",
        "share": "6 GB share of RTX3090-24GB",
    }[kind]
    return {
        "name": name,
        "kind": kind,
        "label": f"{base} ×{count}" if kind in ("gpu", "mig") else base,
        "count": count,
        "cost": 0.125 * count,
        "free": 2,
        "admission": admission,
        "enabled": admission == "now",
        "reason": "" if admission == "now" else "why",
    }


def test_the_kinds_per_node_rules_are_the_dialogs() -> None:
    for kind, rule in KINDS["kinds"].items():
        assert (
            kind,
            options.is_counted(kind),
            options.is_one_per_node(kind),
            options.per_node_label(kind),
        ) == (kind, rule["counted"], rule["onePerNode"], rule["perNode"])
    assert list(options.KIND_PREFERENCE) == KINDS["preference"]
    for row in KINDS["fits"]:
        (chosen,) = choices(document(("t", [line("x", row["kind"], row["count"])])))
        assert (row, chosen.fits(row["gpus"])) == (row, row["fits"])


def test_the_default_takes_several_mig_instances_per_node_where_no_gpu_is_offered() -> None:
    migs = [line("mig-1g", "mig", n, "now" if n < 3 else "wait") for n in (1, 2, 3)]
    doc = document(("t", [line("cpu", "cpu"), *migs]))
    assert [(c.offer, c.count) for c in (default_choice(doc, n) for n in (1, 2))] == [
        ("mig-1g", 1),
        ("mig-1g", 2),
    ]
    assert default_choice(doc, 3).admission == "wait"  # the job queues
    with pytest.raises(
        OptionError,
        match=r"^no MIG offer comes with 4 instance\(s\) per node \(counts offered: 1, 2, 3\); "
        r"pass --offer",
    ):
        choose_offer(doc, 4)
    never = document(("t", [line("mig-1g", "mig", 2, "never"), line("mig-2g", "mig", 2, "never")]))
    with pytest.raises(OptionError, match=r"^every MIG offer with 2 instance\(s\) per node could"):
        choose_offer(never, 2)
    # whole GPUs first, as in the dialog
    assert choose_offer(document(("t", [*migs, line("h100", "gpu", 2)])), 2) == "h100"
    found = check_offer(doc, "mig-1g", 2)
    assert found is not None and (found.count, found.label) == (2, "MIG 1g.10gb ×2")


def test_the_default_takes_one_share_per_node_before_cpu() -> None:
    doc = document(("t", [line("cpu", "cpu"), line("share-6gb", "share")]))
    chosen = default_choice(doc, 1)
    assert (chosen.offer, chosen.count) == ("share-6gb", 1)
    with pytest.raises(
        OptionError, match=r"^6 GB share of RTX3090-24GB runs 1 process per node, not 2; pass "
    ):
        choose_offer(doc, 2)
    assert check_offer(doc, "share-6gb", 2) is None  # the hub refuses it, and says why
    refused = document(("t", [line("cpu", "cpu"), line("share-6gb", "share", 1, "never")]))
    with pytest.raises(OptionError, match=r"^6 GB share of RTX3090-24GB · t could never start"):
        choose_offer(refused, 1)
    assert choose_offer(document(("t", [line("cpu", "cpu")])), 4) == "cpu"


VERDICT = st.sampled_from(["now", "wait", "never"])


@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(1, 2), VERDICT), max_size=8))
def test_the_default_is_the_first_line_of_the_best_verdict_never_a_never(
    lines: list[tuple[str, int, str]],
) -> None:
    made = [
        (team, offer(f"o{i}", "gpu", count, 1.0, 1, "why", v))
        for i, (team, count, v) in enumerate(lines)
    ]
    doc = document(*((t, [o for tt, o in made if tt == t]) for t in ("a", "b")))
    fitting = [o for _, o in made if o["count"] == 2]
    ranks = [o["admission"] for o in fitting]
    if not fitting:
        with pytest.raises(OptionError, match="no GPU offer comes with 2"):
            choose_offer(doc, 2)
    elif set(ranks) == {"never"}:
        with pytest.raises(OptionError, match="could never start for you"):
            choose_offer(doc, 2)
    else:
        best = "now" if "now" in ranks else "wait"
        in_hub_order = [o for t in doc["teams"] for o in t["offers"] if o in fitting]
        expected = next(o for o in in_hub_order if o["admission"] == best)
        assert choose_offer(doc, 2) == expected["name"]
