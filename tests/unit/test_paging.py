"""Pages newest first with a limit and a cursor (``gpupool.core.paging``): every item once, in
order, however the pages are cut, also when items come and go between pages."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool.core.errors import InvalidRequest
from gpupool.core.paging import DEFAULT_PAGE, MAX_PAGE, page, page_limit

Item = tuple[float, str]


def key(item: Item) -> Item:
    return item


def read_all(items: list[Item], limit: int) -> list[Item]:
    out: list[Item] = []
    cursor = None
    while True:
        shown, cursor = page(items, key, limit, cursor)
        assert len(shown) <= limit
        out += shown
        if cursor is None:
            return out


ITEMS = st.lists(
    st.tuples(st.floats(0, 2e9, allow_nan=False), st.text("0123456789abcdef", min_size=1)),
    unique=True,
    max_size=60,
)


@given(ITEMS, st.integers(1, 70))
def test_the_pages_hold_every_item_once_newest_first(items: list[Item], limit: int) -> None:
    assert read_all(items, limit) == sorted(items, reverse=True)


@given(ITEMS, ITEMS, st.integers(1, 10))
def test_items_added_or_removed_between_pages_never_repeat_or_skip_older_ones(
    items: list[Item], later: list[Item], limit: int
) -> None:
    first, cursor = page(items, key, limit)
    if cursor is None:
        return
    boundary = first[-1]
    changed = list(dict.fromkeys([i for i in items if i not in first[:1]] + later))
    rest, _ = page(changed, key, 10**6, cursor)  # one shown was removed, more were added
    assert rest == sorted((i for i in changed if i < boundary), reverse=True)


def test_the_limit_is_a_whole_number_from_1_to_the_most_a_page_holds() -> None:
    assert page_limit(None) == DEFAULT_PAGE  # no ?limit at all
    assert page_limit("7") == 7 and page_limit(str(MAX_PAGE)) == MAX_PAGE
    for bad in ("", "0", str(MAX_PAGE + 1), "x", "²", "-1", " 1"):  # "": ?limit= (the fuzz)
        with pytest.raises(InvalidRequest, match="limit must be a whole number from 1 to 500"):
            page_limit(bad)


@pytest.mark.parametrize("cursor", ["nonsense", "1.5", "_abc", "inf_abc", "1.5_", "1.5_a b"])
def test_a_cursor_that_is_no_page_end_is_refused(cursor: str) -> None:
    with pytest.raises(InvalidRequest, match="cursor must be the 'next' of a page"):
        page([(1.0, "a")], key, 1, cursor)
