"""Persistence of the ledger: allocations in any SQLAlchemy database (SQLite by default).

Vocabulary
- *store*: the database side of the ledger; the pool writes to it before it answers, so a
  restart can rebuild the ledger exactly.
- *jobs*: one row per job (its spec without the script), rewritten at each state change; the
  script in a table of its own, written once and read when the job starts; both deleted when
  retention forgets the job (:meth:`Store.delete_jobs`).
- *upgrade*: Alembic migrations to the newest schema, run at open; the version lives in its own
  table (``gpupool_alembic_version``) so the store may share JupyterHub's database.
- *checked open*: before and after the upgrade the store makes sure the database can be gpupool's
  store: it opens (for SQLite: it is a SQLite file and ``PRAGMA quick_check`` finds no damage);
  it is empty, gpupool's, or another application's without gpupool tables (gpupool then adds its
  own, as when it shares JupyterHub's); its migration is one this gpupool knows; every table is
  there; and a real write (one row in each table, rolled back) succeeds, which for SQLite also
  proves that the journal can be made next to the file. Otherwise :class:`StoreError`, one line
  naming the database (without a password) and what to do.

Contract: each write is one transaction; a failed write raises and leaves the database as it was.
A database refused before its upgrade (not a database, damaged, not gpupool's, an unknown
migration) is left as it was found; the write check is always rolled back.
"""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import create_engine, delete, event, insert, inspect, select, text
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from gpupool.core.jobs import Job, JobSpec
from gpupool.core.ledger import Allocation, Device
from gpupool.store.schema import allocations, devices, job_scripts, jobs, metadata, mig_instances

MIGRATIONS = Path(__file__).parent / "migrations"
VERSION_TABLE = "gpupool_alembic_version"
PROBE = "gpupool-write-check"
"""The id of the rows the write check inserts and rolls back."""
T = TypeVar("T")


class StoreError(RuntimeError):
    """The database cannot be gpupool's store: one line naming it and saying what to do."""


