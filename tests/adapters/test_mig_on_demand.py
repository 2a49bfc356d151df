"""MIG instances on demand: the simulated NVML's creation and destruction calls (NVIDIA's errors
and placement rules), and the pool creating, recording, re-adopting and destroying instances on
managed GPUs through :class:`gpupool.mig.manager.MigManager`, with every failure mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest
from traitlets.config import Config

import gpupool.pool as pool_module
from gpupool.config import GPUPool
from gpupool.core.errors import NoCapacity
from gpupool.declarations import ConfigError
from gpupool.discovery import SimulatedNVML, discover, simulated_inventory
from gpupool.hub.errors import status_of
from gpupool.mig.manager import DeviceUnavailable, parse_managed
from gpupool.monitors.activity import DeviceMonitor
from gpupool.pool import Pool
from tests.mig_instances import H100, make_gi, make_instance, nvml_instances, placement

# GPU 0 whole; GPU 1: MIG on, no instances (managed); GPU 2 on node "b": MIG on, admin layout
SPEC = "a: 2x H100-80GB, mig=1; b: 1x H100-80GB, mig=1:3g.40gb"
OFFERS = {
    "cpu": {},
    "mig-3g.40gb": {"model": "H100-80GB"},
    "mig-4g.40gb": {"model": "H100-80GB"},
    "mig-7g.80gb": {"model": "H100-80GB"},
    "mig-1g.10gb": {"model": "H100-80GB"},
}


def destroy_instance(view: Any, gpu: Any, uuid: str) -> None:
    """What ``nvidia-smi mig -dci`` then ``-dgi`` do to the instance of MIG device ``uuid``."""
    mig = view.nvmlDeviceGetHandleByUUID(uuid)
    gi = view.nvmlDeviceGetGpuInstanceById(gpu, view.nvmlDeviceGetGpuInstanceId(mig))
    view.nvmlComputeInstanceDestroy(view.nvmlGpuInstanceGetComputeInstanceById(gi, 0))
    view.nvmlGpuInstanceDestroy(gi)


class Admin:
    """An admin with ``nvidia-smi`` on node a's GPU 1 (the managed H100), beside the hub."""

    def __init__(self, sim: SimulatedNVML) -> None:
        self.view = sim.for_node("a")
        self.view.nvmlInit()
        self.gpu = self.view.nvmlDeviceGetHandleByIndex(1)

    def create(self, profile: str, start: int) -> str:
        """``nvidia-smi mig -cgi <profile>:<start> -C``: the new instance's UUID."""
        return make_instance(self.view, self.gpu, profile, start)

    def destroy(self, uuid: str) -> None:
        destroy_instance(self.view, self.gpu, uuid)


def code(e: pytest.ExceptionInfo[pynvml.NVMLError]) -> int:
    return int(e.value.value)


# -- the simulated NVML ------------------------------------------------------------------------


@pytest.fixture
def sim() -> SimulatedNVML:
    nvml = SimulatedNVML("n: 1x H100-80GB, mig=1")
    nvml.nvmlInit()
    return nvml


def test_an_instance_created_at_a_placement_becomes_a_mig_device(sim: SimulatedNVML) -> None:
    gpu = sim.nvmlDeviceGetHandleByIndex(0)
    assert (
        sim.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu, H100.by_name["3g.40gb"].profile_id) == 2
    )
    gi = make_gi(sim, gpu, "3g.40gb", 4)
    info = sim.nvmlGpuInstanceGetInfo(gi)
    assert (info.profileId, info.placement.start, info.placement.size) == (9, 4, 4)
    # a GPU instance without a compute instance is no MIG device yet
    assert discover(sim).gpus[0].instances == ()
    ci_info = sim.nvmlGpuInstanceGetComputeInstanceProfileInfo(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 0
    )
    assert (ci_info.id, ci_info.sliceCount) == (pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 3)
    with pytest.raises(pynvml.NVMLError) as e:
        sim.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, 0
        )
    assert code(e) == pynvml.NVML_ERROR_NOT_SUPPORTED
    sim.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
    (found,) = discover(sim).gpus[0].instances
    assert (found.profile, found.start) == ("3g.40gb", 4)
    assert found.uuid and found.uuid.startswith("MIG-")
    mig = sim.nvmlDeviceGetHandleByUUID(found.uuid)
    assert sim.nvmlDeviceGetComputeInstanceId(mig) == 0
    assert sim.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu, 9) == 1


