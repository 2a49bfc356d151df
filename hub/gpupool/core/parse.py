"""Reading user input on the hub: whole numbers, sizes, text, JSON, and quoting user text.

Vocabulary
- *whole number*: an ``int`` (never a ``bool``), or where the door carries text (a form, a query
  argument) a string of ASCII digits only. ``str.isdigit()`` is not enough: it accepts ``"²"``
  and other Unicode digits that ``int()`` refuses, which used to turn bad input into a 500.
- *echo*: a refusal that quotes what the user sent quotes at most :data:`ECHO_LIMIT` characters
  of it (then "…"), so a huge value is never sent back, logged or stored whole, and shows its
  control characters, line breaks and bidirectional controls as escapes (``\\n``, ``\\x1b``,
  ``\\u202e``), so a refusal is one line in every log and cannot disguise what follows it.
- *storable text*: a string every page, table, file name, argument and environment value can
  hold: no lone surrogate (U+D800 to U+DFFF on its own, which JSON's ``\\ud800`` escape makes
  and no UTF-8 encoder writes: a page holding one answers 500), and no NUL (which no path,
  argument or environment value can carry). Everything else (control characters, right-to-left
  overrides, markup) is stored as sent; the pages escape it, the CLI shows it visibly.
- *nesting*: how deep a JSON document puts arrays and objects in each other; a document a user
  sends nests at most :data:`MAX_DEPTH` deep, which is measured before it is parsed (a parser
  recurses, and 10,000 brackets would end in a ``RecursionError``).

Contract: pure; every refusal is an :class:`~gpupool.core.errors.InvalidRequest` (a
:class:`~gpupool.core.errors.TooLarge` for sizes) whose sentence names the field and what is
allowed.
"""

from __future__ import annotations

import json
import re
import reprlib
from collections import deque
from collections.abc import Iterable
from itertools import accumulate
from typing import Any

from gpupool.core.errors import InvalidRequest, TooLarge

ECHO_LIMIT = 64
"""The most characters of a user's text a refusal quotes."""
ECHO_ITEMS = 5
"""The most items of a user's list (unknown keys) a refusal names."""
MAX_DEPTH = 32
"""The deepest a user's JSON document (a request body, ``user_options``) may nest arrays and
objects; gpupool's own documents nest at most 2 deep."""
_UNBOUNDED_DIGITS = 18
"""Digits a whole number without an upper bound may have (below 2**63)."""

_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = ECHO_LIMIT
_repr.maxlist = _repr.maxdict = _repr.maxtuple = _repr.maxset = ECHO_ITEMS
_repr.maxlevel = 2


def whole_number(
    value: Any, name: str, low: int, high: int | None = None, *, text: bool = True
) -> int:
    """``value`` as an ``int`` from ``low`` to ``high`` (``None``: no upper bound), or
    :class:`InvalidRequest` naming ``name`` and the range. ``text=False`` accepts ints only
    (a JSON API whose documents say integer)."""
    allowed = f"from {low} to {high}" if high is not None else f">= {low}"
    refusal = InvalidRequest(f"{name} must be a whole number {allowed}.")
    if isinstance(value, str) and text:
        digits = value.lstrip("0") or "0"
        most = len(str(high)) if high is not None else _UNBOUNDED_DIGITS
        if not (value.isascii() and value.isdigit()) or len(digits) > most:
            raise refusal
        value = int(digits)
    if isinstance(value, bool) or not isinstance(value, int):
        raise refusal
    if value < low or (high is not None and value > high):
        raise refusal
    return value


def clip(value: Any, limit: int = ECHO_LIMIT) -> str:
    """User-supplied ``value`` as a refusal may quote it: a string cut to ``limit`` characters
    plus "…", with what a log or terminal would obey escaped (see *echo*); anything else as its
    repr, bounded the same way (a huge dict is not walked)."""
    text = value if isinstance(value, str) else _repr.repr(value)
    cut = text if len(text) <= limit else f"{text[:limit]}…"
    return _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), cut)


_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u2028\u2029\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)
"""Control characters (C0, DEL, C1), line and paragraph separators, bidirectional controls,
and surrogates (which no page can encode)."""


