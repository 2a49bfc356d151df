"""A real hub whose pool database refuses writes (its tables renamed away by another connection:
:mod:`tests.store_faults`): a stopped server's GPU is free at once, starts are refused with 503
and one sentence, the health endpoint, the metric and the admin page say the store is unhealthy;
once the database works again the owed release is written and all is healthy."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from gpupool.store import Store
from tests.accounts import homes
from tests.hub.conftest import Hub, running, scrape, spawn, value, wait_for
from tests.store_faults import refusing_writes


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with homes() as home_root:
        h = Hub(
            tmp_path_factory.mktemp("store-faults"),
            home_root,
            prelude="c.GPUPool.store_retry_max_s = 1\n",
        )
        with running(h):
            yield h


def health(hub: Hub) -> requests.Response:
    return requests.get(f"{hub.url}/hub/api/gpupool/health", timeout=30)


def test_a_server_stopped_while_the_database_refuses_writes_frees_its_gpu(hub: Hub) -> None:
    url = f"sqlite:///{hub.state / 'gpupool.sqlite'}"
    assert health(hub).status_code == 200 and health(hub).json()["store"]["healthy"]
    spawn(hub, "ada", "vision|h100|1")
    held = hub.allocations()["ada/"]

    with refusing_writes(url):
        assert hub.api("DELETE", "/users/ada/server").status_code in (202, 204)
        hub.wait_stopped("ada")
        token = hub.token("admin", ["custom:gpupool:admin"])
        ledger = hub.as_user(token, "GET", "/allocations?all=1").json()["allocations"]
        assert [a["ref"] for a in ledger] == []  # the ledger: free at once, for everyone

        sick = wait_for(lambda: (r := health(hub)).status_code == 503 and r.json(), 30, "503")
        store = sick["store"]
        assert store["healthy"] is False and store["pending_writes"] == 1 and store["since"]
        assert "problem" not in store  # without an admin's token, only the state
        admin = hub.as_user(token, "GET", "/health").json()["store"]
        assert "no such table" in admin["problem"] and admin["database"].endswith("gpupool.sqlite")
        assert value(scrape(hub)["gpupool_store_healthy"], "gpupool_store_healthy") == 0
        password = (hub.state / "admin-password").read_text().strip()
        page = hub.login("admin", password).get(f"{hub.url}/hub/gpupool", timeout=30)
        assert "refuses writes" in page.text and "no such table" in page.text

        refused = hub.api("POST", "/users/ben/server", json={"offer": "h100", "count": 1})
        assert refused.status_code == 503, refused.text
        assert "gpupool's database cannot record it" in refused.json()["message"]
        assert hub.server("ben") is None

    wait_for(lambda: health(hub).status_code == 200, 30, "the owed release to be written")
    assert health(hub).json()["store"] == {"healthy": True, "pending_writes": 0, "since": None}
    assert held.id not in {a.id for a in Store(url).load()}  # what a restart would read
    assert value(scrape(hub)["gpupool_store_healthy"], "gpupool_store_healthy") == 1
    spawn(hub, "ben", "vision|h100|1")
    hub.stop_server("ben")
