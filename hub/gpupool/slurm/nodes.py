"""Slurm's nodes come and go: the inventory follows ``sinfo`` while the hub runs.

Vocabulary
- *node pass*: one ``sinfo`` call every ``SlurmSettings.node_period`` seconds; the inventory it
  gives (:func:`gpupool.slurm.inventory.inventory_from_sinfo`: down, drained and failing nodes
  left out) replaces the ledger's, every allocation kept. A node that left while allocations
  hold it (an admin's ``scontrol update state=drain``, a node that failed) is *draining*
  (:func:`gpupool.core.draining.kept_node`): kept as far as they hold it, so nothing new lands
  there, until they are released.

Contract: :func:`plan_nodes` is pure; :class:`SlurmNodeWatch` swaps the ledger under the pool's
lock and tells the pool's ``on_inventory`` listeners (a queued job may fit a node that came). A
``sinfo`` that fails changes nothing ("unknown", logged once).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field, replace

from gpupool.background import Periodic
from gpupool.core.draining import kept_node
from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Allocation, Ledger
from gpupool.pool import Pool
from gpupool.slurm.commands import SlurmCommands, SlurmUnavailable
from gpupool.slurm.inventory import inventory_from_sinfo
from gpupool.slurm.settings import SlurmSettings

log = logging.getLogger("gpupool")


@dataclass
class NodeSwap:
    ledger: Ledger | None
    """The ledger to put in place; ``None``: nothing changed (or refused: ``lost``)."""
    draining: list[str] = field(default_factory=list)
    changed: list[Allocation] = field(default_factory=list)
    lost: list[Allocation] = field(default_factory=list)


def plan_nodes(ledger: Ledger, found: Inventory) -> NodeSwap:
    """The ledger over ``found``, with every node whose allocations would not restore on its new
    form kept draining."""
    before = {n.name: n for n in ledger.inventory.nodes}
    after = {n.name: n for n in found.nodes}
    held: dict[str, list[Allocation]] = defaultdict(list)
    for a in ledger.allocations.values():
        if a.node:
            held[a.node].append(a)
    draining = []
    for name in sorted(held):
        kept = kept_node(after.get(name), before.get(name), held[name], ledger)
        if kept is not None:
            after[name] = kept
            draining.append(name)
    notes = found.notes + tuple(
        f"node {name} is draining in gpupool: only the devices its allocations hold are kept, "
        "until they are released"
        for name in draining
    )
    inventory = replace(found, nodes=tuple(after[n] for n in sorted(after)), notes=notes)
    if (inventory.nodes, inventory.notes) == (ledger.inventory.nodes, ledger.inventory.notes):
        return NodeSwap(None, draining)
    fresh, restored, lost = ledger.rebuilt(inventory)
    if lost:
        return NodeSwap(None, draining, lost=lost)
    return NodeSwap(fresh, draining, [a for a in restored if a != ledger.allocations[a.id]])


class SlurmNodeWatch:
    def __init__(
        self,
        pool: Pool,
        commands: SlurmCommands,
        settings: SlurmSettings,
        logger: logging.Logger = log,
    ) -> None:
        self.pool = pool
        self.commands = commands
        self.settings = settings
        self.log = logger
        self.failure = ""
        self._loop = Periodic(
            "Slurm node pass", self.refresh, lambda: settings.node_period, logger, at_once=False
        )

    def start(self) -> None:
        self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()

    async def refresh(self) -> NodeSwap | None:
        try:
            nodes = await self.commands.sinfo()
        except SlurmUnavailable as e:
            if not self.failure:
                self.log.warning("gpupool: Slurm's nodes not read: %s", e.message)
            self.failure = e.message
            return None
        self.failure = ""
        found = inventory_from_sinfo(nodes, self.settings.gres_models, self.settings.partition)
        found = replace(found, simulated=self.settings.simulated)
        return self.apply(found)

    def apply(self, found: Inventory) -> NodeSwap:
        def decide(ledger: Ledger) -> NodeSwap:
            swap = plan_nodes(ledger, found)
            if swap.ledger is not None:
                if swap.changed:
                    self.pool.store.replace(swap.changed)
                self.pool.ledger = swap.ledger
            return swap

        swap: NodeSwap = self.pool.deciding(decide)
        if swap.lost:
            self.log.error(
                "gpupool: Slurm's nodes changed, but allocation(s) %s would not fit; kept the "
                "old inventory",
                ", ".join(a.id for a in swap.lost),
            )
        if swap.ledger is not None:
            self.log.info("gpupool: Slurm inventory now: %s", swap.ledger.inventory.label)
            for note in swap.ledger.inventory.notes:
                self.log.info("gpupool: %s", note)
            for listener in self.pool.on_inventory:
                listener()
        return swap
