"""The ledger re-keyed to the devices an engine says an allocation holds: a Kubernetes node
through dcgm-exporter (:mod:`gpupool.kube.readback`), Slurm through ``squeue``'s gres indices
(:mod:`gpupool.slurm.mirror`). Where the engine, not gpupool, picks the device, this keeps the
ledger's free GPUs the engine's free GPUs.

Vocabulary
- *seen device* (:class:`Seen`): a device the engine reports an allocation holds: its index on
  the node, its UUID (or a name standing for one), and for a MIG instance its GPU instance ID
  and profile.
- *re-key* (:func:`plan_readback`): for an allocation of whole GPUs, its ledger devices become
  the inventory GPUs with the indexes the engine reports, each with the seen UUID as its
  ``instance`` (so ``visible_devices`` names the real GPU). An allocation the ledger had put on
  those indexes is *displaced* onto the ones vacated (it cannot hold them: the engine says
  another holder does). Where the indexes do not name whole GPUs of the inventory, only the
  UUIDs are recorded, paired in order. MIG instances and shares are not re-keyed.

Contract: :func:`plan_readback` is pure. :func:`apply_readback` changes the ledger under the
pool's lock: every allocation of one plan is released and restored with its new devices,
persisted, or nothing changes (logged by the caller), then the pool's ``on_devices`` listeners
hear the allocations rewritten (the job manager records a job's new devices). Quotas and costs
are unchanged (the same count of the same kind on the same node).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpupool.core.ledger import Allocation, Device, Ledger
from gpupool.pool import Pool


@dataclass(frozen=True, order=True)
class Seen:
    """A device an allocation holds, as the engine reports it (see the module docstring)."""

    index: int
    uuid: str
    gi: int | None = None
    profile: str | None = None

    @property
    def id(self) -> str:
        """``<UUID>`` of a GPU, ``<UUID>/gi<GPU instance ID>`` of a MIG instance."""
        return self.uuid if self.gi is None else f"{self.uuid}/gi{self.gi}"


def plan_readback(ledger: Ledger, alloc_id: str, seen: Sequence[Seen]) -> list[Allocation]:
    """The allocations to rewrite so that ``alloc_id`` holds what the node says it holds: the
    allocation re-keyed, and any displaced one (see the module docstring); ``[]`` if nothing
    changes or the engine's answer does not fit the allocation (another count, MIG, shares)."""
    a = ledger.allocations.get(alloc_id)
    node = next((n for n in ledger.inventory.nodes if a and n.name == a.node), None)
    whole = [s for s in seen if s.gi is None]
    if a is None or node is None or len(whole) != len(a.devices) or len(seen) != len(whole):
        return []
    if any(d.profile is not None or d.share_milli is not None for d in a.devices):
        return []
    gpus = {g.uuid: g for g in node.gpus}
    by_index = {g.index: g.uuid for g in node.gpus if not g.mig_enabled and not g.share_resource}
    targets = [by_index.get(s.index) for s in whole]
    old = [d.gpu for d in a.devices]
    if any(t is None for t in targets) or len(set(targets)) != len(targets):
        paired = tuple(
            replace(d, instance=s.uuid)
            for d, s in zip(sorted(a.devices, key=lambda d: gpus[d.gpu].index), whole, strict=True)
        )
        return [replace(a, devices=paired)] if set(paired) != set(a.devices) else []
    devices = tuple(Device(str(t), instance=s.uuid) for t, s in zip(targets, whole, strict=True))
    if set(devices) == set(a.devices):
        return []
    vacated = [g for g in old if g not in targets]
    holders = {d.gpu: b for b in ledger.allocations.values() if b.id != a.id for d in b.devices}
    moved: dict[str, Allocation] = {}
    for t in targets:
        b = holders.get(str(t))
        if b is None or t in old:
            continue
        b = moved.get(b.id, b)
        if any(d.profile is not None or d.share_milli is not None for d in b.devices):
            return []
        swap = vacated.pop(0)
        moved[b.id] = replace(
            b, devices=tuple(Device(swap) if d.gpu == t else d for d in b.devices)
        )
    return [replace(a, devices=devices), *moved.values()]


def apply_readback(pool: Pool, plan: Sequence[Allocation]) -> bool:
    """Rewrite the allocations of ``plan`` (:func:`plan_readback`) in the ledger and the store,
    under the pool's lock; all or nothing. False if they would not restore (then nothing
    changed)."""
    if not plan:
        return False

    def decide(ledger: Ledger) -> list[Allocation] | None:
        before = [ledger.allocations.get(a.id) for a in plan]
        if any(b is None for b in before):
            return None
        for a in plan:
            ledger.release(a.id)
        restored, lost = ledger.restore(plan)
        if lost:
            for a in restored:
                ledger.release(a.id)
            ledger.restore([b for b in before if b is not None])
            return None
        try:
            pool.store.replace(restored)
        except Exception:
            for a in restored:
                ledger.release(a.id)
            ledger.restore([b for b in before if b is not None])
            raise
        return restored

    restored: list[Allocation] | None = pool.deciding(decide)
    if restored is None:
        return False
    for listener in pool.on_devices:  # a job's recorded devices follow (its manager listens)
        listener(restored)
    return True
