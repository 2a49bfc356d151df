"""The pool's database is checked when the pool is built: it opens, it is gpupool's (or empty, or
another application's without gpupool tables, which gpupool shares), it is at a migration this
gpupool knows, and the hub's account can write it. Otherwise the pool refuses to start with one
line that names the database (never its password) and says what to do.

What can be asked of any database runs on a SQLite file and on a real PostgreSQL server
(``db_url``: :mod:`tests.databases`); what concerns a file (damage SQLite finds, paths, the journal
next to the file, permissions, read-only mounts) on SQLite only, as each such test says.

Read-only cases need an account that file permissions apply to: root ignores them, so run as root
(as CI does) the store is opened in a child process as the unprivileged shared account
(:mod:`tests.accounts`); run as an ordinary user, as that user.
"""

from __future__ import annotations

import os
import pwd
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic import command
from alembic.config import Config as AlembicConfig
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.declarations import ConfigError
from gpupool.pool import Pool
from gpupool.store import MIGRATIONS, Store, describe
from tests.accounts import IS_ROOT, RUNTIME_PYTHON, as_account, shared_account

INVENTORY = "simulated:node1: 2x H100-80GB"
MOVE_AWAY = "move it away to start with an empty pool, or restore a backup"
START_EMPTY = "point GPUPool.db_url at an empty database to start with an empty pool"
KEY = "GPUPool.db_url: gpupool's database"


def migrated_to(url: str, revision: str) -> None:
    """The database at ``url`` made by gpupool's migrations up to ``revision`` only."""
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
    engine.dispose()


def sql(url: str, statement: str) -> Any:
    """Run one statement on the database at ``url`` (committed); its first column's value, if
    it returns rows."""
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.exec_driver_sql(statement)
            return result.scalar_one() if result.returns_rows else None
    finally:
        engine.dispose()


def named(url: str) -> str:
    """How the refusal for the database at ``url`` begins: the key, then the database."""
    return f"{KEY} {describe(url)}"


def fresh_start(url: str) -> str:
    """What a refusal advises to start over: move a SQLite file away, else take another URL."""
    return MOVE_AWAY if url.startswith("sqlite") else START_EMPTY


def build(url: str) -> Pool:
    c = Config()
    c.GPUPool.inventory = INVENTORY
    c.GPUPool.db_url = url
    c.GPUPool.offers = {"cpu": {}, "h100": {"model": "H100-80GB"}}
    c.GPUPool.teams = {"vision": {"guarantee": 1}}
    return Pool.from_config(GPUPool(config=c))


def refusal(db: Path | str) -> str:
    """The one line the pool stops with for the SQLite file (or URL) ``db``."""
    url = db if isinstance(db, str) else f"sqlite:///{db}"
    with pytest.raises(ConfigError) as e:
        build(url)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def populated(url: str) -> None:
    """Make the database at ``url`` a gpupool database with an allocation in it, as a hub
    leaves it."""
    pool = build(url)
    pool.allocate("ada", ["vision"], "h100")
    pool.store.close()


def real_database(path: Path) -> bytes:
    """A gpupool SQLite file with an allocation in it, as a hub leaves it: its bytes."""
    populated(f"sqlite:///{path}")
    return path.read_bytes()


def garbage(db: Path) -> None:
    """A file that is no database."""
    db.write_bytes(random.Random(12).randbytes(8192))


