"""User code never acts with the hub's privileges, in a real hub (the demo configuration).

Run as root (as CI does), the demo hub runs every server and job as the unprivileged shared
account ``gpupool-demo``: a job of eve (no team) tries to read the admin password, the cookie
secret, both databases and the hub's environment, and must get nothing; servers run as that
account too. Run as an ordinary user these tests skip: user code then runs as that same user by
design (the README's security model), so there is nothing to withhold from it.
"""

from __future__ import annotations

import json
import os
import pwd

import pytest

from gpupool.usercode import DEMO_ACCOUNT
from tests.accounts import IS_ROOT
from tests.hub.conftest import FINAL, Hub, log, spawn, stop_all, submit, uid_of, wait_job

pytestmark = pytest.mark.skipif(
    not IS_ROOT,
    reason="needs root: as an ordinary user the demo runs user code as the hub's own account",
)
HUB_FILES = [
    "admin-password",
    "jupyterhub_cookie_secret",
    "jupyterhub.sqlite",
    "gpupool.sqlite",
]
PROBE = """\
import json, os
out = {"uid": os.getuid(), "env": sorted(os.environ), "read": {}}
for path in PATHS:
    try:
        with open(path, "rb") as f:
            out["read"][path] = f.read(64).hex()
    except OSError as e:
        out["read"][path] = type(e).__name__
print("PROBE", json.dumps(out), flush=True)
"""


def test_a_job_cannot_read_the_hubs_secrets_databases_or_environment(hub: Hub) -> None:
    eve = hub.token("eve")
    assert hub.proc is not None
    paths = [str(hub.state / name) for name in HUB_FILES] + [f"/proc/{hub.proc.pid}/environ"]
    assert all(os.path.exists(p) for p in paths)
    job = submit(hub, eve, f"PATHS = {paths!r}\n{PROBE}", time_limit=120)
    job = wait_job(hub, eve, job["id"], FINAL)
    assert job["state"] == "succeeded", job["reason"]
    line = next(x for x in log(hub, eve, job["id"], 0).splitlines() if x.startswith("PROBE"))
    probe = json.loads(line.removeprefix("PROBE "))
    assert probe["uid"] != 0
    assert probe["read"] == {p: "PermissionError" for p in paths}
    assert "GPUPOOL_DEMO_PASSWORD" not in probe["env"]
    assert not [k for k in probe["env"] if k.startswith(("JUPYTERHUB_", "CONFIGPROXY_"))]


def test_the_hubs_state_is_the_hubs_only(hub: Hub) -> None:
    assert oct(hub.state.stat().st_mode & 0o777) == oct(0o700)
    for name in ("admin-password", "jupyterhub_cookie_secret"):  # and the databases inside
        assert (hub.state / name).stat().st_mode & 0o077 == 0, name


def test_a_server_runs_as_the_shared_account_not_root(hub: Hub) -> None:
    spawn(hub, "eve", "|cpu|1")
    try:
        assert uid_of(hub.pid("eve")) == pwd.getpwnam(DEMO_ACCOUNT).pw_uid
    finally:
        stop_all(hub, "eve")
