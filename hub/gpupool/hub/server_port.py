"""``POST /hub/api/gpupool/servers/port``: a starting server reports the port it picked on its
node (the Slurm spawner's *port report*, :mod:`gpupool_spawner.slurm`).

Vocabulary
- *the server's own token*: the ``JUPYTERHUB_API_TOKEN`` JupyterHub made for one start of one
  server (``Spawner.api_token``). Only that token reports that server's port: the user's other
  tokens, another server's token, a browser's cookie and everyone else's are refused (403).

Contract: the body is exactly ``{"port": <1..65535>}`` (anything else, a body over
:data:`MAX_BODY` bytes too: 400, nothing changed); the
report is accepted once, while that server starts (else 409); it sets the port and nothing else,
the host is Slurm's (the node's address). Errors become HTTP statuses in
:mod:`gpupool.hub.errors`.
"""

from __future__ import annotations

import hmac
from typing import Any

from gpupool.core.errors import InvalidRequest, TooLarge
from gpupool.hub.handlers import GPUPoolHandler
from gpupool.slurm.notebook import NotTheServersToken, check_port_body

MAX_BODY = 256
"""Bytes a port report may take (``{"port": 65535}`` is 15)."""


class ServerPortHandler(GPUPoolHandler):
    def post(self) -> None:
        name, _, _ = self.caller()  # 403 without a token holding gpupool's scope
        try:
            body = self.json_body(MAX_BODY)
        except TooLarge as e:  # "anything else" than a port is 400, a big body included
            raise InvalidRequest(e.message) from None
        port = check_port_body(body)
        spawner = self._own_server()
        if spawner is None:
            raise NotTheServersToken(
                "Only a starting server's own token (its JUPYTERHUB_API_TOKEN) reports its port."
            )
        spawner.slurm_port_reported(port)
        self.log.info("gpupool: %s's server %r reported port %d", name, spawner.name, port)
        self.write_json({"port": port})

    def _own_server(self) -> Any:
        """The spawner whose ``api_token`` is this request's token, of this token's user."""
        token = self.get_auth_token()
        user = self.current_user
        if not token or user is None or not hasattr(user, "spawners"):
            return None
        for spawner in user.spawners.values():
            own = getattr(spawner, "api_token", "") or ""
            if own and hmac.compare_digest(own.encode(), token.encode()):
                return spawner if hasattr(spawner, "slurm_port_reported") else None
        return None


def handlers() -> list[tuple[str, type[GPUPoolHandler]]]:
    return [(r"/api/gpupool/servers/port", ServerPortHandler)]
