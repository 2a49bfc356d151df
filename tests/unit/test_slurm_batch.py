"""A gpupool job as a Slurm batch job (:mod:`gpupool.slurm.batch`) and what Slurm's states mean
for it (:func:`gpupool.slurm.jobs.observe`, :func:`~gpupool.slurm.jobs.ended`,
:func:`~gpupool.slurm.jobs.from_record`): pure, no daemons (tests/slurm runs them for real)."""

from __future__ import annotations

import base64
import json
import re
import subprocess
from dataclasses import replace

import pytest
from traitlets.config import Config

from gpupool.declarations import ConfigError
from gpupool.slurm.batch import BatchJob, batch_script, per_task_gres, sbatch_args, slurm_time
from gpupool.slurm.jobs import SlurmJobBackend, ended, from_record, observe
from gpupool.slurm.parse import SlurmJob

JOB = BatchJob(
    name="gpupool-ann-abc12345",
    tag="gpupool:hub1:job:abc123456789",
    account="vision",
    nodes=("gpu2", "gpu1"),
    gres="gpu:h100:2",
    procs_per_node=2,
    time_limit=90,
    partition="gpu",
)


def test_sbatch_asks_each_granted_node_for_its_gres_as_the_teams_account() -> None:
    assert sbatch_args(JOB) == [
        "--job-name=gpupool-ann-abc12345",
        "--comment=gpupool:hub1:job:abc123456789",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--output=/dev/null",
        "--error=/dev/null",
        "--account=vision",
        "--nodelist=gpu2,gpu1",
        "--gres=gpu:h100:2",
        "--partition=gpu",
        "--time=0-00:02:00",
    ]


def test_mig_instances_are_a_task_each() -> None:
    mig = BatchJob("n", "t", "a", ("gpu1",), "gpu:1g.10gb:3", 3, one_task_per_device=True)
    assert "--ntasks-per-node=3" in sbatch_args(mig)
    script = batch_script(mig, "print(1)\n", [])
    assert "--gpus-per-task=1g.10gb:1" in script
    assert '--nnodes="$SLURM_NTASKS" --nproc-per-node=1' in script
    assert "--time" not in " ".join(sbatch_args(mig))  # no limit: the partition's


@pytest.mark.parametrize(
    ("seconds", "slurm"),
    [(1, "0-00:01:00"), (60, "0-00:01:00"), (61, "0-00:02:00"), (3600, "0-01:00:00"),
     (86400 + 59, "1-00:01:00")],
)  # fmt: skip
def test_time_limits_round_up_to_slurms_minutes(seconds: int, slurm: str) -> None:
    assert slurm_time(seconds) == slurm


def test_one_task_per_device_needs_one_typed_gpu_gres() -> None:
    assert per_task_gres("gpu:1g.10gb:2") == "1g.10gb:1"
    with pytest.raises(ValueError, match="one typed GPU gres"):
        per_task_gres("shard:3")


def test_the_script_carries_the_users_code_and_arguments_untouched() -> None:
    code = "print('GPUPOOL_SCRIPT_END $HOME `id`')\nimport sys; sys.exit(3)\n"
    args = ["--lr", "0.1; rm -rf ~", "$(id)"]
    script = batch_script(JOB, code, args)
    encoded = re.search(r"<<'GPUPOOL_SCRIPT_END'.*?\n(.*?)GPUPOOL_SCRIPT_END\n", script, re.S)
    assert encoded is not None
    assert base64.b64decode(encoded.group(1)).decode() == code
    assert "'0.1; rm -rf ~' '$(id)'" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_the_script_exits_with_sruns_status_and_keeps_a_final_record() -> None:
    script = batch_script(JOB, "", [])
    assert 'wait "$step"\nrc=$?\n' in script
    assert script.rstrip().endswith('exit "$rc"')  # else a failed job ends COMPLETED 0:0
    assert "trap signalled TERM INT" in script
    assert '[ "$SECONDS" -ge 120 ]' in script  # the limit Slurm enforces: whole minutes
    assert '--rdzv-endpoint="$RDZV_HOST:$RDZV_PORT"' in script
    assert '--nnodes="$SLURM_NNODES" --nproc-per-node=2' in script


def _slurm(state: str, **kw: object) -> SlurmJob:
    return SlurmJob(job_id=7, name="n", user="ann", state=state, **kw)  # type: ignore[arg-type]


def test_pending_shows_slurms_reason_and_estimate() -> None:
    seen = observe(_slurm("PENDING", reason="Resources", start_time=1_800_000_000), ())
    assert seen.state == "starting"
    assert seen.reason == "Slurm: PENDING (Resources), expected to start by 2027-01-15 08:00 UTC"
    assert observe(_slurm("PENDING", reason="None"), ()).reason == "Slurm: PENDING"


def test_running_and_ended_states() -> None:
    running = observe(_slurm("RUNNING", nodes=("gpu1", "gpu2")), ((0, 0),))
    assert (running.state, running.reason) == ("running", "Slurm: RUNNING on gpu1,gpu2")
    ok = observe(_slurm("COMPLETED"), ((0, 0), (1, 0)))
    assert (ok.state, ok.reason) == ("succeeded", "Slurm: COMPLETED; all ranks exited 0")
    bad = observe(_slurm("FAILED", exit_code=1, reason="NonZeroExitCode"), ((0, 0), (1, 3)))
    assert bad.state == "failed"
    assert bad.reason == (
        "Slurm: FAILED (NonZeroExitCode), exit 1: rank 1 exited 3 (see the rank logs)"
    )
    assert observe(_slurm("TIMEOUT", exit_code=143), ()).reason == "Slurm: TIMEOUT, exit 143"
    assert observe(_slurm("NODE_FAIL"), ()).state == "failed"
    # COMPLETED with a rank that failed is not a success (a script that swallowed srun's status)
    assert ended("COMPLETED", 0, ((0, 2),)).state == "failed"
    folder = ended("FAILED", 111, ())
    assert folder.reason.endswith("could not make its folder or write its script")


def test_a_forgotten_job_ends_as_its_final_record_says() -> None:
    record = json.dumps({"job_id": 7, "state": "CANCELLED", "exit": 143})
    seen = from_record(7, record, ())
    assert (seen.state, seen.reason) == (
        "failed",
        "Slurm: CANCELLED, exit 143 (from the job's folder)",
    )
    done = from_record(7, '{"job_id": 7, "state": "COMPLETED", "exit": 0}', ((0, 0),))
    assert done.state == "succeeded"
    for missing in (None, "", "not json", '{"job_id": 8, "state": "COMPLETED", "exit": 0}'):
        assert from_record(7, missing, ()).state == "lost"


@pytest.mark.parametrize("folder", ["relative/{username}", "/scratch/{user}", "{uid}/jobs"])
def test_a_jobs_folder_that_is_not_an_absolute_template_stops_the_hub(folder: str) -> None:
    c = Config()
    c.SlurmJobBackend.jobs_folder = folder
    with pytest.raises(ConfigError, match=r"SlurmJobBackend\.jobs_folder"):
        SlurmJobBackend(config=c)
    c.SlurmJobBackend.jobs_folder = "/scratch/{username}/gpupool-jobs"
    assert SlurmJobBackend(config=c).jobs_folder.startswith("/scratch/")


def test_a_job_without_an_account_names_none() -> None:
    """``SlurmSettings.accounts = {"everyone": ""}``: Slurm charges the user's own default
    account; an empty ``--account=`` would be refused by sbatch."""
    args = sbatch_args(replace(JOB, account=""))
    assert not [a for a in args if a.startswith("--account")]
