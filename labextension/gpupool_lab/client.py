"""The one client of the hub's gpupool REST API (for the CLI, the widget and the server extension).

Zero configuration inside a JupyterHub single-user server: the hub API URL comes from
``JUPYTERHUB_API_URL`` (e.g. ``http://127.0.0.1:8081/hub/api``), the token from
``JUPYTERHUB_API_TOKEN`` and the user name from ``JUPYTERHUB_USER``; arguments override them. A
``url`` given by hand may also be the hub's address (``https://hub.example.org`` or
``…/hub``): ``/hub/api`` is appended as needed. Requests go to ``<hub api>/gpupool/<path>`` with
``Authorization: token <token>``.

Contract with the hub (resources under ``/hub/api/gpupool/``):

- ``GET offers``, ``GET teams``: JSON objects, returned as they come.
- ``GET allocations`` → ``{"allocations": [...]}``: the caller's own allocations (notebooks and
  jobs); a GPU notebook's has ``idle``, what the idle reclaimer knows (``idle_since``,
  ``action``, ``warning``: ``null`` or ``{"reclaim_at", "action", "message"}``).
- ``POST jobs`` (JSON body; only the fields given are sent) → 201 and a job; ``GET
  jobs?limit=&cursor=`` → ``{"jobs": [...], "next": <cursor> | null}``, a page newest first
  (:meth:`Client.jobs` follows ``next`` to the last page); ``GET jobs/<id>`` → a job;
  ``DELETE jobs/<id>`` → the cancelled job.
- ``GET jobs/<id>/logs?rank=R&offset=N`` → ``text/plain`` bytes from byte offset N, with headers
  ``X-Gpupool-Log-Size`` and ``X-Gpupool-Job-State``; ``&follow=1`` streams (chunked) until the
  job has ended.
- Any non-2xx answer raises :class:`HubError` ``(status, message)``, where ``message`` is the
  hub's ``{"status", "message"}`` body's message word for word (or, for a body that is not
  JSON, ``HTTP <status> <reason>``). A hub that cannot be reached raises
  :class:`HubUnreachable`; missing URL or token raises :class:`NotConfigured`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import requests

__all__ = [
    "TERMINAL_STATES",
    "Client",
    "ClientError",
    "HubError",
    "HubUnreachable",
    "NotConfigured",
    "hub_api_url",
]

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "lost"})
PAGE = 200
"""Jobs asked for per page when :meth:`Client.jobs` pages through them (the hub's most: 500)."""
LOG_SIZE_HEADER = "X-Gpupool-Log-Size"
JOB_STATE_HEADER = "X-Gpupool-Job-State"

Job = dict[str, Any]


class ClientError(Exception):
    """Base of everything this client raises on purpose."""


class HubError(ClientError):
    """The hub answered with an error; ``message`` is the hub's own text, word for word."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return self.message


class HubUnreachable(ClientError):
    """No HTTP answer at all (connection refused, DNS, timeout)."""


class NotConfigured(ClientError):
    """Neither the environment of a single-user server nor arguments give a URL and a token."""


def hub_api_url(url: str) -> str:
    """Normalise a hub address to its API root: ``…/hub/api`` (no trailing slash)."""
    parts = urlsplit(url.strip())
    path = parts.path.rstrip("/")
    if path.endswith("/hub/api"):
        pass
    elif path.endswith("/hub"):
        path += "/api"
    else:
        path += "/hub/api"
    return urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class Client:
    """A session with the hub's gpupool API; see the module docstring for the contract."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        user: str | None = None,
        *,
        timeout: float = 30.0,
        session: requests.Session | None = None,
    ) -> None:
        url = url or os.environ.get("JUPYTERHUB_API_URL")
        token = token or os.environ.get("JUPYTERHUB_API_TOKEN")
        if not url or not token:
            missing = " and ".join(
                what for what, value in (("hub URL", url), ("API token", token)) if not value
            )
            raise NotConfigured(
                f"no {missing}: not inside a JupyterHub single-user server "
                "(JUPYTERHUB_API_URL and JUPYTERHUB_API_TOKEN are not set) and none given"
            )
        self.api_url = hub_api_url(url)
        self.base_url = self.api_url + "/gpupool/"
        self.user = user or os.environ.get("JUPYTERHUB_USER")
        self.timeout = timeout
        self.session = session or requests.Session()
        self.session.headers["Authorization"] = f"token {token}"

    def __repr__(self) -> str:
        return f"Client({self.api_url!r}, user={self.user!r})"

    # -- HTTP -------------------------------------------------------------------------------------

    def _request(
        self,
        method: str,
        path: str,
        *,
        stream: bool = False,
        **kwargs: Any,
    ) -> requests.Response:
        url = self.base_url + path
        timeout = (self.timeout, None) if stream else self.timeout
        try:
            response = self.session.request(method, url, timeout=timeout, stream=stream, **kwargs)
        except requests.ConnectionError as exc:
            raise HubUnreachable(f"cannot reach the hub at {self.api_url}: {exc}") from exc
        except requests.Timeout as exc:
            raise HubUnreachable(f"the hub at {self.api_url} did not answer: {exc}") from exc
        if not response.ok:
            try:
                raise _hub_error(response)
            finally:
                response.close()
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        try:
            return response.json()
        except ValueError as exc:
            raise HubError(
                response.status_code, f"the hub sent a body that is not JSON for {path}"
            ) from exc

    # -- resources --------------------------------------------------------------------------------

    def offers(self) -> dict[str, Any]:
        """What the user may request now, per team: ``{"simulated", "inventory", "teams"}``."""
        return dict(self._json("GET", "offers"))

    def teams(self) -> list[dict[str, Any]]:
        """The teams' quotas and usage (``GET teams``' ``teams`` list)."""
        return list(self._json("GET", "teams")["teams"])

    def allocations(self) -> list[dict[str, Any]]:
        """The user's allocations, with idle warnings (``GET allocations``' ``allocations``)."""
        return list(self._json("GET", "allocations")["allocations"])

    def submit(
        self,
        script: str,
        *,
        name: str | None = None,
        filename: str | None = None,
        workdir: str | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        offer: str | None = None,
        gpus: int = 1,
        nodes: int | None = None,
        team: str | None = None,
        time_limit: int | None = None,
        max_restarts: int | None = None,
        priority: int | None = None,
    ) -> Job:
        """Queue ``script`` (Python source) as a torchrun job; returns the new job."""
        body: dict[str, Any] = {"script": script, "gpus": gpus}
        optional = {
            "name": name,
            "filename": filename,
            "workdir": workdir,
            "args": args,
            "env": env,
            "offer": offer,
            "nodes": nodes,
            "team": team,
            "time_limit": time_limit,
            "max_restarts": max_restarts,
            "priority": priority,
        }
        body.update({key: value for key, value in optional.items() if value is not None})
        return dict(self._json("POST", "jobs", json=body))

    def jobs(self, limit: int | None = None) -> list[Job]:
        """The user's jobs (an admin gets everyone's), newest first, page by page to the last
        one (or to the newest ``limit``)."""
        jobs: list[Job] = []
        cursor = None
        while limit is None or len(jobs) < limit:
            want = PAGE if limit is None else min(PAGE, limit - len(jobs))
            page, cursor = self.jobs_page(want, cursor)
            jobs += page
            if cursor is None:
                break
        return jobs

    def jobs_page(
        self, limit: int | str | None = None, cursor: str | None = None
    ) -> tuple[list[Job], str | None]:
        """One page of ``GET jobs`` (newest first; the hub's default size without ``limit``),
        after the page whose ``next`` is ``cursor``, and this page's ``next`` (``None``: the
        last page)."""
        params: dict[str, Any] = {}
        if limit is not None:
            params["limit"] = limit
        if cursor:
            params["cursor"] = cursor
        reply = self._json("GET", "jobs", params=params)
        after = reply.get("next")
        return list(reply["jobs"]), after if isinstance(after, str) and after else None

    def job(self, job_id: str | int) -> Job:
        return dict(self._json("GET", f"jobs/{_segment(job_id)}"))

    def cancel(self, job_id: str | int) -> Job:
        """Cancel a queued or running job; returns the job as it is now."""
        return dict(self._json("DELETE", f"jobs/{_segment(job_id)}"))

    def logs(self, job_id: str | int, rank: int = 0, offset: int = 0) -> tuple[bytes, int, str]:
        """``(bytes from offset, log size now, job state)`` for one rank's log."""
        params = {"rank": rank, "offset": offset}
        response = self._request("GET", f"jobs/{_segment(job_id)}/logs", params=params)
        return response.content, _log_size(response, offset), _job_state(response)

    def follow_logs(
        self, job_id: str | int, rank: int = 0, offset: int = 0, *, poll: float = 1.0
    ) -> Iterator[bytes]:
        """Yield one rank's log as it grows, from ``offset``, until the job has ended.

        A stream that breaks off before the job has ended (a proxy's idle timeout, a hub
        restart) is resumed from the last byte received.
        """
        path = f"jobs/{_segment(job_id)}/logs"
        while True:
            params = {"rank": rank, "offset": offset, "follow": 1}
            with self._request("GET", path, params=params, stream=True) as response:
                try:
                    for chunk in response.iter_content(chunk_size=None):
                        if chunk:
                            offset += len(chunk)
                            yield chunk
                except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError):
                    pass  # resumed below from the last byte received
            rest, _, state = self.logs(job_id, rank, offset)
            if rest:
                offset += len(rest)
                yield rest
            if state in TERMINAL_STATES:
                return
            time.sleep(poll)

    def wait(self, job_id: str | int, poll: float = 2.0, timeout: float | None = None) -> Job:
        """Poll until the job has ended; returns it. Raises ``TimeoutError`` after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("state") in TERMINAL_STATES:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"job {job_id} is still {job.get('state')} after {timeout:g} seconds"
                )
            time.sleep(poll if deadline is None else min(poll, max(deadline - time.monotonic(), 0)))


def _segment(job_id: str | int) -> str:
    return quote(str(job_id), safe="")


def _hub_error(response: requests.Response) -> HubError:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return HubError(response.status_code, body["message"])
    return HubError(response.status_code, f"HTTP {response.status_code} {response.reason}")


def _log_size(response: requests.Response, offset: int) -> int:
    value = response.headers.get(LOG_SIZE_HEADER, "")
    return int(value) if value.isdigit() else offset + len(response.content)


def _job_state(response: requests.Response) -> str:
    return response.headers.get(JOB_STATE_HEADER, "")