def truncated(db: Path) -> None:
    """A database cut short."""
    whole = real_database(db)
    db.write_bytes(whole[: len(whole) // 2])


def damaged_page(db: Path) -> None:
    """A database whose schema reads fine; only the allocations' own pages are garbage."""
    real_database(db)
    with sa.create_engine(f"sqlite:///{db}").connect() as conn:
        page_size = conn.exec_driver_sql("PRAGMA page_size").scalar_one()
        root = conn.exec_driver_sql(
            "SELECT rootpage FROM sqlite_master WHERE name = 'gpupool_allocations'"
        ).scalar_one()
    data = bytearray(db.read_bytes())
    start = (root - 1) * page_size
    data[start : start + page_size] = random.Random(3).randbytes(page_size)
    db.write_bytes(bytes(data))


def wrong_freelist(db: Path) -> None:
    """A database SQLite reads, but whose header's count of free pages ``PRAGMA quick_check``
    finds wrong."""
    data = bytearray(real_database(db))
    data[36:40] = (5).to_bytes(4, "big")
    db.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("damage", "what"),
    [
        (garbage, r"is not a SQLite database \(file is not a database\)"),
        (truncated, r"is damaged \(database disk image is malformed\)"),
        (damaged_page, r"is damaged \(.+\)"),  # SQLite's words vary with the bytes it reads
        (wrong_freelist, r"is damaged \(Main freelist: size is 0 but should be 5\)"),
    ],
    ids=["garbage", "truncated", "damaged page", "integrity check only"],
)
def test_a_damaged_file_is_refused_in_one_line_and_left_alone(
    tmp_path: Path, damage: Callable[[Path], None], what: str
) -> None:
    """SQLite only: damage the file's own bytes show."""
    db = tmp_path / "gpupool.sqlite"
    damage(db)
    damaged = db.read_bytes()
    message = refusal(db)
    expected = f"{re.escape(f'{KEY} {db}')} {what}: {re.escape(MOVE_AWAY)}"
    assert re.fullmatch(expected, message), message
    assert db.read_bytes() == damaged


@pytest.mark.parametrize(
    ("statement", "said"),
    [
        (
            "UPDATE gpupool_alembic_version SET version_num = '0099'",
            "{named} is at migration '0099', which this gpupool does not know (its newest is "
            "'0006'; written by a newer gpupool?): upgrade gpupool, or restore a backup made with "
            "this version",
        ),
        (
            "DROP TABLE gpupool_alembic_version",
            "{named} has gpupool tables (gpupool_allocation_devices, gpupool_allocations, "
            "gpupool_job_scripts, gpupool_jobs, gpupool_mig_instances) but no record of their "
            "migration (table gpupool_alembic_version): {fresh_start}",
        ),
        (
            "DROP TABLE gpupool_jobs",
            "{named} is at migration '0006' but lacks the table gpupool_jobs: {fresh_start}",
        ),
    ],
    ids=["unknown migration", "no migration record", "missing table"],
)
def test_a_database_at_a_state_no_migration_explains_is_refused(
    db_url: str, statement: str, said: str
) -> None:
    populated(db_url)
    sql(db_url, statement)
    assert refusal(db_url) == said.format(named=named(db_url), fresh_start=fresh_start(db_url))


def test_an_older_migration_is_upgraded(db_url: str) -> None:
    migrated_to(db_url, "0001")
    build(db_url).store.close()
    assert sql(db_url, "SELECT version_num FROM gpupool_alembic_version") == "0006"


@pytest.mark.parametrize("content", [None, b""], ids=["no file", "empty file"])
def test_a_new_or_empty_database_is_created(tmp_path: Path, content: bytes | None) -> None:
    """SQLite only: no file, or an empty one (a new PostgreSQL database: test_store.py)."""
    db = tmp_path / "gpupool.sqlite"
    if content is not None:
        db.write_bytes(content)
    pool = build(f"sqlite:///{db}")
    assert pool.store.load() == []
    pool.store.close()


def test_jupyterhubs_own_database_is_shared_not_refused(db_url: str) -> None:
    """gpupool keeps its tables (and its migration record) apart, so it may live in JupyterHub's
    database; JupyterHub's tables and migration record are left as they were."""
    from jupyterhub import orm

    orm.new_session_factory(db_url).kw["bind"].dispose()
    engine = sa.create_engine(db_url)
    with engine.connect() as conn:
        hub_tables = set(sa.inspect(conn).get_table_names())
        hub_version = conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar_one()
    pool = build(db_url)
    pool.allocate("ada", ["vision"], "h100")
    pool.store.close()
    with engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names())
        assert conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar_one() == (
            hub_version
        )
    engine.dispose()
    assert tables - hub_tables == {
        "gpupool_alembic_version",
        "gpupool_allocations",
        "gpupool_allocation_devices",
        "gpupool_jobs",
        "gpupool_job_scripts",
        "gpupool_mig_instances",
    }