def test_placements_follow_nvidias_rules(sim: SimulatedNVML) -> None:
    gpu = sim.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError) as e:
        make_gi(sim, gpu, "3g.40gb", 2)  # 3g starts at 0 or 4 only
    assert code(e) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError) as e:
        sim.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 9, placement(0, 2))  # wrong size
    assert code(e) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    with pytest.raises(pynvml.NVMLError) as e:
        sim.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 12345, placement(0, 4))
    assert code(e) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    make_instance(sim, gpu, "3g.40gb", 0)
    for name, start in (("1g.10gb", 3), ("4g.40gb", 0), ("7g.80gb", 0), ("2g.20gb", 2)):
        with pytest.raises(pynvml.NVMLError) as e:
            make_gi(sim, gpu, name, start)  # overlaps the 3g.40gb at 0-3
        assert code(e) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, name
    make_instance(sim, gpu, "3g.40gb", 4)
    assert sim.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu, 19) == 0


def test_compute_slices_run_out_before_memory_slots(sim: SimulatedNVML) -> None:
    gpu = sim.nvmlDeviceGetHandleByIndex(0)
    make_instance(sim, gpu, "4g.40gb", 0)  # 4 of 7 compute slices, 4 of 8 memory slots
    make_instance(sim, gpu, "2g.20gb", 4)  # 6 of 7
    make_instance(sim, gpu, "1g.10gb", 6)  # 7 of 7; memory slot 7 stays free
    with pytest.raises(pynvml.NVMLError) as e:
        make_gi(sim, gpu, "1g.10gb", 6)
    assert code(e) == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES


def test_destroy_is_refused_while_processes_run_or_a_compute_instance_is_left(
    sim: SimulatedNVML,
) -> None:
    gpu = sim.nvmlDeviceGetHandleByIndex(0)
    uuid = make_instance(sim, gpu, "2g.20gb", 2)
    mig = sim.nvmlDeviceGetHandleByUUID(uuid)
    gi = sim.nvmlDeviceGetGpuInstanceById(gpu, sim.nvmlDeviceGetGpuInstanceId(mig))
    ci = sim.nvmlGpuInstanceGetComputeInstanceById(gi, sim.nvmlDeviceGetComputeInstanceId(mig))
    with pytest.raises(pynvml.NVMLError) as e:
        sim.nvmlGpuInstanceDestroy(gi)  # its compute instance first
    assert code(e) == pynvml.NVML_ERROR_IN_USE
    sim.set_processes(uuid, [4242])
    with pytest.raises(pynvml.NVMLError) as e:
        sim.nvmlComputeInstanceDestroy(ci)
    assert code(e) == pynvml.NVML_ERROR_IN_USE
    sim.set_processes(uuid, [])
    sim.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(pynvml.NVMLError) as e:
        sim.nvmlDeviceGetHandleByUUID(uuid)
    assert code(e) == pynvml.NVML_ERROR_NOT_FOUND
    sim.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError) as e:
        sim.nvmlGpuInstanceGetInfo(gi)  # a destroyed instance's handle
    assert code(e) == pynvml.NVML_ERROR_INVALID_ARGUMENT
    make_instance(sim, gpu, "7g.80gb", 0)  # the whole GPU is free again


def test_without_root_mig_management_is_refused() -> None:
    sim = SimulatedNVML("n: 1x H100-80GB, mig=1", privileged=False)
    sim.nvmlInit()
    gpu = sim.nvmlDeviceGetHandleByIndex(0)
    for call in (
        lambda: sim.nvmlDeviceGetGpuInstanceRemainingCapacity(gpu, 9),
        lambda: make_gi(sim, gpu, "3g.40gb", 0),
    ):
        with pytest.raises(pynvml.NVMLError) as e:
            call()
        assert code(e) == pynvml.NVML_ERROR_NO_PERMISSION


