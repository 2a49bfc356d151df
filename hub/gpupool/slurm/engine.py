"""The hub's Slurm side: one object holding the settings, the commands seam and the shared poller,
built by ``setup(c)`` for a Slurm inventory and handed to the spawners, the job backend and the
services through the hub objects (``hub_objects(settings).slurm``).

Contract: :meth:`SlurmEngine.start` starts the poller's loop in the running event loop;
:meth:`stop` ends it. Nothing here decides: the spawner, the job backend and the mirror
(:mod:`gpupool.slurm.mirror`) read the poller's snapshots.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gpupool.pool import Pool
from gpupool.slurm.commands import SlurmCommands
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
    ) -> None:
        self.settings = settings
        self.log = logger
        self.commands = commands or SlurmCommands.from_settings(settings)
        self.poller = SlurmPoller(self.commands, period=settings.poll_period, logger=logger)
        self.services: list[Any] = []
        """Other loops to start and stop with the poller (the mirror, the reconciler)."""

    @classmethod
    def from_config(
        cls, config: Any, logger: logging.Logger = log, pool: Pool | None = None
    ) -> SlurmEngine:
        """The engine of the hub's ``config``; with ``pool``, its ledger mirrors every answered
        snapshot (:class:`gpupool.slurm.mirror.SlurmMirror`)."""
        engine = cls(SlurmSettings(config=config), logger)
        if pool is not None:
            engine.mirror = SlurmMirror(pool, engine.commands, logger)
            engine.poller.on_snapshot.append(engine.mirror.apply)
            engine.services.append(engine.mirror)
            engine.nodes = SlurmNodeWatch(pool, engine.commands, engine.settings, logger)
            engine.services.append(engine.nodes)
        return engine

    mirror: SlurmMirror | None = None
    nodes: SlurmNodeWatch | None = None

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
