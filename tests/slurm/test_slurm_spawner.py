"""The Slurm notebook spawner end to end: a real JupyterHub (the repository's config with the
Slurm inventory and ``SlurmSpawner``) on a real two-node Slurm dev cluster, users with real unix
accounts, real JupyterLab servers reached through the hub's proxy (:mod:`tests.slurm.slurm_hub`).

Each test answers one of batchspawner's complaints (issue 27; docs/slurm.md lists which):
submit as the user with name, tag, gres, node and account; the pending reason in the progress;
cancel while pending and while running; the port report and who may make it; a controller
restart while servers run; a job that dies before its server answers; one ``squeue`` for all
servers; a hub restart re-attaches.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpupool.slurm.names import parse_tag
from tests.accounts import IS_ROOT, NOT_ROOT
from tests.hub.conftest import wait_for
from tests.slurm.slurm_hub import POLL_PERIOD, SlurmHub, slurm_hub, squeue_calls, wait_ready

pytestmark = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)
RUN = f"gpsl{os.getpid() % 100000}"  # accounts of this run only: runs may overlap here
ANN, BOB, CAL, DUD = (f"{RUN}-{name}" for name in ("ann", "bob", "cal", "dud"))


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmHub]:
    # slurmdbd runs and the hub manages the teams' accounts: every submit needs its association
    with slurm_hub(
        tmp_path_factory.mktemp("slurm-hub"), [ANN, BOB, CAL, DUD], accounting=True
    ) as h:
        yield h


@pytest.fixture(autouse=True)
def no_servers_left(hub: SlurmHub) -> Iterator[None]:
    yield
    for user in (ANN, BOB, CAL, DUD):
        wait_for(lambda u=user: _stopped(hub, u), 120, f"{user}'s server to stop")  # type: ignore[misc]


def _stopped(hub: SlurmHub, user: str) -> bool:
    if hub.server(user) is None:
        return True
    hub.api("DELETE", f"/users/{user}/server")  # again while a stop or a start is pending
    return hub.server(user) is None


def _user_token(hub: SlurmHub, user: str) -> str:
    return hub.token(user, [f"access:servers!user={user}", "custom:gpupool:jobs"])


def _associations(hub: SlurmHub) -> dict[tuple[str, str], dict[str, str]]:
    """slurmdbd's associations, by (user, account); ``("", account)`` is the account's own."""
    fields = ["User", "Account", "ParentName", "QOS", "GrpTRES"]
    out = hub.cluster.run(
        "sacctmgr", "--parsable2", "--noheader", "show", "assoc", f"format={','.join(fields)}"
    ).stdout
    rows = [dict(zip(fields, line.split("|"), strict=True)) for line in out.splitlines()]
    return {(r["User"], r["Account"]): r for r in rows}


def _block_cpus(hub: SlurmHub) -> int:
    """A job outside the hub (root's) holding every idle CPU of the cluster: a server's job
    pends (Slurm: Resources). CPUs, not GPUs: the hub's mirror puts GPUs other jobs hold in
    outside use, and the pool would refuse a GPU server at once instead."""
    idle = int(hub.cluster.run("sinfo", "-h", "-o", "%C").stdout.split("/")[1])
    out = hub.cluster.run(  # a time limit: Slurm's backfill estimates when the server starts
        "sbatch",
        "--parsable",
        f"--ntasks={idle}",
        "--time=30",
        "--output=/dev/null",
        "--wrap",
        "sleep 3600",
    )
    job_id = int(out.stdout.strip().split(";")[0])
    wait_for(lambda: hub.slurm_jobs()[job_id]["job_state"] == "RUNNING", 60, "the blocker")
    return job_id


def test_a_gpu_server_is_a_slurm_job_of_the_user_reached_through_the_proxy(
    hub: SlurmHub,
) -> None:
    r = hub.spawn(ANN, offer="h100", count=1)
    assert r.status_code in (201, 202), r.text
    server = wait_ready(hub, ANN)
    job = hub.job_of(ANN)
    assert job is not None and job["job_state"] == "RUNNING"
    assert job["user_name"] == ANN and job["account"] == "vision"
    # the hub made team vision's account at start and ANN's association before the submit
    assert (ANN, "vision") in _associations(hub)
    vision = _associations(hub)[("", "vision")]
    assert vision["ParentName"] == "gpupool" and vision["QOS"] == "gpupool-vision"
    assert job["nodes"] == "gpu1" and job["gres_detail"][0].startswith("gpu:h100:1(IDX:")
    tag = parse_tag(job["comment"])
    allocation = hub.allocations()[f"{ANN}/"]
    assert tag is not None and tag.kind == "server" and tag.id == allocation.id
    assert job["time_limit"] == 60  # minutes: c.SlurmSpawner.time_limit = "1:00:00"
    assert server["state"]["slurm_job_id"] == job["job_id"]
    status = hub.through_proxy(ANN, _user_token(hub, ANN))
    assert status.status_code == 200 and "started" in status.json(), status.text
    env = hub.server_environ(ANN)  # JupyterHub's and gpupool's variables, nothing of the hub's
    assert env["GPUPOOL_ALLOCATION"] == allocation.id and env["GPUPOOL_OFFER"] == "h100"
    assert env["JUPYTERHUB_USER"] == ANN and env["HOME"] == pwd.getpwnam(ANN).pw_dir
    assert env["CUDA_VISIBLE_DEVICES"] != ""  # Slurm's, for the gres it granted
    assert "GPUPOOL_STATE_DIR" not in env and "GPUPOOL_DEMO_PASSWORD" not in env
    log = Path(pwd.getpwnam(ANN).pw_dir) / f".gpupool-jupyter-{ANN}.log"
    assert log.stat().st_uid == pwd.getpwnam(ANN).pw_uid
    assert "gpupool: serving on" in log.read_text()

    hub.stop_server(ANN)  # cancel while running
    ended = hub.slurm_jobs()[job["job_id"]]
    assert ended["job_state"] == "CANCELLED", ended["job_state"]
    assert f"{ANN}/" not in hub.allocations()


def test_a_pending_server_shows_slurms_reason_and_cancels_while_pending(hub: SlurmHub) -> None:
    blocker = _block_cpus(hub)
    try:
        assert hub.spawn(ANN, offer="cpu").status_code == 202
        events = hub.progress(ANN, "estimated start")
        last = events[-1]["message"]
        assert last.startswith("Slurm: waiting for Resources; estimated start "), events
        job = hub.job_of(ANN)
        assert job is not None and job["job_state"] == "PENDING"
        r = hub.api("DELETE", f"/users/{ANN}/server")  # JupyterHub's cancel of a pending spawn
        assert r.status_code in (202, 204), r.text
        hub.wait_stopped(ANN)
        assert hub.slurm_jobs()[job["job_id"]]["job_state"] == "CANCELLED"
        assert f"{ANN}/" not in hub.allocations()
    finally:
        hub.cluster.run("scancel", str(blocker))


def test_only_the_starting_servers_own_token_reports_its_port(hub: SlurmHub) -> None:
    assert hub.spawn(BOB, offer="cpu").status_code in (201, 202)
    wait_ready(hub, BOB)
    bobs_server = hub.server_token(BOB)
    blocker = _block_cpus(hub)
    try:
        assert hub.spawn(ANN, offer="cpu").status_code == 202
        hub.progress(ANN, "Slurm: waiting for Resources")
        good = {"port": 8000}
        for token in (_user_token(hub, ANN), _user_token(hub, BOB)):  # not a server's token
            r = hub.as_user(token, "POST", "/servers/port", json=good)
            assert r.status_code == 403, r.text
        admin = hub.api("POST", "/gpupool/servers/port", json=good)  # the admin service's
        assert admin.status_code == 403, admin.text
        bodies = [{"port": 8000, "host": "10.9.9.9"}, {"port": "8000"}, {"port": 0}, {}]
        for body in [*bodies, {"port": 8000, "pad": "x" * 1000}]:
            r = hub.as_user(bobs_server, "POST", "/servers/port", json=body)
            assert r.status_code == 400, (body, r.text)
        # bob's server's token reports for bob's server only, which is running: refused
        assert hub.as_user(bobs_server, "POST", "/servers/port", json=good).status_code == 409
        bob = hub.server(BOB)
        assert bob is not None and bob["ready"]
        hub.cluster.run("scancel", str(blocker))
        wait_ready(hub, ANN)  # ann's own server reported its port: none of the above counted
        assert hub.through_proxy(ANN, _user_token(hub, ANN)).status_code == 200
        url = hub.server(ANN)["url"]  # type: ignore[index]
        assert url == f"/user/{ANN}/"
    finally:
        hub.cluster.run("scancel", str(blocker), check=False)


def test_a_job_that_dies_before_its_server_answers_fails_the_spawn_at_once(
    hub: SlurmHub,
) -> None:
    r = hub.spawn(DUD, offer="cpu")
    if r.status_code == 202:  # not over within JupyterHub's slow_spawn_timeout: the progress
        events = hub.progress(DUD, "never", timeout=120)
        last = events[-1]
        assert last.get("failed"), events
    else:  # over at once: the request itself answers the failure
        assert r.status_code == 500, r.text
        last = {"message": r.json()["message"]}
    assert "ended (FAILED) before its server answered" in last["message"], last
    assert "DUD: this server cannot start" in last["message"], last
    hub.wait_stopped(DUD)
    assert f"{DUD}/" not in hub.allocations()


def test_a_controller_restart_stops_no_server(hub: SlurmHub) -> None:
    assert hub.spawn(ANN, offer="h100", count=1).status_code in (201, 202)
    wait_ready(hub, ANN)
    token = _user_token(hub, ANN)
    allocation = hub.allocations()[f"{ANN}/"].id
    hub.cluster.stop_controller()
    try:
        wait_for(lambda: hub.log_has("Slurm's jobs unknown"), 120, "the hub to miss slurmctld")
        # two more failed squeue calls: JupyterHub polled the server every second meanwhile
        failed = squeue_calls(hub.slurm_bin)
        wait_for(lambda: squeue_calls(hub.slurm_bin) >= failed + 2, 150, "more failed calls")
        server = hub.server(ANN)
        assert server is not None and server["ready"], hub.log_tail()
        assert hub.allocations()[f"{ANN}/"].id == allocation
        assert hub.through_proxy(ANN, token).status_code == 200
    finally:
        hub.cluster.start_controller()
    wait_for(lambda: hub.log_has("Slurm's controller answers again"), 120, "slurmctld back")
    server = hub.server(ANN)
    assert server is not None and server["ready"]
    assert hub.through_proxy(ANN, token).status_code == 200


def test_one_squeue_serves_every_server(hub: SlurmHub) -> None:
    for user in (ANN, BOB, CAL):
        assert hub.spawn(user, offer="cpu").status_code in (201, 202)
    for user in (ANN, BOB, CAL):
        wait_ready(hub, user)
    # JupyterHub polls each of the 3 servers every second (c.Spawner.poll_interval = 1): with
    # one squeue per poll, 4 calls would take about a second and a half; one shared poller
    # makes them one per poll period (jittered by a fifth) however many servers there are.
    first = squeue_calls(hub.slurm_bin)
    start = os.times().elapsed
    wait_for(lambda: squeue_calls(hub.slurm_bin) >= first + 5, 120, "5 more squeue calls")
    took = os.times().elapsed - start
    assert took >= 4 * POLL_PERIOD * 0.8 * 0.9, took  # 4 periods at least: not 12 polls' worth
    for user in (ANN, BOB, CAL):
        server = hub.server(user)
        assert server is not None and server["ready"]


def test_an_ended_job_stops_its_server_and_releases_its_gpus(hub: SlurmHub) -> None:
    assert hub.spawn(ANN, offer="h100", count=1).status_code in (201, 202)
    wait_ready(hub, ANN)
    job = hub.job_of(ANN)
    assert job is not None
    hub.cluster.run("scancel", str(job["job_id"]))  # outside the hub (an admin, a time limit)
    hub.wait_stopped(ANN, timeout=120)
    assert f"{ANN}/" not in hub.allocations()


def test_a_hub_restart_reattaches_to_the_running_server(hub: SlurmHub) -> None:
    assert hub.spawn(ANN, offer="h100", count=1).status_code in (201, 202)
    wait_ready(hub, ANN)
    token = _user_token(hub, ANN)
    job = hub.job_of(ANN)
    assert job is not None
    hub.stop_hub()
    hub.start()
    calls = squeue_calls(hub.slurm_bin)
    wait_for(lambda: squeue_calls(hub.slurm_bin) >= calls + 2, 120, "the new hub's squeue calls")
    server = hub.server(ANN)
    assert server is not None and server["ready"], hub.log_tail()
    assert server["state"]["slurm_job_id"] == job["job_id"]
    assert hub.through_proxy(ANN, token).status_code == 200
    assert hub.slurm_jobs()[job["job_id"]]["job_state"] == "RUNNING"
    hub.stop_server(ANN)  # the restarted hub cancels the job it re-attached to
    assert hub.slurm_jobs()[job["job_id"]]["job_state"] == "CANCELLED"
