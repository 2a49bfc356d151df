"""The MIG instances of a running demo hub: what its pool recorded and what its simulated driver
holds (a helper module: test modules never import each other)."""

from __future__ import annotations

import json
from typing import Any

from gpupool.store import Store
from tests.hub.conftest import Hub

A100 = "GPU-43a3e6ab-e43a-5ca0-8511-1ed279d24e69"  # the demo's managed GPU (managed_mig)


def records(hub: Hub) -> list[tuple[str | None, str, str | None]]:
    """The MIG instances the pool has recorded as its own: (UUID, state, holder)."""
    store = Store(f"sqlite:///{hub.state / 'gpupool.sqlite'}", upgrade=False)
    try:
        return [(r.uuid, r.state, r.allocation_id) for r in store.mig_records()]
    finally:
        store.close()


def driver_instances(hub: Hub) -> dict[str, Any]:
    """The MIG devices the simulated driver holds on the managed A100 now: (profile, start)."""
    path = hub.state / "activity.mig-state.json"
    state = json.loads(path.read_text()) if path.exists() else {}
    return {
        uuid: (profile, start)
        for node in state.values()
        for _gi, profile, start, _ci, uuid in node["gpus"].get(A100, [])
        if uuid
    }