def test_a_database_of_another_application_without_gpupool_tables_is_shared(db_url: str) -> None:
    sql(db_url, "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    sql(db_url, "INSERT INTO notes (id, body) VALUES (1, 'keep me')")
    build(db_url).store.close()
    assert sql(db_url, "SELECT body FROM notes") == "keep me"


def test_a_missing_directory_is_named(tmp_path: Path) -> None:
    """SQLite only: the file's directory."""
    db = tmp_path / "nowhere" / "gpupool.sqlite"
    message = refusal(db)
    assert message.startswith(f"{KEY} {db} cannot be created (unable to open database file): ")
    assert f"the directory {db.parent} does not exist" in message


def test_a_relative_path_is_named_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite only: a file's path."""
    monkeypatch.chdir(tmp_path)
    Path("gpupool.sqlite").write_bytes(b"not a database at all, not at all" * 10)
    assert refusal("sqlite:///gpupool.sqlite").startswith(
        f"{KEY} {tmp_path / 'gpupool.sqlite'} is not a SQLite database"
    )


def test_a_server_url_is_named_without_its_password(postgresql_url: str) -> None:
    """A database the server does not have: the pool names it (never with its password) and
    says what to check."""
    url = sa.make_url(postgresql_url)
    missing = url.set(password="s3cret-pw", database="no_such_database")
    message = refusal(missing.render_as_string(hide_password=False))
    assert "s3cret-pw" not in message
    shown = missing.render_as_string(hide_password=True)
    assert "***" in shown, shown
    assert message.startswith(f"{KEY} {shown} cannot be read ("), message
    assert '"no_such_database" does not exist' in message, message
    assert message.endswith("): check that the database server is up and that the URL is right")


def test_a_url_whose_driver_is_not_installed_is_named() -> None:
    """pg8000, another PostgreSQL driver SQLAlchemy knows, is not installed here: the pool says
    so, and hides the password."""
    url = "postgresql+pg8000://gpupool:s3cret-pw@127.0.0.1:1/gpupool"
    message = refusal(url)
    assert "s3cret-pw" not in message
    assert message.startswith(
        f"{KEY} postgresql+pg8000://gpupool:***@127.0.0.1:1/gpupool cannot be opened ("
    ), message
    assert ": install the database driver the URL names" in message, message


def test_the_store_itself_names_the_database(tmp_path: Path) -> None:
    """The store's own error (for callers other than the pool) says the same, without the key
    (SQLite only: a file that is no database)."""
    from gpupool.store import StoreError

    db = tmp_path / "gpupool.sqlite"
    db.write_bytes(b"x" * 4096)
    with pytest.raises(StoreError) as e:
        Store(f"sqlite:///{db}")
    assert str(e.value) == (
        f"gpupool's database {db} is not a SQLite database (file is not a database): {MOVE_AWAY}"
    )


# -- read-only: as an account that permissions apply to ----------------------------------------
OPEN = """
import sys
from traitlets.config import Config
from gpupool.config import GPUPool
from gpupool.pool import Pool
c = Config()
c.GPUPool.inventory = {inventory!r}
c.GPUPool.db_url = {url!r}
try:
    Pool.from_config(GPUPool(config=c)).store.close()
except Exception as e:
    print(type(e).__name__ + ": " + str(e))
else:
    print("opened")
"""


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder the unprivileged account can reach (the tests' tmp_path is root's own)."""
    path = Path(tempfile.mkdtemp(prefix="gpupool-store-", dir="/tmp")).resolve()
    path.chmod(0o755)
    try:
        yield path
    finally:
        path.chmod(0o755)
        shutil.rmtree(path, ignore_errors=True)


def open_as_hub(db: Path) -> tuple[str, str]:
    """Build the pool in a child process as the account permissions apply to: what it printed,
    and that account's name."""
    account = shared_account() if IS_ROOT else pwd.getpwuid(os.geteuid()).pw_name
    code = OPEN.format(inventory=INVENTORY, url=f"sqlite:///{db}")
    out = subprocess.run(
        [RUNTIME_PYTHON if IS_ROOT else sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        **as_account(account if IS_ROOT else ""),
        cwd="/",
        env={**os.environ, "HOME": str(db.parent)},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), account


def give(path: Path, account: str) -> None:
    pw = pwd.getpwnam(account)
    os.chown(path, pw.pw_uid, pw.pw_gid)


def read_only_directory(db: Path) -> None:
    """The file is writable, its directory is not: SQLite cannot make its journal there, so the
    first write (every spawn, every job) would fail. The hub says so at start instead."""
    real_database(db)
    if IS_ROOT:  # the folder stays root's; the file becomes the hub account's
        give(db, shared_account())
    else:
        db.parent.chmod(0o555)


def read_only_file(db: Path) -> None:
    """File permissions."""
    real_database(db)
    if IS_ROOT:  # the folder becomes the hub account's; the file stays root's
        give(db.parent, shared_account())
    else:
        db.chmod(0o444)


def no_file_in_a_read_only_directory(db: Path) -> None:
    """Directory permissions, for a new database."""
    if not IS_ROOT:
        db.parent.chmod(0o555)


@pytest.mark.parametrize(
    ("setup", "what"),
    [
        (read_only_directory, "is read-only (attempt to write a readonly database)"),
        (read_only_file, "is read-only (attempt to write a readonly database)"),
        (no_file_in_a_read_only_directory, "cannot be created (unable to open database file)"),
    ],
    ids=["read-only directory", "read-only file", "new database in a read-only directory"],
)
def test_a_database_the_hubs_account_cannot_write_is_refused(
    folder: Path, setup: Callable[[Path], None], what: str
) -> None:
    """SQLite only: permissions, as the account they apply to."""
    db = folder / "gpupool.sqlite"
    setup(db)
    existed = db.exists()
    said, account = open_as_hub(db)
    assert said == (
        f"ConfigError: {KEY} {db} {what}: "
        f"the hub's account ({account}) must be able to write the file and its directory "
        f"{folder}, where SQLite keeps a journal next to the file"
    )
    assert db.exists() == existed  # a refused new database is not created


@pytest.fixture
def tmpfs(folder: Path) -> Iterator[Path]:
    """A fresh tmpfs mounted on a folder: only root with CAP_SYS_ADMIN may mount one."""
    mnt = folder / "mnt"
    mnt.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]
    done = subprocess.run(mount, capture_output=True, text=True, check=False)
    if done.returncode:
        pytest.skip("needs root (with CAP_SYS_ADMIN): it mounts a tmpfs")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "--lazy", str(mnt)], check=False)


