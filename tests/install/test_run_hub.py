"""``scripts/run-hub``, which ``make run`` starts the demo hub with: a port the demo needs that
is in use stops ``make run`` at once (before it installs anything), saying which and what to do."""

from __future__ import annotations

import socket
import subprocess

from tests.install import ROOT, clean_env, free_port


def test_a_port_in_use_stops_make_run_at_once_naming_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = clean_env(GPUPOOL_PORT=str(port), GPUPOOL_HUB_PORT=str(free_port()))
        done = subprocess.run(
            [str(ROOT / "scripts" / "run-hub"), "--check-ports"],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert done.returncode == 1
    assert done.stderr.startswith(f"gpupool: port {port} (GPUPOOL_PORT) is in use on 127.0.0.1")
    assert f"GPUPOOL_PORT={port + 10} make run" in done.stderr
