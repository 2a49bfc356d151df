"""MIG on demand in a real JupyterHub: the demo's simulated A100 (MIG on, no instances, managed by
``c.GPUPool.managed_mig``) gets a MIG instance created for each server, which sees exactly its
``MIG-…`` UUID; stopping the server destroys it; a hub restart keeps an instance in use, and an
instance whose processes outlive its server drains and is destroyed once they end. An instance an
admin made on the managed GPU is handed out as it is, and left there after its server stops.

What the simulated driver holds is read from its state file beside the activity file (the hub's
simulated NVML keeps its MIG instances there, as a real driver keeps them across hub restarts).
"""

from __future__ import annotations

import json

from tests.hub.admin_pages import admin, page
from tests.hub.conftest import Hub, environ, spawn, stop_all
from tests.hub.mig_records import A100, driver_instances, records

OFFER = "nlp|a100-mig-3g.40gb|1"


def test_a_server_on_a_managed_gpu_sees_its_new_instance_which_its_stop_destroys(
    hub: Hub,
) -> None:
    assert records(hub) == [] and driver_instances(hub) == {}
    spawn(hub, "dee", OFFER)
    held = hub.allocations()["dee/"]
    (device,) = held.devices
    uuid = device.instance
    assert uuid and uuid.startswith("MIG-") and device.profile == "3g.40gb"
    assert device.gpu == A100
    assert environ(hub.pid("dee"))["CUDA_VISIBLE_DEVICES"] == uuid
    assert records(hub) == [(uuid, "live", held.id)]
    assert driver_instances(hub) == {uuid: ("3g.40gb", device.start)}
    soup = page(admin(hub), hub)
    row = soup.select_one(f'#mig-instances tr[data-uuid="{uuid}"]')
    assert row is not None and row["data-state"] == "live" and "dee" in row.get_text()
    hub.stop_server("dee")
    assert records(hub) == [] and driver_instances(hub) == {}
    assert hub.allocations() == {}


def test_a_restart_keeps_an_instance_in_use_which_drains_after_its_stop(hub: Hub) -> None:
    spawn(hub, "dee", OFFER)
    before = hub.allocations()["dee/"]
    uuid = before.devices[0].instance
    assert uuid is not None
    pid = hub.pid("dee")
    activity = hub.state / "activity.json"
    activity.write_text(json.dumps({uuid: {"pids": [pid]}}))  # NVML sees it on the instance

    hub.stop_hub()
    admins = admin_instance(hub, 4 if before.devices[0].start == 0 else 0)  # the other half
    hub.start()
    assert hub.wait_ready("dee") and hub.pid("dee") == pid
    assert hub.allocations()["dee/"] == before
    assert records(hub) == [(uuid, "live", before.id)]
    assert set(driver_instances(hub)) == {uuid, admins}

    hub.stop_server("dee")  # NVML still lists a process on it: destroying it is refused
    assert records(hub) == [(uuid, "draining", None)]
    assert uuid in driver_instances(hub)
    soup = page(admin(hub), hub)
    cell = soup.select_one('.gp-cell[data-state="draining"]')
    assert cell is not None and "draining" in cell.get_text()

    activity.write_text(json.dumps({uuid: {"pids": []}}))  # the process ended
    # the next allocation (or the hub's periodic retry) destroys it first; eli gets the admin's
    # instance as it is (before any new one is made), and its stop leaves it there
    spawn(hub, "eli", OFFER)
    eli = hub.allocations()["eli/"]
    assert eli.devices[0].instance == admins
    assert environ(hub.pid("eli"))["CUDA_VISIBLE_DEVICES"] == admins
    assert records(hub) == []
    assert set(driver_instances(hub)) == {admins}
    stop_all(hub, "eli")
    assert records(hub) == [] and set(driver_instances(hub)) == {admins}


def admin_instance(hub: Hub, start: int) -> str:
    """What an admin's ``nvidia-smi mig -i <A100> -cgi 3g.40gb:<start> -C`` does while the hub is
    down: a 3g.40gb instance on the managed A100, in the simulated driver's state file."""
    from gpupool.discovery import SimulatedNVML
    from tests.mig_instances import make_instance

    spec = (  # the demo's simulated_fallback (jupyterhub_config.py)
        "local: 4x H100-80GB, mig=2:3g.40gb+2g.20gb+1g.10gb, nvlink=2; "
        "local-a100: 1x A100-80GB, mig=1; local-l40s: 2x L40S-48GB"
    )
    sim = SimulatedNVML(spec, state_file=hub.state / "activity.mig-state.json")
    view = sim.for_node("local-a100")
    view.nvmlInit()
    return make_instance(view, view.nvmlDeviceGetHandleByUUID(A100), "3g.40gb", start)
