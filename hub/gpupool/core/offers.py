"""Offers (what an admin lets users pick) and requests (what a user asks for).

Vocabulary
- *offer*: a named, admin-declared shape: ``cpu`` (no GPU), ``gpu`` (whole GPUs, up to
  ``max_count`` per request, optionally one ``model`` and all in one NVLink island), ``mig``
  (instances of one MIG ``profile``, up to ``max_count`` per request, all on one node and
  possibly on several GPUs of it, optionally of one ``model``), or ``share`` (one share of
  the memory of a GPU with MIG off, optionally of one ``model``: ``share_milli`` thousandths of
  it, or ``share_mib`` MiB of it). By convention a MIG offer is named ``mig-<profile>``; a share
  offer is always one share per request.
- *counted*: an offer whose requests name a count (``gpu`` and ``mig``: :attr:`Offer.counted`).
  A process sees only the first MIG instance of its ``CUDA_VISIBLE_DEVICES``, so several
  instances serve several processes (a job's ranks, one per instance), not one bigger device.
- *share cost*: a share by fraction costs its thousandths; a share by size costs
  ``ceil(share_mib * 1000 / memory_mib)`` of the GPU it lands on (rounded up, so the shares on a
  GPU never add up to more than its memory), which may differ between models: before placing,
  the ledger checks the quota with the least it could cost, after placing with what it costs
  (as for MIG profiles). A share larger than a GPU's memory never lands on that GPU.
- *one rank per instance*: a job given several MIG instances per node runs one rank on each:
  ``GPUPOOL_RANK_DEVICES`` lists them in rank order (or names the variable that does, in a pod:
  ``NVIDIA_VISIBLE_DEVICES``) and ``gpupool_lab.rank_log`` gives each rank its own one as
  ``CUDA_VISIBLE_DEVICES``; its ranks talk through ``gloo`` (``GPUPOOL_DDP_BACKEND``, which
  ``gpupool_lab.ddp.init`` follows), since NCCL does not span MIG instances (no peer-to-peer
  between them): a job that asks for ``nccl`` so is refused (:func:`check_ddp_backend`). Every
  profile allows it: each instance gpupool hands out is one GPU instance with one compute
  instance (:mod:`gpupool.discovery.nvml`), its own CUDA device, all of the offer's profile.
- *request*: a user's ask: offer, count, the team to charge, and what it is for (a notebook
  server or a batch job, named by ``ref``).
- *cost*: GPU-equivalents in thousandths (see :mod:`gpupool.core.units`).

Contract: frozen data and pure functions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from gpupool.core.errors import InvalidRequest
from gpupool.core.mig import GEOMETRIES
from gpupool.core.units import GPU_MILLI

OfferKind = Literal["cpu", "gpu", "mig", "share"]
RequestKind = Literal["notebook", "job"]


@dataclass(frozen=True)
class Offer:
    name: str
    kind: OfferKind
    description: str = ""
    model: str | None = None
    max_count: int = 1
    nvlink: bool = False
    profile: str | None = None
    share_milli: int | None = None
    """A ``share`` offer by fraction: thousandths of one GPU's memory (250: a quarter)."""
    share_mib: int | None = None
    """A ``share`` offer by size: MiB of one GPU's memory (6144: 6 GB); its cost is that over
    the memory of the GPU it lands on."""

    @property
    def counted(self) -> bool:
        """Whether a request names how many (whole GPUs, MIG instances): else it takes one."""
        return self.kind in ("gpu", "mig")

    def unit_cost_milli(self) -> int:
        """Cost of one unit of this offer (one GPU, one MIG instance, or nothing for cpu)."""
        if self.kind == "cpu":
            return 0
        if self.kind == "gpu":
            return GPU_MILLI
        if self.kind == "share":
            # by size and without a model: the least on any GPU is unknown here; the ledger
            # knows its GPUs (Ledger.unit_cost_milli) and checks again after placing
            if self.share_milli is not None:
                return self.share_milli
            memory = model_memory_mib(self.model) if self.model else None
            return share_cost_milli(self.share_mib or 0, memory) if memory else 0
        # the cheapest model that has the profile: a lower bound the ledger checks first; it
        # checks again with the cost of the placed instance
        costs = mig_costs(self.profile or "", self.model)
        return min(costs.values(), default=0)

    def cost_milli(self, count: int) -> int:
        return self.unit_cost_milli() * count

    @property
    def label(self) -> str:
        """Short text for pages and messages: ``H100-80GB``, ``MIG 3g.40gb``, ``CPU only``."""
        if self.kind == "cpu":
            return "CPU only"
        if self.kind == "mig":
            return f"MIG {self.profile}"
        if self.kind == "share":
            of = self.model or "a GPU"
            if self.share_mib is not None:
                return f"{fmt_mib(self.share_mib)} share of {of}"
            return f"{fmt_fraction(self.share_milli or 0)} share of {of}"
        return self.model or "GPU"

    def share_cost_on(self, memory_mib: int) -> int:
        """What one share of this offer costs on a GPU of ``memory_mib`` (above 1000: no room)."""
        if self.share_milli is not None:
            return self.share_milli
        return share_cost_milli(self.share_mib or 0, memory_mib)