def _sqlite_foreign_keys(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def describe(url: str | URL) -> str:
    """How messages name a database: a SQLite file by its absolute path, anything else by its
    URL with the password hidden (``postgresql://gpupool:***@db/gpupool``)."""
    url = make_url(url)
    if url.get_backend_name() == "sqlite":
        path = _sqlite_path(url)
        return str(path) if path else "an in-memory SQLite database"
    return url.render_as_string(hide_password=True)


def _sqlite_path(url: URL) -> Path | None:
    """The file of a SQLite URL, absolute (relative ones are opened from the current folder)."""
    db = url.database or ""
    if not db or db == ":memory:" or url.query.get("mode") == "memory":
        return None
    if db.startswith("file:"):
        db = db.removeprefix("file:").partition("?")[0]
    return Path(os.path.abspath(db))


def schema_problem(
    tables: Iterable[str], versions: Sequence[str] | None, known: Sequence[str], fresh_start: str
) -> str | None:
    """Why a database with these ``tables`` and migration record (the rows of
    ``gpupool_alembic_version``; ``None`` without that table) cannot be migrated by a gpupool
    that knows the revisions ``known`` (oldest first): "is ...: what to do", where ``fresh_start``
    says how to start over; ``None`` when it can be.

    A database without gpupool tables is fine whatever else it holds (gpupool may share
    JupyterHub's); gpupool tables without a record of their migration, several records, or a
    revision this gpupool does not know are not.
    """
    ours = sorted(t for t in tables if t.startswith("gpupool_") and t != VERSION_TABLE)
    if not versions:
        if not ours:
            return None
        record = "no record" if versions is None else "an empty record"
        return (
            f"has gpupool tables ({', '.join(ours)}) but {record} of their migration "
            f"(table {VERSION_TABLE}): {fresh_start}"
        )
    if len(versions) > 1:
        listed = ", ".join(sorted(versions))
        return f"records several migrations ({listed}) where gpupool keeps one: {fresh_start}"
    if versions[0] not in known:
        return (
            f"is at migration {versions[0]!r}, which this gpupool does not know (its newest is "
            f"{known[-1]!r}; written by a newer gpupool?): upgrade gpupool, or restore a backup "
            "made with this version"
        )
    return None


class Store:
    def __init__(self, url: str, *, upgrade: bool = True) -> None:
        """Open the database at ``url``; with ``upgrade`` (the default) check it and migrate it
        to the newest schema, raising :class:`StoreError` when it cannot be gpupool's store."""
        try:
            self.engine: Engine = create_engine(url)
        except ImportError as e:  # the URL names a driver that is not installed
            raise StoreError(
                f"gpupool's database {describe(url)} cannot be opened ({e}): install the "
                "database driver the URL names (PostgreSQL: pip install "
                "'jupyterhub-gpupool[postgresql]' and a postgresql+psycopg:// URL)"
            ) from None
        self.where = describe(self.engine.url)
        """The database as messages name it (never with its password)."""
        if self.engine.dialect.name == "sqlite":
            event.listen(self.engine, "connect", _sqlite_foreign_keys)
        if upgrade:
            self.upgrade()

    def upgrade(self) -> None:
        """Check the database, migrate it to the newest schema (creating it when empty) and check
        that it is writable; :class:`StoreError` when it cannot be gpupool's store."""
        cfg = Config()
        cfg.set_main_option("script_location", str(MIGRATIONS))
        script = ScriptDirectory.from_config(cfg)
        known = [s.revision for s in reversed(list(script.walk_revisions()))]
        head = known[-1]
        new = self._sqlite_file_missing()
        tables, versions = self._checked(
            "cannot be created" if new else "cannot be read", self._read
        )
        problem = schema_problem(tables, versions, known, self._fresh_start())
        if problem:
            raise StoreError(f"gpupool's database {self.where} {problem}")
        current = versions[0] if versions else None

        def migrate() -> None:
            with self.engine.begin() as conn:
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")

        if current != head:
            what = (
                f"could not be upgraded from migration {current!r} to {head!r}"
                if current
                else "could not be set up"
            )
            self._checked(what, migrate)
        tables, _ = self._checked("cannot be read", self._read)
        missing = sorted(set(metadata.tables) - set(tables))
        if missing:
            lacks = f"the table{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
            raise StoreError(
                f"gpupool's database {self.where} is at migration {head!r} but lacks {lacks}: "
                f"{self._fresh_start()}"
            )
        self._checked("is not writable", self.write_check)

    # -- the checks --------------------------------------------------------------------------
    def _read(self) -> tuple[list[str], list[str] | None]:
        """The database's tables and its gpupool migration record (``None``: no such table);
        for SQLite, after ``PRAGMA quick_check`` found nothing wrong."""
        with self.engine.connect() as conn:
            if self.engine.dialect.name == "sqlite":
                found = [str(r[0]) for r in conn.exec_driver_sql("PRAGMA quick_check")]
                if found != ["ok"]:
                    lines = "\n".join(found).splitlines()
                    first = next((n for n in lines if n.strip() and not n.startswith("***")), "")
                    raise StoreError(
                        f"gpupool's database {self.where} is damaged ({first.strip()}): "
                        f"{self._fresh_start()}"
                    )
            tables = inspect(conn).get_table_names()
            if VERSION_TABLE not in tables:
                return tables, None
            rows = conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}"))
            return tables, [str(r[0]) for r in rows]

    def write_check(self) -> None:
        """Write one row into each table the pool writes, then roll back: what the first spawn
        or job would do (for SQLite, this makes the journal next to the file)."""
        with self.engine.connect() as conn:
            trans = conn.begin()
            try:
                row = {"user": "", "team": "", "offer": "", "kind": "", "count": 0}
                conn.execute(insert(allocations).values(id=PROBE, cost_milli=0, created=0, **row))
                conn.execute(insert(devices).values(allocation_id=PROBE, position=0, gpu=""))
                conn.execute(
                    insert(jobs).values(id=PROBE, owner="", team="", state="", spec="", created=0)
                )
                conn.execute(insert(job_scripts).values(job_id=PROBE, script=""))
                conn.execute(
                    insert(mig_instances).values(
                        node=PROBE, gpu="", start=0, profile="", state="", created=0
                    )
                )
            finally:
                trans.rollback()

    def _checked(self, what: str, step: Callable[[], T]) -> T:
        """Run ``step``; a database error becomes a :class:`StoreError` saying ``what`` (unless
        SQLite's error code says more: not a database, damaged, read-only, locked, full)."""
        try:
            return step()
        except StoreError:
            raise
        except (SQLAlchemyError, CommandError) as e:
            orig = e.orig if isinstance(e, DBAPIError) else None
            reason = (str(orig if orig is not None else e).strip().splitlines() or ["?"])[0]
            code = str(getattr(orig, "sqlite_errorname", ""))
            what, advice = self._explain(what, code)
            raise StoreError(f"gpupool's database {self.where} {what} ({reason}): {advice}") from e

    def _explain(self, what: str, code: str) -> tuple[str, str]:
        """What is wrong and what to do, from SQLite's error code (``SQLITE_NOTADB``, ...)."""
        if code == "SQLITE_NOTADB":
            return "is not a SQLite database", self._fresh_start()
        if code.startswith("SQLITE_CORRUPT"):
            return "is damaged", self._fresh_start()
        if code.startswith("SQLITE_BUSY") or code.startswith("SQLITE_LOCKED"):
            return "is locked by another process", (
                "stop the other hub that uses it, or give this hub a database of its own"
            )
        if code == "SQLITE_FULL":
            return "cannot grow", "free space on its disk"
        if code.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_AUTH")):
            what = "is read-only" if code.startswith("SQLITE_READONLY") else what
            return what, self._write_access()
        if self.engine.dialect.name == "sqlite":
            return what, f"check the file and its disk, or {self._fresh_start()}"
        if what.startswith("cannot"):
            return what, "check that the database server is up and that the URL is right"
        return what, "give the URL's account the right to create tables and write rows in it"

    def _sqlite_file_missing(self) -> bool:
        path = _sqlite_path(self.engine.url) if self.engine.dialect.name == "sqlite" else None
        return path is not None and not path.exists()

    def _fresh_start(self) -> str:
        if self.engine.dialect.name == "sqlite" and _sqlite_path(self.engine.url):
            return "move it away to start with an empty pool, or restore a backup"
        return "point GPUPool.db_url at an empty database to start with an empty pool"

    def _write_access(self) -> str:
        """Who must be able to write what, for a SQLite file."""
        path = _sqlite_path(self.engine.url) if self.engine.dialect.name == "sqlite" else None
        if path is None:
            return "give the URL's account the right to write it"
        if not path.parent.is_dir():
            return f"the directory {path.parent} does not exist; create it, or fix the URL"
        if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
            return (
                f"the file system of {path.parent} is mounted read-only; the file and its "
                "directory must be writable, since SQLite keeps a journal next to the file"
            )
        try:
            account = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:  # an account without a name (some containers)
            account = f"uid {os.geteuid()}"
        return (
            f"the hub's account ({account}) must be able to write the file and its directory "
            f"{path.parent}, where SQLite keeps a journal next to the file"
        )

    def close(self) -> None:
        self.engine.dispose()

    # -- reads -----------------------------------------------------------------------------
    def load(self) -> list[Allocation]:
        """Every persisted allocation, oldest first."""
        with self.engine.connect() as conn:
            held: dict[str, list[Device]] = {}
            for row in conn.execute(select(devices).order_by(devices.c.position)):
                held.setdefault(row.allocation_id, []).append(
                    Device(row.gpu, row.profile, row.start, row.instance, row.share_milli)
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
                    r._mapping["count"],  # ``r.count`` is also the tuple method, for type checkers
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
                        "share_milli": d.share_milli,
                    }
                    for i, d in enumerate(a.devices)
                ],
            )

    # -- MIG instances the pool created (:mod:`gpupool.mig.manager`) ---------------
    def mig_records(self) -> list[MigRecord]:
        """Every MIG instance the pool created and has not destroyed yet, oldest first."""
        with self.engine.connect() as conn:
            rows = conn.execute(select(mig_instances).order_by(mig_instances.c.created))
            return [MigRecord(**dict(r._mapping)) for r in rows]

    def save_mig(self, record: MigRecord) -> None:
        """Insert or replace the record of the instance at ``record``'s node, GPU and start."""
        key = _mig_key(record.node, record.gpu, record.start)
        with self.engine.begin() as conn:
            conn.execute(delete(mig_instances).where(*key))
            conn.execute(insert(mig_instances).values(**asdict(record)))

    def delete_mig(self, node: str, gpu: str, start: int) -> None:
        with self.engine.begin() as conn:
            conn.execute(delete(mig_instances).where(*_mig_key(node, gpu, start)))

    # -- jobs --------------------------------------------------------------------------------
    def save_job(self, job: Job) -> None:
        """Insert or replace one job (one transaction). Its script goes to a table of its own
        when the job carries one (at submit); a job saved without one keeps the stored script."""
        self.save_jobs([job])

    def save_jobs(self, changed: Iterable[Job]) -> None:
        """:meth:`save_job` for several jobs in one transaction (a scheduling pass's waiting
        reasons: one commit, however many jobs)."""
        changed = list(changed)
        if not changed:
            return
        with self.engine.begin() as conn:
            self._save_jobs(conn, changed)

    @staticmethod
    def _save_jobs(conn: Connection, changed: Iterable[Job]) -> None:
        for job in changed:
            conn.execute(delete(jobs).where(jobs.c.id == job.id))
            conn.execute(insert(jobs).values(**_job_row(job)))
            if job.spec.script:
                conn.execute(delete(job_scripts).where(job_scripts.c.job_id == job.id))
                conn.execute(insert(job_scripts).values(job_id=job.id, script=job.spec.script))

    def settle(self, release_ids: Sequence[str], changed: Sequence[Job]) -> None:
        """Delete these allocations and write these jobs' rows, in one transaction (what the
        :class:`~gpupool.store.outbox.Outbox` owes)."""
        if not release_ids and not changed:
            return
        with self.engine.begin() as conn:
            if release_ids:
                conn.execute(delete(devices).where(devices.c.allocation_id.in_(release_ids)))
                conn.execute(delete(allocations).where(allocations.c.id.in_(release_ids)))
            self._save_jobs(conn, changed)

    def load_jobs(self) -> list[Job]:
        """Every job, oldest first, without its script (:meth:`job_script` reads that)."""
        with self.engine.connect() as conn:
            return [_row_job(r) for r in conn.execute(select(jobs).order_by(jobs.c.created))]

    def job_script(self, job_id: str) -> str | None:
        """A job's script, or ``None`` if the store has none (the job was forgotten)."""
        with self.engine.connect() as conn:
            found = conn.execute(
                select(job_scripts.c.script).where(job_scripts.c.job_id == job_id)
            ).scalar_one_or_none()
        return None if found is None else str(found)

    def delete_jobs(self, job_ids: Iterable[str]) -> None:
        """Forget jobs: their rows and scripts (one transaction)."""
        ids = list(job_ids)
        if not ids:
            return
        with self.engine.begin() as conn:
            conn.execute(delete(job_scripts).where(job_scripts.c.job_id.in_(ids)))
            conn.execute(delete(jobs).where(jobs.c.id.in_(ids)))


