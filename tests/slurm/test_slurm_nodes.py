"""The pool's nodes follow Slurm's (:mod:`gpupool.slurm.nodes`), against real daemons: an admin
drains a node while an allocation holds one of its GPUs; the node is kept only as far as that
allocation holds it (nothing new lands there), and comes back whole once Slurm resumes it."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gpupool.core import Offer, Team
from gpupool.core.errors import PoolError
from gpupool.core.ledger import Ledger
from gpupool.pool import Pool
from gpupool.slurm.commands import SlurmCommands
from gpupool.slurm.devcluster import DevCluster
from gpupool.slurm.inventory import inventory_from_sinfo
from gpupool.slurm.nodes import SlurmNodeWatch
from gpupool.slurm.settings import SlurmSettings
from gpupool.store import Store

MODELS = {"h100": "H100-80GB", "1g.10gb": "H100-80GB", "a100": "A100-40GB"}
OFFERS = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=2)}


def test_a_drained_node_keeps_what_is_held_and_comes_back(
    slurm_cluster: DevCluster, tmp_path: Path
) -> None:
    async def run() -> None:
        settings = SlurmSettings(slurm_conf=str(slurm_cluster.conf), gres_models=MODELS)
        slurm = SlurmCommands.from_settings(settings)
        inventory = inventory_from_sinfo(await slurm.sinfo(), MODELS)
        teams = {"vision": Team("vision", 8000)}
        ledger = Ledger(inventory, OFFERS, teams, Team("everyone"))
        pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}"))
        watch = SlurmNodeWatch(pool, slurm, settings)
        held = pool.allocate("ada", ["vision"], "h100", 1)
        assert held.node == "gpu1"
        slurm_cluster.run("scontrol", "update", "nodename=gpu1", "state=drain", "reason=maint")
        swap = await watch.refresh()
        assert swap is not None and swap.draining == ["gpu1"]
        gpu1 = {n.name: n for n in pool.inventory.nodes}["gpu1"]
        assert [g.uuid for g in gpu1.gpus] == [held.devices[0].gpu]  # only what is held
        try:
            pool.allocate("ada", ["vision"], "h100", 1)
        except PoolError as e:
            assert "h100" in e.message.lower() or "free" in e.message.lower()
        else:
            raise AssertionError("a GPU of a drained node was handed out")
        assert held.id in pool.ledger.allocations
        pool.release(held.id)
        slurm_cluster.run("scontrol", "update", "nodename=gpu1", "state=resume")
        swap = await watch.refresh()
        assert swap is not None and swap.draining == []
        gpu1 = {n.name: n for n in pool.inventory.nodes}["gpu1"]
        assert len([g for g in gpu1.gpus if not g.mig_enabled]) == 2

    asyncio.run(run())