def test_a_read_only_file_system_is_refused_even_as_root(tmpfs: Path) -> None:
    """SQLite only: root writes through any permission, not through a read-only mount."""
    db = tmpfs / "gpupool.sqlite"
    real_database(db)
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    assert refusal(db) == (
        f"{KEY} {db} is read-only (attempt to write a readonly database): the file system of "
        f"{tmpfs} is mounted read-only; the file and its directory must be writable, since "
        "SQLite keeps a journal next to the file"
    )


def test_jobs_of_a_database_at_0002_are_kept_by_the_upgrade(db_url: str) -> None:
    """0003 adds the devices a job ran on; jobs written before it load with none; 0005 moves
    their scripts to a table of their own."""
    migrated_to(db_url, "0002")
    sql(
        db_url,
        "INSERT INTO gpupool_jobs (id, owner, team, state, reason, spec, created) "
        """VALUES ('j1', 'ada', 'vision', 'succeeded', 'done', '{"script": "pass"}', 1.0)""",
    )
    pool = build(db_url)
    [job] = pool.store.load_jobs()
    script = pool.store.job_script("j1")
    pool.store.close()
    assert (job.id, job.state, job.devices) == ("j1", "succeeded", ())
    assert script == "pass"  # 0005 moved it to gpupool_job_scripts
