"""``python -m benchmarks.spawn [--spawns N] [--json]``: what gpupool adds to a spawn.

Vocabulary
- *time to ready*: wall time of ``POST /hub/api/users/<name>/server`` until it answers 201 (the
  hub answers once the server is up, because a spawn here is faster than ``slow_spawn_timeout``).
- *gpupool*: a ``LocalGPUSpawner`` spawn of one whole GPU (``{"offer": "h100"}``) on the demo
  config's pool; *plain*: JupyterHub's ``SimpleLocalProcessSpawner`` in the same hub (see
  :mod:`benchmarks.spawn_hub`). Spawns alternate between the two in ABBA order (so neither
  always runs right after the other's stop); each server is stopped before the next spawn.

Contract: starts its own hub (the repository's ``jupyterhub_config.py`` on free ports, state in a
temporary directory), prints the medians and their ratio, and stops everything it started.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.accounts import homes
from tests.hub.conftest import Hub, kill_servers

ROOT = Path(__file__).resolve().parents[1]


def timed_spawn(hub: Hub, user: str, options: dict[str, object]) -> float:
    start = time.perf_counter()
    r = hub.api("POST", f"/users/{user}/server", json=options)
    if r.status_code == 202:  # slower than slow_spawn_timeout: wait for ready
        hub.wait_ready(user)
    elif r.status_code != 201:
        raise SystemExit(f"spawn of {user} failed: {r.status_code} {r.text}")
    elapsed = time.perf_counter() - start
    hub.stop_server(user)
    return elapsed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spawns", type=int, default=10, help="spawns of each kind (default 10)")
    parser.add_argument("--json", action="store_true", help="print a JSON object")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="gpupool-spawn-bench-") as tmp, homes() as home_root:
        hub = Hub(Path(tmp), home_root)
        hub.env["PYTHONPATH"] = str(ROOT)
        with hub.config.open("a") as f:
            f.write(
                "c.JupyterHub.spawner_class = 'benchmarks.spawn_hub.PerUserSpawner'\n"
                "c.Authenticator.allowed_users.add('plain')\n"
                "c.SimpleLocalProcessSpawner.home_dir_template = "
                "c.LocalGPUSpawner.home_dir_template\n"
                # the baseline is JupyterHub's own spawner, which runs servers as the hub's user
                "import os\n"
                "if os.geteuid() == 0:\n"
                "    c.SimpleLocalProcessSpawner.args = ['--ServerApp.allow_root=True']\n"
            )
        hub.start()
        try:
            timed_spawn(hub, "ada", {"offer": "h100"})  # warm both paths once, not counted
            timed_spawn(hub, "plain", {})
            gpupool: list[float] = []
            plain: list[float] = []
            for i in range(args.spawns):  # ABBA order: neither kind always follows the other
                pair = [
                    lambda: gpupool.append(timed_spawn(hub, "ada", {"offer": "h100"})),
                    lambda: plain.append(timed_spawn(hub, "plain", {})),
                ]
                for run in pair if i % 2 == 0 else reversed(pair):
                    run()
        finally:
            hub.stop_hub()
            kill_servers(hub)
    result = {
        "spawns": args.spawns,
        "gpupool_s": round(statistics.median(gpupool), 3),
        "plain_s": round(statistics.median(plain), 3),
    }
    result["ratio"] = round(result["gpupool_s"] / result["plain_s"], 3)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"median time to a ready server over {args.spawns} spawns each, one hub")
        print(f"  LocalGPUSpawner (1x h100)   {result['gpupool_s']:.3f} s")
        print(f"  SimpleLocalProcessSpawner   {result['plain_s']:.3f} s")
        print(f"  ratio                       {result['ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
