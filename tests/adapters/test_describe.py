"""``python -m gpupool.describe``: the repo's own jupyterhub_config.py loads and shows its pool."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_inspect(config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUPOOL_STATE_DIR": str(cwd)}
    return subprocess.run(
        [sys.executable, "-m", "gpupool.describe", str(config)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_default_config_shows_a_pool(tmp_path: Path) -> None:
    done = run_inspect(ROOT / "jupyterhub_config.py", tmp_path)
    assert done.returncode == 0, done.stderr
    first = next(line for line in done.stdout.splitlines() if line.startswith("gpupool: "))
    if "simulated" in first:  # no NVIDIA driver here: the fallback, labelled as such
        assert "[SIMULATED: no real GPUs]" in first
        assert "GPU-" in done.stdout and "MIG fixed  3g.40gb@0, 2g.20gb@4, 1g.10gb@6" in done.stdout
    assert "vision" in done.stdout and "mig-3g.40gb" in done.stdout
    assert (tmp_path / "gpupool.sqlite").exists()


def test_a_bad_config_stops_with_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "jupyterhub_config.py"
    bad.write_text("c.GPUPool.teams = {'vision': {'guarantee': -2}}\n")
    done = run_inspect(bad, tmp_path)
    assert done.returncode == 2
    assert "GPUPool.teams['vision'].guarantee: must be a number >= 0" in done.stderr
    assert not (tmp_path / "gpupool.sqlite").exists()
