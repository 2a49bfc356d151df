"""The idle reclaimer talks to the hub like any service: it finds a notebook's server through
JupyterHub's REST API, reads its kernels through the proxy and stops it through the REST API, all
with its own token; it never reaches into the hub's objects.

A real pool (simulated inventory, SQLite) and JupyterHub's REST API and proxy answered from a
JupyterHub database made by JupyterHub's own ORM (:class:`tests.hubapi.FakeHub`); the real hub's
replies are checked in ``tests/hub/test_reclaim.py``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from gpupool.core.ledger import Allocation
from gpupool.hub.reclaim import IdleReclaimer, hub_urls
from tests.conftest import small_pool
from tests.hubapi import TOKEN, HubStandIns, free_port

LOG = logging.getLogger("gpupool.tests.reclaim")
ACTIVITY = "2026-03-01T10:00:00.000000Z"


class Setting(HubStandIns):
    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.pool = small_pool(tmp)

    def reclaimer(self, token: str = TOKEN, **policies: Any) -> IdleReclaimer:
        c = Config()
        c.IdleReclaimer.policies = {"*": policies} if policies else {}
        return IdleReclaimer(self.pool, token, self.api.api_url, self.api.url, config=c, log=LOG)

    def notebook(self, user: str, name: str = "") -> Allocation:
        """A GPU notebook of ``user`` the pool granted and JupyterHub records as running."""
        allocation = self.pool.allocate(user, ["vision"], "h100", 1, ref=f"{user}/{name}")
        self.hubdb.server(user, ("vision",), {"gpupool_allocation": allocation.id}, name=name)
        return allocation


@pytest.fixture
def s(tmp_path: Path) -> Iterator[Setting]:
    with Setting(tmp_path) as setting:
        yield setting


def kernels(reclaimer: IdleReclaimer, allocation: Allocation) -> tuple[bool | None, float | None]:
    """What the last look read of the notebook's kernels: (busy, newest activity)."""
    last = reclaimer.watches[allocation.id].last
    assert last is not None
    return last.kernel_busy, last.kernel_activity


def test_kernels_are_read_through_the_proxy_with_the_services_token(s: Setting) -> None:
    ada, ben = s.notebook("ada"), s.notebook("ben", "big")
    s.api.kernels["/user/ada/"] = [
        {"id": "k1", "execution_state": "busy", "last_activity": ACTIVITY},
        {"id": "k2", "execution_state": "idle", "last_activity": "2026-02-01T10:00:00Z"},
    ]
    s.api.kernels["/user/ben/big/"] = [{"id": "k3", "execution_state": "idle"}]
    r = s.reclaimer()

    assert asyncio.run(r.look()) == []

    assert kernels(r, ada) == (True, datetime.fromisoformat(ACTIVITY).timestamp())
    assert kernels(r, ben) == (False, None)
    assert sorted(s.api.calls) == [
        ("GET", "/hub/api/users/ada"),
        ("GET", "/hub/api/users/ben"),
        ("GET", "/user/ada/api/kernels"),
        ("GET", "/user/ben/big/api/kernels"),
    ]


@pytest.mark.parametrize(
    "trouble",
    ["starting", "not recorded", "kernels fail", "not kernels", "hub down", "wrong token"],
)
def test_a_server_whose_kernels_cannot_be_read_counts_as_unknown(
    s: Setting, trouble: str, caplog: pytest.LogCaptureFixture
) -> None:
    ada = s.notebook("ada")
    s.api.kernels["/user/ada/"] = [{"execution_state": "busy", "last_activity": ACTIVITY}]
    token = TOKEN
    if trouble == "starting":
        s.api.pending["ada/"] = "spawn"
    elif trouble == "not recorded":  # the user's server is gone, or another server name
        ada = s.pool.allocate("ada", ["vision"], "h100", 1, ref="ada/other")
    elif trouble == "kernels fail":
        s.api.kernels["/user/ada/"] = 500
    elif trouble == "not kernels":
        s.api.kernels["/user/ada/"] = {"kernels": []}
    elif trouble == "hub down":
        s.api.status = 503
    else:
        token = "not-the-services"
    r = s.reclaimer(token)
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        asyncio.run(r.look())
        asyncio.run(r.look())
    assert kernels(r, ada) == (None, None)
    assert r.watches[ada.id].last.devices  # type: ignore[union-attr]  # its devices still count
    unreadable = [x for x in caplog.records if "unreadable" in x.getMessage()]
    quiet = trouble in ("starting", "not recorded")  # nothing failed: no server to read yet
    assert [x.levelno for x in unreadable] == ([] if quiet else [logging.WARNING, logging.DEBUG])
    assert TOKEN not in caplog.text


