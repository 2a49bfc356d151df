"""A gpupool job as a Slurm batch job: the ``sbatch`` arguments and the batch script (pure).

Vocabulary
- *job folder*: the folder on the shared filesystem (every node and the hub see it) where the
  job keeps ``script.py``, the per-rank logs ``rank-<r>.log`` and exit codes ``rank-<r>.exit``
  (written by ``python -m gpupool_lab.rank_log``), ``batch.log`` (the batch script's and
  torchrun's own output) and ``slurm-final.json``, the *final record*.
- *final record*: ``{"job_id": <Slurm job id>, "state": "COMPLETED" | "FAILED" |
  "CANCELLED" | "TIMEOUT", "exit": <status>}``, written by the batch script (as the job's
  owner) when srun ends or when Slurm signals the script (cancel, time limit): without
  slurmdbd Slurm forgets a job ``MinJobAge`` seconds after it ends (slurm.conf(5)), and a hub
  that looks later reads what happened from here.
- *tasks per node*: 1 (one ``torchrun`` per node running a rank per GPU), or, for an offer
  of several MIG instances per node, one task per instance, each given its own instance by
  Slurm (``srun --gpus-per-task``), each a ``torchrun`` with one rank.

Contract: pure; the user's script travels inside the batch script base64-encoded (no quoting
of what the user wrote), the user's arguments are shell-quoted, the user's environment travels
in the submission's environment (never in the script's text).
"""

from __future__ import annotations

import base64
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

FINAL_RECORD = "slurm-final.json"
BATCH_LOG = "batch.log"
FOLDER_FAILED = 111
"""The batch script's status when it could not make the job folder or write the script."""


@dataclass(frozen=True)
class BatchJob:
    name: str
    """``--job-name`` (:func:`gpupool.slurm.names.batch_job_name`)."""
    tag: str
    """``--comment`` (:class:`gpupool.slurm.names.Tag`)."""
    account: str
    nodes: tuple[str, ...]
    """The allocations' nodes, in the ledger's order; ``()`` for allocations on no node
    (CPU-only offers): Slurm picks ``node_count`` nodes."""
    gres: str
    """Per node (``gpu:h100:2``; ``""``: none)."""
    procs_per_node: int
    """Ranks per node."""
    one_task_per_device: bool = False
    """A rank per MIG instance, each its own Slurm task (see *tasks per node*)."""
    time_limit: int = 0
    """Seconds; 0: the partition's own limit."""
    partition: str = ""
    node_count: int = 0
    """How many nodes (0: as many as :attr:`nodes`)."""


