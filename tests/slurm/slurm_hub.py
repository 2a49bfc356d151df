"""A real JupyterHub on a real Slurm dev cluster, for the Slurm spawner's end-to-end tests.

The hub is the repository's ``jupyterhub_config.py`` run as a subprocess (:class:`tests.hub.
conftest.Hub`) with ``c.GPUPool.inventory = "slurm"``, the dev cluster's ``slurm.conf`` and gres
models, and ``c.JupyterHub.spawner_class`` = gpupool's Slurm spawner; its users are real unix
accounts (:func:`tests.accounts.unix_user`) in team ``vision``, whose servers run as Slurm jobs
on the dev cluster's nodes (this machine) from the runtime's ``jupyterhub-singleuser``.

Every Slurm command the hub runs goes through a small wrapper in ``slurm_bin`` that appends the
command's name to ``calls.log`` before running Slurm's own: the tests count the hub's ``squeue``
calls there (the hub is another process: its ``SlurmCommands.calls`` cannot be read).

Users whose name ends with ``-dud`` get a server command that writes a line and exits 3 (a
``pre_spawn_hook`` of the test config): a job that dies before its server answers.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from gpupool.slurm.accounts import gres_costs_of
from gpupool.slurm.devcluster import DevCluster
from tests.accounts import RUNTIME_PYTHON, homes, remove_unix_user, unix_user
from tests.hub.conftest import Hub, running, wait_for
from tests.slurm_cluster import TWO_NODES, skip_reason, with_accounting

MODELS = {"h100": "H100-80GB", "1g.10gb": "H100-80GB", "a100": "A100-80GB"}
POLL_PERIOD = 4.0
"""The hub's ``SlurmSettings.poll_period`` here (jittered by a fifth either way)."""
COMMANDS = ("sbatch", "scancel", "squeue", "sinfo", "scontrol", "sacctmgr")
DUD_COMMAND = "echo DUD: this server cannot start >&2; exit 3"
"""The server command of users whose name ends with ``-dud``."""


def start_cluster(accounting: bool = False) -> DevCluster:
    """A two-node dev cluster (:data:`tests.slurm_cluster.TWO_NODES`); skips without Slurm.
    ``accounting``: with slurmdbd, the billing weights and tracked gres the teams' plan needs."""
    reason = skip_reason(accounting)
    if reason and os.geteuid() == 0:
        pytest.fail(f"as root the Slurm tests must run: {reason}")
    if reason:
        pytest.skip(reason)
    folder = Path(tempfile.mkdtemp(prefix="gpupool-slurm-"))
    folder.chmod(0o755)
    costs = gres_costs_of(MODELS, shards_per_gpu=4)  # TWO_NODES: 8 shards over 2 A100s
    extra = with_accounting(costs) if accounting else {}
    return DevCluster(folder, nodes=TWO_NODES, **extra).start()  # type: ignore[arg-type]


def wrappers(folder: Path) -> Path:
    """``slurm_bin`` for the hub: each command logs its name, then runs Slurm's own."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    log = folder / "calls.log"
    log.touch()
    log.chmod(0o666)  # sbatch and scancel run as the users
    for name in COMMANDS:
        real = shutil.which(name)
        assert real, f"no {name}"
        path = folder / name
        path.write_text(f'#!/bin/sh\necho {name} >> {log}\nexec {real} "$@"\n')
        path.chmod(0o755)
    return folder


def squeue_calls(slurm_bin: Path) -> int:
    return (slurm_bin / "calls.log").read_text().split().count("squeue")


class SlurmHub(Hub):
    cluster: DevCluster
    slurm_bin: Path

    def spawn(self, user: str, **options: Any) -> requests.Response:
        """Ask for ``user``'s server through the REST API (as the admin service)."""
        return self.api("POST", f"/users/{user}/server", json=options)

    def slurm_jobs(self) -> dict[int, dict[str, Any]]:
        out = self.cluster.run("squeue", "--json", "--all")
        return {j["job_id"]: j for j in json.loads(out.stdout)["jobs"]}

    def job_of(self, user: str) -> dict[str, Any] | None:
        """``user``'s newest server job as ``squeue`` lists it."""
        mine = [j for j in self.slurm_jobs().values() if j["name"] == f"jupyter-{user}"]
        return max(mine, key=lambda j: j["job_id"]) if mine else None

    def progress(self, user: str, until: str, timeout: float = 120) -> list[dict[str, Any]]:
        """The spawn's progress events (JupyterHub's event stream) up to the first whose
        message holds ``until``, or the last one (a failure, the end)."""
        events: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        with self.api_stream(f"/users/{user}/server/progress") as r:
            for line in r.iter_lines(decode_unicode=True):
                if line and line.startswith("data:"):
                    event = json.loads(line[5:])
                    events.append(event)
                    if until in event.get("message", "") or event.get("failed"):
                        break
                    if event.get("ready"):
                        break
                assert time.monotonic() < deadline, f"no {until!r} in {events}"
        return events

    @contextmanager
    def api_stream(self, path: str) -> Iterator[requests.Response]:
        from tests.hub.conftest import TOKEN

        r = requests.get(
            f"{self.url}/hub/api{path}",
            headers={"Authorization": f"token {TOKEN}"},
            stream=True,
            timeout=120,
        )
        try:
            yield r
        finally:
            r.close()

    def server_token(self, user: str) -> str:
        """The running server's own token, read from its process (we are root)."""
        return self.server_environ(user)["JUPYTERHUB_API_TOKEN"]

    def server_environ(self, user: str) -> dict[str, str]:
        """The environment of the running server's process (the job's, as Slurm ran it)."""
        job = self.job_of(user)
        assert job and job["job_state"] == "RUNNING", job
        uid = int(job["user_id"])
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid != uid:
                    continue
                env = dict(
                    item.split(b"=", 1)
                    for item in (entry / "environ").read_bytes().split(b"\0")
                    if b"=" in item
                )
            except OSError:
                continue
            if env.get(b"SLURM_JOB_ID") == str(job["job_id"]).encode() and env.get(
                b"JUPYTERHUB_API_TOKEN"
            ):
                return {k.decode(): v.decode(errors="replace") for k, v in env.items()}
        raise AssertionError(f"no process of job {job['job_id']} carries a server token")

    def through_proxy(self, user: str, token: str) -> requests.Response:
        return requests.get(
            f"{self.url}/user/{user}/api/status",
            headers={"Authorization": f"token {token}"},
            timeout=30,
        )

    def pending(self, user: str) -> str | None:
        server = self.server(user)
        return server.get("pending") if server else None

    def log_has(self, text: str) -> bool:
        return text in self.log.read_text(errors="replace")