def test_the_state_file_keeps_created_instances_across_restarts(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    first = SimulatedNVML("n: 1x H100-80GB, mig=1", state_file=state)
    first.nvmlInit()
    uuid = make_instance(first, first.nvmlDeviceGetHandleByIndex(0), "1g.10gb", 5)
    again = SimulatedNVML("n: 1x H100-80GB, mig=1", state_file=state)
    again.nvmlInit()
    (found,) = discover(again).gpus[0].instances
    assert (found.profile, found.start, found.uuid) == ("1g.10gb", 5, uuid)
    other = make_instance(again, again.nvmlDeviceGetHandleByIndex(0), "1g.10gb", 0)
    assert other != uuid  # a new instance gets a new UUID


# -- the setting -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "quoted"),
    [
        ("H100-80GB", "must be a list, a dict or True/False"),
        (["V100-32GB"], "'V100-32GB' is neither a GPU UUID"),
        ({"H100-80GB": "yes"}, "entries are GPU UUIDs or model keys"),
        ([3], "entries are GPU UUIDs or model keys"),
    ],
)
def test_bad_managed_mig_stops_the_hub_naming_the_key(value: Any, quoted: str) -> None:
    c = Config()
    c.GPUPool.managed_mig = value
    with pytest.raises(ConfigError) as e:
        GPUPool(config=c)
    assert str(e.value).startswith("GPUPool.managed_mig")
    assert quoted in str(e.value)


def test_managed_mig_by_uuid_wins_over_the_model() -> None:
    sim = SimulatedNVML(SPEC)
    a, b, c = simulated_inventory(sim).gpus
    managed = parse_managed({"H100-80GB": True, c.uuid: False})
    assert [managed.covers(g) for g in (a, b, c)] == [True, True, False]
    assert parse_managed([b.uuid]).covers(b) and not parse_managed([b.uuid]).covers(c)


# -- the pool on managed GPUs ------------------------------------------------------------------


def build(
    tmp_path: Path,
    sim: SimulatedNVML,
    monkeypatch: pytest.MonkeyPatch,
    managed: Any = ("H100-80GB",),
    logger: logging.Logger | None = None,
    url: str = "",
) -> Pool:
    """A pool over ``sim`` as ``Pool.from_config`` builds it (a restart is another call), its
    database at ``url`` (default: a SQLite file in ``tmp_path``)."""

    def load(*_args: Any, **_kwargs: Any) -> tuple[Any, DeviceMonitor]:
        views = {n: sim.for_node(n) for n in sim.node_names}
        return simulated_inventory(sim), DeviceMonitor(views)

    monkeypatch.setattr(pool_module, "load_inventory", load)
    c = Config()
    c.GPUPool.inventory = f"simulated:{SPEC}"
    c.GPUPool.db_url = url or f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = OFFERS
    c.GPUPool.teams = {"vision": {"guarantee": 3}}
    c.GPUPool.managed_mig = list(managed) if not isinstance(managed, dict | bool) else managed
    return Pool.from_config(GPUPool(config=c), logger or logging.getLogger("test"))


def all_instances(sim: SimulatedNVML) -> set[str]:
    return set(nvml_instances(sim, "a")) | set(nvml_instances(sim, "b"))


Start = Callable[..., Pool]
"""Builds the pool over the ``machine`` fixture as ``Pool.from_config`` does (a restart is
another call); keywords as :func:`build`'s."""


@pytest.fixture
def machine(request: pytest.FixtureRequest) -> SimulatedNVML:
    """The simulated machine of :data:`SPEC`; privileged unless parametrized (indirectly)
    with ``False``."""
    return SimulatedNVML(SPEC, privileged=getattr(request, "param", True))


