"""Fair use in a real hub: one user cannot starve the others.

Per-user limits (``GPUPool.user_limits``, small here: 3 jobs queued or running, 2 followed logs,
1 server starting) are answered 429 naming the limit and what is in use, before anything is
stored, while another user is served as before; a client that leaves a followed log is one INFO
line; ``GET /jobs`` pages newest first (a limit and a cursor).

The hub: the demo's (simulated 4x H100), with named servers allowed and every server's start
held 3 s by a shell in front of it (so a start is reliably in flight), and one CPU-only job per
user running at a time (``JobManager.max_cpu_jobs_per_user = 1``), so a user's other jobs stay
queued and cost nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from gpupool.store import Store
from tests.accounts import homes
from tests.hub.conftest import FINAL, TOKEN, Hub, running, schema, submit, wait_for, wait_job

LIMITS = """\
c.GPUPool.user_limits = {"jobs": 3, "log_followers": 2, "spawns": 1}
c.JobManager.max_cpu_jobs_per_user = 1
"""
SLOW_STARTS = """\
c.JupyterHub.allow_named_servers = True
c.Spawner.cmd = ["/bin/sh", "-c", 'sleep 3; exec "$@"', "slow-start", *c.Spawner.cmd]
"""
SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"
LEAVES = 10
OTHERS = ["two", "three", "four", "five"]
BIG_LOG = """\
import sys
line = "x" * 65535 + "\\n"
for _ in range(1024):  # 64 MiB of log
    sys.stdout.write(line)
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    state = tmp_path_factory.mktemp("fair-use")
    with homes() as root, running(Hub(state, root, SLOW_STARTS, prelude=LIMITS)) as h:
        yield h


@pytest.fixture(scope="module")
def ada(hub: Hub) -> str:
    return hub.token("ada")


def stored_jobs(hub: Hub) -> set[str]:
    store = Store(f"sqlite:///{hub.state / 'gpupool.sqlite'}", upgrade=False)
    try:
        return {j.id for j in store.load_jobs()}
    finally:
        store.close()


def cancel_all(hub: Hub, token: str) -> None:
    for job in all_jobs(hub, token):
        if job["state"] not in FINAL:
            hub.as_user(token, "DELETE", f"/jobs/{job['id']}")


def all_jobs(hub: Hub, token: str) -> list[dict[str, Any]]:
    """Every job of the token's user, page by page."""
    jobs: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 100}
    while True:
        page = hub.as_user(token, "GET", "/jobs", params=params).json()
        jobs += page["jobs"]
        if not page.get("next"):
            return jobs
        params["cursor"] = page["next"]


def follow(hub: Hub, token: str, job_id: str) -> requests.Response:
    return requests.get(
        f"{hub.url}/hub/api/gpupool/jobs/{job_id}/logs",
        params={"follow": 1},
        headers={"Authorization": f"token {token}"},
        stream=True,
        timeout=30,
    )


def test_jobs_beyond_the_limit_get_429_before_anything_is_stored(hub: Hub, ada: str) -> None:
    jobs = [submit(hub, ada, SLEEPER, offer="cpu", time_limit=600) for _ in range(3)]
    before = stored_jobs(hub)
    r = hub.as_user(ada, "POST", "/jobs", json={"script": SLEEPER, "offer": "cpu"})
    assert r.status_code == 429, r.text
    schema("Error", r.json())
    assert r.json()["message"] == (
        "You have 3 jobs queued or running; the limit is 3 per user in team vision. "
        "Wait until one ends, or cancel one."
    )
    assert stored_jobs(hub) == before  # nothing was stored
    ben = hub.token("ben")  # another user of the same team is served as before
    theirs = submit(hub, ben, "print('mine')", offer="cpu", time_limit=60)
    hub.as_user(ada, "DELETE", f"/jobs/{jobs[2]['id']}")  # a place comes free
    again = submit(hub, ada, SLEEPER, offer="cpu", time_limit=600)
    assert again["state"] == "queued"
    cancel_all(hub, ada)
    wait_job(hub, ben, theirs["id"], FINAL)


def test_followers_beyond_the_limit_get_429_and_a_closed_one_frees_its_place(
    hub: Hub, ada: str
) -> None:
    job = submit(hub, ada, SLEEPER, offer="cpu", time_limit=600)
    first, second = follow(hub, ada, job["id"]), follow(hub, ada, job["id"])
    try:
        assert (first.status_code, second.status_code) == (200, 200)
        third = follow(hub, ada, job["id"])
        assert third.status_code == 429, third.text
        assert third.json()["message"] == (
            "You have 2 followed logs open; the limit is 2 per user in team vision. "
            "Close one (another tab or terminal follows it)."
        )
        ben = hub.token("ben")
        theirs = submit(hub, ben, SLEEPER, offer="cpu", time_limit=600)
        with follow(hub, ben, theirs["id"]) as other:
            assert other.status_code == 200  # ben's own count
        hub.as_user(ben, "DELETE", f"/jobs/{theirs['id']}")
    finally:
        first.close()

    def a_place_again() -> bool:
        with follow(hub, ada, job["id"]) as r:
            return r.status_code == 200

    wait_for(a_place_again, 30, "the closed stream's place to come free")
    second.close()
    cancel_all(hub, ada)


