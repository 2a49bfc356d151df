"""A share of a GPU without MIG in a real JupyterHub, end to end on the simulated NVML: the spawn
page says how it is enforced, the server sees exactly its GPU's UUID and its cap, and when the
activity file makes its process use more than the cap, the user is warned (the allocations
document JupyterLab reads), then the server is stopped after the grace, with the reason on the
admin page and in ``gpupool_share_overuse_total``.

The demo's config, with the pool swapped before its ``setup(c)`` runs: two simulated
L40S-48GB without MIG, and a ``share-12gb`` offer (a quarter: 12288 MiB) that users in no team
(eve) may take. The watch looks every half second with a grace of 6 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from html import unescape

import pytest

from tests.accounts import homes
from tests.hub.conftest import (
    Hub,
    environ,
    running,
    scrape,
    spawn,
    stop_all,
    value,
    wait_for,
)

SWAP_POOL = """
import gpupool.hub as _gpupool_hub
_real_setup = _gpupool_hub.setup


def _setup_with_shares(c, *args, **kwargs):
    c.GPUPool.inventory = "simulated:local: 2x L40S-48GB"
    c.GPUPool.offers = {
        "cpu": {"description": "CPU only"},
        "share-12gb": {"kind": "share", "memory": "12GB", "description": "A quarter of an L40S"},
    }
    c.GPUPool.teams = {}
    c.GPUPool.everyone = {"guarantee": 1, "offers": ["cpu", "share-12gb"]}
    return _real_setup(c, *args, **kwargs)


_gpupool_hub.setup = _setup_with_shares
c.ShareEnforcement.period = 0.5
c.ShareEnforcement.grace_minutes = 0.1
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    state = tmp_path_factory.mktemp("shares")
    with homes() as home_root, running(Hub(state, home_root, prelude=SWAP_POOL)) as h:
        yield h


def test_a_share_is_offered_started_warned_and_stopped_over_its_cap(hub: Hub) -> None:
    page = hub.login("eve").get(f"{hub.url}/hub/spawn", timeout=30).text
    assert "everyone|share-12gb|1" in page
    assert (
        "Shared; capped in PyTorch and watched; over the cap you are warned, then stopped after "
        "0.1 minutes"
    ) in unescape(page)

    spawn(hub, "eve", "everyone|share-12gb|1")
    held = hub.allocations()["eve/"]
    (device,) = held.devices
    assert device.share_milli == 250
    pid = hub.pid("eve")
    env = environ(pid)
    assert env["CUDA_VISIBLE_DEVICES"] == device.gpu and device.gpu.startswith("GPU-")
    assert (env["GPUPOOL_SHARE_MILLI"], env["GPUPOOL_SHARE_MIB"]) == ("250", "12288")
    assert env["GPUPOOL_SHARE_ENFORCEMENT"] == "watched"
    assert env["PYTHONSTARTUP"].endswith("gpupool_lab/ipython_startup.py")

    try:
        (hub.state / "activity.json").write_text(
            json.dumps({device.gpu: {"pids": [pid], "used_mib": 20000}})
        )
        token = hub.token("eve")

        def warned() -> dict[str, str] | None:
            mine = hub.as_user(token, "GET", "/allocations").json()["allocations"]
            found = [a for a in mine if a["id"] == held.id]
            return found[0]["idle"]["warning"] if found else None

        warning = wait_for(warned, 30, "the share's warning in the allocations document")
        assert "20000 MiB of GPU memory" in warning["message"]
        assert "12288 MiB" in warning["message"] and warning["action"] == "stop"

        hub.wait_stopped("eve", timeout=60)
        wait_for(lambda: "eve/" not in hub.allocations(), 30, "eve's share to be released")
        samples = scrape(hub)["gpupool_share_overuse"]
        total = "gpupool_share_overuse_total"
        assert value(samples, total, kind="notebook", action="warn") == 1
        assert value(samples, total, kind="notebook", action="stop") == 1
        admin_password = (hub.state / "admin-password").read_text().strip()
        admin_page = hub.login("admin", admin_password).get(f"{hub.url}/hub/gpupool", timeout=30)
        text = unescape(admin_page.text)
        assert 'data-action="stop" data-ref="eve/"' in admin_page.text
        assert "20000 MiB of GPU memory on " + device.gpu in text
        assert "over the share's 12288 MiB for more than 0.1 min after a warning" in text
    finally:
        (hub.state / "activity.json").write_text("{}")
        stop_all(hub, "eve")