def quoted(value: Any) -> str:
    """``'value'``: :func:`clip` in single quotes, for a refusal's sentence (``repr`` would
    escape :func:`clip`'s escapes again)."""
    return f"'{clip(value)}'"


def clip_names(items: Iterable[Any], most: int = ECHO_ITEMS) -> str:
    """``a, b, c and 7 more``: at most ``most`` items of a user's list, each :func:`clip` ped."""
    items = list(items)
    shown = ", ".join(clip(i) for i in items[:most])
    return f"{shown} and {len(items) - most} more" if len(items) > most else shown


def json_size(value: Any) -> int:
    """Bytes of ``value`` as compact UTF-8 JSON (what a client sent, near enough); values JSON
    cannot encode count as their ``repr``."""
    text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=repr)
    return len(text.encode("utf-8", "surrogatepass"))


def check_size(size: int, limit: int, what: str) -> None:
    """Refuse ``what`` of ``size`` bytes over ``limit`` (:class:`TooLarge`, HTTP 413)."""
    if size > limit:
        raise TooLarge(f"{what} is {size} bytes; the limit is {limit} bytes.")


# -- text and JSON -------------------------------------------------------------------------------
_STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
"""A JSON string literal (its escapes included), as bytes."""
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth(text: bytes) -> int:
    """How deep the JSON document ``text`` nests arrays and objects (``0`` for a scalar), read
    without parsing it: in linear time, without recursion. Brackets inside strings are text.
    For bytes that are no JSON the number means nothing, and the parser refuses them anyway."""
    brackets = _STRINGS.sub(b"", text).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _too_deep(what: str) -> InvalidRequest:
    return InvalidRequest(
        f"{what} nests arrays and objects deeper than {MAX_DEPTH} levels; send a flatter document."
    )


def parse_json_object(body: bytes, limit: int, what: str = "The request body") -> dict[str, Any]:
    """``body`` as a JSON object: :class:`TooLarge` over ``limit`` bytes and
    :class:`InvalidRequest` if nested deeper than :data:`MAX_DEPTH` (both checked before it is
    parsed), if it is no JSON, or no object. An empty body is ``{}``."""
    check_size(len(body), limit, what)
    if json_depth(body) > MAX_DEPTH:
        raise _too_deep(what)
    try:
        value = json.loads(body or b"{}")
    except ValueError:
        raise InvalidRequest(f"{what} is not valid JSON.") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a JSON object.")
    return value


def check_text(text: str, what: str) -> None:
    """Refuse ``text`` unless it is storable text (see the module docstring), with an
    :class:`InvalidRequest` naming ``what`` and where the offending character is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = f"U+{ord(text[e.start]):04X}"
        raise InvalidRequest(
            f"{what} contains a lone surrogate ({code} at character {e.start}), which is no "
            "character: send text as UTF-8 (a JSON \\u escape of a surrogate needs its pair)."
        ) from None
    nul = text.find("\0")
    if nul >= 0:
        raise InvalidRequest(
            f"{what} contains a NUL character (at character {nul}), which no path, argument or "
            "environment value can hold: remove it."
        )


def check_texts(value: Any, name: str = "") -> None:
    """Every string in ``value`` (a JSON-like document: dicts, lists and tuples, walked without
    recursion, in document order), keys included, is storable text (:func:`check_text`), and
    ``value`` nests at most :data:`MAX_DEPTH` deep. A refusal names where: ``name`` for
    ``value`` itself (``""``: its fields by their own names), then ``[0]`` and ``['key']``."""
    todo: deque[tuple[Any, str, int]] = deque([(value, name, 0)])
    while todo:
        item, where, depth = todo.popleft()
        if isinstance(item, str):
            check_text(item, where)
            continue
        if not isinstance(item, dict | list | tuple):
            continue
        if depth >= MAX_DEPTH:
            raise _too_deep(name or "The document")
        if isinstance(item, dict):
            for key, sub in item.items():
                if isinstance(key, str):
                    check_text(key, f"A key of {where}" if where else "A field name")
                label = quoted(key) if isinstance(key, str) else repr(key)
                todo.append((sub, f"{where}[{label}]" if where else clip(key), depth + 1))
        else:
            todo.extend((sub, f"{where}[{i}]", depth + 1) for i, sub in enumerate(item))
