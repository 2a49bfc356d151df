"""JupyterHub's records of running servers, read both ways reconciliation reads them: at start
from JupyterHub's database through JupyterHub's own ORM, while the hub runs from its REST API.

The database is a real one, made by JupyterHub's ORM (``orm.new_session_factory``) with users,
groups, spawners and servers. The REST API is :class:`FakeHub`: an HTTP server that answers as
JupyterHub's does (``user_model``/``server_model`` in ``jupyterhub/apihandlers/base.py``, its
pagination and its token check) from that same database (:mod:`tests.hubapi`); the real hub's
replies are checked in ``tests/hub/test_reconcile.py``. Servers' processes are real.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.core.reconcile import Record
from gpupool.hub.hub_api import HubAPI, HubUnreadable
from gpupool.hub.records import START_KEY, STATE_KEY, read_records, record, rest_records
from gpupool.procfs import process_start
from tests.conftest import holder, holders
from tests.hubapi import TOKEN, FakeHub, HubDB, free_port


@pytest.fixture
def hubdb(tmp_path: Path) -> Iterator[HubDB]:
    db = HubDB(tmp_path / "jupyterhub.sqlite")
    yield db
    db.close()


@pytest.fixture
def fake(hubdb: HubDB) -> Iterator[FakeHub]:
    hub = FakeHub(hubdb.url)
    yield hub
    hub.close()


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def by_ref(records: list[Record]) -> dict[str, Record]:
    assert len({r.ref for r in records}) == len(records)
    return {r.ref: r for r in records}


# -- at start: JupyterHub's ORM -------------------------------------------------------------------


def test_a_hub_database_that_does_not_exist_yet_records_nothing_and_is_not_made(
    tmp_path: Path,
) -> None:
    path = tmp_path / "jupyterhub.sqlite"
    assert read_records(f"sqlite:///{path}") == []
    assert not path.exists()
    assert read_records("sqlite://") == [] and read_records("sqlite:///:memory:") == []


def test_a_hub_database_without_tables_records_nothing_and_gets_none(tmp_path: Path) -> None:
    path = tmp_path / "jupyterhub.sqlite"
    sqlite3.connect(path).close()
    assert read_records(f"sqlite:///{path}") == []
    with sqlite3.connect(path) as conn:
        assert conn.execute("select name from sqlite_master").fetchall() == []


def test_the_orm_reads_running_servers_with_groups_and_state_and_writes_nothing(
    hubdb: HubDB,
) -> None:
    with holders() as ps:
        live = holder(ps, GPUPOOL_ALLOCATION="a1")
        dead = holder(ps, GPUPOOL_ALLOCATION="b1")
        dead_start = process_start(dead.pid)
        dead.kill()
        dead.wait()
        hubdb.server("ada", ("vision",), {STATE_KEY: "a1", "pid": live.pid,
                                          START_KEY: process_start(live.pid)})  # fmt: skip
        hubdb.server("ben", ("vision", "ops"), {STATE_KEY: "b1", "pid": dead.pid,
                                                 START_KEY: dead_start}, name="big")  # fmt: skip
        hubdb.server("ben", ("vision",), {STATE_KEY: "b0", "pid": dead.pid}, running=False)
        hubdb.server("cal", (), {STATE_KEY: "c1"})  # Kubernetes: no pid
        hubdb.server("dee", ("nlp",), {"pid": "12", START_KEY: True})  # not gpupool's state
        hubdb.server("eli", ("nlp",), running=False)  # never started
        before = digest(hubdb.path)

        records = by_ref(read_records(hubdb.url))

        assert records == {
            "ada/": Record("ada", "", frozenset({"vision"}), "a1", live.pid, True),
            "ben/big": Record("ben", "big", frozenset({"vision", "ops"}), "b1", dead.pid, False),
            "cal/": Record("cal", "", frozenset(), "c1", None, None),
            "dee/": Record("dee", "", frozenset({"nlp"}), "", None, None),
        }
        assert digest(hubdb.path) == before


# -- while the hub runs: its REST API -------------------------------------------------------------


def test_the_rest_api_gives_the_same_records_as_the_orm_page_by_page(
    hubdb: HubDB, fake: FakeHub
) -> None:
    with holders() as ps:
        for i, user in enumerate(("ada", "ben", "cal", "dee", "eve")):
            server = holder(ps, GPUPOOL_ALLOCATION=f"x{i}")
            state = {STATE_KEY: f"x{i}", "pid": server.pid, START_KEY: process_start(server.pid)}
            hubdb.server(user, ("vision",) if i % 2 else ("nlp", "ops"), state)
        hubdb.server("ben", ("vision",), {STATE_KEY: "y"}, name="second")
        hubdb.server("fay", ("nlp",), running=False)
        fake.page = 2

        users = asyncio.run(HubAPI(fake.api_url, TOKEN).active_users())

        assert [u["name"] for u in users] == ["ada", "ben", "cal", "dee", "eve"]
        assert fake.calls == [("GET", "/hub/api/users")] * 3  # three pages of two
        from_rest = by_ref(rest_records(users))
        assert from_rest == by_ref(read_records(hubdb.url))
        assert all(r.alive for r in from_rest.values() if r.pid)


def test_a_hub_that_does_not_page_gives_the_same_records(hubdb: HubDB, fake: FakeHub) -> None:
    hubdb.server("ada", ("vision",), {STATE_KEY: "a1"})
    hubdb.server("ben", ("vision",), {STATE_KEY: "b1"})
    fake.body = json.dumps(fake.users({"state": ["active"]}, paged=False)).encode()
    assert rest_records(asyncio.run(HubAPI(fake.api_url, TOKEN).active_users())) == read_records(
        hubdb.url
    )


def test_a_server_whose_start_is_pending_is_left_to_its_spawner() -> None:
    with holders() as ps:
        gone = holder(ps)
        gone.kill()
        gone.wait()
        state = {STATE_KEY: "a1", "pid": gone.pid}
        models = [
            {"name": "ada", "groups": ["vision"], "servers": {"": {"pending": p, "state": state}}}
            for p in ("spawn", "stop")
        ]
        spawning, stopping = rest_records(models)
        assert (spawning.pid, spawning.alive) == (gone.pid, None)
        assert stopping.alive is False
    assert record("ada", "", (), None) == Record("ada")
    assert record("ada", "", (), json.dumps({STATE_KEY: "a1"})).allocation == "a1"


@pytest.mark.parametrize(
    "trouble",
    ["closed", "forbidden", "error", "not json", "not users", "bad next page", "wrong token"],
)
def test_an_unreadable_rest_api_raises_never_an_empty_list(
    hubdb: HubDB, fake: FakeHub, trouble: str
) -> None:
    hubdb.server("ada", ("vision",), {STATE_KEY: "a1"})
    api, token = fake.api_url, TOKEN
    if trouble == "closed":
        api = f"http://127.0.0.1:{free_port()}/hub/api"
    elif trouble == "forbidden":
        fake.status = 403
    elif trouble == "error":
        fake.status = 503
    elif trouble == "not json":
        fake.body = b"<html>login</html>"
    elif trouble == "not users":
        fake.body = b'{"status": 200}'
    elif trouble == "bad next page":
        fake.body = b'{"items": [], "_pagination": {"next": {"offset": 0}}}'
    else:
        token = "someone-elses"
    with pytest.raises(HubUnreadable):
        asyncio.run(HubAPI(api, token, timeout=5).active_users())
