"""Reading user input on the hub: whole numbers, sizes, and quoting user text in refusals.

Vocabulary
- *whole number*: an ``int`` (never a ``bool``), or where the door carries text (a form, a query
  argument) a string of ASCII digits only. ``str.isdigit()`` is not enough: it accepts ``"²"``
  and other Unicode digits that ``int()`` refuses, which used to turn bad input into a 500.
- *echo*: a refusal that quotes what the user sent quotes at most :data:`ECHO_LIMIT` characters
  of it (then "…"), so a huge value is never sent back, logged or stored whole.

Contract: pure; every refusal is an :class:`~gpupool.core.errors.InvalidRequest` (a
:class:`~gpupool.core.errors.TooLarge` for sizes) whose sentence names the field and what is
allowed.
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Iterable
from typing import Any

from .errors import InvalidRequest, TooLarge

ECHO_LIMIT = 64
"""The most characters of a user's text a refusal quotes."""
ECHO_ITEMS = 5
"""The most items of a user's list (unknown keys) a refusal names."""
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
    plus "…"; anything else as its repr, bounded the same way (a huge dict is not walked)."""
    text = value if isinstance(value, str) else _repr.repr(value)
    return text if len(text) <= limit else f"{text[:limit]}…"


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
