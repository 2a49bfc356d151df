"""gpupool's pure core: MIG geometry, inventory, offers, team quotas, placement and the ledger.

Nothing in this package performs I/O or imports JupyterHub, tornado, Kubernetes, NVML or SQL;
it is deterministic and fast, and everything above it (discovery, persistence, the hub) is built
on these types.
"""

from gpupool.core.errors import (
    InvalidRequest,
    NoCapacity,
    NotATeamMember,
    OfferNotAllowed,
    PoolError,
    QuotaExceeded,
    TooLarge,
    UnknownAllocation,
)
from gpupool.core.inventory import GPU, Inventory, MigInstance, Node, model_key
from gpupool.core.ledger import Allocation, Device, Ledger
from gpupool.core.mig import GEOMETRIES, Geometry, Profile, geometry_for
from gpupool.core.offers import Offer, Request
from gpupool.core.placement import POLICIES, Demand, PlacementPolicy, make_policy
from gpupool.core.quota import EVERYONE, Team, resolve_team
from gpupool.core.units import fmt, to_milli

__all__ = [
    "EVERYONE",
    "GEOMETRIES",
    "GPU",
    "POLICIES",
    "Allocation",
    "Demand",
    "Device",
    "Geometry",
    "InvalidRequest",
    "Inventory",
    "Ledger",
    "MigInstance",
    "NoCapacity",
    "Node",
    "NotATeamMember",
    "Offer",
    "OfferNotAllowed",
    "PlacementPolicy",
    "PoolError",
    "Profile",
    "QuotaExceeded",
    "Request",
    "Team",
    "TooLarge",
    "UnknownAllocation",
    "fmt",
    "geometry_for",
    "make_policy",
    "model_key",
    "resolve_team",
    "to_milli",
]
