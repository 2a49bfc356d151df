"""A hub restart with servers running: allocations re-attach, nothing doubles, nothing leaks
(a server that died while the hub was down and an allocation no server holds are released)."""

from __future__ import annotations

import os
import signal

from gpupool.core.ledger import Allocation, Device
from gpupool.discovery import simulated_inventory
from gpupool.store import Store
from tests.hub.conftest import Hub, job_processes, log, spawn, stop_all, submit, wait_job

SIMULATED = "local: 4x H100-80GB, mig=2:3g.40gb+2g.20gb+1g.10gb, nvlink=2"  # the demo fallback


def test_restart_reattaches_running_servers_and_releases_vanished_ones(hub: Hub) -> None:
    spawn(hub, "ada", "vision|h100|1")
    spawn(hub, "dee", "nlp|mig-3g.40gb|1")
    spawn(hub, "eve", "everyone|cpu|1")
    before = hub.allocations()
    dee_pid = hub.pid("dee")
    ada_gpu = before["ada/"].devices[0].gpu

    hub.stop_hub()  # servers keep running (cleanup_servers is off)
    os.kill(dee_pid, signal.SIGKILL)  # one of them dies while the hub is down
    # a hub that died in the middle of a start leaves an allocation no server holds
    inventory = simulated_inventory(SIMULATED)
    other = next(g.uuid for g in inventory.gpus if g.mig_mode == "off" and g.uuid != ada_gpu)
    orphan = Allocation(
        "orphan", "cal", "vision", "h100", "notebook", "cal/", 1, 1000, "local", (Device(other),)
    )
    store = Store(f"sqlite:///{hub.state / 'gpupool.sqlite'}", upgrade=False)
    store.insert(orphan)
    store.close()
    hub.start()

    assert hub.wait_ready("ada") and hub.wait_ready("eve")
    assert hub.server("dee") is None
    after = hub.allocations()
    assert set(after) == {"ada/", "eve/"}
    assert after["ada/"] == before["ada/"] and after["eve/"] == before["eve/"]

    # nothing double-allocated: ben's GPU is the other whole GPU; dee's 3g slice is free again
    spawn(hub, "ben", "vision|h100|1")
    spawn(hub, "eli", "nlp|mig-3g.40gb|1")
    held = hub.allocations()
    assert held["ben/"].devices[0].gpu != held["ada/"].devices[0].gpu
    stop_all(hub, "ada", "ben", "eli", "eve")
    assert hub.allocations() == {}


def test_a_job_running_across_a_hub_restart_finishes_and_frees_its_gpus(hub: Hub) -> None:
    ada = hub.token("ada")
    flag = hub.homes / "let-the-job-finish"  # where the job's account can look
    script = (
        "import os, time\nprint('started', flush=True)\n"
        f"while not os.path.exists({str(flag)!r}):\n    time.sleep(0.2)\n"
        "print('done', flush=True)\n"
    )
    job = submit(hub, ada, script, offer="h100", gpus=2, time_limit=300)
    wait_job(hub, ada, job["id"], {"running"})
    pids = job_processes(job["id"])
    held = hub.allocations()
    assert pids and set(held) == {job["id"]}

    hub.stop_hub()
    hub.start()

    again = hub.as_user(ada, "GET", f"/jobs/{job['id']}").json()
    assert again["state"] == "running" and again["devices"] == job_devices(held, job["id"])
    assert set(job_processes(job["id"])) == set(pids)  # the very same processes
    flag.touch()
    done = wait_job(hub, ada, job["id"], {"succeeded", "failed", "cancelled", "lost"})
    assert done["state"] == "succeeded" and "done" in log(hub, ada, job["id"], 1)
    assert hub.allocations() == {}


def job_devices(held: dict[str, Allocation], ref: str) -> list[str]:
    return held[ref].visible_devices.split(",")