def slurm_time(seconds: int) -> str:
    """``--time`` for ``seconds``: Slurm counts whole minutes (``minutes:seconds`` rounds up,
    sbatch(1) ``--time``), so ``D-HH:MM:SS`` of the seconds rounded up to a minute."""
    minutes = -(-seconds // 60)
    days, rest = divmod(minutes, 24 * 60)
    return f"{days}-{rest // 60:02d}:{rest % 60:02d}:00"


def per_task_gres(gres: str) -> str:
    """``--gpus-per-task`` for a node's gres of one GPU type (``gpu:1g.10gb:2`` →
    ``1g.10gb:1``)."""
    parts = gres.split(":")
    if len(parts) != 3 or parts[0] != "gpu":
        raise ValueError(f"one task per device needs one typed GPU gres, not {gres!r}")
    return f"{parts[1]}:1"


def sbatch_args(job: BatchJob) -> list[str]:
    """The ``sbatch`` options (``--parsable`` and ``--export`` are the commands seam's)."""
    tasks = job.procs_per_node if job.one_task_per_device else 1
    args = [
        f"--job-name={job.name}",
        f"--comment={job.tag}",
        f"--nodes={job.node_count or len(job.nodes)}",
        f"--ntasks-per-node={tasks}",
        # The batch script sends its own output to the job folder once it has made it.
        "--output=/dev/null",
        "--error=/dev/null",
    ]
    if job.account:  # none: Slurm charges the user's default account (SlurmSettings.accounts)
        args.append(f"--account={job.account}")
    if job.nodes:
        args.append(f"--nodelist={','.join(job.nodes)}")
    if job.gres:
        args.append(f"--gres={job.gres}")
    if job.partition:
        args.append(f"--partition={job.partition}")
    if job.time_limit > 0:
        args.append(f"--time={slurm_time(job.time_limit)}")
    return args


def batch_script(job: BatchJob, script: str, args: Sequence[str]) -> str:
    """The batch script (bash): make the job folder, write ``script.py``, run one ``torchrun``
    per task with ``srun`` (rendezvous on the first node, this one: sbatch(1) runs the script
    "on the first node in the set of allocated nodes"), keep the final record, and exit with
    srun's status (a batch script that ends 0 after a failed step is COMPLETED 0:0 in Slurm).

    Environment it expects (the submission's): ``GPUPOOL_JOB_DIR``, ``GPUPOOL_PYTHON``,
    ``GPUPOOL_WORKDIR``; Slurm's ``SLURM_JOB_ID``, ``SLURM_NNODES``, ``SLURM_NTASKS``."""
    encoded = base64.encodebytes(script.encode()).decode()
    if job.one_task_per_device:
        srun = ["srun", "--kill-on-bad-exit=1", f"--ntasks-per-node={job.procs_per_node}",
                f"--gpus-per-task={per_task_gres(job.gres)}"]  # fmt: skip
        nnodes, nproc = '"$SLURM_NTASKS"', "1"
    else:
        srun = ["srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1"]
        nnodes, nproc = '"$SLURM_NNODES"', str(job.procs_per_node)
    torchrun = [
        '"$GPUPOOL_PYTHON"', "-m", "torch.distributed.run",
        f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$RDZV_HOST:$RDZV_PORT"',
        '--rdzv-id="$SLURM_JOB_ID"',
        "--max-restarts=0",  # failures end the job (as on every backend)
        "-m", "gpupool_lab.rank_log", '"$D"', '"$D/script.py"',
        *(shlex.quote(a) for a in args),
    ]  # fmt: skip
    limit = -(-job.time_limit // 60) * 60 if job.time_limit > 0 else 1 << 40
    return f"""\
#!/bin/bash
# gpupool job {shlex.quote(job.tag)} (gpupool.slurm.batch)
umask 077
D="$GPUPOOL_JOB_DIR"
mkdir -p -- "$D" || exit {FOLDER_FAILED}
base64 -d > "$D/script.py" <<'GPUPOOL_SCRIPT_END' || exit {FOLDER_FAILED}
{encoded}GPUPOOL_SCRIPT_END
exec </dev/null >>"$D/{BATCH_LOG}" 2>&1
cd -- "$GPUPOOL_WORKDIR" 2>/dev/null || cd -- "$HOME" 2>/dev/null || cd /

final() {{  # the final record: Slurm forgets the job MinJobAge seconds after it ends
  printf '{{"job_id": %s, "state": "%s", "exit": %s}}\\n' "$SLURM_JOB_ID" "$1" "$2" \\
    > "$D/{FINAL_RECORD}.tmp" && mv -f -- "$D/{FINAL_RECORD}.tmp" "$D/{FINAL_RECORD}"
}}
signalled() {{  # scancel or the time limit: Slurm signals the script (SIGTERM, then SIGKILL
  # after KillWait). squeue cannot say which yet (the job is COMPLETING until this script
  # ends), so: signalled at or past the time limit is TIMEOUT, before it CANCELLED.
  if [ "$SECONDS" -ge {limit} ]; then state=TIMEOUT; else state=CANCELLED; fi
  final "$state" 143
  [ -n "$step" ] && kill -TERM "$step" 2>/dev/null
  exit 143
}}
trap signalled TERM INT

RDZV_HOST=$(hostname)
RDZV_PORT=$("$GPUPOOL_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); \
print(s.getsockname()[1])') || RDZV_PORT=29400
echo "gpupool: Slurm job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $RDZV_HOST:$RDZV_PORT"
{shlex.join(srun)} \\
  {" ".join(torchrun)} &
step=$!
wait "$step"
rc=$?
if [ "$rc" = 0 ]; then final COMPLETED 0; else final FAILED "$rc"; fi
exit "$rc"
"""
