"""Refuse a start beyond ``user_limits.spawns`` before JupyterHub does any work for it.

Vocabulary
- *start request*: ``POST {hub}api/users/<name>/server`` or ``.../servers/<server>``, served by
  JupyterHub's ``UserServerAPIHandler``, whose spawn path writes to JupyterHub's database (a
  server row, a token, an OAuth client, the options: four commits) before ``Spawner.start`` can
  refuse, then undoes it (three more): a tenth of a second of the hub's event loop per refusal
  here, which a user retrying at once turns into everyone's wait.
- *starting servers*: a user's servers JupyterHub has pending a spawn and gpupool admitted
  (:func:`starting`); ``user_limits.spawns`` bounds them.
- *gate*: a tornado routing rule put first in JupyterHub's handlers. It takes a start request
  only when JupyterHub would go on to spawn (named servers allowed or the default server; the
  server asked for is neither starting nor running) and every team the user may charge it to
  would refuse it (:func:`gpupool.core.quota.check_limit_in_every`); every other request falls
  through to JupyterHub's own handler, untouched.

Contract: a start the gate takes gets JupyterHub's own authentication and scope check
(``servers`` on that server) and then a 429 with the limit's sentence, and nothing is written.
The spawner's check stays the one that decides (by the team the start is charged to); the gate
refuses only what it would refuse. :func:`install` puts the gate in place by observing the
application's ``handlers`` trait, which JupyterHub assigns once in ``init_handlers``, before it
builds its tornado application.
"""

from __future__ import annotations

import re
from typing import Any

from jupyterhub.apihandlers.base import APIHandler
from jupyterhub.scopes import needs_scope
from tornado import httputil
from tornado.routing import PathMatches, Rule

from ..core.errors import LimitReached
from ..core.quota import check_limit_in_every, member_teams
from ..pool import Pool
from .errors import http_error

START = r"api/users/([^/]+)/server(?:s/([^/]*))?"
"""The paths of a start request below the hub's prefix: the default server, a named one."""


def starting(user: Any, besides: Any = None) -> int:
    """How many of ``user``'s servers (JupyterHub ``User``) are starting after gpupool admitted
    them, ``besides`` (a spawner) left out: a start that will be refused is not counted."""
    return sum(
        1
        for s in getattr(user, "spawners", {}).values()
        if s is not besides and s.pending == "spawn" and getattr(s, "gpupool_admitted", False)
    )


def refusal(pool: Pool, user: Any, server_name: str, named: bool) -> LimitReached | None:
    """Why the gate takes a start of ``user``'s ``server_name`` (``None``: it lets it through);
    ``named``: whether the hub allows named servers."""
    spawner = user.spawners.get(server_name)
    if spawner is not None and (spawner.pending or spawner.ready):
        return None  # JupyterHub answers these itself (202, 400)
    if server_name and not named:
        return None
    ledger = pool.ledger
    teams = member_teams(ledger.teams, ledger.everyone, [g.name for g in user.groups])
    try:
        check_limit_in_every(teams, "spawns", starting(user))
    except LimitReached as e:
        return e
    return None


class StartBeyondLimit(PathMatches):
    """Matches a start request the gate refuses, and nothing else."""

    def __init__(self, app: Any, pool: Pool) -> None:
        super().__init__(re.escape(app.hub_prefix) + START + "$")
        self.app = app
        self.pool = pool

    def match(self, request: httputil.HTTPServerRequest) -> dict[str, Any] | None:
        if request.method != "POST":
            return None
        found = super().match(request)
        if found is None:
            return None
        name, server = (a.decode() if a else "" for a in found["path_args"])
        user = next((u for u in dict.values(self.app.users) if u.name == name), None)
        if user is None:  # not in memory: nothing of theirs is starting
            return None
        refused = refusal(self.pool, user, server, self.app.allow_named_servers)
        if refused is None:
            return None
        return {
            "path_args": [name.encode(), server.encode()],
            "path_kwargs": {"sentence": refused.message.encode()},
        }


class RefusedStartHandler(APIHandler):
    """A start the gate took: JupyterHub's scope check, then 429 with the limit's sentence."""

    @needs_scope("servers")
    async def post(self, user_name: str, server_name: str, sentence: str) -> None:
        ref = f"{user_name}/{server_name}"
        self.log.info("gpupool: refused %s before JupyterHub's spawn: %s", ref, sentence)
        raise http_error(LimitReached(sentence))


def install(app: Any, pool: Pool) -> None:
    """Put the gate first in ``app``'s (a ``JupyterHub`` application's) handlers when it
    assigns them (at once if it already has)."""

    def first(handlers: list[Any]) -> None:
        gates = (
            h for h in handlers if isinstance(h, Rule) and isinstance(h.matcher, StartBeyondLimit)
        )
        if not any(gates):
            handlers.insert(0, Rule(StartBeyondLimit(app, pool), RefusedStartHandler))

    if app.handlers:
        first(app.handlers)
    app.observe(lambda change: first(change["new"]), names="handlers")
