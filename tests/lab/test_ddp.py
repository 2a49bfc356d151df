"""Real torchrun runs of converted notebooks (gloo on CPU), the rank launcher, gpupool_lab.ddp.

torchrun is started as ``sys.executable -m torch.distributed.run`` with a c10d rendezvous on a free
local port, and runs ``-m gpupool_lab.rank_log LOG_DIR SCRIPT`` per rank, as the hub's local job
backend does. Results are read back from the per-rank logs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpupool_lab.convert import SKIP_TAG, notebook_to_script
from gpupool_lab.rank_log import exit_path, log_path

TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def torchrun(script: Path, log_dir: Path, nproc: int = 2) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--max-restarts",
        "0",
        "-m",
        "gpupool_lab.rank_log",
        str(log_dir),
        str(script),
    ]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=script.parent,
        env=job_env(),
    )


def tagged_lines(log: str, tag: str) -> list[str]:
    return [line.removeprefix(tag + " ") for line in log.splitlines() if line.startswith(tag + " ")]


TRAINING_NOTEBOOK = [
    new_markdown_cell("# A tiny linear model, trained with DDP"),
    new_code_cell(
        "%matplotlib inline\n"
        "import json\n"
        "import torch\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from gpupool_lab import ddp"
    ),
    new_code_cell("raise RuntimeError('interactive only')", metadata={"tags": [SKIP_TAG]}),
    new_code_cell(
        "device = ddp.init()\n"
        "torch.manual_seed(100 + ddp.rank())  # different on each rank: DDP must broadcast\n"
        "model = DDP(torch.nn.Linear(4, 1).to(device))\n"
        "g = torch.Generator().manual_seed(1234)\n"
        "x = torch.randn(64, 4, generator=g)\n"
        "y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.25\n"
        "data = TensorDataset(torch.arange(64), x, y)"
    ),
    new_code_cell(
        "def train(epochs=3):\n"
        "    sampler = ddp.sampler(data)\n"
        "    loader = DataLoader(data, batch_size=8, sampler=sampler)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    losses = []\n"
        "    for epoch in range(epochs):\n"
        "        sampler.set_epoch(epoch)\n"
        "        seen = []\n"
        "        for idx, xb, yb in loader:\n"
        "            seen += idx.tolist()\n"
        "            opt.zero_grad()\n"
        "            loss = torch.nn.functional.mse_loss(model(xb.to(device)), yb.to(device))\n"
        "            loss.backward()\n"
        "            opt.step()\n"
        "            losses.append(loss.item())\n"
        "        print('SEEN', json.dumps([epoch, sorted(seen)]))\n"
        "    return losses"
    ),
    new_code_cell(
        "losses = train()\n"
        "print('LOSS', json.dumps([losses[0], losses[-1]]))\n"
        "params = [p.detach().cpu().flatten().tolist() for p in model.module.parameters()]\n"
        "print('PARAMS', json.dumps(params))\n"
        "print('WORLD', ddp.rank(), ddp.world_size(), ddp.local_rank(), ddp.is_main())\n"
        "ddp.barrier()\n"
        "ddp.cleanup()"
    ),
]


def test_torchrun_trains_a_converted_notebook_with_identical_parameters(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        notebook_to_script(new_notebook(cells=TRAINING_NOTEBOOK), name="train.ipynb"),
        encoding="utf-8",
    )
    logs = tmp_path / "logs"
    result = torchrun(script, logs)
    rank_logs = [log_path(logs, r).read_text(encoding="utf-8") for r in (0, 1)]
    assert result.returncode == 0, result.stderr + "\n".join(rank_logs)

    params = [json.loads(tagged_lines(log, "PARAMS")[-1]) for log in rank_logs]
    assert params[0] == params[1]  # exactly equal, float for float
    for log in rank_logs:
        first, last = json.loads(tagged_lines(log, "LOSS")[-1])
        assert last < first / 4
        assert "interactive only" not in log and "Traceback" not in log
    assert [tagged_lines(log, "WORLD") for log in rank_logs] == [
        ["0 2 0 True"],
        ["1 2 1 False"],
    ]
    for epoch in range(3):  # the sampler splits each epoch between the ranks
        shards = [json.loads(tagged_lines(log, "SEEN")[epoch])[1] for log in rank_logs]
        assert len(shards[0]) == len(shards[1]) == 32
        assert sorted(shards[0] + shards[1]) == list(range(64))
    assert all(log.startswith("==== gpupool: rank ") for log in rank_logs)
    assert [exit_path(logs, r).read_text() for r in (0, 1)] == ["0\n", "0\n"]


def test_a_failing_rank_leaves_its_traceback_in_its_log(tmp_path: Path) -> None:
    nb = new_notebook(
        cells=[
            new_code_cell("import os\nrank = int(os.environ['RANK'])\nprint('rank', rank, 'up')"),
            new_code_cell("if rank == 1:\n    raise RuntimeError(f'boom on rank {rank}')"),
        ]
    )
    script = tmp_path / "fail.py"
    script.write_text(notebook_to_script(nb, name="fail.ipynb"), encoding="utf-8")
    result = torchrun(script, tmp_path / "logs")
    assert result.returncode != 0
    log = log_path(tmp_path / "logs", 1).read_text(encoding="utf-8")
    assert "rank 1 up" in log
    assert "Traceback (most recent call last):" in log
    assert 'File "fail.ipynb, cell #2", line 2' in log
    assert "raise RuntimeError(f'boom on rank {rank}')" in log
    assert log.rstrip().endswith("RuntimeError: boom on rank 1")
    assert "boom on rank 1" not in result.stdout  # it went to the rank's log
    assert exit_path(tmp_path / "logs", 1).read_text() == "1\n"


# -- rank_log on its own --------------------------------------------------------------------------


def rank_log(
    tmp_path: Path, source: str, *args: str, rank: str = "3"
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(source, encoding="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "gpupool_lab.rank_log", str(tmp_path / "logs"), str(script), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=job_env(RANK=rank),
    )


def test_rank_log_runs_the_script_as_main_with_its_argv_and_exit_code(tmp_path: Path) -> None:
    source = (
        "import os, sys\n"
        "print('name', __name__, sys.argv[1:])\n"
        "sys.stdout.flush()\n"
        "os.system('echo from a child process')\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    result = rank_log(tmp_path, source, "--lr", "0.1")
    assert (result.returncode, result.stdout, result.stderr) == (3, "", "")
    lines = log_path(tmp_path / "logs", 3).read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("==== gpupool: rank 3 starting ")
    assert lines[1:] == [
        "name __main__ ['--lr', '0.1']",
        "from a child process",
        "to stderr",
    ]
    assert exit_path(tmp_path / "logs", 3).read_text() == "3\n"


def test_rank_log_ends_as_python_would_threads_then_atexit(tmp_path: Path) -> None:
    source = (
        "import atexit, threading, time\n"
        "atexit.register(print, 'atexit ran')\n"
        "def late():\n"
        "    time.sleep(0.2)\n"
        "    print('thread done', flush=True)\n"
        "threading.Thread(target=late).start()\n"
        "print('script done')\n"
    )
    result = rank_log(tmp_path, source)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    lines = log_path(tmp_path / "logs", 3).read_text(encoding="utf-8").splitlines()
    assert lines[1:] == ["script done", "thread done", "atexit ran"]


def test_rank_log_appends_and_turns_an_exception_into_exit_1(tmp_path: Path) -> None:
    assert rank_log(tmp_path, "print('first run')").returncode == 0
    result = rank_log(tmp_path, "def f():\n    raise KeyError('missing')\nf()\n")
    assert (result.returncode, result.stdout, result.stderr) == (1, "", "")
    log = log_path(tmp_path / "logs", 3).read_text(encoding="utf-8")
    assert log.count("==== gpupool: rank 3 starting") == 2
    assert "first run" in log
    assert log.rstrip().endswith("KeyError: 'missing'")
    assert 'script.py", line 2, in f' in log
    assert exit_path(tmp_path / "logs", 3).read_text() == "1\n"
    assert rank_log(tmp_path, "raise SystemExit('bye')").returncode == 1
    assert log_path(tmp_path / "logs", 3).read_text(encoding="utf-8").rstrip().endswith("bye")


def test_rank_log_usage_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpupool_lab.rank_log", "only-one-argument"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("usage: python -m gpupool_lab.rank_log LOG_DIR SCRIPT")


# -- ddp outside torchrun -------------------------------------------------------------------------


def test_ddp_is_a_world_of_one_outside_torchrun_and_imports_no_torch() -> None:
    probe = (
        "import sys\n"
        "from gpupool_lab import ddp\n"
        "assert 'torch' not in sys.modules, 'importing ddp imported torch'\n"
        "print(ddp.rank(), ddp.world_size(), ddp.local_rank(), ddp.is_main(),\n"
        "      ddp.under_torchrun())\n"
        "import torch\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "device = ddp.init()\n"
        "assert ddp.init() == device\n"
        "model = DDP(torch.nn.Linear(2, 1).to(device))\n"
        "sampler = ddp.sampler(list(range(10)), shuffle=False)\n"
        "print(device, list(sampler), model(torch.ones(3, 2, device=device)).shape[0])\n"
        "ddp.barrier()\n"
        "ddp.cleanup()\n"
        "ddp.cleanup()\n"
    )
    env = job_env(CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "0 1 0 True False",
        "cpu [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] 3",
    ]
