"""A small client of JupyterHub's REST API, for gpupool's services in the hub (the idle reclaimer,
the reconciler, the share watch).

Vocabulary
- ``api_url``: the hub's REST API as this process reaches it (``http://127.0.0.1:8081/hub/api``,
  :func:`gpupool.hub.reclaim.hub_urls`); ``token``: the calling service's; ``timeout``: seconds
  one call may take (tornado's ``request_timeout``).
- *server*: a user's server by ``name`` (``""``: the default one), at ``users/{user}/server`` or
  ``users/{user}/servers/{name}`` (:func:`server_path`).
- *slow*: a start or stop whose reply did not come within ``timeout``. JupyterHub carries on with
  it regardless (it replies 202 after its ``slow_spawn_timeout``/``slow_stop_timeout``, 10 s by
  default), so :meth:`HubAPI.start_server` and :meth:`HubAPI.stop_server` return ``False`` then
  and the caller reads the outcome from the hub's model, not from the reply's speed.

Contract: a failed call raises tornado's ``HTTPClientError`` (an HTTP status; 599,
:data:`HTTP_CLIENT_TIMEOUT`, when no reply came in time) or ``OSError`` (unreachable), except
:meth:`HubAPI.active_users`, which raises :class:`HubUnreadable` and never returns part of the
list. The token travels only in the ``Authorization`` header and is never logged. Waits (the hub
coming up, a server stopping) poll with ``jupyterhub.utils.exponential_backoff``.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from jupyterhub.utils import exponential_backoff, url_path_join
from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

HTTP_CLIENT_TIMEOUT = 599
"""The code tornado's HTTP client gives a call that timed out (``HTTPTimeoutError``)."""
PAGINATION = "application/jupyterhub-pagination+json"
PAGE = 200
"""Users per page asked for (JupyterHub's default ``api_page_max_limit``)."""


class HubUnreadable(Exception):
    """JupyterHub's REST API could not be read (unreachable, refused, or an unexpected reply)."""


def server_path(user: str, name: str = "") -> str:
    """The REST API path of ``user``'s server ``name`` (relative to ``api_url``)."""
    if name:
        return str(url_path_join("users", quote(user, safe=""), "servers", quote(name, safe="")))
    return str(url_path_join("users", quote(user, safe=""), "server"))


def reply_message(error: HTTPClientError) -> str:
    """The error and JupyterHub's ``message`` from its reply's JSON, when there is one."""
    body = error.response.body if error.response is not None else b""
    try:
        message = json.loads(body or b"{}").get("message", "")
    except (ValueError, AttributeError):
        message = ""
    return f"{error} {message}".strip()


class HubAPI:
    """JupyterHub's REST API at ``api_url``, called with ``token`` (see the module docstring)."""

    def __init__(self, api_url: str, token: str, timeout: float = 10.0) -> None:
        self.api_url = api_url.rstrip("/")
        self.token = token
        self.timeout = timeout

    def url(self, *path: str) -> str:
        """``api_url`` joined with ``path`` (``url("users", "ada")``)."""
        return str(url_path_join(self.api_url, *path))

    async def call(
        self, method: str, url: str, body: Any = None, accept: str = "application/json"
    ) -> Any:
        """One call to ``url`` (the REST API, or a server through the proxy) with the token; the
        reply's JSON, or ``None`` for an empty reply. A ``POST`` always sends a JSON body."""
        request = HTTPRequest(
            url,
            method=method,
            headers={
                "Authorization": f"token {self.token}",
                "Content-Type": "application/json",
                "Accept": accept,
            },
            body=None if body is None and method != "POST" else json.dumps(body or {}),
            request_timeout=self.timeout,
            follow_redirects=False,
        )
        response = await AsyncHTTPClient().fetch(request)
        return json.loads(response.body) if response.body else None

    # -- the hub ---------------------------------------------------------------------------------
    async def is_up(self) -> bool:
        """Whether the REST API answers at its root (which needs no token)."""
        try:
            await self.call("GET", self.url("/"))
        except (HTTPClientError, OSError, ValueError):
            return False
        return True

    async def wait_up(self, max_wait: float = 1.0) -> None:
        """Return once the REST API answers, however long that takes."""
        while True:
            try:
                await exponential_backoff(self.is_up, "", max_wait=max_wait, timeout=60)
                return
            except TimeoutError:
                continue

    # -- users and their servers -------------------------------------------------------------------
    async def user(self, name: str) -> dict[str, Any] | None:
        """``name``'s user model, or ``None`` when the hub has no such user (404)."""
        try:
            model = await self.call("GET", self.url("users", quote(name, safe="")))
        except HTTPClientError as e:
            if e.code == 404:
                return None
            raise
        return model if isinstance(model, dict) else None

    async def server(self, user: str, name: str = "") -> dict[str, Any] | None:
        """The model of ``user``'s server ``name``, or ``None`` when the hub records none."""
        model = await self.user(user)
        servers = model.get("servers") if model is not None else None
        server = servers.get(name) if isinstance(servers, dict) else None
        return server if isinstance(server, dict) else None

    async def has_server(self, user: str, name: str = "") -> bool:
        return await self.server(user, name) is not None

    async def stop_server(self, user: str, name: str = "") -> bool:
        """Ask the hub to stop the server; ``False`` when its reply was slow."""
        return await self._slow_ok("DELETE", self.url(server_path(user, name)))

    async def start_server(self, user: str, name: str = "", options: Any = None) -> bool:
        """Ask the hub to start the server with ``options`` (the spawn form's fields); ``False``
        when its reply was slow."""
        return await self._slow_ok("POST", self.url(server_path(user, name)), options or {})

    async def wait_stopped(self, user: str, name: str = "", timeout: float = 120.0) -> None:
        """Return once the hub records no server ``name`` of ``user``; ``TimeoutError`` after
        ``timeout`` seconds."""

        async def stopped() -> bool:
            return not await self.has_server(user, name)

        message = f"server {user}/{name} did not stop within {timeout:.0f} s"
        await exponential_backoff(stopped, message, max_wait=2, timeout=timeout)

    async def active_users(self) -> list[dict[str, Any]]:
        """Every user with an active server (started, starting or stopping), as the REST API
        models them: ``GET users?state=active``, page by page (a hub that does not page answers
        one list). :class:`HubUnreadable` if any page cannot be read."""
        users: list[dict[str, Any]] = []
        offset = 0
        while True:
            url = self.url("users") + f"?state=active&offset={offset}&limit={PAGE}"
            try:
                reply = await self.call("GET", url, accept=PAGINATION)
            except (HTTPClientError, OSError, ValueError) as e:
                raise HubUnreadable(f"GET {url}: {e}") from e
            if isinstance(reply, list):  # a hub that does not page
                items, following = reply, None
            elif isinstance(reply, dict) and isinstance(reply.get("items"), list):
                items = reply["items"]
                following = (reply.get("_pagination") or {}).get("next")
            else:
                raise HubUnreadable(f"GET {url}: not a list of users")
            users += [u for u in items if isinstance(u, dict)]
            if not following:
                return users
            after = following.get("offset") if isinstance(following, dict) else None
            if not isinstance(after, int) or after <= offset:
                raise HubUnreadable(f"GET {url}: the next page is at offset {after!r}")
            offset = after

    async def _slow_ok(self, method: str, url: str, body: Any = None) -> bool:
        try:
            await self.call(method, url, body)
        except HTTPClientError as e:
            if e.code != HTTP_CLIENT_TIMEOUT:
                raise
            return False
        return True