@pytest.fixture
def start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, machine: SimulatedNVML) -> Start:
    def start(**kwargs: Any) -> Pool:
        return build(tmp_path, machine, monkeypatch, **kwargs)

    return start


def refused_503(pool: Pool, offer: str) -> str:
    """Asks ``pool`` for ``offer``, which must fail with a 503 that holds and stores nothing:
    the refusal's message."""
    with pytest.raises(DeviceUnavailable) as e:
        pool.allocate("ada", ["vision"], offer)
    assert status_of(e.value) == 503
    assert "Free now: " in e.value.message
    assert pool.ledger.allocations == {} and pool.store.load() == []
    return e.value.message


def test_an_allocation_gets_an_instance_created_recorded_and_destroyed_on_release(
    machine: SimulatedNVML, start: Start
) -> None:
    pool = start()
    managed = simulated_inventory(machine).gpus[1]
    assert pool.inventory.gpus[1].mig_mode == "dynamic"
    assert pool.inventory.gpus[2].mig_mode == "dynamic"  # node b's admin 3g stays, blocked
    a = pool.allocate("ada", ["vision"], "mig-4g.40gb")
    (device,) = a.devices
    assert device.gpu == managed.uuid and device.instance and device.instance.startswith("MIG-")
    assert a.visible_devices == device.instance
    assert nvml_instances(machine) == {device.instance: ("4g.40gb", device.start)}
    (record,) = pool.store.mig_records()
    assert (record.state, record.uuid, record.allocation_id) == ("live", device.instance, a.id)
    (persisted,) = pool.store.load()
    assert persisted.devices[0].instance == device.instance  # persisted with its UUID
    assert pool.ledger.allocations[a.id] == a
    pool.ledger.check_invariants()
    pool.release(a.id)
    assert nvml_instances(machine) == {}
    assert pool.store.mig_records() == []
    pool.ledger.check_invariants()


def test_admin_instances_on_a_managed_gpu_are_handed_out_never_placed_over_nor_destroyed(
    machine: SimulatedNVML, start: Start
) -> None:
    admin = Admin(machine).create("3g.40gb", 4)
    (b_admin,) = nvml_instances(machine, "b")  # node b's 3g.40gb at slot 0, made by an admin too
    pool = start()
    assert pool.ledger.blocked == {}  # fixed instances now, not blocked slots
    first = [pool.allocate("ada", ["vision"], "mig-3g.40gb") for _ in range(2)]
    assert {a.devices[0].instance for a in first} == {admin, b_admin}  # before carving any
    assert all_instances(machine) == {admin, b_admin}  # nothing was created for them
    assert pool.store.mig_records() == []
    ours = [pool.allocate("ada", ["vision"], "mig-3g.40gb") for _ in range(2)]
    assert sorted((a.devices[0].gpu, a.devices[0].start) for a in ours) == sorted(
        [(pool.inventory.gpus[1].uuid, 0), (pool.inventory.gpus[2].uuid, 4)]
    )  # the pool's own, on the free halves beside the admin's
    assert len(pool.store.mig_records()) == 2
    with pytest.raises(NoCapacity):
        pool.allocate("ada", ["vision"], "mig-3g.40gb")
    pool.ledger.check_invariants()
    for held in (*first, *ours):
        pool.release(held.id)
    assert all_instances(machine) == {admin, b_admin}  # the admin's stay, the pool's are gone
    assert pool.store.mig_records() == []
    again = pool.allocate("ada", ["vision"], "mig-3g.40gb")  # the next user gets one as it is
    assert again.devices[0].instance in {admin, b_admin}
    assert all_instances(machine) == {admin, b_admin}
    pool.ledger.check_invariants()


