"""Persistence of the ledger: allocations in any SQLAlchemy database (SQLite by default).

Vocabulary
- *store*: the database side of the ledger; the pool writes to it before it answers, so a
  restart can rebuild the ledger exactly.
- *upgrade*: Alembic migrations to the newest schema, run at open; the version lives in its own
  table (``gpupool_alembic_version``) so the store may share JupyterHub's database.

Contract: each write is one transaction; a failed write raises and leaves the database as it was.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, delete, event, insert, select
from sqlalchemy.engine import Connection, Engine

from ..core.jobs import Job, JobSpec
from ..core.ledger import Allocation, Device
from .schema import allocations, devices, jobs

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

    # -- jobs --------------------------------------------------------------------------------
    def save_job(self, job: Job) -> None:
        """Insert or replace one job (one transaction)."""
        row = _job_row(job)
        with self.engine.begin() as conn:
            conn.execute(delete(jobs).where(jobs.c.id == job.id))
            conn.execute(insert(jobs).values(**row))

    def load_jobs(self) -> list[Job]:
        with self.engine.connect() as conn:
            return [_row_job(r) for r in conn.execute(select(jobs).order_by(jobs.c.created))]


def _job_row(job: Job) -> dict[str, Any]:
    spec = asdict(job.spec)
    return {
        "id": job.id,
        "owner": job.owner,
        "team": job.team,
        "state": job.state,
        "reason": job.reason,
        "spec": json.dumps(spec),
        "created": job.created,
        "started": job.started,
        "finished": job.finished,
        "exit_codes": json.dumps({str(r): c for r, c in job.exit_codes}),
        "restarts": job.restarts,
        "allocations": json.dumps(list(job.allocations)),
        "handle": job.handle,
    }


def _row_job(r: Any) -> Job:
    spec = json.loads(r.spec)
    spec["args"] = tuple(spec.get("args", ()))
    spec["env"] = tuple(tuple(kv) for kv in spec.get("env", ()))
    return Job(
        id=r.id,
        owner=r.owner,
        team=r.team,
        spec=JobSpec(**spec),
        state=r.state,
        reason=r.reason,
        created=r.created,
        started=r.started,
        finished=r.finished,
        exit_codes=tuple(sorted((int(k), int(v)) for k, v in json.loads(r.exit_codes).items())),
        restarts=r.restarts,
        allocations=tuple(json.loads(r.allocations)),
        handle=r.handle,
    )
