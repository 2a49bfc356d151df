# gpupool: the runnable LOCAL / DEV default. `make run` starts JupyterHub with this file.
#
# It is a complete hub for one machine: JupyterHub + configurable-http-proxy on
# http://127.0.0.1:8000, JupyterLab servers as local processes (all in one shared unix account:
# the hub's own, or the unprivileged `gpupool-demo` when the hub runs as root, never root), demo
# users with one shared password, and the GPU pool: offers (what users may pick), teams
# (JupyterHub groups) with quotas in GPU-equivalents, and where the GPUs come from. Not for
# production: every demo user shares one password and servers are not isolated from each other
# (they share one account); the hub's secrets and databases in the state dir are the hub's only.
#
# Environment knobs (for tests and demos): GPUPOOL_STATE_DIR (databases, secrets; default ./.run),
# GPUPOOL_HOMES (the users' homes; default <state dir>/home, or ~gpupool-demo/homes as root),
# GPUPOOL_PORT (8000), GPUPOOL_HUB_PORT (8081), GPUPOOL_PROXY_API_PORT (8001),
# GPUPOOL_INVENTORY (default "nvml"), GPUPOOL_DEMO_PASSWORD (default: generated, kept in the
# state dir), GPUPOOL_RECLAIM_PERIOD (seconds between idle checks; 30), GPUPOOL_CONCURRENT_SPAWNS
# (spawns in flight before JupyterHub answers 429; 8).
import logging
import os
import pwd
import secrets
import sys
from pathlib import Path

from gpupool.clock import OffsetClock
from gpupool.hub import setup
from gpupool.usercode import DEMO_ACCOUNT

c = get_config()  # noqa: F821  (injected by JupyterHub / traitlets)

ROOT = Path(__file__).resolve().parent
STATE = Path(os.environ.get("GPUPOOL_STATE_DIR", ROOT / ".run")).resolve()
STATE.mkdir(parents=True, exist_ok=True)
STATE.chmod(0o700)  # secrets and databases: readable by the hub only


def _secret(name: str, env: str, size: int) -> str:
    """A demo secret from the environment, or generated once and kept in the state dir."""
    if os.environ.get(env):
        return os.environ[env]
    path = STATE / name
    if not path.exists():
        path.write_text(secrets.token_urlsafe(size))
        path.chmod(0o600)
    return path.read_text().strip()


# -- JupyterHub: where it listens, where it keeps its state -----------------------------------
c.JupyterHub.bind_url = f"http://127.0.0.1:{os.environ.get('GPUPOOL_PORT', '8000')}"
c.JupyterHub.hub_port = int(os.environ.get("GPUPOOL_HUB_PORT", "8081"))
c.ConfigurableHTTPProxy.api_url = (
    f"http://127.0.0.1:{os.environ.get('GPUPOOL_PROXY_API_PORT', '8001')}"
)
c.ConfigurableHTTPProxy.command = [str(ROOT / "node_modules" / ".bin" / "configurable-http-proxy")]
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")

# -- who can log in: demo users with one shared password --------------------------------------
TEAMS = {"vision": ["ada", "ben", "cal"], "nlp": ["dee", "eli"]}
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = _secret("demo-password", "GPUPOOL_DEMO_PASSWORD", 9)
c.SharedPasswordAuthenticator.admin_password = _secret(
    "admin-password", "GPUPOOL_ADMIN_PASSWORD", 33
)
c.Authenticator.allowed_users = {u for users in TEAMS.values() for u in users} | {"eve"}
c.Authenticator.admin_users = {"admin"}
# Teams are JupyterHub groups: a group named like a team below belongs to that team.
c.JupyterHub.load_groups = {team: {"users": users} for team, users in TEAMS.items()}

# -- notebook servers: local processes that see only their GPUs -------------------------------
c.JupyterHub.spawner_class = "gpupool-local"
# Servers and jobs run from the *runtime*: an installation the account that runs them can run.
# As root, `make` builds it outside this checkout (which that account may not be able to enter)
# and records where in the hub's venv; otherwise it is the hub's own Python.
_RECORD = Path(sys.prefix) / "gpupool-runtime"
RUNTIME = (
    Path(_RECORD.read_text().strip()) / "bin" if _RECORD.is_file() else Path(sys.executable).parent
)
c.Spawner.cmd = [str(RUNTIME / "jupyterhub-singleuser")]
if "python" not in c.LocalJobBackend:  # unless set before this file runs (the tests do)
    c.LocalJobBackend.python = str(RUNTIME / "python")
