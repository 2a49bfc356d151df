"""A pool database that refuses writes, for real: gpupool's tables renamed away by another
connection (the database answers "no such table", as it does for a dropped table), and renamed
back. Works on SQLite and PostgreSQL alike; reads fail too, as they do for a dropped table."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy import create_engine, text

TABLES = ("gpupool_allocations", "gpupool_jobs")
AWAY = "_away"


def _rename(url: str, away: bool) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            for table in TABLES:
                old, new = (table, table + AWAY) if away else (table + AWAY, table)
                conn.execute(text(f"ALTER TABLE {old} RENAME TO {new}"))
    finally:
        engine.dispose()


def refuse_writes(url: str) -> None:
    """From now on the pool's writes of allocations and jobs fail."""
    _rename(url, away=True)


def take_writes(url: str) -> None:
    """The database works again."""
    _rename(url, away=False)


@contextmanager
def refusing_writes(url: str) -> Iterator[None]:
    refuse_writes(url)
    try:
        yield
    finally:
        take_writes(url)
