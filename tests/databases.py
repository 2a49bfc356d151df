"""Real databases for the store's tests: a fresh SQLite file, or a fresh database on a real
PostgreSQL server (the production store: DESIGN.md, the Helm chart), one per test.

- :func:`postgresql_server` (one per test process: each pytest-xdist worker starts its own):
  Debian's PostgreSQL (``initdb``, ``pg_ctl``; ``make install`` installs the ``postgresql``
  package as root), made in a fresh folder under ``/tmp`` with ``initdb``, listening only on a
  unix socket in that folder (no port to collide on), trusting local connections, without
  fsync (a test database). ``initdb`` and ``pg_ctl`` refuse root: as root they run as the
  ``postgres`` account (``runuser``), which owns the folder. Started and stopped with ``pg_ctl
  -w`` (it waits until the server answers, or gives up after :data:`WAIT_S`); stopped with ``-m
  fast`` and removed at the end of the run, also when a test or the start failed.
- :func:`postgresql_url`: a database of its own on that server (``CREATE DATABASE`` with a unique
  name; dropped afterwards, with whatever connections a test left open).
- :func:`db_url`: parametrized over ``sqlite`` and ``postgresql``: a fresh URL of each kind.

Where PostgreSQL cannot run: as an ordinary user without Debian's package (only root installs
it) or without the driver (``jupyterhub-gpupool[postgresql]``), the PostgreSQL tests skip, saying
which. As root (CI), ``make install`` installs both: anything missing, or a server that does not
start, fails them loudly, never skips them.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.accounts import IS_ROOT

ACCOUNT = "postgres"
"""The unprivileged account the server runs as under root (Debian's package makes it)."""
SUPERUSER = "postgres"
"""The server's superuser role, which the tests connect as (trusted: no password)."""
WAIT_S = 60
"""How long ``pg_ctl`` waits for the server to start or stop."""
SETTINGS = {
    "listen_addresses": "''",  # no TCP: only the socket in the folder
    "fsync": "off",  # a throwaway test database; durability is not under test
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "100",
}
NOT_INSTALLED = (
    "needs PostgreSQL (Debian's postgresql package: initdb and pg_ctl), which only root can "
    "install (make install does, as root)"
)
NO_DRIVER = (
    "needs the PostgreSQL driver psycopg (pip install 'jupyterhub-gpupool[postgresql]'; "
    "make install does)"
)


def bindir() -> Path | None:
    """The folder of PostgreSQL's ``initdb`` and ``pg_ctl``: ``pg_config --bindir`` (which may
    name client tools only), else the newest of Debian's ``/usr/lib/postgresql/<version>/bin``."""
    found: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            found.append(Path(out.stdout.strip()))
    versions = Path("/usr/lib/postgresql").glob("*/bin")
    found += sorted(
        versions,
        key=lambda p: [int(n) for n in p.parent.name.split(".") if n.isdigit()],
        reverse=True,
    )
    return next((d for d in found if (d / "initdb").is_file() and (d / "pg_ctl").is_file()), None)


def unavailable(reason: str) -> None:
    """Skip as an ordinary user; fail as root, where ``make install`` provides PostgreSQL."""
    if IS_ROOT:
        pytest.fail(f"PostgreSQL tests: {reason}; run as root, make install provides it")
    pytest.skip(reason)


@dataclass(frozen=True)
class PostgresServer:
    folder: Path
    """Holds the data directory, the log and the unix socket."""
    bin_dir: Path
    """Where ``pg_ctl`` is."""

    def stop(self) -> None:
        """Stop the server (fast: open connections are cut), as when it goes down under a hub."""
        self._pg_ctl("-m", "fast", "stop")

    def start(self) -> None:
        """Start it again (returns once it takes connections)."""
        self._pg_ctl("-l", str(self.folder / "server.log"), "start")

    def _pg_ctl(self, *args: str) -> None:
        data = self.folder / "data"
        command = [str(self.bin_dir / "pg_ctl"), "-D", str(data), "-w", "-t", str(WAIT_S)]
        _run([*command, *args], f"pg_ctl {args[-1]}", self.folder, self.folder / "server.log")

    def url(self, database: str) -> str:
        """The SQLAlchemy URL of ``database`` (psycopg 3, over the folder's socket)."""
        return f"postgresql+psycopg://{SUPERUSER}@/{database}?host={self.folder}"

    def execute(self, sql: str) -> None:
        """Run ``sql`` outside a transaction (``CREATE DATABASE`` needs that) as the superuser."""
        import psycopg

        with psycopg.connect(
            host=str(self.folder), user=SUPERUSER, dbname="postgres", autocommit=True,
            connect_timeout=WAIT_S,
        ) as conn:  # fmt: skip
            conn.execute(sql.encode())

    @contextmanager
    def database(self) -> Iterator[str]:
        """A new, empty database (its URL), dropped at the end with any connection left to it."""
        name = f"gpupool_test_{uuid.uuid4().hex[:16]}"
        self.execute(f"CREATE DATABASE {name}")
        try:
            yield self.url(name)
        finally:
            self.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _run(command: list[str], what: str, cwd: Path, log: Path | None = None) -> None:
    """Run a PostgreSQL tool (as :data:`ACCOUNT` under root); fail saying what it printed."""
    prefix = ["runuser", "-u", ACCOUNT, "--"] if IS_ROOT else []
    out = subprocess.run(
        prefix + command, cwd=cwd, capture_output=True, text=True, check=False,
        timeout=WAIT_S + 30, env={**os.environ, "LC_ALL": "C"},
    )  # fmt: skip
    if out.returncode:
        said = (out.stdout + out.stderr).strip()
        if log is not None and log.is_file():
            said += "\nthe server's log:\n" + "\n".join(log.read_text().splitlines()[-20:])
        raise RuntimeError(f"{what} failed (exit status {out.returncode}):\n{said}")


@contextmanager
def running_server(bin_dir: Path) -> Iterator[PostgresServer]:
    """A PostgreSQL server in a fresh folder under ``/tmp``, stopped and removed at the end."""
    folder = Path(tempfile.mkdtemp(prefix="gpupool-pg-", dir="/tmp"))
    data, log = folder / "data", folder / "server.log"
    if IS_ROOT:
        pw = pwd.getpwnam(ACCOUNT)
        os.chown(folder, pw.pw_uid, pw.pw_gid)
    pg_ctl = [str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-t", str(WAIT_S)]
    try:
        _run(
            [str(bin_dir / "initdb"), "-D", str(data), "-U", SUPERUSER, "--auth=trust",
             "--encoding=UTF8", "--locale=C", "--no-sync"],
            "initdb", folder,
        )  # fmt: skip
        settings = {**SETTINGS, "unix_socket_directories": f"'{folder}'"}
        with (data / "postgresql.conf").open("a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
        _run([*pg_ctl, "-l", str(log), "start"], "pg_ctl start", folder, log)
        yield PostgresServer(folder, bin_dir)
    except BaseException:
        if (data / "postmaster.pid").exists():  # stop it, but say what went wrong first
            subprocess.run([*(["runuser", "-u", ACCOUNT, "--"] if IS_ROOT else []), *pg_ctl,
                            "-m", "fast", "stop"], capture_output=True, check=False)  # fmt: skip
        raise
    else:
        if (data / "postmaster.pid").exists():
            _run([*pg_ctl, "-m", "fast", "stop"], "pg_ctl stop", folder, log)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def postgresql_server() -> Iterator[PostgresServer]:
    """This test process's PostgreSQL server (see the module's docstring)."""
    bin_dir = bindir()
    if bin_dir is None:
        unavailable(NOT_INSTALLED)
        return
    try:
        import psycopg  # noqa: F401
    except ImportError:
        unavailable(NO_DRIVER)
        return
    if IS_ROOT:
        try:
            pwd.getpwnam(ACCOUNT)
        except KeyError:
            pytest.fail(f"PostgreSQL tests: no account {ACCOUNT!r} to run the server as (root)")
    with ExitStack() as stack:
        try:
            server = stack.enter_context(running_server(bin_dir))
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            pytest.fail(f"PostgreSQL tests: the server did not start: {e}")
        yield server


@pytest.fixture
def postgresql_url(postgresql_server: PostgresServer) -> Iterator[str]:
    """A fresh database of its own on this run's PostgreSQL server."""
    with postgresql_server.database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """A fresh database of each kind: a SQLite file (not made yet), a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'gpupool.sqlite'}"
    return request.getfixturevalue("postgresql_url")
