"""A node that changed while allocations hold it: kept, as far as they hold it, until released.

Vocabulary
- *draining node*: a node whose new form (fewer GPUs, other MIG instances, gone from the
  cluster, drained in Slurm) no longer holds the allocations on it: the ledger keeps the node
  as it was, but only the devices those allocations hold, so nothing new lands there and
  nothing held is lost; once they are released the node takes its new form.

Contract: pure (Kubernetes' node reconciler and Slurm's node watch both decide with it).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import replace

from gpupool.core.inventory import GPU, Inventory, Node
from gpupool.core.ledger import Allocation, Device, Ledger


def kept_node(
    new: Node | None, old: Node | None, held: Iterable[Allocation], ledger: Ledger
) -> Node | None:
    """``None`` if the allocations ``held`` on a node all restore onto its ``new`` form (the
    node may take it), else the node *draining*: ``old`` as far as they hold it. On a node as it
    was they do (the ledger holds them there), so only a changed node is tried."""
    if new == old:
        return None
    trial = Ledger(Inventory((new,) if new else ()), ledger.offers, ledger.teams, ledger.everyone)
    _restored, lost = trial.restore(held)
    if not lost or old is None:
        return None
    devices: dict[str, list[Device]] = defaultdict(list)
    for a in held:
        for d in a.devices:
            devices[d.gpu].append(d)
    return Node(old.name, tuple(g for g in (_held_part(g, devices[g.uuid]) for g in old.gpus) if g))


def _held_part(gpu: GPU, devices: list[Device]) -> GPU | None:
    """``gpu`` as far as ``devices`` hold it: ``None`` if nothing; a fixed-MIG GPU with only its
    held instances; otherwise the GPU as it was."""
    if not devices:
        return None
    if gpu.mig_mode != "fixed":
        return gpu
    taken = {(d.profile, d.start) for d in devices}
    return replace(gpu, instances=tuple(i for i in gpu.instances if (i.profile, i.start) in taken))
