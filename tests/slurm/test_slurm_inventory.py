"""The Slurm inventory, the commands seam and the shared poller, against real daemons.

Each test starts a dev cluster (:mod:`tests.slurm_cluster`); the gres indices Slurm hands out are
the ones the inventory names, so what ``squeue`` says a job holds is a device of the ledger.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gpupool.slurm.commands import SlurmCommands, SlurmRefused, SlurmUnavailable
from gpupool.slurm.devcluster import DevCluster
from gpupool.slurm.inventory import gpu_name, gres_index, inventory_from_sinfo
from gpupool.slurm.poller import SlurmPoller
from tests.slurm_cluster import job_in_state, until

MODELS = {"h100": "H100-80GB", "1g.10gb": "H100-80GB", "a100": "A100-40GB"}


def commands(cluster: DevCluster, timeout: float = 30.0) -> SlurmCommands:
    return SlurmCommands(str(cluster.conf), timeout=timeout)


def test_inventory_names_slurms_gres_indices(slurm_cluster: DevCluster) -> None:
    inventory = inventory_from_sinfo(commands(slurm_cluster).sinfo_now(), MODELS)
    by_node = {n.name: n for n in inventory.nodes}
    gpu1 = by_node["gpu1"]
    whole = [g for g in gpu1.gpus if not g.mig_enabled]
    assert [g.uuid for g in whole] == [gpu_name("gpu1", 0), gpu_name("gpu1", 1)]
    instances = [i for g in gpu1.gpus for i in g.instances]
    assert sorted(i.uuid or "" for i in instances) == [gpu_name("gpu1", i) for i in (2, 3, 4)]
    assert {i.profile for i in instances} == {"1g.10gb"}
    shards = by_node["gpu2"].gpus
    assert [(g.share_resource, g.share_slots) for g in shards] == [("shard", 4), ("shard", 4)]


def test_a_mig_job_holds_the_index_the_inventory_names(slurm_cluster: DevCluster) -> None:
    async def run() -> None:
        slurm = commands(slurm_cluster)
        me = _root()
        job = await slurm.sbatch(
            "#!/bin/sh\nsleep 60\n", ["--gres=gpu:1g.10gb:2", "--nodelist=gpu1"], me, {}, "/tmp"
        )
        jobs = await until(lambda: job_in_state(slurm, job, "RUNNING"))
        held = jobs.gpu_indices("gpu1")
        indices = {i for g in held for i in g.indices}
        inventory = inventory_from_sinfo(await slurm.sinfo(), MODELS)
        names = {i.uuid for g in inventory.gpus for i in g.instances}
        assert {gpu_name("gpu1", i) for i in indices} <= names
        assert len(indices) == 2
        assert {gres_index(gpu_name("gpu1", i)) for i in indices} == indices
        await slurm.scancel(job)

    asyncio.run(run())


def test_sbatch_refusal_is_slurms_words(slurm_cluster: DevCluster) -> None:
    async def run() -> None:
        with pytest.raises(SlurmRefused, match="Requested node configuration is not available"):
            await commands(slurm_cluster).sbatch(
                "#!/bin/sh\ntrue\n", ["--gres=gpu:b200:1"], _root(), {}, "/tmp"
            )

    asyncio.run(run())


def test_poller_serves_many_readers_with_one_call_and_a_dead_controller_is_unknown(
    slurm_cluster: DevCluster,
) -> None:
    async def run() -> None:
        slurm = commands(slurm_cluster, timeout=5)
        poller = SlurmPoller(slurm, period=3600, min_interval=0.5)
        job = await slurm.sbatch("#!/bin/sh\nsleep 60\n", ["--gres=gpu:h100:1"], _root(), {}, "/")
        before = slurm.calls
        since = time.monotonic()
        snaps = await asyncio.gather(*(poller.fresh(since, timeout=30) for _ in range(20)))
        assert all(job in s.jobs for s in snaps)
        assert slurm.calls - before <= 2  # twenty readers, one squeue (two if one was in flight)
        assert poller.job(job) is not None
        slurm_cluster.stop_controller()
        with pytest.raises(SlurmUnavailable):
            await poller.fresh(time.monotonic(), timeout=60)
        with pytest.raises(SlurmUnavailable):
            poller.job(job)  # unknown, never "gone"
        slurm_cluster.start_controller()
        snap = await poller.fresh(time.monotonic(), timeout=60)
        assert not snap.jobs[job].ended  # the job outlived its controller
        assert await until(lambda: job_in_state(slurm, job, "RUNNING"))
        await slurm.scancel(job)

    asyncio.run(run())


def _root():  # type: ignore[no-untyped-def]
    from gpupool.usercode import hub_account

    return hub_account()
