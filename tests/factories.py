"""Small builders for test inventories and pool settings (plain core objects, no stand-ins)."""

from __future__ import annotations

from gpupool.core import GPU, Inventory, MigInstance, Node, Offer, Team
from gpupool.core.inventory import MigMode


def gpu(
    node: str,
    index: int,
    model: str = "H100-80GB",
    mode: MigMode = "off",
    instances: tuple[tuple[str, int], ...] = (),
    peers: tuple[int, ...] = (),
) -> GPU:
    uuid = f"GPU-{node}-{index}"
    return GPU(
        uuid=uuid,
        index=index,
        model=model,
        memory_mib=81559,
        mig_capable=model in ("H100-80GB", "A100-40GB", "A100-80GB", "H200-141GB", "A30-24GB"),
        mig_mode=mode,
        instances=tuple(MigInstance(p, s, f"MIG-{node}-{index}-{s}") for p, s in instances),
        nvlink_peers=frozenset(f"GPU-{node}-{i}" for i in peers),
    )


def mixed_inventory() -> Inventory:
    """Two nodes: whole H100s with NVLink pairs, a dynamic and a fixed MIG H100, and A100-40GBs."""
    a = Node(
        "a",
        (
            gpu("a", 0, peers=(1,)),
            gpu("a", 1, peers=(0,)),
            gpu("a", 2, peers=(3,)),
            gpu("a", 3, peers=(2,)),
            gpu("a", 4, mode="dynamic"),
            gpu("a", 5, mode="fixed", instances=(("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6))),
        ),
    )
    b = Node(
        "b",
        (gpu("b", 0, "A100-40GB"), gpu("b", 1, "A100-40GB"), gpu("b", 2, "A100-40GB", "flex")),
    )
    return Inventory((a, b), source="test")


OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "gpu": Offer("gpu", "gpu", max_count=4),
    "h100-pair": Offer("h100-pair", "gpu", model="H100-80GB", max_count=2, nvlink=True),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", profile="3g.40gb"),
    "mig-2g.20gb": Offer("mig-2g.20gb", "mig", profile="2g.20gb"),
    "mig-1g.10gb": Offer("mig-1g.10gb", "mig", model="H100-80GB", profile="1g.10gb"),
    "mig-1g.5gb": Offer("mig-1g.5gb", "mig", profile="1g.5gb"),
}

TEAMS = {
    "vision": Team("vision", 2000, 1000, 2000, None),
    "nlp": Team("nlp", 1000, 0, None, frozenset({"cpu", "mig-1g.10gb", "mig-3g.40gb", "gpu"})),
    "ops": Team("ops", 3000, 2000, None, frozenset({"cpu", "gpu", "h100-pair", "mig-1g.5gb"})),
}
