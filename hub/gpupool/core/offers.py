"""Offers (what an admin lets users pick) and requests (what a user asks for).

Vocabulary
- *offer*: a named, admin-declared shape: ``cpu`` (no GPU), ``gpu`` (whole GPUs, up to
  ``max_count`` per request, optionally one ``model`` and all in one NVLink island), or ``mig``
  (one instance of a MIG ``profile``, optionally of one ``model``). By convention a MIG offer is
  named ``mig-<profile>``.
- *request*: a user's ask: offer, count, the team to charge, and what it is for (a notebook
  server or a batch job, named by ``ref``).
- *cost*: GPU-equivalents in thousandths (see :mod:`gpupool.core.units`).

Contract: frozen data and pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .mig import GEOMETRIES
from .units import GPU_MILLI

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

    def unit_cost_milli(self) -> int:
        """Cost of one unit of this offer (one GPU, one MIG instance, or nothing for cpu)."""
        if self.kind == "cpu":
            return 0
        if self.kind == "gpu":
            return GPU_MILLI
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
        return self.model or "GPU"


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
