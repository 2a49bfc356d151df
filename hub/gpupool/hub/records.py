"""JupyterHub's records of running servers, read the two ways reconciliation reads them: at start
from JupyterHub's database through JupyterHub's own ORM (:func:`read_records`; JupyterHub has not
loaded it yet and its REST API is not up), while the hub runs from its REST API's user models
(:func:`rest_records`, of :meth:`gpupool.hub.hub_api.HubAPI.active_users`). Both are parsed by
one function, :func:`record`; the Kubernetes reconciler reads them too.

Vocabulary
- *state*: the spawner's saved state: :data:`STATE_KEY` (the server's allocation), and for a
  local server ``pid`` and :data:`START_KEY` (its process's start time).
- *alive*: that pid is the very process (same start time; for a state without one, a process
  whose environment names the allocation); ``None`` (unchecked) without a pid (not a local
  process: Kubernetes) or while its start is in progress (``pending == "spawn"``).

Contract: JupyterHub's database is only read (only the columns needed: one JupyterHub has yet to
upgrade reads too), never created, upgraded or written; a database that does not exist yet, or
has no tables yet, records no server.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from jupyterhub import orm
from sqlalchemy import create_engine, inspect, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from gpupool.core.reconcile import Record
from gpupool.processes import server_alive

STATE_KEY = "gpupool_allocation"
"""The spawner state key naming a server's allocation."""
START_KEY = "gpupool_process_start"
"""The spawner state key with a local server's process start time (clock ticks since boot)."""


def record(user: str, name: str, groups: Iterable[str], state: Any, pending: Any = None) -> Record:
    """One running server as JupyterHub keeps it, read the same way from its database and from
    its REST API: the spawner's saved ``state`` (:data:`STATE_KEY`, ``pid``, :data:`START_KEY`)
    and, for a local server, whether that pid is alive (``/proc``). A server whose start is in
    progress (``pending == "spawn"``) is its spawner's: unchecked."""
    value: Any = json.loads(state) if isinstance(state, str | bytes) else state
    value = value if isinstance(value, dict) else {}
    allocation = str(value.get(STATE_KEY) or "")
    pid = _int(value.get("pid"))
    pid = pid if pid is not None and pid > 0 else None
    start = _int(value.get(START_KEY))
    alive = None
    if pid is not None and pending != "spawn":
        alive = server_alive(pid, start, allocation)
    return Record(user, name or "", frozenset(groups), allocation, pid, alive)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read_records(url: str) -> list[Record]:
    """JupyterHub's running servers (spawners with a server) from its database at ``url``,
    through JupyterHub's own ORM (:mod:`jupyterhub.orm`), read only: nothing is created,
    upgraded or written, and a database that does not exist yet, or has no tables yet, records
    none. Only the columns read are selected, so a database JupyterHub has yet to upgrade reads
    too."""
    if _missing_sqlite(url):
        return []
    # no statement cache: JupyterHub's JSONDict type cannot be cached (SQLAlchemy warns)
    base = create_engine(url)
    engine = base.execution_options(compiled_cache=None)
    try:
        tables = set(inspect(engine).get_table_names())
        if not {orm.User.__tablename__, orm.Spawner.__tablename__} <= tables:
            return []
        with Session(engine) as db:
            rows = db.execute(
                select(orm.User.id, orm.User.name, orm.Spawner.name, orm.Spawner.state)
                .join(orm.Spawner, orm.Spawner.user_id == orm.User.id)
                .where(orm.Spawner.server_id.is_not(None))
            ).all()
            groups: dict[int, set[str]] = defaultdict(set)
            if {orm.Group.__tablename__, orm.user_group_map.name} <= tables:
                for user_id, group in db.execute(
                    select(orm.User.id, orm.Group.name).join(orm.User.groups)
                ):
                    groups[user_id].add(group)
    finally:
        base.dispose()
    return [record(user, name, groups[user_id], state) for user_id, user, name, state in rows]


def _missing_sqlite(url: str) -> bool:
    """Whether ``url`` is a SQLite database that does not exist (opening it would create it)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return False
    path = parsed.database or ""
    if path in ("", ":memory:"):
        return True  # a fresh, empty database: no records
    return not path.startswith("file:") and not os.path.exists(path)


def safe_url(url: str) -> str:
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "(unparsable URL)"


def rest_records(users: Iterable[Mapping[str, Any]]) -> list[Record]:
    """JupyterHub's running servers from its REST API's user models: each user's ``groups`` and
    active ``servers`` with their ``state`` (present only with ``admin:server_state``) and
    ``pending`` event."""
    records = []
    for user in users:
        name = user.get("name")
        servers = user.get("servers")
        if not isinstance(name, str) or not isinstance(servers, dict):
            continue
        groups = [g for g in user.get("groups") or () if isinstance(g, str)]
        for server_name, server in servers.items():
            if isinstance(server, dict) and not server.get("stopped"):
                state = server.get("state")
                records.append(record(name, server_name, groups, state, server.get("pending")))
    return records
