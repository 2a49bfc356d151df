"""Reading user input on the hub: strict whole numbers, sizes, and bounded quotes of user text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool.core.errors import InvalidRequest, NotATeamMember, TooLarge
from gpupool.core.parse import ECHO_LIMIT, check_size, clip, clip_names, json_size, whole_number
from gpupool.core.quota import EVERYONE, Team, check_offer, resolve_team


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0), (7, 7), ("7", 7), ("007", 7), ("64", 64), ("0", 0)],
)
def test_ints_and_ascii_digit_strings_are_whole_numbers(value: object, expected: int) -> None:
    assert whole_number(value, "count", 0, 64) == expected


@pytest.mark.parametrize(
    "value",
    [
        "²",  # isdigit() says yes, int() says no: this was a 500
        "١٢",  # Arabic-Indic digits: int() accepts them, the hub does not
        "٣",
        "𝟗",
        "1_000",
        " 1",
        "1 ",
        "+1",
        "-1",
        "",
        "1.0",
        "0x10",
        True,
        False,
        1.0,
        None,
        [1],
        {"n": 1},
        65,
        -1,
        "65",
        "9" * 5000,  # int() of over 4300 digits raises ValueError: refused before int()
    ],
)
def test_anything_else_is_refused_naming_the_field_and_range(value: object) -> None:
    with pytest.raises(InvalidRequest) as e:
        whole_number(value, "user_options.count", 0, 64)
    assert e.value.message == "user_options.count must be a whole number from 0 to 64."


def test_text_can_be_refused_where_the_document_says_integer() -> None:
    assert whole_number(3, "gpus", 1, 64, text=False) == 3
    with pytest.raises(InvalidRequest, match="gpus must be a whole number from 1 to 64"):
        whole_number("3", "gpus", 1, 64, text=False)


def test_without_an_upper_bound() -> None:
    assert whole_number("123456789012345678", "offset", 0) == 123456789012345678
    for value in ("1234567890123456789", "²", "-3"):
        with pytest.raises(InvalidRequest) as e:
            whole_number(value, "offset", 0)
        assert e.value.message == "offset must be a whole number >= 0."


@given(st.text(max_size=30))
def test_any_text_is_a_number_in_range_or_an_invalid_request(text: str) -> None:
    try:
        value = whole_number(text, "n", 0, 10**9)
    except InvalidRequest:
        assert not (text.isascii() and text.isdigit() and int(text) <= 10**9)
    else:
        assert 0 <= value <= 10**9 and text.isascii() and text.isdigit()


def test_clip_bounds_user_text_and_marks_the_cut() -> None:
    assert clip("h100") == "h100"
    assert clip("x" * ECHO_LIMIT) == "x" * ECHO_LIMIT
    assert clip("x" * (5 << 20)) == "x" * ECHO_LIMIT + "…"
    assert len(clip({"k" * 1000: ["v" * 1000] * 1000})) <= ECHO_LIMIT + 1
    assert clip(None) == "None" and clip(3) == "3"


def test_clip_names_names_a_few_and_counts_the_rest() -> None:
    assert clip_names(["a", "b"]) == "a, b"
    names = clip_names(["k" * 10_000, *(f"x{i}" for i in range(99))])
    assert names == f"{'k' * ECHO_LIMIT}…, x0, x1, x2, x3 and 95 more"


def test_sizes() -> None:
    assert json_size({"offer": "h100", "count": 1}) == len('{"offer":"h100","count":1}')
    assert json_size({"é": "\ud800"}) > 0  # a lone surrogate from JSON does not break it
    check_size(10, 10, "x")
    with pytest.raises(TooLarge) as e:
        check_size(11, 10, "user_options")
    assert e.value.message == "user_options is 11 bytes; the limit is 10 bytes."
    assert isinstance(e.value, InvalidRequest)


def test_unknown_offer_and_team_names_are_quoted_short() -> None:
    huge = "o" * (1 << 20)
    with pytest.raises(InvalidRequest) as e:
        check_offer(Team("t", 1000), {}, huge, 1)
    assert len(e.value.message) < 200 and "…" in e.value.message
    with pytest.raises(NotATeamMember) as e2:
        resolve_team({}, Team(EVERYONE), ["a"], huge)
    assert len(e2.value.message) < 200 and "…" in e2.value.message
