"""Reading user input on the hub: strict whole numbers, sizes, bounded quotes of user text,
storable text, JSON nesting, and job submissions' text."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool.core.errors import InvalidRequest, NotATeamMember, TooLarge
from gpupool.core.jobs import check_submission
from gpupool.core.parse import (
    ECHO_LIMIT,
    MAX_DEPTH,
    check_size,
    check_text,
    check_texts,
    clip,
    clip_names,
    json_depth,
    json_size,
    parse_json_object,
    whole_number,
)
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


def test_clip_shows_what_a_log_or_terminal_would_obey_as_escapes() -> None:
    assert clip("a\nb\r\x1b[2J\t\x85\u2028\u202eZ\ud800") == (
        "a\\nb\\r\\x1b[2J\\t\\x85\\u2028\\u202eZ\\ud800"
    )
    assert clip("é😀 <b>\u200b") == "é😀 <b>\u200b"  # other text as it came
    assert clip("\n" * 100) == "\\n" * ECHO_LIMIT + "…"  # cut first: 64 of the user's characters


@given(st.text())
def test_a_clipped_quote_is_one_line_of_encodable_text(text: str) -> None:
    quoted = clip(text)
    assert len(quoted.splitlines()) <= 1
    quoted.encode("utf-8")


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


# -- storable text ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text",
    ["", "plain", "é😀", "\u202eevil", "\x1b[31m\x07\r\n\t", "<script>x</script>", "x" * 10_000],
)
def test_control_characters_overrides_markup_and_long_text_are_storable(text: str) -> None:
    check_text(text, "name")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("\ud800", "name contains a lone surrogate (U+D800 at character 0)"),
        ("ab\udfff", "name contains a lone surrogate (U+DFFF at character 2)"),
        ("\udc00\ud800", "name contains a lone surrogate (U+DC00 at character 0)"),
        ("a\0", "name contains a NUL character (at character 1)"),
    ],
)
def test_lone_surrogates_and_nul_are_refused_saying_where(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        check_text(text, "name")
    assert e.value.message.startswith(message + ", which ")


@given(st.text())
def test_text_is_storable_exactly_when_it_encodes_as_utf8_without_nul(text: str) -> None:
    try:
        check_text(text, "t")
    except InvalidRequest:
        refused = True
    else:
        refused = False
    try:
        text.encode("utf-8")
        encodes = True
    except UnicodeEncodeError:
        encodes = False
    assert refused == (not encodes or "\0" in text)


def test_texts_names_the_place_in_the_document() -> None:
    cases = [
        ({"name": "\ud800"}, "", "name contains a lone"),
        ({"args": ["ok", "a\0"]}, "", "args[1] contains a NUL"),
        ({"env": {"K": "\ud800"}}, "", "env['K'] contains a lone"),
        ({"env": {"\ud800": "v"}}, "", "A key of env contains a lone"),
        ({"\ud800": 1}, "", "A field name contains a lone"),
        ({"a": [{"b": ("x\0",)}]}, "user_options", "user_options['a'][0]['b'][0] contains a NUL"),
        (["\ud800"], "args", "args[0] contains a lone"),
    ]
    for value, name, message in cases:
        with pytest.raises(InvalidRequest) as e:
            check_texts(value, name)
        assert e.value.message.startswith(message), (value, e.value.message)
    check_texts({"a": [1, 2.5, None, True, {"b": "\u202e<b>"}], 3: "x"}, "user_options")


def test_texts_refuses_nesting_deeper_than_the_limit_without_recursion() -> None:
    ok: list[object] = []
    for _ in range(MAX_DEPTH - 1):
        ok = [ok]
    check_texts(ok, "user_options")  # MAX_DEPTH levels
    deep: list[object] = []
    for _ in range(sys.getrecursionlimit() * 10):
        deep = [deep]
    for value in ([ok], deep, {"k": deep}):
        with pytest.raises(InvalidRequest) as e:
            check_texts(value, "user_options")
        assert e.value.message == (
            f"user_options nests arrays and objects deeper than {MAX_DEPTH} levels;"
            " send a flatter document."
        )


# -- JSON nesting, measured before parsing -------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "depth"),
    [
        (b"1", 0),
        (b'"[[[["', 0),
        (b"[]", 1),
        (b'{"a": [[], {"b": []}]}', 4),
        (b'{"a": "\\\\", "b": [[]]}', 3),  # an escaped backslash ends before the quote
        (b'{"a": "\\"[[", "b": {}}', 2),  # an escaped quote does not end the string
        (b"[" * 100_000 + b"]" * 100_000, 100_000),
    ],
)
def test_json_depth_counts_arrays_and_objects_outside_strings(text: bytes, depth: int) -> None:
    assert json_depth(text) == depth


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='[]{}"\\ab\n'),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(alphabet='[]{}"\\a'), inner, max_size=3)
    ),
    max_leaves=20,
)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@given(json_values)
def test_json_depth_is_the_parsed_documents_depth(value: object) -> None:
    assert json_depth(json.dumps(value).encode()) == _depth(value)
    assert json_depth(json.dumps(value, indent=1, ensure_ascii=False).encode()) == _depth(value)


def test_a_json_object_is_parsed_only_within_its_size_and_depth() -> None:
    assert parse_json_object(b"", 10) == {}
    assert parse_json_object(b'{"a": [1]}', 10) == {"a": [1]}
    for body, error, message in [
        (b'{"a": "' + b"x" * 20 + b'"}', TooLarge, "The request body is 29 bytes; the limit is"),
        (b"[" * 10_000 + b"]" * 10_000, InvalidRequest, "The request body nests arrays and"),
        (b"[" * 10_000, InvalidRequest, "The request body nests arrays and"),  # not even JSON
        (b'{"a": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", InvalidRequest, "The request"),
        (b"{", InvalidRequest, "The request body is not valid JSON."),
        (b"[]", InvalidRequest, "The request body must be a JSON object."),
    ]:
        with pytest.raises(error) as e:
            parse_json_object(body, 100_000 if error is not TooLarge else 20)
        assert e.value.message.startswith(message), e.value.message


# -- a job submission's text -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["A", "_", "MY_SETTING_2", "lower_case", "_1"])
def test_portable_env_names_are_accepted(name: str) -> None:
    check_submission({"script": "print(1)", "env": {name: "v"}})


@pytest.mark.parametrize("name", ["", "A=B", "=", "1A", "A B", "A-B", "É", "A\n", "A.B"])
def test_other_env_names_are_refused_naming_the_name(name: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        check_submission({"script": "print(1)", "env": {name: "v"}})
    assert e.value.message == (
        f"env name {name!r} is not a portable name: use ASCII letters, digits and _, not"
        " starting with a digit (like MY_SETTING)."
    )


def test_a_submission_of_the_wrong_types_is_left_to_the_spec_checks() -> None:
    check_submission({"script": 3, "env": ["A=B"], "args": "x", "name": None})
    check_submission({"env": {"A": 1}})
