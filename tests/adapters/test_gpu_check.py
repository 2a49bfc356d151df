"""``scripts/gpu-check`` runs here: without a GPU it says so and exits 2; with one, the job runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_reports_the_inventory_and_its_verdict() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-check")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.stdout.startswith("gpupool: ")
    if done.stdout.startswith("gpupool: 0 GPUs (nvml)"):
        assert done.returncode == 2
        assert "no NVIDIA GPU without MIG here" in done.stderr
    else:  # a machine with a GPU: the nccl job must succeed
        assert done.returncode == 0, done.stdout + done.stderr
        assert "backend nccl" in done.stdout and "job succeeded" in done.stdout
