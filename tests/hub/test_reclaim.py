"""Idle GPU reclaim in the real hub: simulated NVML held at 0 % (through the activity file), the
reclaimer's clock moved forward through its seam (``OffsetClock``, the demo config's
``.run/clock-offset``). An idle notebook is warned, then stopped (vision) or restarted without a
GPU (nlp), and its GPU freed; a busy kernel and a running job are left alone."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families
from tornado.httpclient import HTTPRequest
from tornado.websocket import websocket_connect

from gpupool.hub.reclaim import SERVICE_SCOPES, IdleReclaimer
from tests.accounts import homes
from tests.conftest import small_pool
from tests.hub.conftest import TOKEN, Hub, running, submit, wait_for, wait_job

MINUTE = 60.0


HOLD = "hold-cpu-restarts"
RESTART_TIMEOUT_S = 5


def hold_cpu_restarts(hold: Path) -> str:
    """Config: starts on the ``cpu`` offer wait (in JupyterHub's pre-spawn hook, before the
    spawner's start and its timeout) while ``hold`` exists, so a restart outlasts the
    reclaimer's call to start it; its calls time out after RESTART_TIMEOUT_S."""
    return (
        "import asyncio as _asyncio, pathlib as _pathlib\n"
        f"_HOLD = _pathlib.Path({str(hold)!r})\n"
        "async def _hold_cpu_restarts(spawner):\n"
        "    while spawner.user_options.get('offer') == 'cpu' and _HOLD.exists():\n"
        "        await _asyncio.sleep(0.1)\n"
        "c.Spawner.pre_spawn_hook = _hold_cpu_restarts\n"
        f"c.IdleReclaimer.request_timeout = {RESTART_TIMEOUT_S}\n"
    )


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with homes() as home_root:
        state = tmp_path_factory.mktemp("reclaim")
        h = Hub(state, home_root, extra_config=hold_cpu_restarts(state / HOLD))
        h.env["GPUPOOL_RECLAIM_PERIOD"] = "0.2"
        with running(h):
            yield h


class Clock:
    """The hub's reclaim clock: an offset in seconds kept in the state dir."""

    def __init__(self, hub: Hub) -> None:
        self.path = hub.state / "clock-offset"
        self.offset = 0.0

    def advance(self, seconds: float) -> None:
        """Move the hub's time forward."""
        self.offset += seconds
        self.path.write_text(str(self.offset))


@pytest.fixture(scope="module")
def clock(hub: Hub) -> Clock:
    return Clock(hub)


def my_allocation(hub: Hub, user: str) -> dict[str, Any] | None:
    reply = hub.as_user(hub.token(user), "GET", "/allocations")
    assert reply.status_code == 200, reply.text
    notebooks = [a for a in reply.json()["allocations"] if a["ref"] == f"{user}/"]
    return notebooks[0] if notebooks else None


def looked_after(hub: Hub, user: str, offset: float) -> dict[str, Any]:
    """Wait for a reclaimer look at hub time >= now + ``offset`` (so after the last advance)."""
    start = datetime.now().astimezone().timestamp() + offset

    def seen() -> dict[str, Any] | None:
        a = my_allocation(hub, user)
        checked = a and a["idle"]["checked"]
        return a if checked and datetime.fromisoformat(checked).timestamp() >= start else None

    return wait_for(seen, 30, f"a reclaimer look at {user}'s notebook")


def reclaims(hub: Hub) -> dict[tuple[str, str], float]:
    text = requests.get(
        f"{hub.url}/hub/metrics", headers={"Authorization": f"token {TOKEN}"}, timeout=30
    ).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gpupool_reclaims_total":
                out[(s.labels["team"], s.labels["action"])] = s.value
    return out


def counted(hub: Hub, key: tuple[str, str], expected: float) -> None:
    """The reclaim counter reaches ``expected`` (it counts once the reclaimer has seen the server
    stop, which may be after the test has)."""
    wait_for(lambda: reclaims(hub).get(key) == expected, 30, f"{key} reclaims to be {expected}")
    assert reclaims(hub)[key] == expected


def test_an_idle_notebook_is_warned_then_stopped_and_its_gpu_freed(hub: Hub, clock: Clock) -> None:
    assert hub.spawn_form("ada", "vision|mig-3g.40gb|1").status_code == 302
    hub.wait_ready("ada")
    held = hub.allocations()["ada/"]
    looked_after(hub, "ada", clock.offset)
    assert my_allocation(hub, "ada")["idle"]["warning"] is None  # type: ignore[index]

    clock.advance(46 * MINUTE)  # idle 60 min, warned 15 min ahead
    warning = wait_for(
        lambda: (my_allocation(hub, "ada") or {}).get("idle", {}).get("warning"),
        30,
        "the idle warning",
    )
    assert warning["action"] == "stop"
    assert "Save your work" in warning["message"] and "mig-3g.40gb" in warning["message"]
    assert hub.server("ada") is not None

    clock.advance(16 * MINUTE)
    hub.wait_stopped("ada")
    wait_for(lambda: "ada/" not in hub.allocations(), 30, "ada's GPU to be released")
    assert held.id not in {a.id for a in hub.allocations().values()}
    counted(hub, ("vision", "stop"), 1)
    assert "reclaiming" in hub.log.read_text()


def test_the_nlp_policy_restarts_the_notebook_without_a_gpu(hub: Hub, clock: Clock) -> None:
    assert hub.spawn_form("eli", "nlp|mig-2g.20gb|1").status_code == 302
    hub.wait_ready("eli")
    looked_after(hub, "eli", clock.offset)
    clock.advance(46 * MINUTE)
    wait_for(
        lambda: (my_allocation(hub, "eli") or {}).get("idle", {}).get("warning"), 30, "warning"
    )
    clock.advance(16 * MINUTE)

    def on_cpu() -> bool:
        a = hub.allocations().get("eli/")
        return a is not None and a.offer == "cpu" and hub.server("eli") is not None

    wait_for(on_cpu, 120, "eli's server to come back on cpu")
    hub.wait_ready("eli")
    counted(hub, ("nlp", "cpu"), 1)


def test_a_restart_on_cpu_slower_than_the_reclaimers_call_still_counts(
    hub: Hub, clock: Clock
) -> None:
    """JupyterHub answers a start after its ``slow_spawn_timeout`` or when the server is up, and
    goes on with the start either way; a reply slower than the reclaimer's own call timeout (as
    on a loaded machine) is not a failed reclaim: the GPU was freed and the server restarts."""
    before = reclaims(hub).get(("nlp", "cpu"), 0)
    if hub.server("eli") is not None:
        hub.stop_server("eli")
    assert hub.spawn_form("eli", "nlp|mig-1g.10gb|1").status_code == 302
    hub.wait_ready("eli")
    held = hub.allocations()["eli/"]
    hold = hub.state / HOLD
    hold.touch()
    try:
        looked_after(hub, "eli", clock.offset)
        clock.advance(46 * MINUTE)
        wait_for(
            lambda: (my_allocation(hub, "eli") or {}).get("idle", {}).get("warning"), 30, "warning"
        )
        clock.advance(16 * MINUTE)
        wait_for(
            lambda: (
                "restart of eli/ on cpu" in (text := hub.log.read_text())
                or "could not reclaim eli/" in text
            ),
            60,
            "the reclaimer's call to restart eli's server to end",
        )
    finally:
        hold.unlink()
    wait_for(
        lambda: getattr(hub.allocations().get("eli/"), "offer", None) == "cpu",
        120,
        "eli's server to come back on cpu",
    )
    hub.wait_ready("eli")
    assert held.id not in {a.id for a in hub.allocations().values()}
    assert "could not reclaim eli/" not in hub.log.read_text()
    counted(hub, ("nlp", "cpu"), before + 1)


def busy_kernel(hub: Hub, user: str) -> str:
    """Start a kernel in ``user``'s server and keep it busy (a long cell); returns its id."""
    token = hub.token(user, [f"access:servers!user={user}"])
    auth = {"Authorization": f"token {token}"}
    base = f"{hub.url}/user/{user}/api/kernels"
    kernel = requests.post(base, headers=auth, json={"name": "python3"}, timeout=60).json()

    async def run_cell() -> None:
        url = f"ws://127.0.0.1:{hub.port}/user/{user}/api/kernels/{kernel['id']}/channels"
        ws = await websocket_connect(HTTPRequest(url, headers=auth))
        msg_id = uuid.uuid4().hex
        header = {
            "msg_id": msg_id,
            "msg_type": "execute_request",
            "username": user,
            "session": uuid.uuid4().hex,
            "date": datetime.now().isoformat(),
            "version": "5.3",
        }
        content = {"code": "import time\ntime.sleep(3600)", "silent": False}
        message = {"header": header, "parent_header": {}, "metadata": {}, "content": content}
        ws.write_message(json.dumps({**message, "buffers": [], "channel": "shell"}))
        while True:  # until the kernel says it is busy with our cell
            reply = json.loads(await ws.read_message())
            mine = reply["parent_header"].get("msg_id") == msg_id
            state = reply["content"].get("execution_state")
            if mine and reply["msg_type"] == "status" and state == "busy":
                break
        ws.close()

    asyncio.run(run_cell())
    state = requests.get(f"{base}/{kernel['id']}", headers=auth, timeout=30).json()
    assert state["execution_state"] == "busy"
    return str(kernel["id"])


def test_a_notebook_with_a_busy_kernel_is_not_idle(hub: Hub, clock: Clock) -> None:
    assert hub.spawn_form("ben", "vision|h100|1").status_code == 302
    hub.wait_ready("ben")
    busy_kernel(hub, "ben")  # GPU utilisation stays 0 %: only the kernel is busy
    looked_after(hub, "ben", clock.offset)  # a look has seen the kernel busy (activity settled)
    clock.advance(3 * 60 * MINUTE)
    looked_after(hub, "ben", clock.offset)
    clock.advance(MINUTE)  # two looks with the same kernel activity: only "busy" keeps it in use
    seen = looked_after(hub, "ben", clock.offset)
    assert seen["idle"]["idle_since"] is None and seen["idle"]["warning"] is None
    assert list(seen["idle"]["utilisation"].values()) == [0]
    assert hub.server("ben") is not None


def test_the_reclaimers_own_scopes_read_a_servers_kernels_through_the_proxy(
    hub: Hub, tmp_path: Path
) -> None:
    """ben's kernel is still busy (the test above): the reclaimer finds his server through the
    REST API and reads its kernels through the proxy with a token of exactly its scopes."""
    held = hub.allocations()["ben/"]
    api, pool = f"{hub.url}/hub/api", small_pool(tmp_path)

    def kernels(scopes: list[str]) -> tuple[bool | None, float | None]:
        reclaimer = IdleReclaimer(pool, hub.token("admin", scopes), api, hub.url)
        return asyncio.run(reclaimer.read_kernels(held))

    busy, activity = kernels(SERVICE_SCOPES)
    assert busy is True and activity is not None
    assert kernels([s for s in SERVICE_SCOPES if s != "access:servers"]) == (None, None)


def test_a_running_job_is_never_reclaimed(hub: Hub, clock: Clock) -> None:
    dee = hub.token("dee")
    job = submit(hub, dee, "import time\ntime.sleep(600)", offer="mig-1g.10gb")
    wait_job(hub, dee, job["id"], {"running"})
    clock.advance(3 * 60 * MINUTE)
    looked_after(hub, "ben", clock.offset)  # a full pass has run since
    clock.advance(3 * 60 * MINUTE)
    looked_after(hub, "ben", clock.offset)
    assert hub.as_user(dee, "GET", f"/jobs/{job['id']}").json()["state"] == "running"
    (held,) = [a for a in hub.as_user(dee, "GET", "/allocations").json()["allocations"]]
    assert held["kind"] == "job" and "idle" not in held
    about_job = [line for line in hub.log.read_text().splitlines() if job["id"] in line]
    assert not [line for line in about_job if "warned" in line or "reclaiming" in line]
    hub.as_user(dee, "DELETE", f"/jobs/{job['id']}")
    wait_job(hub, dee, job["id"], {"cancelled"})
