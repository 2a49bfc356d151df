"""The hub services' client of JupyterHub's REST API (:class:`gpupool.hub.hub_api.HubAPI`)
against the stand-in hub (:class:`tests.hubapi.FakeHub`, which stops and starts servers as
JupyterHub's ``UserServerAPIHandler`` does), and against a hub that never answers: a start or
stop whose reply is slow is not a failure (the hub's model tells what happened)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from tornado.httpclient import HTTPClientError

from gpupool.hub.hub_api import HubAPI, HubUnreadable, reply_message, server_path
from tests.hubapi import TOKEN, HubStandIns, free_port


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubStandIns]:
    with HubStandIns(tmp_path) as stand_ins:
        yield stand_ins


@pytest.fixture
def silent() -> Iterator[str]:
    """The REST API URL of a hub that accepts connections and never replies."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield f"http://127.0.0.1:{s.getsockname()[1]}/hub/api"


def test_server_paths_name_the_default_and_named_servers_quoted() -> None:
    assert server_path("ada") == "users/ada/server"
    assert server_path("ada", "big") == "users/ada/servers/big"
    assert server_path("a b", "x/y") == "users/a%20b/servers/x%2Fy"
    assert HubAPI("http://h/hub/api/", "t").url("users", "ada") == "http://h/hub/api/users/ada"


@pytest.mark.parametrize("name", ["", "big"])
def test_a_server_is_stopped_and_started_through_the_rest_api(hub: HubStandIns, name: str) -> None:
    hub.hubdb.server("ada", ("vision",), name=name)
    api = HubAPI(hub.api.api_url, TOKEN)
    path = f"/hub/api/{server_path('ada', name)}"

    async def main() -> None:
        assert await api.has_server("ada", name)
        assert await api.stop_server("ada", name) is True
        await api.wait_stopped("ada", name, timeout=5)
        assert not await api.has_server("ada", name)
        assert await api.start_server("ada", name, {"offer": "cpu"}) is True
        assert await api.has_server("ada", name)

    asyncio.run(main())
    assert [c for c in hub.api.calls if c[0] != "GET"] == [("DELETE", path), ("POST", path)]


def test_a_user_the_hub_does_not_know_has_no_server(hub: HubStandIns) -> None:
    api = HubAPI(hub.api.api_url, TOKEN)
    assert asyncio.run(api.user("nobody")) is None
    assert asyncio.run(api.has_server("nobody")) is False


def test_a_server_that_does_not_stop_is_a_timeout(hub: HubStandIns) -> None:
    hub.hubdb.server("ada")
    api = HubAPI(hub.api.api_url, TOKEN)
    with pytest.raises(TimeoutError, match="server ada/ did not stop within 0 s"):
        asyncio.run(api.wait_stopped("ada", timeout=0.3))


def test_a_refused_call_raises_with_the_hubs_message(hub: HubStandIns) -> None:
    hub.hubdb.server("ada")
    api = HubAPI(hub.api.api_url, "not-the-services-token")
    with pytest.raises(HTTPClientError) as refused:
        asyncio.run(api.stop_server("ada"))
    assert refused.value.code == 403
    assert reply_message(refused.value) == "HTTP 403: Forbidden Forbidden"
    assert hub.api.calls == []  # the stand-in records only calls with the right token


def test_a_slow_start_or_stop_is_not_a_failure(silent: str) -> None:
    api = HubAPI(silent, TOKEN, timeout=0.2)
    assert asyncio.run(api.stop_server("ada")) is False
    assert asyncio.run(api.start_server("ada", "big", {"offer": "cpu"})) is False
    with pytest.raises(HTTPClientError) as slow:  # any other call's slow reply is a failure
        asyncio.run(api.user("ada"))
    assert slow.value.code == 599


def test_whether_the_hub_is_up(hub: HubStandIns, silent: str) -> None:
    assert asyncio.run(HubAPI(hub.api.api_url, "no token needed").is_up())
    assert not asyncio.run(HubAPI(f"http://127.0.0.1:{free_port()}/hub/api", TOKEN).is_up())
    assert not asyncio.run(HubAPI(silent, TOKEN, timeout=0.2).is_up())
    hub.api.status = 503
    assert not asyncio.run(HubAPI(hub.api.api_url, TOKEN).is_up())


def test_active_users_read_every_page_or_raise(hub: HubStandIns) -> None:
    for user in ("ada", "ben", "cal"):
        hub.hubdb.server(user)
    hub.hubdb.server("dee", running=False)
    hub.api.page = 2
    api = HubAPI(hub.api.api_url, TOKEN)
    assert [u["name"] for u in asyncio.run(api.active_users())] == ["ada", "ben", "cal"]
    hub.api.status = 500
    with pytest.raises(HubUnreadable, match="500"):
        asyncio.run(api.active_users())
