"""A spawn storm is shed, not absorbed: with the demo's `concurrent_spawn_limit` reached, the
next spawn gets 429 with Retry-After at once (a real hub whose servers are held in `start`, so
the spawns in flight stay in flight until the test lets them go)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.accounts import homes
from tests.hub.conftest import Hub, running, stop_all

HELD = """
import asyncio, os
from gpupool_spawner.local import LocalGPUSpawner


class HeldSpawner(LocalGPUSpawner):
    async def start(self):
        while os.path.exists({hold!r}):  # the test holds every start here
            await asyncio.sleep(0.05)
        return await super().start()


c.JupyterHub.spawner_class = HeldSpawner
# answer 202 at once while pending (added to the settings: setup(c) put the pool's objects there)
c.JupyterHub.tornado_settings["slow_spawn_timeout"] = 0
"""


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    hold = tmp_path / "hold-the-starts"
    (tmp_path / "state").mkdir()
    with homes() as root:
        h = Hub(tmp_path / "state", root, extra_config=HELD.format(hold=str(hold)))
        h.env["GPUPOOL_CONCURRENT_SPAWNS"] = "2"
        with running(h):
            hold.touch()
            yield h
            hold.unlink(missing_ok=True)


def test_a_spawn_beyond_the_limit_in_flight_gets_429_at_once(hub: Hub) -> None:
    for user in ("ada", "dee"):  # two spawns in flight, held in start
        r = hub.api("POST", f"/users/{user}/server", json={"offer": "cpu"})
        assert r.status_code == 202, r.text
    r = hub.api("POST", "/users/eve/server", json={"offer": "cpu"})
    assert r.status_code == 429, r.text
    assert "Try again in" in r.json()["message"] and int(r.headers["Retry-After"]) > 0
    hold = next(Path(hub.config.parent.parent).glob("hold-the-starts"))
    hold.unlink()  # let the two go
    hub.wait_ready("ada")
    hub.wait_ready("dee")
    stop_all(hub, "ada", "dee")
    assert hub.allocations() == {}