def test_a_holder_of_an_admins_instance_keeps_it_across_a_restart(
    machine: SimulatedNVML, start: Start
) -> None:
    admin = Admin(machine).create("1g.10gb", 6)
    pool = start()
    held = pool.allocate("ada", ["vision"], "mig-1g.10gb")
    assert held.devices[0].instance == admin
    ours = pool.allocate("ada", ["vision"], "mig-4g.40gb")  # made by the pool, at slot 0
    again = start()
    assert again.ledger.allocations == {held.id: held, ours.id: ours}
    (record,) = again.store.mig_records()  # the pool's own only: the admin's is not recorded
    assert (record.uuid, record.allocation_id) == (ours.devices[0].instance, ours.id)
    assert again.mig is not None
    gpu = again.inventory.gpus[1].uuid
    assert [r for r in again.mig.view(again.ledger)["admin"] if r["gpu"] == gpu] == [
        {"gpu": gpu, "profile": "1g.10gb", "start": 6, "uuid": admin, "holder": "ada"}
    ]  # (node b's GPU has its own)
    with pytest.raises(NoCapacity):  # nothing goes over it while it is held, nor after
        again.allocate("ada", ["vision"], "mig-7g.80gb")
    again.release(held.id)
    assert admin in nvml_instances(machine)  # released, not destroyed
    assert again.allocate("bob", ["vision"], "mig-1g.10gb").devices[0].instance == admin
    again.ledger.check_invariants()


def test_an_admins_instance_destroyed_while_the_hub_was_down_loses_its_holder_only(
    machine: SimulatedNVML, start: Start
) -> None:
    by_hand = Admin(machine)
    admin = by_hand.create("1g.10gb", 6)
    pool = start()
    held = pool.allocate("ada", ["vision"], "mig-1g.10gb")
    assert held.devices[0].instance == admin
    ours = pool.allocate("ada", ["vision"], "mig-4g.40gb")
    by_hand.destroy(admin)  # the admin destroyed it while the hub was down
    again = start()
    assert again.ledger.allocations == {ours.id: ours}
    assert [a.id for a in again.store.load()] == [ours.id]
    assert again.mig is not None
    assert admin not in {r["uuid"] for r in again.mig.view(again.ledger)["admin"]}
    assert set(nvml_instances(machine)) == {ours.devices[0].instance}
    made = again.allocate("ada", ["vision"], "mig-1g.10gb")
    assert made.devices[0].instance not in (None, admin)  # slot 6 is the pool's to use now
    again.ledger.check_invariants()


def test_an_admins_instance_destroyed_while_the_hub_runs_is_not_handed_out_again(
    machine: SimulatedNVML, start: Start
) -> None:
    by_hand = Admin(machine)
    admin = by_hand.create("1g.10gb", 6)
    pool = start()
    by_hand.destroy(admin)  # the admin takes it back while the hub runs
    assert "slot 6 of GPU 1 (an admin's) is gone" in refused_503(pool, "mig-1g.10gb")
    managed = pool.inventory.gpus[1].uuid
    assert pool.ledger.blocked[managed, 6].reason == "gone"
    assert pool.mig is not None
    assert admin not in {r["uuid"] for r in pool.mig.view(pool.ledger)["admin"]}
    made = pool.allocate("ada", ["vision"], "mig-1g.10gb")  # one the pool makes, elsewhere
    (device,) = made.devices
    assert device.instance not in (None, admin) and (device.gpu, device.start) != (managed, 6)
    assert device.instance in all_instances(machine) and admin not in all_instances(machine)
    pool.ledger.check_invariants()
    again = start()  # the next start: slot 6 is free to use
    assert (managed, 6) not in again.ledger.blocked
    assert again.ledger.allocations == {made.id: made}


