"""Pages of a list, newest first: a limit and a cursor (``GET /jobs``).

Vocabulary
- *order*: newest first, by creation time, then by id (both descending), so it is total.
- *page*: at most ``limit`` items (1 to :data:`MAX_PAGE`; :data:`DEFAULT_PAGE` when none is
  given) that come after the *cursor* in that order.
- *cursor*: text naming where the previous page ended (the creation time and id of its last
  item, ``<created>_<id>``), given back as ``next`` while more items follow (else ``None``).
  It names a place, not an item: a page read later is still right when items were added (they
  come before it) or removed since.

Contract: pure. A limit or cursor that is not one of these is an
:class:`~gpupool.core.errors.InvalidRequest` naming it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TypeVar

from gpupool.core.errors import InvalidRequest
from gpupool.core.parse import whole_number

T = TypeVar("T")
DEFAULT_PAGE = 50
MAX_PAGE = 500
_CURSOR = re.compile(r"(\d{1,20}(?:\.\d{1,20})?(?:e[+-]\d{1,3})?)_([0-9A-Za-z-]{1,64})")

Key = tuple[float, str]
"""Where an item sits in the order: its creation time and its id."""


def page_limit(text: str | None) -> int:
    """The ``limit`` query argument (text of ASCII digits), :data:`DEFAULT_PAGE` when absent
    (``None``; an empty ``?limit=`` is no whole number)."""
    return DEFAULT_PAGE if text is None else whole_number(text, "limit", 1, MAX_PAGE)


def cursor_of(key: Key) -> str:
    created, ident = key
    return f"{float(created)!r}_{ident}"


def parse_cursor(text: str) -> Key:
    m = _CURSOR.fullmatch(text)
    if not m:
        raise InvalidRequest(
            "cursor must be the 'next' of a page you were given (or left out for the first page)."
        )
    return float(m.group(1)), m.group(2)


def page(
    items: Iterable[T], key: Callable[[T], Key], limit: int, cursor: str | None = None
) -> tuple[list[T], str | None]:
    """The page of ``items`` after ``cursor`` (from the newest without one), and the cursor of
    the next page (``None`` when nothing follows)."""
    after = parse_cursor(cursor) if cursor else None
    ordered = sorted(items, key=key, reverse=True)
    if after is not None:
        ordered = [i for i in ordered if key(i) < after]
    shown = ordered[:limit]
    more = len(ordered) > limit
    return shown, cursor_of(key(shown[-1])) if more else None
