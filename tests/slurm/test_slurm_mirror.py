"""The ledger mirrors what real Slurm daemons granted (:mod:`gpupool.slurm.mirror`).

A job of another user takes an H100 before the hub's; the hub's job, which the ledger had put on
that very GPU, gets the other one from Slurm: the allocation follows Slurm (read back), the other
user's GPU is outside use (admission says wait, naming no one), a job tagged as this hub's whose
allocation is gone is cancelled, and a tag a user forged on their own job changes nothing.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TypeVar

import pytest
from traitlets.config import Config

from gpupool.core import Offer, Team
from gpupool.core.ledger import Ledger
from gpupool.hub.pages import slurm_view
from gpupool.hub.pages_view import admin_view
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool.slurm.commands import SlurmCommands
from gpupool.slurm.devcluster import DevCluster
from gpupool.slurm.engine import SlurmEngine
from gpupool.slurm.inventory import gpu_name, inventory_from_sinfo
from gpupool.slurm.mirror import SlurmMirror
from gpupool.slurm.names import Tag
from gpupool.slurm.settings import SlurmSettings
from gpupool.store import Store
from gpupool.usercode import account
from tests.accounts import IS_ROOT, NOT_ROOT, unix_user
from tests.admin_page_render import render_admin
from tests.slurm_cluster import gone_or_ended, job_in_state, until

pytestmark = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)

MODELS = {"h100": "H100-80GB", "1g.10gb": "H100-80GB", "a100": "A100-40GB"}
OFFERS = {
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=2),
    "cpu": Offer("cpu", "cpu"),
}
T = TypeVar("T")


def make_pool(cluster: DevCluster, tmp_path: Path) -> tuple[Pool, SlurmEngine]:
    slurm = SlurmCommands(str(cluster.conf), timeout=10)
    inventory = inventory_from_sinfo(slurm.sinfo_now(), MODELS)
    teams = {"vision": Team("vision", 4000)}
    ledger = Ledger(inventory, OFFERS, teams, Team("everyone", offers=frozenset({"cpu"})))
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}"))
    settings = SlurmSettings(slurm_conf=str(cluster.conf), gres_models=MODELS)
    engine = SlurmEngine(settings, commands=slurm)
    engine.mirror = SlurmMirror(pool, slurm)
    engine.poller.min_interval = 0.2
    engine.poller.on_snapshot.append(engine.mirror.apply)
    return pool, engine


SCRIPT = "#!/bin/sh\nsleep 120\n"


def test_the_ledger_follows_slurm_and_another_users_job_is_outside_use(
    slurm_cluster: DevCluster, tmp_path: Path
) -> None:
    ada, bob = unix_user("gpslurm-ada"), unix_user("gpslurm-bob")

    async def run() -> None:
        pool, engine = make_pool(slurm_cluster, tmp_path)
        slurm, poller = engine.commands, engine.poller
        bob_acct = account(bob.pw_name, "test")
        ada_acct = account(ada.pw_name, "test")
        outside = await slurm.sbatch(
            SCRIPT, ["--gres=gpu:h100:1", "--nodelist=gpu1", "-o", "/dev/null"], bob_acct, {}, "/"
        )
        job = await until(lambda: job_in_state(slurm, outside, "RUNNING"))
        bob_index = job.gpu_indices("gpu1")[0].indices[0]
        # the ledger, not knowing yet, would put ada's H100 on bob's GPU
        a = pool.allocate(ada.pw_name, ["vision"], "h100", 1, ref="ada/")
        assert a.devices[0].gpu == gpu_name("gpu1", bob_index)
        tag = Tag(pool.hub_marker, "server", a.id)
        mine = await slurm.sbatch(
            SCRIPT,
            ["--gres=gpu:h100:1", "--nodelist=gpu1", f"--comment={tag}", "-o", "/dev/null"],
            ada_acct,
            {},
            "/",
        )
        held = await until(lambda: job_in_state(slurm, mine, "RUNNING"))
        ada_index = held.gpu_indices("gpu1")[0].indices[0]
        assert ada_index != bob_index
        await poller.fresh(time.monotonic(), timeout=30)
        after = pool.ledger.allocations[a.id]
        assert [d.gpu for d in after.devices] == [gpu_name("gpu1", ada_index)]
        bob_gpu = gpu_name("gpu1", bob_index)
        assert pool.ledger.outside == {bob_gpu: f"{bob_gpu} is used outside gpupool"}
        assert "gpslurm-bob" in engine.mirror.detail[bob_gpu]  # the admin's view names it
        admin = slurm_view(SimpleNamespace(slurm=engine, pool=pool))  # type: ignore[arg-type]
        assert admin is not None and admin["failure"] == ""
        assert [(r["node"], r["device"]) for r in admin["outside"]] == [("gpu1", bob_gpu)]
        assert "gpslurm-bob" in admin["outside"][0]["reason"]
        c = Config()
        c.LocalGPUSpawner.run_as_hub_user = False  # jobs as their owners: no shared account
        view = admin_view(pool, JobManager(pool, config=c), IdleReclaimer(pool, config=c), 0.0)
        page = render_admin({**view, "shares": None, "devices": None, "slurm": admin})
        assert "Slurm's controller answers" in page and f'data-device="{bob_gpu}"' in page
        verdict = pool.ledger.admit(pool.ledger.team("vision"), ada.pw_name, OFFERS["h100"], 1)
        assert verdict.verdict == "wait", verdict  # both H100s are held: wait, not never
        await slurm.scancel(outside)
        await until(lambda: gone_or_ended(slurm, outside))
        await poller.fresh(time.monotonic(), timeout=30)
        assert pool.ledger.outside == {}
        await slurm.scancel(mine)

    asyncio.run(run())


def test_orphans_of_this_hub_are_cancelled_and_forged_tags_are_not(
    slurm_cluster: DevCluster, tmp_path: Path
) -> None:
    ada, bob = unix_user("gpslurm-ada"), unix_user("gpslurm-bob")

    async def run() -> None:
        pool, engine = make_pool(slurm_cluster, tmp_path)
        slurm, poller = engine.commands, engine.poller
        a = pool.allocate(ada.pw_name, ["vision"], "h100", 1, ref="ada/")
        orphan_tag = Tag(pool.hub_marker, "server", "released-long-ago")
        forged = Tag(pool.hub_marker, "server", a.id)  # bob claims ada's allocation
        orphan = await slurm.sbatch(
            SCRIPT,
            ["--gres=gpu:h100:1", f"--comment={orphan_tag}", "-o", "/dev/null"],
            account(ada.pw_name, "test"),
            {},
            "/",
        )
        bobs = await slurm.sbatch(
            SCRIPT,
            ["--gres=gpu:h100:1", f"--comment={forged}", "-o", "/dev/null"],
            account(bob.pw_name, "test"),
            {},
            "/",
        )
        await until(lambda: job_in_state(slurm, bobs, "RUNNING"))
        await poller.fresh(time.monotonic(), timeout=30)
        ended = await until(lambda: gone_or_ended(slurm, orphan))
        assert ended
        listed = {j.job_id: j for j in await slurm.squeue()}
        assert listed[bobs].state == "RUNNING"  # not this hub's to cancel
        assert len(pool.ledger.allocations[a.id].devices) == 1
        bob_gpu = gpu_name("gpu1", listed[bobs].gpu_indices("gpu1")[0].indices[0])
        await poller.fresh(time.monotonic(), timeout=30)
        assert bob_gpu in pool.ledger.outside  # bob's job is outside use, whatever its tag
        await slurm.scancel(bobs)

    asyncio.run(run())