_MODEL_GB = re.compile(r"-(\d+)GB$")


def model_memory_mib(model: str) -> int | None:
    """The memory a model key names: ``RTX3090-24GB`` → 24576 (GB read as GiB, as the keys do)."""
    m = _MODEL_GB.search(model)
    return int(m.group(1)) * 1024 if m else None


def share_cost_milli(share_mib: int, memory_mib: int) -> int:
    """``share_mib`` of a GPU of ``memory_mib`` in thousandths, rounded up: 6144 of 24576 → 250."""
    return -(-share_mib * GPU_MILLI // memory_mib) if memory_mib > 0 else GPU_MILLI + 1


def fmt_mib(mib: int) -> str:
    """``6144`` → ``"6 GB"``, ``6656`` → ``"6.5 GB"``, ``512`` → ``"512 MB"`` (GB: 1024 MiB)."""
    if mib < 1024:
        return f"{mib} MB"
    return f"{mib / 1024:.2f}".rstrip("0").rstrip(".") + " GB"


def fmt_fraction(milli: int) -> str:
    """``250`` → ``"25%"``, ``125`` → ``"12.5%"``."""
    return f"{milli / 10:.1f}".rstrip("0").rstrip(".") + "%"


def mig_costs(profile: str, model: str | None = None) -> dict[str, int]:
    """Cost of one ``profile`` instance on each model that has it (restricted to ``model``)."""
    out: dict[str, int] = {}
    for key, geometry in GEOMETRIES.items():
        if model is not None and key != model:
            continue
        p = geometry.resolve(profile)
        if p is not None:
            out[key] = geometry.cost_milli(p)
    return out


@dataclass(frozen=True)
class Request:
    user: str
    team: str
    offer: str
    count: int = 1
    kind: RequestKind = "notebook"
    ref: str = ""
    avoid_nodes: frozenset[str] = frozenset()
    """Nodes the devices must not be on (a multi-node job's nodes already granted)."""


DDP_BACKEND = "GPUPOOL_DDP_BACKEND"
"""A job's environment variable naming the ``torch.distributed`` backend of its ranks."""
RANK_DEVICES = "GPUPOOL_RANK_DEVICES"
"""A job's environment variable listing each local rank's own device (see *one rank per
instance*), or naming the variable that lists them."""
DDP_BACKENDS = ("gloo", "nccl")
MIG_NCCL_REFUSAL = (
    "NCCL does not communicate between MIG instances (CUDA has no peer-to-peer access between "
    "them), so a job on several MIG instances runs one rank per instance with the gloo backend: "
    "leave GPUPOOL_DDP_BACKEND unset or set it to gloo"
)
MIG_NOTEBOOK_NOTE = (
    "Several MIG instances: a process sees only the first of them (CUDA enumerates one MIG "
    "instance per process); give each process its own (CUDA_VISIBLE_DEVICES=<its MIG UUID>), "
    "or run a job, one rank per instance."
)


def one_rank_per_instance(offer: Offer, count: int) -> bool:
    """Whether ``count`` of ``offer`` per node are MIG instances that each get one rank."""
    return offer.kind == "mig" and count > 1


def check_ddp_backend(offer: Offer, count: int, env: dict[str, str]) -> None:
    """Refuse a job's backend (``env[DDP_BACKEND]``) that is unknown, or ``nccl`` for several
    MIG instances per node, with the reason (:class:`InvalidRequest`)."""
    asked = env.get(DDP_BACKEND, "")
    if asked and asked not in DDP_BACKENDS:
        raise InvalidRequest(
            f"{DDP_BACKEND} must be {' or '.join(DDP_BACKENDS)} (or unset), not {asked[:40]!r}."
        )
    if asked == "nccl" and one_rank_per_instance(offer, count):
        raise InvalidRequest(
            f"The job asks for {count}× {offer.label} per node with nccl: {MIG_NCCL_REFUSAL}."
        )


def rank_env(offer: Offer | None, count: int, devices: str) -> dict[str, str]:
    """What a job's environment gets so that each rank uses its own MIG instance over gloo:
    ``devices`` (the instances' UUIDs in rank order, or the name of the variable holding them);
    nothing for other jobs."""
    if offer is None or not one_rank_per_instance(offer, count):
        return {}
    return {RANK_DEVICES: devices, DDP_BACKEND: "gloo"}