def test_a_restart_re_adopts_held_instances_and_destroys_orphans_only(
    machine: SimulatedNVML, start: Start, db_url: str
) -> None:
    """The records of the instances the pool made, kept in its database (SQLite, PostgreSQL)."""
    pool = start(url=db_url)
    kept = pool.allocate("ada", ["vision"], "mig-4g.40gb")  # made by the pool on GPU 1
    orphan = pool.allocate("ada", ["vision"], "mig-1g.10gb")
    # the hub dies after the orphan's instance was made and recorded, but its allocation is lost
    pool.store.delete([orphan.id])
    taken = {d.start for d in orphan.devices if d.gpu == pool.inventory.gpus[1].uuid}
    free = next(s for s in (6, 5, 4) if s not in taken)
    admin = Admin(machine).create("1g.10gb", free)  # meanwhile
    pool.store.close()
    again = start(url=db_url)
    assert again.ledger.allocations[kept.id].devices == kept.devices
    b_admin = set(nvml_instances(machine, "b"))  # node b's admin 3g.40gb (and perhaps ours)
    assert all_instances(machine) == {kept.devices[0].instance, admin} | b_admin
    (record,) = again.store.mig_records()
    assert (record.uuid, record.allocation_id, record.state) == (
        kept.devices[0].instance,
        kept.id,
        "live",
    )
    again.ledger.check_invariants()
    again.release(kept.id)
    assert all_instances(machine) == {admin} | (b_admin - {kept.devices[0].instance})
    assert again.store.mig_records() == []
    again.store.close()


def test_an_allocation_whose_instance_vanished_is_lost_at_restart(
    machine: SimulatedNVML, start: Start
) -> None:
    pool = start()
    a = pool.allocate("ada", ["vision"], "mig-4g.40gb")  # fits only the managed GPU 1
    assert a.devices[0].instance is not None
    Admin(machine).destroy(a.devices[0].instance)  # an admin destroyed it while the hub was down
    again = start()
    assert a.id not in again.ledger.allocations
    assert again.store.load() == [] and again.store.mig_records() == []