@contextmanager
def slurm_hub(state: Path, users: list[str], accounting: bool = False) -> Iterator[SlurmHub]:
    """A dev cluster and a hub on it, whose ``users`` (real unix accounts) are in team vision.
    ``accounting``: the cluster runs slurmdbd and the hub manages the teams' accounts
    (``c.SlurmAccounts.manage``), so every submit needs the user's association."""
    cluster = start_cluster(accounting)
    for name in users:
        unix_user(name)
    slurm_bin = wrappers(cluster.folder / "hub-bin")  # the users run sbatch and scancel
    prelude = (
        f"c.SlurmSettings.slurm_conf = {str(cluster.conf)!r}\n"
        f"c.SlurmSettings.slurm_bin = {str(slurm_bin)!r}\n"
        f"c.SlurmSettings.gres_models = {MODELS!r}\n"
        f"c.SlurmSettings.poll_period = {POLL_PERIOD!r}\n"
        f"c.SlurmAccounts.manage = {accounting!r}\n"
    )
    extra = (
        'c.JupyterHub.spawner_class = "gpupool_spawner.slurm.SlurmSpawner"\n'
        f"c.SlurmSpawner.port_python = {RUNTIME_PYTHON!r}\n"
        "c.SlurmSpawner.time_limit = '1:00:00'\n"
        f"c.Authenticator.allowed_users |= set({users!r})\n"
        f"c.JupyterHub.load_groups['vision']['users'] += {users!r}\n"
        f"DUD = {DUD_COMMAND!r}\n"
        "def _dud(spawner):\n"
        "    if spawner.user.name.endswith('-dud'):\n"
        "        spawner.cmd = ['/bin/sh', '-c', DUD]\n"
        "c.Spawner.pre_spawn_hook = _dud\n"
    )
    try:
        with homes() as home_root:
            hub = SlurmHub(state, home_root, extra_config=extra, prelude=prelude)
            hub.env["GPUPOOL_INVENTORY"] = "slurm"
            hub.cluster, hub.slurm_bin = cluster, slurm_bin
            with running(hub):
                yield hub
    finally:
        for job_id in _jobs(cluster):
            cluster.run("scancel", str(job_id), check=False)
        for name in users:
            remove_unix_user(name)
        cluster.stop()
        shutil.rmtree(cluster.folder, ignore_errors=True)


def _jobs(cluster: DevCluster) -> list[int]:
    out = cluster.run("squeue", "--json", "--all", check=False)
    if out.returncode:
        return []
    return [int(j["job_id"]) for j in json.loads(out.stdout).get("jobs", [])]


def wait_ready(hub: SlurmHub, user: str, timeout: float = 180) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        s = hub.server(user)
        if s is None:
            raise AssertionError(f"{user}'s server is gone:\n{hub.log_tail()}")
        return s if s.get("ready") else None

    return wait_for(ready, timeout, f"{user}'s server to be ready")