# A terminal in JupyterLab finds the runtime's commands (`gpupool submit`) first.
c.Spawner.environment = {"PATH": f"{RUNTIME}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
c.Spawner.default_url = "/lab"
if os.geteuid() == 0:  # user code never runs as root: `make run` creates this account for it
    c.LocalGPUSpawner.shared_account = DEMO_ACCOUNT
    try:
        HOMES = Path(pwd.getpwnam(DEMO_ACCOUNT).pw_dir) / "homes"
    except KeyError:  # setup() below stops the hub and says how to create the account
        HOMES = Path("/var/lib") / DEMO_ACCOUNT / "homes"
else:
    HOMES = STATE / "home"
c.LocalGPUSpawner.home_dir_template = str(
    Path(os.environ.get("GPUPOOL_HOMES", HOMES)) / "{username}"
)
# Batch jobs ("Run distributed", `gpupool submit`) run as local torchrun process groups, as the
# same account as the servers, with their files under the same homes: ~/.gpupool/jobs/<id>/.
c.JobManager.backend_class = "gpupool.jobs.local.LocalJobBackend"
c.Spawner.start_timeout = 120
# Shed spawn storms instead of absorbing them: with this many spawns in flight JupyterHub answers
# 429 (with Retry-After) at once, so the hub stays quick and a refusal (quota, capacity) comes
# back as an immediate 4xx instead of a 202 that fails later. Size it to the machine: each
# JupyterLab server takes about 2 CPU-seconds to start.
c.JupyterHub.concurrent_spawn_limit = int(os.environ.get("GPUPOOL_CONCURRENT_SPAWNS", "8"))
c.Spawner.http_timeout = 90

# -- the GPU pool ---------------------------------------------------------------------------------
# Where the GPUs come from: "nvml" reads this machine's GPUs through the NVIDIA driver. Without a
# driver (a laptop, CI) the pool falls back to a SIMULATED pool of 4x H100-80GB whose last two
# GPUs have MIG on with instances 3g.40gb + 2g.20gb + 1g.10gb; the spawn page and the logs say
# "simulated" then. Spec grammar: "NODE: COUNTx MODEL[, mig=N[:P+P…]][, nvlink=K]".
c.GPUPool.inventory = os.environ.get("GPUPOOL_INVENTORY", "nvml")
c.GPUPool.simulated_fallback = (
    "local: 4x H100-80GB, mig=2:3g.40gb+2g.20gb+1g.10gb, nvlink=2; local-a100: 1x A100-80GB, mig=1;"
    " local-l40s: 2x L40S-48GB"
)
# MIG on demand: on the simulated A100 (MIG on, no instances yet) gpupool itself creates each MIG
# instance where it places it and destroys it on release. Named by UUID so that a real GPU is
# never managed by this demo; on a real machine list GPU UUIDs or models, e.g. ["A100-80GB"]
# (the hub must run as root; gpupool never switches MIG mode: nvidia-smi -i 0 -mig 1 does).
c.GPUPool.managed_mig = ["GPU-43a3e6ab-e43a-5ca0-8511-1ed279d24e69"]

# Offers: what users may pick. kind "gpu": whole GPUs (max_count per server, optional model,
# nvlink=True for one NVLink island); kind "mig": one MIG instance (a name like "mig-3g.40gb"
# implies the kind and the profile).
c.GPUPool.offers = {
    "cpu": {"description": "CPU only"},
    "h100": {"model": "H100-80GB", "max_count": 2, "description": "Whole H100 80GB"},
    "mig-3g.40gb": {"model": "H100-80GB", "description": "Half an H100"},
    "mig-2g.20gb": {"model": "H100-80GB", "description": "A quarter of an H100"},
    "mig-1g.10gb": {"model": "H100-80GB", "description": "An eighth of an H100"},
    "share-12gb": {
        "kind": "share",
        "memory": "12GB",
        "model": "L40S-48GB",
        "description": "A quarter of an L40S (no MIG): capped in PyTorch and watched",
    },
    "a100-mig-3g.40gb": {
        "kind": "mig",
        "profile": "3g.40gb",
        "model": "A100-80GB",
        "description": "Half an A100, MIG instance made on demand",
    },
}

# Teams, by JupyterHub group. guarantee: GPU-equivalents (a whole GPU = 1, a MIG instance = its
# memory slots / 8: 3g.40gb = 0.5, 1g.10gb = 0.125) the team can always use while the pool has
# them; borrow_limit: how much more it may use while other teams leave theirs idle; user_cap: the
# most one member may hold; offers: what the team may request (default: all). Small on purpose,
# so a refusal is easy to see.
c.GPUPool.teams = {
    "vision": {
        "guarantee": 1.5,
        "borrow_limit": 0.5,
        "user_cap": 2,
        "offers": ["cpu", "h100", "mig-3g.40gb", "share-12gb"],
    },
    "nlp": {
        "guarantee": 1,
        "user_cap": 0.5,
        "offers": ["cpu", "mig-3g.40gb", "mig-2g.20gb", "mig-1g.10gb", "a100-mig-3g.40gb"],
    },
}
# Users in no team (eve) get only this: CPU only.
c.GPUPool.everyone = {"offers": ["cpu"]}

# Placement: "gpupool" (fragmentation-aware), "best-fit" or "first-fit".
c.GPUPool.policy = "gpupool"
# Allocations persist here and survive hub restarts (any SQLAlchemy URL).
c.GPUPool.db_url = f"sqlite:///{STATE / 'gpupool.sqlite'}"

# -- on Slurm (`make run-slurm`): every server and job is a Slurm job on a cluster started on this
# machine with simulated GPUs (gpupool.slurm.demo), run as each user's own unix account.
SLURM_CONF = os.environ.get("GPUPOOL_SLURM_CONF", "")
if SLURM_CONF:
    from gpupool.slurm.demo import GRES_MODELS

    c.GPUPool.inventory = "slurm"
    c.GPUPool.managed_mig = []  # Slurm's MIG instances are the admin's (gres.conf)
    c.SlurmSettings.slurm_conf = SLURM_CONF
    c.SlurmSettings.gres_models = GRES_MODELS
    c.SlurmSettings.simulated = True
    c.JupyterHub.spawner_class = "gpupool_spawner.slurm.SlurmSpawner"
    c.JobManager.backend_class = "gpupool.slurm.jobs.SlurmJobBackend"
    c.SlurmJobBackend.python = str(RUNTIME / "python")
    c.LocalGPUSpawner.run_as_hub_user = False  # each user's own account, as Slurm runs them

# Idle GPUs come back: a GPU notebook under 5% GPU use with no busy kernel for 60 minutes is
# warned in JupyterLab 15 minutes ahead, then its server is stopped (vision) or restarted
# without a GPU (nlp, "action": "cpu"). Simulated GPUs are idle unless the activity file says
# otherwise, e.g. {"GPU-…": {"gpu": 80}} (the admin page at /hub/gpupool shows the UUIDs); the
# demo's clock can be moved forward by writing seconds to .run/clock-offset.
c.IdleReclaimer.policies = {
    "*": {"threshold": 5, "idle_minutes": 60, "warn_minutes": 15, "action": "stop"},
    "nlp": {"action": "cpu"},
}
c.IdleReclaimer.period = float(os.environ.get("GPUPOOL_RECLAIM_PERIOD", "30"))
c.IdleReclaimer.clock = OffsetClock(STATE / "clock-offset")
c.GPUPool.simulated_activity_file = str(STATE / "activity.json")

# Validate all of the above now and build the pool: a bad key stops the hub here, named.
hub = setup(c, logging.getLogger("JupyterHub").getChild("gpupool"))
RUNS_AS = c.LocalGPUSpawner.get("shared_account") or pwd.getpwuid(os.geteuid()).pw_name
HOMES_TEMPLATE = c.LocalGPUSpawner.home_dir_template
ACCOUNTS = (  # the shared mode (run_as_hub_user, the default) gives users no isolation
    f"  servers and jobs run as the unix account {RUNS_AS}, homes in {HOMES_TEMPLATE}\n"
    "  shared-account mode: all users share that account, so they are not isolated from each"
    " other (files, processes)\n"
    if c.LocalGPUSpawner.get("run_as_hub_user", True)
    else "  servers and jobs run as each user's own unix account\n"
)
teams = "; ".join(f"{team}: {', '.join(users)}" for team, users in TEAMS.items())
print(
    f"\ngpupool demo hub on {c.JupyterHub.bind_url} with {hub.pool.inventory.label}\n"
    f"  users: {', '.join(sorted(c.Authenticator.allowed_users))} ({teams}; eve: no team)\n"
    f"  shared demo password: {c.SharedPasswordAuthenticator.user_password}\n"
    f"{ACCOUNTS}"
    f"  admin: user 'admin', password in {STATE / 'admin-password'};"
    f" the pool: {c.JupyterHub.bind_url}/hub/gpupool\n",
    flush=True,
)
