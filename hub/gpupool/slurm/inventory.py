"""Slurm's nodes as gpupool's inventory (pure), and the gres a ledger device is in Slurm's words.

Vocabulary
- *gres index*: Slurm's number of a GPU gres device on its node (``IDX`` in ``gres_detail`` and
  ``gres_used``), counted over the node's GPU gres in the order the node lists them (the order of
  ``gres.conf``): on a node with ``gpu:h100:2,gpu:1g.10gb:3`` the H100s are 0-1 and the three
  MIG instances 2-4.
- *device names*: a whole GPU is ``slurm-<node>-gpu<gres index>``; a MIG gres device is a fixed
  instance ``slurm-<node>-gpu<gres index>`` on a parent GPU ``slurm-<node>-mig<k>`` (Slurm does
  not say which physical GPU holds which instance: the parents are one valid packing of the
  node's counts, as on Kubernetes). Both stable across restarts for the same ``gres.conf``.
- *shard GPU*: on a node with ``shard`` gres, its whole GPUs take shares only, by memory, at
  most ``shards per GPU`` of them (the GPU's *share slots*; Slurm's shards are a count, nothing
  caps memory), and a share of ``m`` thousandths asks ``shard:ceil(m × slots / 1000)``.

Contract: pure. Nodes not in the partition, down, drained or failing are left out with a note;
GPU gres types :attr:`SlurmSettings.gres_models` does not name are left out with a note.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from gpupool.core.inventory import GPU, Inventory, MigInstance, Node
from gpupool.core.ledger import Allocation
from gpupool.core.mig import GEOMETRIES, Profile
from gpupool.core.offers import model_memory_mib
from gpupool.kube.nodes import pack_instances
from gpupool.slurm.parse import SlurmNode
from gpupool.slurm.settings import mig_profile_of

PREFIX = "slurm-"
SHARD_RESOURCE = "shard"
UNUSABLE = ("down", "drain", "drained", "draining", "fail", "failing", "future", "unknown")


def gpu_name(node: str, index: int) -> str:
    return f"{PREFIX}{node}-gpu{index}"


def inventory_from_sinfo(
    nodes: Iterable[SlurmNode], gres_models: Mapping[str, str], partition: str = ""
) -> Inventory:
    notes: list[str] = []
    built = []
    for n in sorted(nodes, key=lambda n: n.name):
        if partition and partition not in n.partitions:
            continue
        bad = [s for s in (n.state, *n.flags) if s in UNUSABLE]
        if bad:
            notes.append(
                f"node {n.name} is {bad[0]} in Slurm{f' ({n.reason})' if n.reason else ''}"
            )
            continue
        node = _node(n, gres_models, notes)
        if node.gpus:
            built.append(node)
    where = f"partition {partition}" if partition else "every partition"
    return Inventory(tuple(built), source=f"slurm ({where})", notes=tuple(notes))


def _node(n: SlurmNode, gres_models: Mapping[str, str], notes: list[str]) -> Node:
    index = 0
    whole: list[GPU] = []
    migs: dict[str, list[tuple[Profile, int]]] = {}
    for g in n.gres:
        if g.name != "gpu":
            continue
        model = gres_models.get(g.type)
        first, index = index, index + g.count
        if model is None:
            notes.append(
                f"node {n.name}: gpu:{g.type or '(untyped)'} is not in SlurmSettings.gres_models;"
                f" its {g.count} GPU(s) are left out"
            )
            continue
        profile = mig_profile_of(g.type, model)
        if profile is not None:
            p = GEOMETRIES[model].by_name[profile]
            migs.setdefault(model, []).extend((p, first + i) for i in range(g.count))
            continue
        memory = model_memory_mib(model) or 0
        geometry = GEOMETRIES.get(model)
        for i in range(first, first + g.count):
            whole.append(
                GPU(
                    gpu_name(n.name, i),
                    i,
                    model,
                    memory,
                    mig_capable=geometry is not None,
                    share_resource="",
                    product_name=f"gpu:{g.type}",
                )
            )
    shards = sum(g.count for g in n.gres if g.name == SHARD_RESOURCE)
    if shards and whole:
        whole = _shard_gpus(n.name, whole, shards, notes)
    parents = _mig_parents(n.name, migs, index, notes)
    return Node(n.name, tuple(whole + parents))


def _shard_gpus(node: str, gpus: list[GPU], shards: int, notes: list[str]) -> list[GPU]:
    if shards % len(gpus):
        notes.append(
            f"node {node}: {shards} shards do not divide evenly over its {len(gpus)} GPUs; "
            "its GPUs are handed out whole only"
        )
        return gpus
    slots = shards // len(gpus)
    notes.append(f"node {node}: GPUs shared by Slurm shards ({slots} per GPU): shares only")
    return [
        GPU(
            g.uuid,
            g.index,
            g.model,
            g.memory_mib,
            mig_capable=False,
            share_resource=SHARD_RESOURCE,
            share_slots=slots,
            product_name=g.product_name,
        )
        for g in gpus
    ]


def _mig_parents(
    node: str, migs: Mapping[str, list[tuple[Profile, int]]], next_index: int, notes: list[str]
) -> list[GPU]:
    out: list[GPU] = []
    k = 0
    for model, instances in sorted(migs.items()):
        geometry = GEOMETRIES[model]
        counts = Counter(p for p, _ in instances)
        layouts = pack_instances(geometry, counts)
        if layouts is None:
            notes.append(f"node {node}: its {model} MIG gres do not fit any GPU layout; left out")
            continue
        # hand the gres indices of each profile out in order over the packed slots
        free = {p: sorted(i for q, i in instances if q == p) for p in counts}
        memory = model_memory_mib(model) or 0
        for layout in layouts:
            uuid = f"{PREFIX}{node}-mig{k}"
            placed = tuple(
                MigInstance(p.name, start, gpu_name(node, free[p].pop(0)))
                for p, start in sorted(layout, key=lambda ps: ps[1])
            )
            out.append(GPU(uuid, next_index + k, model, memory, True, "fixed", placed))
            k += 1
    return out


def gres_index(name: str) -> int | None:
    """The gres index in a device name (``slurm-gpu1-gpu3`` → 3)."""
    tail = name.rpartition("-gpu")[2]
    return int(tail) if tail.isdigit() else None


def gres_request(
    allocation: Allocation, inventory: Inventory, gres_types: Mapping[str, str]
) -> str:
    """The ``--gres`` of an allocation on its node: ``gpu:h100:2``, ``gpu:1g.10gb:1``,
    ``shard:3`` (``gres_types``: the gres type of each model key and of each (model, profile),
    :func:`gres_types_of`); ``""`` for a CPU-only allocation."""
    gpus = {g.uuid: g for g in inventory.gpus}
    counts: Counter[str] = Counter()
    for d in allocation.devices:
        gpu = gpus.get(d.gpu)
        if gpu is None:
            continue
        if d.share_milli is not None:
            counts[SHARD_RESOURCE] += max(1, math.ceil(d.share_milli * gpu.share_slots / 1000))
        elif d.profile is not None:
            counts[f"gpu:{gres_types[f'{gpu.model}/{d.profile}']}"] += 1
        else:
            counts[f"gpu:{gres_types[gpu.model]}"] += 1
    return ",".join(f"{k}:{n}" for k, n in sorted(counts.items()))


def gres_types_of(gres_models: Mapping[str, str]) -> dict[str, str]:
    """Model key (and ``model/profile``) → gres type: the first type naming it wins."""
    out: dict[str, str] = {}
    for gres_type, model in gres_models.items():
        profile = mig_profile_of(gres_type, model)
        out.setdefault(f"{model}/{profile}" if profile else model, gres_type)
    return out


def load_slurm_inventory(settings: Any) -> Inventory:
    """The cluster's inventory now (one ``sinfo``), through ``settings``
    (:class:`~gpupool.slurm.settings.SlurmSettings`); ``RuntimeError`` saying so when the
    controller does not answer."""
    from gpupool.slurm.commands import SlurmCommands, SlurmUnavailable
    from gpupool.slurm.settings import SlurmSettings

    settings = settings if settings is not None else SlurmSettings()
    try:
        nodes = SlurmCommands.from_settings(settings).sinfo_now()
    except SlurmUnavailable as e:
        raise RuntimeError(f"GPUPool.inventory: Slurm could not be read: {e.message}") from None
    found = inventory_from_sinfo(nodes, settings.gres_models, settings.partition)
    return replace(found, simulated=settings.simulated)
