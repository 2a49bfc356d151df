"""``make run-slurm``: the demo hub on a Slurm cluster started on this machine.

    python -m gpupool.slurm.demo LOG JUPYTERHUB_COMMAND...

Starts the dev cluster (:mod:`gpupool.slurm.devcluster`: munged, slurmctld and two slurmd, with
simulated GPUs) in ``/var/tmp/gpupool-slurm-demo``, then the demo hub (``scripts/run-hub LOG
JUPYTERHUB_COMMAND...``) with ``GPUPOOL_SLURM_CONF`` naming the cluster, which makes
``jupyterhub_config.py`` run every server and job as a Slurm job; when the hub exits (Ctrl-C),
the cluster's daemons stop too. Daemons a killed run left behind are stopped first. Needs root
(Slurm's daemons, jobs as the users' accounts) and Debian's Slurm packages.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
from pathlib import Path

from gpupool.slurm.devcluster import DevCluster, NodeLayout, missing

ROOT = Path(__file__).resolve().parents[3]
LAYOUT = (
    NodeLayout("gpu1", {"h100": 2, "1g.10gb": 7}),
    NodeLayout("gpu2", {"l40s": 2}, shards=8),
)
"""Two whole H100s and one H100's worth of 1g.10gb MIG instances on one node, two L40S shared
by Slurm shards (4 per GPU) on the other."""
DEMO_USERS = ("ada", "ben", "cal", "dee", "eli", "eve")
"""jupyterhub_config.py's demo users; on Slurm each needs a unix account (created if missing)."""
FOLDER = Path("/var/tmp/gpupool-slurm-demo")
GRES_MODELS = {"h100": "H100-80GB", "1g.10gb": "H100-80GB", "l40s": "L40S-48GB"}


def main(argv: list[str]) -> int:
    gone = missing()
    if gone:
        print(
            f"gpupool: the Slurm demo needs {', '.join(gone)}: it starts Slurm's daemons and runs "
            "each user's server as a Slurm job of their own unix account; as root, `make "
            "run-slurm` installs Debian's Slurm packages",
            file=sys.stderr,
        )
        return 1
    # not under the state dir (0700, the hub's only): munged runs as munge, and jobs as users
    folder = FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    for user in DEMO_USERS:  # Slurm runs each user's server and jobs as their unix account
        try:
            pwd.getpwnam(user)
        except KeyError:
            subprocess.run(["useradd", "--create-home", "--user-group", user], check=True)
            print(f"gpupool: created the unix account {user} for the Slurm demo")
    cluster = DevCluster(folder, nodes=LAYOUT)
    cluster.stop_stale()
    cluster.start()
    print(f"gpupool: a Slurm cluster runs on this machine ({folder}): SLURM_CONF={cluster.conf}")
    env = {**os.environ, "GPUPOOL_SLURM_CONF": str(cluster.conf)}
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the hub; we wait for it
    try:
        hub = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "run-hub"), *argv], env=env)
        # SIGTERM and SIGHUP go on to the hub (which stops its servers); then the cluster stops
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: hub.send_signal(signum))
        return hub.wait()
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
