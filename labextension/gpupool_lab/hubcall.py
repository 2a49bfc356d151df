"""How the server extension's handlers call the hub, and answer when that fails.

Vocabulary and contract:

- :class:`Reply`: any answer of ours other than success, an HTTP status and a message for the
  user, as is; the handlers write it as ``{"message": <text>}``.
- :func:`hub` ``(call)``: ``call(client)`` with a fresh :class:`gpupool_lab.client.Client` (the
  server's own ``JUPYTERHUB_API_URL`` and ``JUPYTERHUB_API_TOKEN``: zero configuration), in a
  worker thread so the server's event loop never waits on the hub; e.g.
  ``await hub(Client.offers)`` or ``await hub(lambda c: c.job(job_id))``.
- Failures become Replies: an error from the hub keeps the hub's status and message word for
  word; a hub that cannot be reached is 502; a server outside JupyterHub (no hub URL/token) 503.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import tornado.web

from gpupool_lab.client import Client, ClientError, HubError, NotConfigured

__all__ = ["HUB_TIMEOUT", "Reply", "call_hub", "hub"]

#: seconds a call waits for the hub unless told otherwise
HUB_TIMEOUT = 30.0

T = TypeVar("T")


class Reply(tornado.web.HTTPError):
    """An answer other than success: an HTTP status and a message for the user, as is.

    An :class:`~tornado.web.HTTPError` without a log message (tornado would %-format it), so
    tornado sends it as an error reply; the handlers' ``write_error`` writes the body.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(status)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"HTTP {self.status}: {self.message}"


def call_hub(call: Callable[[Client], T], timeout: float = HUB_TIMEOUT) -> T:
    """``call(client)`` with a fresh client, blocking; ClientErrors become :class:`Reply`."""
    try:
        client = Client(timeout=timeout)
    except NotConfigured as exc:
        raise Reply(503, str(exc)) from exc
    try:
        return call(client)
    except HubError as exc:
        raise Reply(exc.status, exc.message) from exc
    except ClientError as exc:  # HubUnreachable: no HTTP answer at all
        raise Reply(502, str(exc)) from exc
    finally:
        client.session.close()


async def hub(call: Callable[[Client], T], *, timeout: float = HUB_TIMEOUT) -> T:
    """:func:`call_hub` in a worker thread, so the event loop goes on meanwhile."""
    return await asyncio.to_thread(call_hub, call, timeout)
