"""Persistence of the ledger: allocations in any SQLAlchemy database (SQLite by default).

Vocabulary
- *store*: the database side of the ledger; the pool writes to it before it answers, so a
  restart can rebuild the ledger exactly.
- *upgrade*: Alembic migrations to the newest schema, run at open; the version lives in its own
  table (``gpupool_alembic_version``) so the store may share JupyterHub's database.

Contract: each write is one transaction; a failed write raises and leaves the database as it was.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, delete, event, insert, select
from sqlalchemy.engine import Connection, Engine

from ..core.ledger import Allocation, Device
from .schema import allocations, devices

MIGRATIONS = Path(__file__).parent / "migrations"


def _sqlite_foreign_keys(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


class Store:
    def __init__(self, url: str, *, upgrade: bool = True) -> None:
        self.engine: Engine = create_engine(url)
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_foreign_keys)
        if upgrade:
            self.upgrade()

    def upgrade(self) -> None:
        """Migrate the database to the newest schema (creates it on an empty database)."""
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        with self.engine.begin() as conn:
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def close(self) -> None:
        self.engine.dispose()

    # -- reads -----------------------------------------------------------------------------
    def load(self) -> list[Allocation]:
        """Every persisted allocation, oldest first."""
        with self.engine.connect() as conn:
            held: dict[str, list[Device]] = {}
            for row in conn.execute(select(devices).order_by(devices.c.position)):
                held.setdefault(row.allocation_id, []).append(
                    Device(row.gpu, row.profile, row.start, row.instance)
                )
            rows = conn.execute(select(allocations).order_by(allocations.c.created))
            return [
                Allocation(
                    r.id,
                    r.user,
                    r.team,
                    r.offer,
                    r.kind,
                    r.ref,
                    r.count,
                    r.cost_milli,
                    r.node,
                    tuple(held.get(r.id, ())),
                    r.created,
                )
                for r in rows
            ]

    # -- writes ----------------------------------------------------------------------------
    def insert(self, allocation: Allocation) -> None:
        with self.engine.begin() as conn:
            self._insert(conn, allocation)

    def delete(self, alloc_ids: Iterable[str]) -> None:
        ids = list(alloc_ids)
        if not ids:
            return
        with self.engine.begin() as conn:
            conn.execute(delete(devices).where(devices.c.allocation_id.in_(ids)))
            conn.execute(delete(allocations).where(allocations.c.id.in_(ids)))

    def replace(self, changed: Iterable[Allocation]) -> None:
        """Rewrite allocations whose devices changed (MIG UUIDs refreshed on restore)."""
        with self.engine.begin() as conn:
            for a in changed:
                conn.execute(delete(devices).where(devices.c.allocation_id == a.id))
                conn.execute(delete(allocations).where(allocations.c.id == a.id))
                self._insert(conn, a)

    @staticmethod
    def _insert(conn: Connection, a: Allocation) -> None:
        conn.execute(
            insert(allocations).values(
                id=a.id,
                user=a.user,
                team=a.team,
                offer=a.offer,
                kind=a.kind,
                ref=a.ref,
                count=a.count,
                cost_milli=a.cost_milli,
                node=a.node,
                created=a.created,
            )
        )
        if a.devices:
            conn.execute(
                insert(devices),
                [
                    {
                        "allocation_id": a.id,
                        "position": i,
                        "gpu": d.gpu,
                        "profile": d.profile,
                        "start": d.start,
                        "instance": d.instance,
                    }
                    for i, d in enumerate(a.devices)
                ],
            )