@pytest.mark.parametrize("machine", [False], ids=["unprivileged"], indirect=True)
def test_without_permission_the_hub_starts_and_managed_gpus_are_fixed(
    machine: SimulatedNVML, start: Start, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        pool = start(logger=logging.getLogger("gpupool-test"))
    assert pool.mig is not None and "no permission" in pool.mig.off
    assert "MIG on demand is off" in caplog.text
    assert pool.inventory.gpus[1].mig_mode == "fixed"
    with pytest.raises(NoCapacity):  # nothing to hand out on the empty managed GPU
        pool.allocate("ada", ["vision"], "mig-4g.40gb")
    a = pool.allocate("ada", ["vision"], "mig-3g.40gb")  # node b's admin instance, as it is
    assert a.devices[0].instance in nvml_instances(machine, "b")
    assert pool.mig.view(pool.ledger)["off"] == pool.mig.off


def test_no_permission_at_creation_releases_and_turns_mig_on_demand_off(
    machine: SimulatedNVML, start: Start
) -> None:
    pool = start()
    assert pool.mig is not None
    pool.mig.nvml_by_node["a"].privileged = False  # the hub lost its MIG capability meanwhile
    assert "no permission" in refused_503(pool, "mig-7g.80gb")
    assert pool.store.mig_records() == [] and nvml_instances(machine) == {}
    assert pool.mig is not None and pool.mig.off
    with pytest.raises(NoCapacity):  # the managed GPU's slots are no longer offered
        pool.allocate("ada", ["vision"], "mig-7g.80gb")
    pool.ledger.check_invariants()


def test_a_racing_admin_instance_fails_the_creation_with_503_and_no_leak(
    machine: SimulatedNVML, start: Start
) -> None:
    pool = start()
    racer = Admin(machine).create("1g.10gb", 0)
    message = refused_503(pool, "mig-7g.80gb")
    assert "Could not create MIG 7g.80gb at slot 0 of GPU 1" in message
    assert "1g.10gb" in message  # among what is free now
    assert pool.store.mig_records() == []
    assert set(nvml_instances(machine)) == {racer}  # the admin's is untouched, nothing leaked
    assert pool.ledger.blocked[pool.inventory.gpus[1].uuid, 0].reason == "admin"
    a = pool.allocate("ada", ["vision"], "mig-3g.40gb")  # placed beside the racer now
    assert a.devices[0].start == 4 or a.devices[0].gpu != pool.inventory.gpus[1].uuid
    pool.ledger.check_invariants()


def test_a_failed_creation_leaves_the_admins_instances_of_the_start_allocatable(
    machine: SimulatedNVML, start: Start
) -> None:
    """What NVML shows after a failed creation is learnt (the racer's instance is blocked), but
    the admin's instances known since the start stay fixed instances, handed out as they are."""
    by_hand = Admin(machine)
    admin = by_hand.create("3g.40gb", 4)
    (b_admin,) = nvml_instances(machine, "b")
    pool = start()
    racer = by_hand.create("1g.10gb", 0)
    refused_503(pool, "mig-4g.40gb")  # a 4g.40gb fits only slot 0 of GPU 1
    gpu = pool.inventory.gpus[1].uuid
    assert pool.ledger.blocked[gpu, 0].reason == "admin"
    assert (gpu, 4) not in pool.ledger.blocked
    held = [pool.allocate("ada", ["vision"], "mig-3g.40gb") for _ in range(2)]
    assert {a.devices[0].instance for a in held} == {admin, b_admin}
    assert set(nvml_instances(machine)) == {admin, racer}
    assert pool.mig is not None
    assert {r["uuid"] for r in pool.mig.view(pool.ledger)["admin"]} == {admin, b_admin, racer}
    pool.ledger.check_invariants()


def test_a_busy_instance_drains_then_is_destroyed_and_its_slots_come_back(
    machine: SimulatedNVML, start: Start
) -> None:
    pool = start()
    a = pool.allocate("ada", ["vision"], "mig-7g.80gb")
    uuid = a.devices[0].instance
    assert uuid is not None
    machine.set_processes(uuid, [4242])  # a process outlives the server
    pool.release(a.id)
    assert uuid in nvml_instances(machine)
    (record,) = pool.store.mig_records()
    assert (record.state, record.allocation_id) == ("draining", None)
    gpu = pool.inventory.gpus[1].uuid
    assert pool.ledger.blocked[gpu, 0].reason == "draining"
    assert pool.mig is not None
    assert [r["state"] for r in pool.mig.view(pool.ledger)["instances"]] == ["draining"]
    with pytest.raises(NoCapacity):  # the draining slots are not handed out
        pool.allocate("ada", ["vision"], "mig-7g.80gb")
    assert pool.retry_draining() == 0
    machine.set_processes(uuid, [])
    assert pool.retry_draining() == 1
    assert nvml_instances(machine) == {} and pool.store.mig_records() == []
    assert (gpu, 0) not in pool.ledger.blocked
    b = pool.allocate("ada", ["vision"], "mig-7g.80gb")
    assert b.devices[0].gpu == gpu and b.devices[0].instance not in (None, uuid)
    pool.ledger.check_invariants()


def test_a_draining_orphan_at_restart_is_blocked_until_it_can_go(
    machine: SimulatedNVML, start: Start
) -> None:
    pool = start()
    a = pool.allocate("ada", ["vision"], "mig-7g.80gb")
    uuid = a.devices[0].instance
    assert uuid is not None
    pool.store.delete([a.id])  # lost with the hub; its process still runs
    machine.set_processes(uuid, [4242])
    again = start()
    assert again.ledger.blocked[a.devices[0].gpu, 0].reason == "draining"
    machine.set_processes(uuid, [])
    assert again.retry_draining() == 1
    assert nvml_instances(machine) == {}


# -- the admin page ----------------------------------------------------------------------------


def render_admin(pool: Pool) -> str:
    import jinja2

    import gpupool.hub
    from gpupool.hub.pages_view import admin_view
    from gpupool.hub.reclaim import IdleReclaimer
    from gpupool.jobs.manager import JobManager
    from tests.accounts import shared_mode

    c = Config()
    shared_mode(c)
    jobs, reclaimer = JobManager(pool, config=c), IdleReclaimer(pool, config=c)
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(
            [
                jinja2.FileSystemLoader(str(Path(gpupool.hub.__file__).parent / "templates")),
                jinja2.DictLoader({"page.html": "{% block main %}{% endblock %}"}),
            ]
        ),
        autoescape=True,
    )
    view = admin_view(pool, jobs, reclaimer, pool.clock().timestamp())
    return env.get_template("gpupool-admin.html").render(
        view=view, flash="", base_url="/hub/", xsrf="T", pool_admin=True
    )


