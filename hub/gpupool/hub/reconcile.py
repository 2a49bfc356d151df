"""Hub-start reconciliation: notebook allocations that no server holds any more are released.

Vocabulary
- *held*: a notebook allocation is held when JupyterHub's database has a running server
  (``spawners.server_id`` set) for its ref (``user/server-name``) whose saved spawner state names
  the allocation (``state["gpupool_allocation"]``).
- *orphan*: a persisted notebook allocation that is not held, e.g. left by a hub that died in the
  middle of a start, before JupyterHub saved the spawner's state.

Contract: runs once when the pool is built in the hub process, before JupyterHub checks its
spawners; reads JupyterHub's tables (``users``, ``spawners``) and never writes them. Running
servers are re-checked by JupyterHub itself right after (the spawners' ``poll``), which releases
the allocations of servers that died while the hub was down.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import create_engine, inspect, text

from ..pool import Pool

STATE_KEY = "gpupool_allocation"


def held_allocations(hub_db_url: str) -> set[str]:
    """Allocation ids named by running servers in JupyterHub's database."""
    engine = create_engine(hub_db_url)
    try:
        with engine.connect() as conn:
            if not {"users", "spawners"} <= set(inspect(conn).get_table_names()):
                return set()
            rows = conn.execute(
                text("SELECT state FROM spawners WHERE server_id IS NOT NULL AND state IS NOT NULL")
            )
            held = set()
            for (state,) in rows:
                value: Any = json.loads(state) if isinstance(state, str | bytes) else state
                if isinstance(value, dict) and value.get(STATE_KEY):
                    held.add(str(value[STATE_KEY]))
            return held
    finally:
        engine.dispose()


def release_orphans(pool: Pool, hub_db_url: str) -> list[str]:
    """Release notebook allocations no running server holds; returns their ids."""
    held = held_allocations(hub_db_url)
    orphans = [
        a for a in pool.ledger.allocations.values() if a.kind == "notebook" and a.id not in held
    ]
    for a in orphans:
        pool.log.warning(
            "gpupool: releasing %s (%s, %s): no running server holds it", a.id, a.ref, a.offer
        )
        pool.release(a.id)
    return [a.id for a in orphans]
