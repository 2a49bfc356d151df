"""The Slurm notebook spawner's pure builders (:mod:`gpupool.slurm.notebook`): the ``sbatch``
arguments, the batch script (run here for real with bash against a small HTTP server standing in
for the hub), the port report's body, the progress message and the exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from traitlets.config import Config

from gpupool.core.errors import InvalidRequest
from gpupool.declarations import ConfigError
from gpupool.slurm.notebook import (
    REPORT_FAILED,
    ServerJob,
    batch_script,
    check_port_body,
    check_spawner_config,
    exit_status,
    node_address,
    output_path,
    progress_message,
    sbatch_args,
    spawn_failure,
    tail_text,
)
from gpupool.slurm.parse import SlurmJob

JOB = ServerJob(
    job_name="jupyter-ada-big",
    tag="gpupool:abc:server:a1",
    time_limit="8:00:00",
    gres="gpu:h100:2",
    node="gpu1",
    account="vision",
    partition="gpu",
    output="/home/ada/.gpupool-jupyter-ada-big.log",
    workdir="/home/ada",
)


def test_sbatch_args_name_tag_time_gres_node_account_partition_output() -> None:
    assert sbatch_args(JOB) == [
        "--job-name=jupyter-ada-big",
        "--comment=gpupool:abc:server:a1",
        "--time=8:00:00",
        "--nodes=1",
        "--ntasks=1",
        "--output=/home/ada/.gpupool-jupyter-ada-big.log",
        "--chdir=/home/ada",
        "--gres=gpu:h100:2",
        "--nodelist=gpu1",
        "--account=vision",
        "--partition=gpu",
    ]


def test_a_cpu_server_has_no_gres_node_account_or_partition_and_extras_come_last() -> None:
    cpu = ServerJob("jupyter-eve", "t", "1:00:00", "", "", "", "", "/o", "/w", ("--mem=4G",))
    args = sbatch_args(cpu)
    assert not [a for a in args if a.split("=")[0] in ("--gres", "--nodelist", "--account")]
    assert args[-1] == "--mem=4G"


def test_the_output_path_keeps_no_slurm_pattern() -> None:
    path = output_path("{home}/{username}-{job_name}-%j.log", "/home/a%b/", "ada", "jupyter-ada")
    assert path == "/home/a%%b/ada-jupyter-ada-%%j.log"  # sbatch(1): %% is a literal %


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"port": 0},
        {"port": 65536},
        {"port": "8000"},
        {"port": True},
        {"port": 8000.0},
        {"port": None},
        {"port": 8000, "host": "evil.example"},
        {"port": 8000, "ip": "10.0.0.1"},
    ],
)
def test_a_port_report_is_exactly_one_port(body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        check_port_body(body)


def test_a_good_port_report() -> None:
    assert check_port_body({"port": 1}) == 1
    assert check_port_body({"port": 65535}) == 65535


def _job(**kw: Any) -> SlurmJob:
    fields: dict[str, Any] = {"job_id": 7, "name": "jupyter-ada", "user": "ada", "state": "PENDING"}
    fields.update(kw)
    return SlurmJob(**fields)


def test_progress_says_slurms_reason_and_estimate() -> None:
    now = time.time()
    start = int(now + 3600)
    text = progress_message(_job(reason="Resources", start_time=start), now=now)
    assert text == (
        "Slurm: waiting for Resources; estimated start "
        + time.strftime("%H:%M", time.localtime(start))
    )
    assert progress_message(_job(reason="Priority"), now=now) == "Slurm: waiting for Priority"
    running = _job(state="RUNNING", nodes=("gpu1",))
    assert progress_message(running) == (
        "Slurm job 7 running on gpu1, waiting for the server to report its port"
    )
    assert "does not answer (timeout)" in progress_message(None, unknown="timeout")
    assert "waiting for it to list the job" in progress_message(None)


def test_exit_status_decodes_the_wait_status_and_never_says_success_for_a_cancel() -> None:
    assert exit_status(_job(state="FAILED", exit_code=3 << 8)) == 3
    assert exit_status(_job(state="FAILED", exit_code=9)) == 128 + 9
    assert exit_status(_job(state="COMPLETED", exit_code=0)) == 0
    cancelled = exit_status(_job(state="CANCELLED", exit_code=0))
    assert cancelled == 1 and "CANCELLED" in str(cancelled)


def test_the_failure_message_carries_the_output_tail() -> None:
    tail = tail_text(b"".join(f"line {i}\n".encode() for i in range(100)), lines=3)
    assert tail == "line 97\nline 98\nline 99"
    message = spawn_failure(7, "FAILED", tail)
    assert message.startswith("The Slurm job 7 ended (FAILED) before its server answered.")
    assert message.endswith("line 99")
    assert "could not be read" in spawn_failure(7, "FAILED", "")


def test_the_node_address_is_slurms() -> None:
    sinfo = {"nodes": [{"name": "gpu1", "address": "10.1.2.3"}, {"name": "gpu2", "address": ""}]}
    assert node_address(sinfo, "gpu1") == "10.1.2.3"
    assert node_address(sinfo, "gpu2") == "gpu2"
    assert node_address({}, "gpu3") == "gpu3"


# -- the batch script, run for real ---------------------------------------------------------
class _Hub(BaseHTTPRequestHandler):
    reports: ClassVar[list[tuple[str, str, dict[str, Any]]]] = []
    answer = 200

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).reports.append((self.path, self.headers["Authorization"], body))
        self.send_response(type(self).answer)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"message": "refused here"}' if self.answer >= 400 else b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def hub() -> Iterator[tuple[str, type[_Hub]]]:
    handler = type("Hub", (_Hub,), {"reports": [], "answer": 200})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/hub/api", handler
    server.shutdown()


def _run(
    script: str, api: str, tmp: Path, token: str | None = "server-token"
) -> subprocess.CompletedProcess[str]:
    path = tmp / "job.sh"
    path.write_text(script)
    env = {
        "PATH": os.environ["PATH"],
        "JUPYTERHUB_API_URL": api,
        "JUPYTERHUB_SERVICE_PREFIX": "/user/ada/",
        "PYTHONPATH": "/nowhere",  # -I: the reporter ignores it
    }
    if token is not None:
        env["JUPYTERHUB_API_TOKEN"] = token
    return subprocess.run(
        ["bash", str(path)], env=env, capture_output=True, text=True, timeout=60, cwd=tmp
    )


def test_the_script_reports_a_free_port_then_execs_the_server_there(
    hub: tuple[str, type[_Hub]], tmp_path: Path
) -> None:
    api, handler = hub
    cmd = [sys.executable, "-c", "import os; print('URL', os.environ['JUPYTERHUB_SERVICE_URL'])"]
    done = _run(batch_script(cmd, sys.executable, note="for ada/big"), api, tmp_path)
    assert done.returncode == 0, done.stderr
    [(path, auth, body)] = handler.reports
    assert path == "/hub/api/gpupool/servers/port" and auth == "token server-token"
    assert set(body) == {"port"} and 1 <= body["port"] <= 65535
    assert f"URL http://0.0.0.0:{body['port']}/user/ada/" in done.stdout


def test_a_refused_report_stops_the_job_before_the_server_with_the_hubs_words(
    hub: tuple[str, type[_Hub]], tmp_path: Path
) -> None:
    api, handler = hub
    handler.answer = 403
    done = _run(batch_script(["echo", "SERVER RAN"], sys.executable), api, tmp_path)
    assert done.returncode == REPORT_FAILED
    assert "SERVER RAN" not in done.stdout
    assert "refused the port report (403)" in done.stderr and "refused here" in done.stderr


def test_arguments_with_spaces_and_quotes_reach_the_server_unchanged(
    hub: tuple[str, type[_Hub]], tmp_path: Path
) -> None:
    api, _ = hub
    odd = ["it's", 'a "b"', "$HOME", "`id`"]
    cmd = [sys.executable, "-c", "import sys; print(repr(sys.argv[1:]))", *odd]
    done = _run(batch_script(cmd, sys.executable), api, tmp_path)
    assert done.returncode == 0, done.stderr
    assert repr(odd) in done.stdout


def _config(**spawner: Any) -> Config:
    c = Config()
    c.JupyterHub.spawner_class = "gpupool-slurm"
    for key, value in spawner.items():
        c.SlurmSpawner[key] = value
    return c


def test_a_bad_slurm_spawner_setting_stops_the_hub_naming_the_key() -> None:
    check_spawner_config(_config(time_limit="1-00:00:00"), "slurm")
    check_spawner_config(_config(output_template="/scratch/{username}/{job_name}.log"), "slurm")
    other = Config()
    other.JupyterHub.spawner_class = "gpupool-local"
    other.SlurmSpawner.time_limit = "never"
    check_spawner_config(other, "nvml")  # not the Slurm spawner: not its business
    for c, inventory, key in (
        (_config(), "nvml", "GPUPool.inventory"),
        (_config(time_limit="eight hours"), "slurm", "SlurmSpawner.time_limit"),
        (_config(output_template="{home}/{user}.log"), "slurm:gpu", "SlurmSpawner.output_template"),
    ):
        with pytest.raises(ConfigError) as refused:
            check_spawner_config(c, inventory)
        assert refused.value.path == key


def test_a_job_without_the_servers_token_says_what_is_missing(
    hub: tuple[str, type[_Hub]], tmp_path: Path
) -> None:
    api, handler = hub
    done = _run(batch_script(["echo", "SERVER RAN"], sys.executable), api, tmp_path, token=None)
    assert done.returncode == REPORT_FAILED and "SERVER RAN" not in done.stdout
    assert "lacks JUPYTERHUB_API_URL or JUPYTERHUB_API_TOKEN" in done.stderr
    assert handler.reports == []
