"""Several MIG instances in one request, through the adapters: a notebook server gets every UUID
(and the spawn page says a process sees only the first), a local job runs one rank per instance
with gloo (real torchrun on CPU, each rank seeing its own UUID), a job asking for nccl on them is
refused at submit, MIG on demand creates every instance of an allocation, undoes them all
when one fails, destroys them all on release and re-adopts them after a restart, and
reconciliation adopts a live server holding several instances."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from traitlets.config import Config

import gpupool.pool as pool_module
from gpupool.config import GPUPool
from gpupool.core import Inventory, Ledger, Node, Offer, Team
from gpupool.core.errors import InvalidRequest
from gpupool.core.ledger import Device
from gpupool.core.offers import MIG_NOTEBOOK_NOTE
from gpupool.core.reconcile import Proc, Record, plan
from gpupool.discovery import SimulatedNVML, simulated_inventory
from gpupool.hub.errors import status_of
from gpupool.hub.objects import SETTINGS_KEY, build
from gpupool.jobs.manager import JobManager
from gpupool.mig.manager import DeviceUnavailable
from gpupool.monitors.activity import DeviceMonitor
from gpupool.pool import Pool
from gpupool_spawner.local import LocalGPUSpawner
from tests.accounts import shared_mode
from tests.factories import gpu
from tests.mig_instances import make_instance, nvml_instances

LOG = logging.getLogger("gpupool.tests.mig_count")
FIXED = "simulated:n: 1x H100-80GB, mig=1:1g.10gb+1g.10gb+1g.10gb"
OFFERS = {"cpu": {}, "mig-1g.10gb": {"model": "H100-80GB", "max_count": 2}}


def config(tmp: Path) -> Config:
    c = Config()
    c.GPUPool.inventory = FIXED
    c.GPUPool.db_url = f"sqlite:///{tmp / 'pool.sqlite'}"
    c.GPUPool.offers = OFFERS
    c.GPUPool.teams = {"t": {"guarantee": 1}}
    shared_mode(c)
    return c


# -- a notebook server ---------------------------------------------------------------------------


def test_a_server_gets_both_mig_uuids_in_order_and_the_page_says_one_process_sees_one(
    tmp_path: Path,
) -> None:
    c = config(tmp_path)
    objects = build(Pool.from_config(GPUPool(config=c)), c, LOG)
    a = objects.pool.allocate("ada", ["t"], "mig-1g.10gb", 2, ref="ada/")
    uuids = [d.instance for d in a.devices]
    assert len(uuids) == 2 and all(u and u.startswith("MIG-") for u in uuids)
    assert a.cost_milli == 250
    user = SimpleNamespace(
        name="ada", groups=[SimpleNamespace(name="t")], url="/user/ada/", escaped_name="ada",
        settings={SETTINGS_KEY: objects},
    )  # fmt: skip
    the_hub = SimpleNamespace(
        public_host="", url="http://127.0.0.1:8081/hub/",
        api_url="http://127.0.0.1:8081/hub/api", base_url="/hub/",
    )  # fmt: skip
    s = LocalGPUSpawner(config=c, user=user, hub=the_hub)
    s.gpupool_allocation_id = a.id
    assert s.get_env()["CUDA_VISIBLE_DEVICES"] == ",".join(u or "" for u in uuids)
    page = s._render_gpupool_form()
    assert 'value="t|mig-1g.10gb|2"' in page and "MIG 1g.10gb ×2" in page
    assert "a process sees only the first of them" in MIG_NOTEBOOK_NOTE
    assert MIG_NOTEBOOK_NOTE in page.replace("&lt;", "<").replace("&gt;", ">")


# -- a local job ---------------------------------------------------------------------------------

SCRIPT = """\
import os
import torch
import torch.distributed as dist
from gpupool_lab import ddp

ddp.init()
total = torch.tensor([ddp.rank() + 1])
dist.all_reduce(total)
print("sees", os.environ["CUDA_VISIBLE_DEVICES"], "backend", dist.get_backend(),
      "world", ddp.world_size(), "sum", int(total.item()), flush=True)