def test_a_client_that_leaves_a_busy_log_is_one_info_line(hub: Hub, ada: str) -> None:
    job = submit(hub, ada, BIG_LOG, offer="cpu", time_limit=600)
    assert wait_job(hub, ada, job["id"], FINAL)["state"] == "succeeded"
    since = len(hub.log.read_text(errors="replace"))
    for _ in range(LEAVES):  # each leaves while the hub is still sending it the log
        with follow(hub, ada, job["id"]) as r:
            assert r.status_code == 200
            got = 0
            for chunk in r.iter_content(chunk_size=None):
                got += len(chunk)
                if got > (2 << 20):
                    break
    left = f"the client following job {job['id']}'s log left; stopped"

    def logged() -> str:
        return hub.log.read_text(errors="replace")[since:]

    def every_leave_seen() -> bool:  # as an INFO line, or (the fault) as an error
        return logged().count(left) + logged().count("Uncaught exception") >= LEAVES

    wait_for(every_leave_seen, 30, "the hub to stop sending")
    for fault in ("Traceback", "StreamClosedError", "Uncaught exception", "[E "):
        assert fault not in logged(), logged()[-3000:]
    assert logged().count(left) == LEAVES


def test_get_jobs_pages_newest_first_with_a_limit_and_a_cursor(hub: Hub) -> None:
    cal = hub.token("cal")
    running_one = submit(hub, cal, SLEEPER, offer="cpu", time_limit=600)
    for _ in range(3):  # queued behind the one running, then cancelled: cheap ended jobs
        for job in [submit(hub, cal, "print(1)", offer="cpu") for _ in range(2)]:
            hub.as_user(cal, "DELETE", f"/jobs/{job['id']}")
    first = hub.as_user(cal, "GET", "/jobs", params={"limit": 2})
    assert first.status_code == 200, first.text
    schema("JobPage", first.json())
    assert len(first.json()["jobs"]) == 2 and first.json()["next"]
    listed = all_jobs(hub, cal)
    paged: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 2}
    while True:
        page = hub.as_user(cal, "GET", "/jobs", params=params).json()
        assert len(page["jobs"]) <= 2
        paged += page["jobs"]
        if not page["next"]:
            break
        params["cursor"] = page["next"]
    assert [j["id"] for j in paged] == [j["id"] for j in listed]
    assert len(paged) == 7 and paged[-1]["id"] == running_one["id"]
    created = [j["created"] for j in paged]
    assert created == sorted(created, reverse=True)  # newest first
    for params, word in [({"limit": 0}, "limit"), ({"limit": "x"}, "limit"),
                         ({"cursor": "nonsense"}, "cursor")]:  # fmt: skip
        r = hub.as_user(cal, "GET", "/jobs", params=params)
        assert r.status_code == 400 and word in r.json()["message"], r.text
    cancel_all(hub, cal)


def spawns_failed(hub: Hub) -> float:
    """Spawns JupyterHub began and saw fail (its metric ``server_spawn_duration_seconds``)."""
    auth = {"Authorization": f"token {TOKEN}"}
    r = requests.get(f"{hub.url}/hub/metrics", headers=auth, timeout=30)
    return sum(
        s.value
        for family in text_string_to_metric_families(r.text)
        if family.name == "jupyterhub_server_spawn_duration_seconds"
        for s in family.samples
        if s.name.endswith("_count") and s.labels.get("status") == "failure"
    )


def test_servers_starting_beyond_the_limit_get_429(hub: Hub) -> None:
    failed = spawns_failed(hub)
    names = ["one", *OTHERS]
    with ThreadPoolExecutor(len(names)) as pool:  # all at once, none admitted yet
        sent = pool.map(lambda n: hub.api("POST", f"/users/dee/servers/{n}", json={}), names)
        answers = dict(zip(names, sent, strict=True))
    started = [n for n, r in answers.items() if r.status_code in (201, 202)]
    assert len(started) == 1, {n: r.text for n, r in answers.items()}
    for r in (answers[n] for n in names if n not in started):
        assert r.status_code == 429, r.text
        assert r.json()["message"] == (  # refused starts in flight are not counted as starting
            "You have 1 server starting; the limit is 1 per user in team nlp. "
            "Wait until it has started."
        )
    # Refused before JupyterHub began a spawn for them (which writes a server, a token, an
    # OAuth client and the options to its database, then undoes it): its own count of failed
    # spawns did not move.
    assert spawns_failed(hub) == failed
    ada = {"Authorization": f"token {hub.token('ada', ['servers!user'])}"}
    url = f"{hub.url}/hub/api/users/dee/servers/other"
    others = requests.post(url, json={}, headers=ada, timeout=30)
    assert others.status_code == 404, others.text  # JupyterHub's own answer, not dee's limit
    [first] = started
    wait_for(lambda: hub.api("GET", "/users/dee").json()["servers"][first]["ready"], 60)
    second = next(n for n in names if n not in started)
    assert f"dee/{second}" not in hub.allocations()  # the refused start holds nothing
    r = hub.api("POST", f"/users/dee/servers/{second}", json={})  # room for another now
    assert r.status_code in (201, 202), r.text
    wait_for(lambda: hub.api("GET", "/users/dee").json()["servers"][second]["ready"], 60)
    for name in (first, second):
        hub.api("DELETE", f"/users/dee/servers/{name}")
    wait_for(lambda: not hub.api("GET", "/users/dee").json()["servers"], 60)
