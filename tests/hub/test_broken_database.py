"""A real hub (the demo's ``jupyterhub_config.py``) with a broken pool database stops at start with
one line that names the file and says what to do, and no traceback; the demo itself starts with
no warnings about its settings.

JupyterHub loads its config file inside traitlets' ``catch_config_error``: a ``TraitError`` (which
gpupool's ``ConfigError`` is) raised from the config file is logged as one critical line, "Bad
config encountered during initialization: <message>", and the hub exits 1; any other exception is
logged with its whole traceback.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.store import Store
from tests.accounts import IS_ROOT, homes, shared_account
from tests.hub.conftest import Hub, exits, last_line, running

MOVE_AWAY = "move it away to start with an empty pool, or restore a backup"
BAD_CONFIG = "Bad config encountered during initialization: GPUPool.db_url: gpupool's database"


def real_database(path: Path) -> bytes:
    store = Store(f"sqlite:///{path}")
    store.close()
    return path.read_bytes()


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_broken_database_stops_the_hub_with_one_line(
    tmp_path_factory: pytest.TempPathFactory, damage: str
) -> None:
    state = tmp_path_factory.mktemp("state").resolve()
    db = state / "gpupool.sqlite"
    if damage == "garbage":
        db.write_bytes(random.Random(7).randbytes(16384))
        what = "is not a SQLite database (file is not a database)"
    else:
        whole = real_database(db)
        db.write_bytes(whole[: len(whole) // 2])
        what = "is damaged (database disk image is malformed)"
    before = db.read_bytes()
    with homes() as home_root:
        hub = Hub(state, home_root)
        assert exits(hub) == 1
    assert last_line(hub).endswith(f"] {BAD_CONFIG} {db} {what}: {MOVE_AWAY}"), hub.log_tail()
    assert "Traceback" not in hub.log.read_text(), hub.log_tail()
    assert db.read_bytes() == before


@pytest.fixture
def hub_state() -> Iterator[tuple[Path, str]]:
    """A state folder for a hub run as an account that file permissions apply to (root ignores
    them): the shared account when the tests run as root, else this account."""
    account = shared_account() if IS_ROOT else pwd.getpwuid(os.geteuid()).pw_name
    state = Path(tempfile.mkdtemp(prefix="gpupool-state-", dir="/tmp")).resolve()
    pw = pwd.getpwnam(account)
    os.chown(state, pw.pw_uid, pw.pw_gid)
    try:
        yield state, account
    finally:
        shutil.rmtree(state, ignore_errors=True)


def test_a_read_only_database_stops_the_hub(hub_state: tuple[Path, str]) -> None:
    """Today's symptom was a hub that starts and then answers every spawn and job with a 500."""
    state, account = hub_state
    db = state / "gpupool.sqlite"
    real_database(db)  # root's (or, not as root, made read-only below)
    db.chmod(0o444)
    with homes() as home_root:
        hub = Hub(state, home_root)
        assert exits(hub, user=account if IS_ROOT else "") == 1
    assert last_line(hub).endswith(
        f"] {BAD_CONFIG} {db} is read-only (attempt to write a readonly database): the hub's "
        f"account ({account}) must be able to write the file and its directory {state}, where "
        "SQLite keeps a journal next to the file"
    ), hub.log_tail()
    assert "Traceback" not in hub.log.read_text(), hub.log_tail()


def test_the_demo_starts_without_warnings_about_its_settings(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with homes() as home_root, running(Hub(tmp_path_factory.mktemp("demo"), home_root)) as hub:
        pass
    said = hub.log.read_text()
    assert "gpupool: SIMULATED inventory" in said  # the pool was built and logged
    assert "gpupool: GPUPool." not in said, hub.log_tail()
