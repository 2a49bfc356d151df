"""Refuse a start beyond ``user_limits.spawns`` before JupyterHub does any work for it.

Vocabulary
- *start request*: ``POST {hub}api/users/<name>/server`` or ``.../servers/<server>``, served by
  JupyterHub's ``UserServerAPIHandler``, whose spawn path writes to JupyterHub's database (a
  server row, a token, an OAuth client, the options: four commits) before ``Spawner.start`` can
  refuse, then undoes it (three more): a tenth of a second of the hub's event loop per refusal
  here, which a user retrying at once turns into everyone's wait.
- *starting servers*: a user's servers JupyterHub has pending a spawn and gpupool admitted
  (:func:`starting`); ``user_limits.spawns`` bounds them.
- *in flight*: a start the gate let through that no spawner has admitted or refused yet
  (:class:`SpawnGate`); the gate counts it as starting, so starts sent all at once are gated
  although none has reached a spawner yet.
- *gate*: :class:`GatedStartHandler`, JupyterHub's own start handler with the gate's check
  first, routed before JupyterHub's handlers for the start requests (other methods on the same
  paths reach JupyterHub's handler untouched). After JupyterHub's own authentication and scope
  check, where its ``post`` looks up the user, it refuses a start when JupyterHub would go on
  to spawn (named servers allowed or the default server; the server asked for neither starting
  nor running) and every team the user may charge it to would refuse it
  (:func:`gpupool.core.quota.check_limit_in_every`); everything else goes on as in JupyterHub.

Contract: a start the gate refuses is a 429 with the limit's sentence and nothing written. The
spawner's check stays the one that decides (by the team the start is charged to, counting
admitted starts only); the gate refuses what it would refuse, and what is in flight ahead.
:func:`install` puts the gate in place by observing the application's ``handlers`` trait, which
JupyterHub assigns once in ``init_handlers``, before it builds its tornado application.
"""

from __future__ import annotations

import re
from typing import Any

from jupyterhub.apihandlers.users import UserServerAPIHandler
from tornado import httputil
from tornado.routing import PathMatches, Rule

from gpupool.core.errors import LimitReached
from gpupool.core.quota import check_limit_in_every, member_teams
from gpupool.hub.errors import http_error
from gpupool.pool import Pool

STARTS = (r"api/users/([^/]+)/server", r"api/users/([^/]+)/servers/([^/]*)")
"""The paths of a start request below the hub's prefix (JupyterHub's own two routes)."""


def starting(user: Any, besides: Any = None) -> int:
    """How many of ``user``'s servers (JupyterHub ``User``) are starting after gpupool admitted
    them, ``besides`` (a spawner) left out: a start that will be refused is not counted."""
    return sum(
        1
        for s in getattr(user, "spawners", {}).values()
        if s is not besides and s.pending == "spawn" and getattr(s, "gpupool_admitted", False)
    )


class SpawnGate:
    """What the gate knows: the pool (teams and their limits) and, per user, the starts in
    flight, by server name."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self._in_flight: dict[str, set[str]] = {}

    def check(self, user: Any, server_name: str, named: bool) -> LimitReached | None:
        """Why the gate refuses a start of ``user``'s (JupyterHub ``User``) ``server_name``;
        ``None``: it lets it through, in flight until :meth:`decided`. ``named``: whether
        the hub allows named servers."""
        spawner = user.spawners.get(server_name)
        if spawner is not None and (spawner.pending or spawner.ready):
            return None  # JupyterHub answers these itself (202, 400)
        if server_name and not named:
            return None
        ledger = self.pool.ledger
        teams = member_teams(ledger.teams, ledger.everyone, [g.name for g in user.groups])
        flights = self._in_flight.setdefault(user.name, set())
        try:
            check_limit_in_every(teams, "spawns", starting(user) + len(flights - {server_name}))
        except LimitReached as e:
            return e
        flights.add(server_name)
        return None

    def decided(self, user_name: str, server_name: str) -> None:
        """The spawner admitted or refused this start, or JupyterHub answered it without one:
        it counts as its spawner says now."""
        flights = self._in_flight.get(user_name, set())
        flights.discard(server_name)
        if not flights:
            self._in_flight.pop(user_name, None)


class StartRequest(PathMatches):
    """A ``POST`` to one of :data:`STARTS` below ``prefix``."""

    def __init__(self, prefix: str, path: str) -> None:
        super().__init__(re.escape(prefix) + path + "$")

    def match(self, request: httputil.HTTPServerRequest) -> dict[str, Any] | None:
        return super().match(request) if request.method == "POST" else None


class GatedStartHandler(UserServerAPIHandler):
    """JupyterHub's start of a server, with the gate's check where JupyterHub's ``post`` first
    looks up the user: after its own authentication and scope check (``servers`` in JupyterHub
    5, ``start:servers`` in 6), before anything else."""

    def initialize(self, gate: SpawnGate) -> None:
        self.gate = gate
        self.in_flight: tuple[str, str] | None = None

    async def post(self, user_name: str, server_name: str = "") -> None:
        self.server_name = server_name
        try:
            return await super().post(user_name, server_name)
        finally:
            if self.in_flight is not None:
                self.gate.decided(*self.in_flight)

    def find_user(self, name: str) -> Any:
        user = super().find_user(name)
        if user is None or self.in_flight is not None:
            return user
        refused = self.gate.check(user, self.server_name, self.allow_named_servers)
        if refused is not None:
            ref = f"{user.name}/{self.server_name}"
            self.log.info("gpupool: refused %s before JupyterHub's spawn: %s", ref, refused.message)
            raise http_error(refused)
        self.in_flight = (user.name, self.server_name)
        return user


def install(app: Any, gate: SpawnGate) -> None:
    """Route ``app``'s (a ``JupyterHub`` application's) start requests to ``gate``, ahead of
    its own handlers, when it assigns them (at once if it already has)."""

    def first(handlers: list[Any]) -> None:
        if not any(isinstance(h, Rule) and isinstance(h.matcher, StartRequest) for h in handlers):
            handlers[:0] = [
                Rule(StartRequest(app.hub_prefix, path), GatedStartHandler, {"gate": gate})
                for path in STARTS
            ]

    if app.handlers:
        first(app.handlers)
    app.observe(lambda change: first(change["new"]), names="handlers")
