"""A GPU is used only by its holder, in a real per-user hub: a process of another hub user's
account on a user's GPU is warned in that user's allocation (what JupyterLab shows), then
stopped; a root process on a free GPU is never stopped, is listed on the admin page, and the GPU
is not handed out (the spawn page says why) until it ends.

Real unix accounts (``useradd``) for two hub users of team vision; the stray and the root
process are real processes the simulated NVML reports on the GPUs (the hub's activity file).
The watch looks every half second with a grace of 3 s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from html import unescape

import pytest

from gpupool.discovery import simulated_inventory
from tests.accounts import (
    IS_ROOT,
    NOT_ROOT,
    RUNTIME_PYTHON,
    as_account,
    homes,
    remove_unix_user,
    unix_user,
)
from tests.hub.conftest import Hub, running, spawn, stop_all, wait_for

pytestmark = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)
IVY, JON = "gpupool-ivy", "gpupool-jon"
FALLBACK = "local: 4x H100-80GB, mig=2:3g.40gb+2g.20gb+1g.10gb, nvlink=2"  # the demo's first node
WHOLE = [g.uuid for g in simulated_inventory(FALLBACK).gpus if g.mig_mode == "off"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    for name in (IVY, JON):
        unix_user(name)
    users = f"[{IVY!r}, {JON!r}]"
    try:
        with homes() as home_root:
            h = Hub(
                tmp_path_factory.mktemp("device-watch-hub"),
                home_root,
                prelude=(
                    "c.LocalGPUSpawner.run_as_hub_user = False\n"
                    "c.DeviceWatch.period = 0.5\n"
                    "c.DeviceWatch.grace_minutes = 0.05\n"
                ),
                extra_config=(
                    f"c.Authenticator.allowed_users |= set({users})\n"
                    f"c.JupyterHub.load_groups['vision']['users'] += {users}\n"
                ),
            )
            with running(h):
                yield h
    finally:
        for name in (IVY, JON):
            remove_unix_user(name)


def waiting(account: str) -> subprocess.Popen[bytes]:
    """A real process of ``account`` that waits for a signal (``root``: as root)."""
    code = "import signal; print('ready', flush=True); signal.pause()"
    p = subprocess.Popen(
        [RUNTIME_PYTHON, "-c", code],
        cwd="/",
        start_new_session=True,
        stdout=subprocess.PIPE,
        **({} if account == "root" else as_account(account)),
    )
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def test_a_gpu_is_used_only_by_its_holder(hub: Hub) -> None:
    spawn(hub, IVY, "vision|h100|1")
    spawn(hub, JON, "vision|cpu|1")
    held = hub.allocations()
    ivy_gpu = held[f"{IVY}/"].devices[0].gpu
    (free,) = [g for g in WHOLE if g != ivy_gpu]
    stray, daemon = waiting(JON), waiting("root")
    activity = hub.state / "activity.json"
    try:
        activity.write_text(
            json.dumps({ivy_gpu: {"pids": [stray.pid]}, free: {"pids": [daemon.pid]}})
        )
        token = hub.token(JON)

        def warned() -> dict[str, str] | None:
            mine = hub.as_user(token, "GET", "/allocations").json()["allocations"]
            found = [a for a in mine if a["id"] == held[f"{JON}/"].id]
            return ((found[0].get("idle") or {}).get("warning")) if found else None

        warning = wait_for(warned, 30, f"{JON}'s warning in the allocations document")
        assert (
            warning is not None and warning["reason"] == "device" and ivy_gpu in warning["message"]
        )
        assert stray.wait(timeout=60) == -signal.SIGTERM

        page = unescape(hub.login("cal").get(f"{hub.url}/hub/spawn", timeout=30).text)
        assert f"{free} is in use by process {daemon.pid} (root)" in page
        password = (hub.state / "admin-password").read_text().strip()
        admin = hub.login("admin", password).get(f"{hub.url}/hub/gpupool", timeout=30).text
        assert f'data-pid="{daemon.pid}"' in admin and 'data-policy="stop"' in admin
        assert daemon.poll() is None, "a root process was stopped"

        daemon.kill()
        daemon.wait()
        activity.write_text("{}")

        def back() -> bool:
            page = hub.login("cal").get(f"{hub.url}/hub/spawn", timeout=30).text
            return "is in use by process" not in unescape(page)

        wait_for(back, 30, f"{free} to be handed out again")
    finally:
        activity.write_text("{}")
        for p in (stray, daemon):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait()
        stop_all(hub, IVY, JON)
