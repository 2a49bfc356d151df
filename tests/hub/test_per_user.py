"""The per-user mode for real: a hub run as root starts each user's server and jobs as that
user's own unix account (``run_as_hub_user = False``), end to end.

The test makes real unix accounts (``useradd``) for two hub users of team vision, spawns a GPU
server, runs a two-rank job, reads its logs, cancels it and stops the server, checking at each
step which account the processes run as and who owns the files. Run as an ordinary user it
skips: switching accounts needs root (CI runs as root).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterator
from pathlib import Path

import pytest
from bs4 import BeautifulSoup

from tests.accounts import IS_ROOT, NOT_ROOT, homes, remove_unix_user, unix_user
from tests.hub.conftest import (
    FINAL,
    Hub,
    environ,
    job_processes,
    log,
    running,
    spawn,
    stop_all,
    submit,
    uid_of,
    wait_job,
)

pytestmark = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)
ANN, BOB = "gpupool-ann", "gpupool-bob"
WHOAMI = """\
import os, pwd, time
print("RUNS AS", pwd.getpwuid(os.getuid()).pw_name, os.environ["RANK"], flush=True)
while True:
    time.sleep(1)
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    for name in (ANN, BOB):
        unix_user(name)
    users = f"[{ANN!r}, {BOB!r}]"
    try:
        with homes() as home_root:
            h = Hub(
                tmp_path_factory.mktemp("per-user-hub"),
                home_root,
                prelude="c.LocalGPUSpawner.run_as_hub_user = False\n",
                extra_config=(
                    f"c.Authenticator.allowed_users |= set({users})\n"
                    f"c.JupyterHub.load_groups['vision']['users'] += {users}\n"
                ),
            )
            with running(h):
                yield h
    finally:
        for name in (ANN, BOB):
            remove_unix_user(name)


def test_a_server_runs_as_its_users_own_account_in_their_home(hub: Hub) -> None:
    spawn(hub, ANN, "vision|h100|1")
    try:
        pid = hub.pid(ANN)
        ann = pwd.getpwnam(ANN)
        assert uid_of(pid) == ann.pw_uid
        assert os.getpriority(os.PRIO_PROCESS, pid) == 10  # below the hub's CPU priority
        env = environ(pid)
        assert env["HOME"] == ann.pw_dir and env["CUDA_VISIBLE_DEVICES"].startswith("GPU-")
        assert hub.allocations()[f"{ANN}/"].offer == "h100"
    finally:
        stop_all(hub, ANN)
    assert hub.allocations() == {}


def test_a_two_rank_job_runs_logs_and_cancels_as_its_owner(hub: Hub) -> None:
    token = hub.token(ANN)
    job = submit(hub, token, WHOAMI, offer="h100", gpus=2, time_limit=300)
    job = wait_job(hub, token, job["id"], {"running"})
    for rank in (0, 1):
        text = log(hub, token, job["id"], rank)
        assert f"RUNS AS {ANN} {rank}" in text, text
    jdir = Path(pwd.getpwnam(ANN).pw_dir) / ".gpupool" / "jobs" / job["id"]
    ann_uid = pwd.getpwnam(ANN).pw_uid
    assert {p.stat().st_uid for p in [jdir, *jdir.iterdir()]} == {ann_uid}
    assert {uid_of(pid) for pid in job_processes(job["id"])} == {ann_uid}
    networks = {os.readlink(f"/proc/{pid}/ns/net") for pid in job_processes(job["id"])}
    assert len(networks) == 1 and networks != {os.readlink("/proc/self/ns/net")}, networks
    bob = hub.token(BOB)  # another user of the same team sees nothing of it
    assert hub.as_user(bob, "GET", f"/jobs/{job['id']}/logs").status_code == 404
    r = hub.as_user(token, "DELETE", f"/jobs/{job['id']}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert wait_job(hub, token, job["id"], FINAL)["state"] == "cancelled"
    assert job_processes(job["id"]) == []
    assert hub.allocations() == {}


def test_the_admin_page_says_jobs_have_a_network_of_their_own(hub: Hub) -> None:
    password = os.environ.get("GPUPOOL_ADMIN_PASSWORD") or (
        (hub.state / "admin-password").read_text().strip()
    )
    page = hub.login("admin", password).get(f"{hub.url}/hub/gpupool", timeout=30)
    assert page.status_code == 200
    line = BeautifulSoup(page.content.decode(), "html.parser").select_one("#gp-job-network")
    assert line is not None and "private: each job has a network namespace" in line.get_text()