@dataclass(frozen=True)
class MigRecord:
    """One MIG instance the pool created on a managed GPU (table ``gpupool_mig_instances``).

    ``state``: ``creating`` (recorded before NVML is asked, so a crash in between leaves a trace),
    ``live`` (made; ``uuid`` is its ``MIG-…`` UUID, ``allocation_id`` its holder) or ``draining``
    (released, but NVML refused to destroy it while processes run on it; retried)."""

    node: str
    gpu: str
    start: int
    profile: str
    state: str
    created: float
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None
    uuid: str | None = None
    allocation_id: str | None = None


def _mig_key(node: str, gpu: str, start: int) -> tuple[Any, ...]:
    c = mig_instances.c
    return (c.node == node, c.gpu == gpu, c.start == start)


def _job_row(job: Job) -> dict[str, Any]:
    spec = asdict(job.spec)
    del spec["script"]  # in gpupool_job_scripts
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
        "devices": json.dumps(list(job.devices)),
        "handle": job.handle,
    }


def _encodable(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings read as U+FFFD (pairs kept): what an
    older gpupool stored before it refused them must not break a page, a log or a terminal."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [_encodable(v) for v in value]
    if isinstance(value, dict):
        return {_encodable(k): _encodable(v) for k, v in value.items()}
    return value


def _row_job(r: Any) -> Job:
    spec = _encodable(json.loads(r.spec))
    spec["script"] = ""  # read apart, when the job starts (Store.job_script)
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
        devices=tuple(json.loads(r.devices)),
        handle=r.handle,
    )