ddp.cleanup()
"""


def manager(tmp_path: Path) -> JobManager:
    c = config(tmp_path)
    c.JobManager.schedule_interval = 3600.0  # passes only when the test runs one
    return JobManager(Pool.from_config(GPUPool(config=c)), config=c)


async def ended(m: JobManager, job_id: str) -> None:
    async def done() -> None:
        while not m.jobs[job_id].final:
            await asyncio.sleep(0.05)

    await asyncio.wait_for(done(), 120)


@pytest.mark.slow  # real torchrun
def test_a_job_on_two_mig_instances_runs_a_rank_on_each_with_gloo(tmp_path: Path) -> None:
    async def scenario() -> None:
        m = manager(tmp_path)
        await m.start()
        try:
            job = m.submit("ada", ["t"], {"script": SCRIPT, "offer": "mig-1g.10gb", "gpus": 2})
            await m.schedule_pass()
            uuids = list(m.jobs[job.id].devices)
            await ended(m, job.id)
            done = m.jobs[job.id]
            logs = [(await m.backend.read_log(done, r, 0))[0].decode() for r in range(2)]
            assert done.state == "succeeded", (done.reason, logs)
            assert len(uuids) == 2 and all(u.startswith("MIG-") for u in uuids)
            for rank, log in enumerate(logs):
                assert f"local rank {rank} runs on {uuids[rank]}" in log
                assert f"sees {uuids[rank]} backend gloo world 2 sum 3" in log
            assert m.pool.ledger.allocations == {}
        finally:
            await m.stop()

    asyncio.run(scenario())


def test_a_job_asking_nccl_on_several_mig_instances_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    m = manager(tmp_path)
    fields: dict[str, Any] = {
        "script": SCRIPT, "offer": "mig-1g.10gb", "gpus": 2,
        "env": {"GPUPOOL_DDP_BACKEND": "nccl"},
    }  # fmt: skip
    with pytest.raises(InvalidRequest) as e:
        m.submit("ada", ["t"], fields)
    assert status_of(e.value) == 400
    assert e.value.message.startswith(
        "The job asks for 2× MIG 1g.10gb per node with nccl: NCCL does not communicate between "
        "MIG instances"
    )
    assert m.jobs == {}
    one = m.submit("ada", ["t"], {**fields, "gpus": 1})  # one instance: nccl is the user's call
    assert one.state == "queued"
    with pytest.raises(InvalidRequest, match="GPUPOOL_DDP_BACKEND must be gloo or nccl"):
        m.submit("ada", ["t"], {**fields, "env": {"GPUPOOL_DDP_BACKEND": "mpi"}})


# -- MIG on demand -------------------------------------------------------------------------------

MANAGED = "a: 2x H100-80GB, mig=2"


def on_demand(tmp_path: Path, sim: SimulatedNVML, monkeypatch: pytest.MonkeyPatch) -> Pool:
    """A pool over ``sim`` whose H100s are managed, as ``Pool.from_config`` builds it."""

    def load(*_args: Any, **_kwargs: Any) -> tuple[Any, DeviceMonitor]:
        views = {n: sim.for_node(n) for n in sim.node_names}
        return simulated_inventory(sim), DeviceMonitor(views)

    monkeypatch.setattr(pool_module, "load_inventory", load)
    c = Config()
    c.GPUPool.inventory = f"simulated:{MANAGED}"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {
        "mig-7g.80gb": {"model": "H100-80GB", "max_count": 2},
        "mig-3g.40gb": {"model": "H100-80GB", "max_count": 3},
    }
    c.GPUPool.teams = {"t": {"guarantee": 4}}
    c.GPUPool.managed_mig = ["H100-80GB"]
    return Pool.from_config(GPUPool(config=c), LOG)


def test_every_instance_is_created_recorded_re_adopted_and_destroyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = SimulatedNVML(MANAGED)
    pool = on_demand(tmp_path, sim, monkeypatch)
    a = pool.allocate("ada", ["t"], "mig-3g.40gb", 3)
    made = {d.instance: (d.profile, d.start) for d in a.devices}
    assert len(made) == 3 and None not in made
    assert nvml_instances(sim) == made
    assert a.visible_devices == ",".join(d.instance or "" for d in a.devices)
    assert {r.uuid for r in pool.store.mig_records()} == set(made)
    again = on_demand(tmp_path, sim, monkeypatch)  # a restart keeps all three
    assert again.ledger.allocations[a.id].devices == a.devices
    assert nvml_instances(sim) == made
    again.ledger.check_invariants()
    again.release(a.id)
    assert nvml_instances(sim) == {} and again.store.mig_records() == []
    again.ledger.check_invariants()


def test_when_the_second_creation_fails_the_first_instance_is_destroyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sim = SimulatedNVML(MANAGED)
    pool = on_demand(tmp_path, sim, monkeypatch)
    view = sim.for_node("a")
    view.nvmlInit()
    # an admin takes a slot of the second GPU behind the pool's back: the 7g.80gb the policy
    # places there cannot be made, after the one on the first GPU was
    racer = make_instance(view, view.nvmlDeviceGetHandleByIndex(1), "1g.10gb", 0)
    with (
        caplog.at_level(logging.INFO, logger="gpupool.tests.mig_count"),
        pytest.raises(DeviceUnavailable) as e,
    ):
        pool.allocate("ada", ["t"], "mig-7g.80gb", 2)
    assert status_of(e.value) == 503
    assert "Could not create MIG 7g.80gb at slot 0 of GPU 1" in e.value.message
    created = [r.message for r in caplog.records if "created MIG 7g.80gb" in r.message]
    assert len(created) == 1 and "GPU 0" in created[0]  # the first was made, then undone
    assert set(nvml_instances(sim)) == {racer}
    assert pool.ledger.allocations == {} and pool.store.load() == []
    assert pool.store.mig_records() == []
    assert +pool.ledger.team_used == {}
    pool.ledger.check_invariants()


# -- reconciliation ------------------------------------------------------------------------------


def test_a_live_server_holding_two_instances_is_adopted_at_start() -> None:
    inventory = Inventory(
        (Node("n", (gpu("n", 0, mode="fixed", instances=(("1g.10gb", 0), ("1g.10gb", 1))),)),)
    )
    offers = {"mig-1g": Offer("mig-1g", "mig", model="H100-80GB", profile="1g.10gb", max_count=2)}
    ledger = Ledger(inventory, offers, {"vision": Team("vision", 1000)})
    visible = ("MIG-n-0-0", "MIG-n-0-1")
    server = Proc(
        pid=100, pgid=100, uid=1000, start=1, allocation="lost", visible=visible,
        offer="mig-1g", team="vision", started_at=12.5,
    )  # fmt: skip
    records = [Record("ada", "", frozenset({"vision"}), "lost", 100, True)]
    (action,) = plan(ledger, records, [server], at_start=True)
    assert action.action == "adopted" and action.adopt is not None
    assert action.adopt.count == 2 and action.adopt.cost_milli == 250
    assert action.adopt.devices == (
        Device("GPU-n-0", "1g.10gb", 0, "MIG-n-0-0"),
        Device("GPU-n-0", "1g.10gb", 1, "MIG-n-0-1"),
    )
    ledger.restore([action.adopt])
    ledger.check_invariants()
