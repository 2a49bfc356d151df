"""Batch jobs in a real hub: real torchrun (gloo on CPU), the REST API, the queue, restarts.

Same demo pool as the spawner tests (simulated 4× H100, GPUs 0 and 1 whole). Responses are
checked against the OpenAPI document in the repository.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import nbformat
import pytest
import requests

from gpupool.hub import server_port
from gpupool.hub.handlers import handlers
from tests.conftest import TRAIN, TRAIN_CELL
from tests.hub.conftest import (
    FINAL,
    OPENAPI,
    Hub,
    job_processes,
    log,
    schema,
    spawn,
    stop_all,
    submit,
    wait_for,
    wait_job,
)


@pytest.fixture(scope="module")
def ada(hub: Hub) -> str:
    return hub.token("ada")


def test_the_openapi_document_lists_exactly_the_routes() -> None:
    routes = {
        re.sub(r"\(\[\^/\]\+\)", "{job_id}", r).removeprefix("/api/gpupool")
        for r, _ in [*handlers(), *server_port.handlers()]
    }
    assert routes == set(OPENAPI["paths"])


def test_a_notebook_trains_with_ddp_on_two_ranks_through_the_cli(hub: Hub, tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(TRAIN),
        nbformat.v4.new_code_cell(
            "%matplotlib inline\nprint('interactive only')", metadata={"tags": ["skip-distributed"]}
        ),
        nbformat.v4.new_code_cell(TRAIN_CELL),
    ]
    path = tmp_path / "train.ipynb"
    nbformat.write(nb, path)
    env = {
        **os.environ,
        "JUPYTERHUB_API_URL": f"{hub.url}/hub/api",
        "JUPYTERHUB_API_TOKEN": hub.token("ada"),
        "JUPYTERHUB_USER": "ada",
    }
    done = subprocess.run(
        [sys.executable, "-m", "gpupool_lab.command", "submit", str(path), "--gpus", "2",
         "--offer", "h100", "--wait", "--json"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr + done.stdout
    job = json.loads(done.stdout)
    assert job["state"] == "succeeded" and job["exit_codes"] == {"0": 0, "1": 0}
    finals = []
    for rank in (0, 1):
        text = subprocess.run(
            [sys.executable, "-m", "gpupool_lab.command", "logs", job["id"], "--rank", str(rank)],
            env=env, capture_output=True, text=True, timeout=60,
        ).stdout  # fmt: skip
        line = next(x for x in text.splitlines() if x.startswith("FINAL"))
        _, r, world, params = line.split(" ", 3)
        assert (int(r), int(world)) == (rank, 2)
        finals.append(params)
    assert finals[0] == finals[1]  # DDP kept both replicas identical
    assert "interactive only" not in log(hub, env["JUPYTERHUB_API_TOKEN"], job["id"], 0)
    assert hub.allocations() == {}  # the GPUs came back


def test_a_failing_rank_fails_the_job_with_its_traceback(hub: Hub, ada: str) -> None:
    script = textwrap.dedent("""\
        import os
        if os.environ["RANK"] == "1":
            raise RuntimeError("rank one is broken")
        print("rank 0 fine")
    """)
    job = submit(hub, ada, script, offer="h100", gpus=2, time_limit=120)
    job = wait_job(hub, ada, job["id"], FINAL)
    assert job["state"] == "failed" and "rank 1 exited 1" in job["reason"]
    assert job["exit_codes"]["1"] == 1
    text = log(hub, ada, job["id"], 1)
    assert "Traceback" in text and "RuntimeError: rank one is broken" in text
    assert hub.allocations() == {}


def test_cancel_stops_every_process_and_frees_the_gpus(hub: Hub, ada: str) -> None:
    script = "import time\nprint('up', flush=True)\nwhile True:\n    time.sleep(1)\n"
    job = submit(hub, ada, script, offer="h100", gpus=2, time_limit=600)
    wait_job(hub, ada, job["id"], {"running"})
    assert job_processes(job["id"])
    r = hub.as_user(ada, "DELETE", f"/jobs/{job['id']}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert r.json()["reason"] == "cancelled by ada"
    assert job_processes(job["id"]) == []
    assert hub.allocations() == {}


def test_a_time_limit_ends_a_runaway_job(hub: Hub, ada: str) -> None:
    script = "import time\nwhile True:\n    time.sleep(1)\n"
    job = submit(hub, ada, script, offer="h100", gpus=1, time_limit=3)
    job = wait_job(hub, ada, job["id"], FINAL, timeout=90)
    assert job["state"] == "failed" and job["reason"] == "time limit of 3 s reached"
    assert job_processes(job["id"]) == [] and hub.allocations() == {}


def test_a_job_waits_for_a_full_pool_and_starts_when_a_notebook_stops(hub: Hub) -> None:
    spawn(hub, "ada", "vision|h100|1")
    spawn(hub, "ben", "vision|h100|1")
    cal = hub.token("cal")
    offers = hub.as_user(cal, "GET", "/offers").json()["teams"][0]["offers"]
    verdicts = {(o["name"], o["count"]): (o["admission"], o["reason"]) for o in offers}
    assert verdicts["h100", 1] == ("wait", "needs 1 GPU-eq; team vision has 0 left")
    assert verdicts["cpu", 1] == ("now", "")
    never = hub.as_user(cal, "POST", "/jobs", json={"script": "x", "offer": "h100", "gpus": 3})
    assert never.status_code == 400, never.text
    assert "Offer h100 takes a count from 1 to 2, not 3." in never.text
    job = submit(hub, cal, "print('ran')", offer="h100", gpus=1, time_limit=60)
    queued = hub.as_user(cal, "GET", f"/jobs/{job['id']}").json()
    assert queued["state"] == "queued" and queued["queue_position"] == 1
    assert "team vision uses 2 of 2 GPU-eq" in queued["reason"]
    hub.stop_server("ada")
    done = wait_job(hub, cal, job["id"], FINAL)
    assert done["state"] == "succeeded" and "ran" in log(hub, cal, job["id"], 0)
    stop_all(hub, "ben")
    assert hub.allocations() == {}


def test_users_see_and_touch_only_their_own_jobs(hub: Hub, ada: str) -> None:
    job = submit(hub, ada, "print('mine')", offer="cpu", gpus=1, time_limit=60)
    ben = hub.token("ben")
    assert job["id"] not in {j["id"] for j in hub.as_user(ben, "GET", "/jobs").json()["jobs"]}
    for method, path in [("GET", ""), ("GET", "/logs"), ("DELETE", "")]:
        r = hub.as_user(ben, method, f"/jobs/{job['id']}{path}")
        assert r.status_code == 404 and r.json()["message"] == f"No job {job['id']}."
    admin = hub.token("admin", ["custom:gpupool:admin"])  # admins hold it (gpupool-admin role)
    listed = hub.as_user(admin, "GET", "/jobs").json()
    schema("Teams", hub.as_user(admin, "GET", "/teams").json())
    assert job["id"] in {j["id"] for j in listed["jobs"]}
    assert hub.as_user(admin, "GET", f"/jobs/{job['id']}/logs").status_code == 200
    no_scope = hub.token("ada", ["read:users:name!user"])
    r = hub.as_user(no_scope, "GET", "/jobs")
    assert r.status_code == 403 and "custom:gpupool:jobs" in r.json()["message"]
    wait_job(hub, ada, job["id"], FINAL)


@pytest.mark.parametrize(
    ("fields", "status", "message"),
    [
        ({"offer": "h100", "gpus": 2, "nodes": 2}, 400, "nodes must be 1"),
        ({"offer": "h100", "gpus": 3}, 400, "Offer h100 takes a count from 1 to 2, not 3."),
        ({"offer": "mig-1g.10gb"}, 403, "Team vision may not request mig-1g.10gb"),
        ({"offer": "tpu"}, 400, "Unknown offer 'tpu'"),
        ({"offer": "h100", "gpus": "two"}, 400, "gpus must be a whole number from 1 to 64."),
        ({"gpu": 2}, 400, "Unknown job fields: gpu."),
        ({"script": ""}, 400, "script must be the job's Python code"),
        ({"team": "nlp"}, 403, "You are not in team 'nlp'"),
        ({"time_limit": 10**9}, 400, "time_limit must be a whole number"),
        ({"priority": 5}, 400, "Team vision lets its users set a priority from -100 to 0"),
        ({"filename": False}, 400, "name, filename, workdir, offer and team must be strings."),
        ({"args": {}}, 400, "args must be a list of strings."),
        ({"offer": "cpu", "gpus": 64}, 400, "A CPU-only job runs at most"),
    ],
)
def test_invalid_specs_get_a_4xx_with_the_reason(
    hub: Hub, ada: str, fields: dict[str, Any], status: int, message: str
) -> None:
    r = hub.as_user(ada, "POST", "/jobs", json={"script": "print(1)", **fields})
    assert r.status_code == status, r.text
    schema("Error", r.json())
    assert message in r.json()["message"]


def test_only_an_admin_may_raise_a_priority(hub: Hub, ada: str) -> None:
    body = {"script": "print(1)", "offer": "cpu", "priority": 50, "time_limit": 60}
    r = hub.as_user(ada, "POST", "/jobs", json=body)
    assert r.status_code == 400 and "from -100 to 0" in r.json()["message"]
    admin = hub.token("admin", ["custom:gpupool:admin"])
    r = hub.as_user(admin, "POST", "/jobs", json=body)
    assert r.status_code == 201 and r.json()["priority"] == 50, r.text
    wait_job(hub, admin, r.json()["id"], FINAL)


def test_offers_match_the_document(hub: Hub, ada: str) -> None:
    offers = hub.as_user(ada, "GET", "/offers").json()
    schema("Offers", offers)
    assert offers["simulated"] is True
    assert [t["team"] for t in offers["teams"]] == ["vision"]
    names = {(o["name"], o["count"]) for o in offers["teams"][0]["offers"]}
    assert names == {("cpu", 1), ("mig-3g.40gb", 1), ("h100", 1), ("h100", 2), ("share-12gb", 1)}
    for line in offers["teams"][0]["offers"]:  # enabled and the reason follow the verdict
        now = line["admission"] == "now"
        assert line["enabled"] is now and (line["reason"] == "") is now, line


def test_a_followed_log_stops_when_the_client_leaves(hub: Hub, ada: str) -> None:
    quiet = "import time\nwhile True:\n    time.sleep(1)\n"  # writes nothing: the stream idles
    job = submit(hub, ada, quiet, offer="h100", gpus=1, time_limit=300)
    wait_job(hub, ada, job["id"], {"running"})
    url = f"{hub.url}/hub/api/gpupool/jobs/{job['id']}/logs"
    with requests.get(
        url, params={"follow": 1}, headers={"Authorization": f"token {ada}"}, stream=True,
        timeout=30,
    ) as r:  # fmt: skip
        assert r.status_code == 200
    left = f"the client following job {job['id']}'s log left; stopped"
    wait_for(lambda: left in hub.log.read_text(), 30, "the hub to stop following")
    assert hub.as_user(ada, "DELETE", f"/jobs/{job['id']}").json()["state"] == "cancelled"