@pytest.mark.parametrize("machine", [False], ids=["unprivileged"], indirect=True)
def test_the_admin_page_says_why_mig_on_demand_is_off(machine: SimulatedNVML, start: Start) -> None:
    pool = start()
    html = render_admin(pool)
    assert 'id="gp-mig-off"' in html
    assert "MIG on demand is off: NVML refuses to manage MIG instances (no permission" in html


def test_the_admin_page_shows_made_admin_and_draining_instances(
    machine: SimulatedNVML, start: Start
) -> None:
    Admin(machine).create("1g.10gb", 6)  # an admin's
    pool = start()
    a = pool.allocate("ada", ["vision"], "mig-4g.40gb")
    admins = pool.allocate("ada", ["vision"], "mig-1g.10gb")  # the admin's, as it is
    b = pool.allocate("ada", ["vision"], "mig-1g.10gb")  # one the pool makes
    assert admins.devices[0].start == 6 and b.devices[0].start != 6
    machine.set_processes(b.devices[0].instance or "", [4242])
    pool.release(b.id)
    html = render_admin(pool)
    assert 'id="gp-mig-off"' not in html
    assert f'<tr data-uuid="{a.devices[0].instance}" data-state="live">' in html
    assert f'<tr data-uuid="{b.devices[0].instance}" data-state="draining">' in html
    assert "1g.10gb (admin&#39;s instance)" in html and "1g.10gb (draining)" in html
    assert f'data-uuid="{admins.devices[0].instance}"' not in html  # not among the pool's


# -- the hub: draining instances are retried until the hub shuts down --------------------------


def test_setup_stops_retrying_draining_instances_when_the_hub_shuts_down(
    tmp_path: Path,
) -> None:
    """``setup(c)`` retries draining instances periodically (a tornado ``PeriodicCallback``);
    the hub's shutdown (the line JupyterHub logs first) stops it, as it stops the other loops."""
    import asyncio

    from tornado.ioloop import PeriodicCallback

    from gpupool.hub import setup
    from gpupool.hub.shutdown import ShutdownWatch
    from tests.accounts import shared_mode

    c = Config()
    shared_mode(c)
    c.JupyterHub.db_url = f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}"
    c.JupyterHub.hub_port = 9  # the REST API answers nothing
    c.GPUPool.inventory = "simulated:a: 1x H100-80GB, mig=1"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"mig-1g.10gb": {"model": "H100-80GB"}}
    c.GPUPool.teams = {"vision": {"guarantee": 1}}
    c.GPUPool.managed_mig = ["H100-80GB"]
    c.Reconciler.period = 0
    jupyterhub = logging.getLogger("JupyterHub")
    level, filters = jupyterhub.level, list(jupyterhub.filters)
    jupyterhub.setLevel(logging.INFO)

    async def main() -> None:
        hub = setup(c)
        try:
            assert hub.pool.mig is not None
            (watch,) = [f for f in jupyterhub.filters if isinstance(f, ShutdownWatch)]
            drains = [
                getattr(cb, "__self__", None)
                for cb in watch.callbacks
                if isinstance(getattr(cb, "__self__", None), PeriodicCallback)
            ]
            assert [getattr(d.callback, "__wrapped__", d.callback) for d in drains] == [
                hub.pool.writes.retry_due,  # owed database writes, whatever the inventory
                hub.pool.retry_draining,
            ]
            assert all(d.is_running() for d in drains)
            jupyterhub.info("Received signal SIGTERM, initiating shutdown...")
            assert not any(d.is_running() for d in drains)
        finally:
            for d in drains if "drains" in locals() else ():
                d.stop()
            await hub.jobs.stop()
            await hub.reclaimer.stop()

    try:
        asyncio.run(main())
    finally:
        jupyterhub.setLevel(level)
        for f in list(jupyterhub.filters):
            if f not in filters:
                jupyterhub.removeFilter(f)
