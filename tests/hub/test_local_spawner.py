"""The local spawner in a real JupyterHub: quotas, visible devices, release paths, tampering.

The pool is the demo config's simulated fallback (no NVIDIA driver here): 4× H100-80GB, GPUs 0
and 1 whole, GPUs 2 and 3 with MIG instances 3g.40gb + 2g.20gb + 1g.10gb (and a managed MIG A100
and two L40S for shares, on nodes of their own). Team vision (ada, ben,
cal) may hold 2 GPU-eq, 2 per user; team nlp (dee, eli) 1 GPU-eq, 0.5 per user; eve is in no team.
Each test stops what it started. JupyterHub polls servers only every 300 s here and periodic
reconciliation is off, so a dead server's GPU comes back only through the spawner's own notice of
its exit.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from tests.accounts import homes
from tests.hub.conftest import Hub, environ, refusal, running, spawn, stop_all, wait_for


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    state = tmp_path_factory.mktemp("hub")
    with homes() as home_root:
        h = Hub(
            state,
            home_root,
            prelude="c.Reconciler.period = 0\n",
            extra_config="c.Spawner.poll_interval = 300\n",
        )
        with running(h):
            yield h


def test_a_team_is_refused_at_its_quota_while_another_team_still_gets_a_gpu(hub: Hub) -> None:
    spawn(hub, "ada", "vision|h100|1")
    spawn(hub, "ben", "vision|h100|1")
    r = hub.spawn_form("cal", "vision|mig-3g.40gb|1")
    assert r.status_code == 403
    assert refusal(r) == (
        "MIG 3g.40gb needs 0.5 GPU-eq but team vision uses 2 of 2 GPU-eq (guarantee 1.5, borrow "
        "limit 0.5); 0 GPU-eq left. Free now: nothing within your quota (free in the pool: "
        "2× 3g.40gb, 8× share-12gb)."
    )
    assert hub.server("cal") is None and "cal/" not in hub.allocations()
    page = hub.login("cal").get(f"{hub.url}/hub/spawn").text
    assert "Simulated pool" in page
    assert "team vision has 0 left" in page and "disabled" in page

    spawn(hub, "dee", "nlp|mig-3g.40gb|1")
    held = hub.allocations()
    assert held["dee/"].devices[0].profile == "3g.40gb"
    assert {a.team for a in held.values()} == {"vision", "nlp"}
    stop_all(hub, "ada", "ben", "dee")
    assert hub.allocations() == {}


def test_the_server_sees_exactly_its_allocated_uuids(hub: Hub) -> None:
    spawn(hub, "ada", "vision|h100|1")
    spawn(hub, "dee", "nlp|mig-1g.10gb|1")
    spawn(hub, "eve", "everyone|cpu|1")
    held = hub.allocations()
    ada, dee = environ(hub.pid("ada")), environ(hub.pid("dee"))
    assert ada["CUDA_VISIBLE_DEVICES"] == held["ada/"].visible_devices
    assert ada["CUDA_VISIBLE_DEVICES"].startswith("GPU-") and "," not in ada["CUDA_VISIBLE_DEVICES"]
    assert dee["CUDA_VISIBLE_DEVICES"] == held["dee/"].devices[0].instance
    assert dee["CUDA_VISIBLE_DEVICES"].startswith("MIG-")
    assert (dee["GPUPOOL_OFFER"], dee["GPUPOOL_TEAM"]) == ("mig-1g.10gb", "nlp")
    assert dee["GPUPOOL_ALLOCATION"] == held["dee/"].id and dee["GPUPOOL_SIMULATED"] == "1"
    assert environ(hub.pid("eve"))["CUDA_VISIBLE_DEVICES"] == ""
    stop_all(hub, "ada", "dee", "eve")


def test_stop_and_a_dead_server_both_free_the_gpu(hub: Hub) -> None:
    spawn(hub, "ada", "vision|h100|1")
    spawn(hub, "ben", "vision|h100|1")
    assert hub.spawn_form("cal", "vision|h100|1").status_code == 403  # team full
    hub.stop_server("ada")
    spawn(hub, "cal", "vision|h100|1")  # ada's GPU came back
    assert "ada/" not in hub.allocations()

    os.kill(hub.pid("ben"), signal.SIGKILL)  # noticed at its exit, not at the 300-s poll
    hub.wait_stopped("ben", timeout=30)
    wait_for(lambda: "ben/" not in hub.allocations(), 30, "ben's allocation to be released")
    spawn(hub, "ada", "vision|h100|1")
    stop_all(hub, "ada", "cal")
    assert hub.allocations() == {}


@pytest.mark.parametrize(
    ("user", "choice", "status", "message"),
    [
        ("ada", "nlp|mig-1g.10gb|1", 403, "You are not in team 'nlp' (your teams: vision)."),
        ("ada", "vision|mig-2g.20gb|1", 403, "Team vision may not request mig-2g.20gb;"),
        ("ada", "vision|h100|3", 400, "Offer h100 takes a count from 1 to 2, not 3."),
        ("ada", "vision|tpu|1", 400, "Unknown offer 'tpu'"),
        ("eve", "everyone|h100|1", 403, "Users in no team may not request h100;"),
        ("ada", "vision|h100", 400, "Choose one of the offers on the form."),
    ],
)
def test_a_tampered_form_is_refused_by_the_hub(
    hub: Hub, user: str, choice: str, status: int, message: str
) -> None:
    r = hub.spawn_form(user, choice)
    assert r.status_code == status
    assert message in refusal(r)
    assert hub.server(user) is None and hub.allocations() == {}


@pytest.mark.parametrize(
    ("user", "options", "status", "message"),
    [
        ("ada", {"offer": "mig-2g.20gb"}, 403, "Team vision may not request mig-2g.20gb"),
        ("dee", {"offer": "h100", "count": 1}, 403, "Team nlp may not request h100"),
        ("ada", {"offer": "h100", "count": "lots"}, 400, "count must be a whole number"),
        ("ada", {"offer": ["h100"], "gpus": 8}, 400, "user_options.offer must be an offer name"),
        ("dee", {"offer": "mig-3g.40gb", "team": "vision"}, 403, "not in team 'vision'"),
    ],
)
def test_the_rest_api_gets_the_same_answers(
    hub: Hub, user: str, options: dict[str, object], status: int, message: str
) -> None:
    r = hub.api("POST", f"/users/{user}/server", json=options)
    assert r.status_code == status, r.text
    assert message in r.json()["message"]
    assert hub.server(user) is None and hub.allocations() == {}