def test_an_idle_notebook_is_stopped_through_the_rest_api(s: Setting) -> None:
    ada = s.notebook("ada")
    r = s.reclaimer(idle_minutes=0, warn_minutes=0)
    done = []
    for _ in range(3):
        done += [verdict for a, verdict in asyncio.run(r.look()) if a.id == ada.id]
        if "reclaim" in done:
            break
    assert done[-1] == "reclaim"
    assert ("DELETE", "/hub/api/users/ada/server") in s.api.calls


def test_without_the_hubs_api_url_the_reclaimer_does_not_run(
    s: Setting, caplog: pytest.LogCaptureFixture
) -> None:
    r = IdleReclaimer(s.pool, TOKEN, log=LOG)

    async def start() -> bool:
        r.start()
        started = r.background.running
        await r.stop()
        return started

    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert asyncio.run(start()) is False
    assert "the idle GPU reclaimer is off" in caplog.text


def test_the_loop_waits_for_the_hub_then_looks(s: Setting) -> None:
    ada = s.notebook("ada")
    c = Config()
    c.IdleReclaimer.period = 0.05
    r = IdleReclaimer(
        s.pool, TOKEN, f"http://127.0.0.1:{free_port()}/hub/api", s.api.url, config=c, log=LOG
    )

    async def run() -> None:
        r.start()
        await asyncio.sleep(0.3)
        assert r.last_look is None  # the hub is not up: no look yet
        r.hub.api_url = s.api.api_url  # (as if it had come up)
        for _ in range(100):
            if ada.id in r.watches:
                break
            await asyncio.sleep(0.05)
        await r.stop()

    asyncio.run(run())
    assert ada.id in r.watches and r.last_look is not None


@pytest.mark.parametrize(
    ("config", "api", "public"),
    [
        ({}, "http://127.0.0.1:8081/hub/api", "http://127.0.0.1:8000"),
        (
            {"bind_url": "http://127.0.0.1:8123", "hub_port": 8124},
            "http://127.0.0.1:8124/hub/api",
            "http://127.0.0.1:8123",
        ),
        (
            {"bind_url": "http://0.0.0.0:8000/jupyter/", "hub_ip": "10.0.0.5"},
            "http://10.0.0.5:8081/jupyter/hub/api",
            "http://127.0.0.1:8000",
        ),
        (
            {"bind_url": "http://:8000", "base_url": "/a/", "hub_bind_url": "http://:9000"},
            "http://127.0.0.1:9000/a/hub/api",
            "http://127.0.0.1:8000",
        ),
        (
            {"ssl_cert": "/c.pem", "bind_url": "https://[::]:8443", "internal_ssl": True},
            "https://127.0.0.1:8081/hub/api",
            "https://[::1]:8443",
        ),
        (
            {"ip": "192.0.2.1", "port": 8001},
            "http://127.0.0.1:8081/hub/api",
            "http://192.0.2.1:8001",
        ),
        ({"bind_url": "http+unix://%2Fsrv%2Fproxy.sock"}, "http://127.0.0.1:8081/hub/api", ""),
    ],
)
def test_the_hubs_urls_come_from_its_config(config: dict[str, Any], api: str, public: str) -> None:
    c = Config()
    for key, value in config.items():
        setattr(c.JupyterHub, key, value)
    assert hub_urls(c) == (api, public)


def test_a_configured_proxy_url_replaces_the_one_read_from_the_hubs_config(tmp_path: Path) -> None:
    """On Kubernetes the proxy is a service of its own (the chart sets ``proxy_url``)."""
    c = Config()
    c.IdleReclaimer.proxy_url = "http://proxy-public/"
    given = ("http://h:8081/hub/api", "http://127.0.0.1:8000")
    assert IdleReclaimer(small_pool(tmp_path), "t", *given, config=c).public_url == (
        "http://proxy-public"
    )
    assert IdleReclaimer(small_pool(tmp_path), "t", *given).public_url == "http://127.0.0.1:8000"
