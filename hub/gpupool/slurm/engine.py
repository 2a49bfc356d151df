"""The hub's Slurm side: one object holding the settings, the commands seam, the shared poller
and the teams' accounts, built by ``setup(c)`` for a Slurm inventory and handed to the spawners,
the job backend and the services through the hub objects (``hub_objects(settings).slurm``).

Contract: :meth:`SlurmEngine.apply_accounts` makes slurmdbd hold the teams' plan at start (a
cluster that cannot stops the hub, :class:`~gpupool.declarations.ConfigError`);
:meth:`submit_account` is the one rule for ``--account``, used by every submit.
:meth:`SlurmEngine.start` starts the poller's loop in the running event loop; :meth:`stop` ends
it. Nothing here decides: the spawner, the job backend and the mirror
(:mod:`gpupool.slurm.mirror`) read the poller's snapshots.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Ledger
from gpupool.declarations import ConfigError
from gpupool.pool import Pool
from gpupool.slurm.accounts import gres_costs_of
from gpupool.slurm.accounts_sync import SlurmAccounts
from gpupool.slurm.commands import SlurmCommands
from gpupool.slurm.inventory import SHARD_RESOURCE
from gpupool.slurm.mirror import SlurmMirror
from gpupool.slurm.nodes import SlurmNodeWatch
from gpupool.slurm.poller import SlurmPoller
from gpupool.slurm.settings import SlurmSettings

log = logging.getLogger("gpupool")


class SlurmEngine:
    def __init__(
        self,
        settings: SlurmSettings,
        logger: logging.Logger = log,
        commands: SlurmCommands | None = None,
        shards_per_gpu: int = 0,
    ) -> None:
        """``shards_per_gpu``: the shards of each GPU on the partition's shard nodes (0: none),
        which prices a ``shard`` in the teams' plan."""
        self.settings = settings
        self.log = logger
        self.commands = commands or SlurmCommands.from_settings(settings)
        self.poller = SlurmPoller(self.commands, period=settings.poll_period, logger=logger)
        costs = gres_costs_of(settings.gres_models, shards_per_gpu)
        self.accounts = SlurmAccounts(
            commands=self.commands,
            partition=settings.partition,
            gres_costs=costs,
            accounts=settings.accounts,
            config=settings.config,
            log=logger,
        )
        self.services: list[Any] = []
        """Other loops to start and stop with the poller (the mirror, the reconciler)."""

    @classmethod
    def from_config(
        cls, config: Any, logger: logging.Logger = log, pool: Pool | None = None
    ) -> SlurmEngine:
        """The engine of the hub's ``config``; with ``pool``, its ledger mirrors every answered
        snapshot (:class:`gpupool.slurm.mirror.SlurmMirror`)."""
        settings = SlurmSettings(config=config)
        managed = bool(config.SlurmAccounts.get("manage", False))
        shards = shards_per_gpu(pool.inventory) if pool is not None and managed else 0
        engine = cls(settings, logger, shards_per_gpu=shards)
        if pool is not None:
            engine.mirror = SlurmMirror(pool, engine.commands, logger)
            engine.poller.on_snapshot.append(engine.mirror.apply)
            engine.services.append(engine.mirror)
            engine.nodes = SlurmNodeWatch(pool, engine.commands, engine.settings, logger)
            engine.services.append(engine.nodes)
        return engine

    mirror: SlurmMirror | None = None
    nodes: SlurmNodeWatch | None = None

    # -- the teams' accounts ---------------------------------------------------------------------
    def apply_accounts(self, ledger: Ledger) -> None:
        """At the hub's start, before anything is served: slurmdbd holds the accounts and QOS
        of the ledger's teams and ``everyone`` (``SlurmAccounts.manage``; nothing when it is
        off). Its own event loop in a worker thread: ``setup`` is synchronous and may run
        inside the hub's loop."""
        teams = [*ledger.teams.values(), ledger.everyone]
        with ThreadPoolExecutor(1, thread_name_prefix="gpupool-slurm-accounts") as worker:
            worker.submit(asyncio.run, self.accounts.apply(teams)).result()

    async def submit_account(self, user: str, team: str) -> str:
        """The ``--account`` of ``user``'s job for ``team`` (``""``: none, for users in no
        team), their association with it added first when the hub manages the accounts. Every
        submit asks here, notebooks and jobs alike."""
        return await self.accounts.ensure_user(user, team)

    def start(self) -> None:
        self.poller.start()
        for service in self.services:
            service.start()

    def shutting_down(self) -> None:
        """The hub is going away (:func:`gpupool.hub.shutdown.watch`): :meth:`stop`, scheduled
        on the loop."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_task(self.stop())

    _stopping: asyncio.Task[None] | None = None

    async def stop(self) -> None:
        for service in reversed(self.services):
            await service.stop()
        await self.poller.stop()


def shards_per_gpu(inventory: Inventory) -> int:
    """Shards per GPU on the pool's shard nodes (0: none). Slurm prices ``gres/shard`` with one
    weight per partition, so every shard node must split its GPUs alike."""
    slots = {g.share_slots for g in inventory.gpus if g.share_resource == SHARD_RESOURCE}
    if len(slots) > 1:
        raise ConfigError(
            "SlurmSettings.partition",
            f"its nodes split GPUs into different numbers of shards ({sorted(slots)}): Slurm "
            "bills a shard with one weight per partition, so give every node of the partition "
            "the same shards per GPU, or put them in partitions of their own",
        )
    return slots.pop() if slots else 0
