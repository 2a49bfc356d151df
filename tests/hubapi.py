"""JupyterHub as gpupool's services see it, for tests without a hub process: a JupyterHub
database made by JupyterHub's own ORM (:class:`HubDB`), and its REST API with the proxy's routes
to servers' kernels (:class:`FakeHub`), answering in JupyterHub's model shapes from that database.
:class:`HubStandIns` is the two together, for a test's setting to build on. The real hub is
``tests/hub/conftest.py``'s ``Hub``.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self
from urllib.parse import parse_qs, unquote, urlparse

from jupyterhub import orm

from gpupool.hub.compat import HAS_DISPLAY_NAMES, JUPYTERHUB_VERSION

TOKEN = "gpupool-test-service-token"
PAGINATION = "application/jupyterhub-pagination+json"


class HubDB:
    """A JupyterHub database made by JupyterHub's own ORM."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.url = f"sqlite:///{path}"
        self.db = orm.new_session_factory(self.url)()

    def server(
        self,
        user: str,
        groups: tuple[str, ...] = (),
        state: dict[str, Any] | None = None,
        name: str = "",
        running: bool = True,
    ) -> None:
        """``user``'s spawner ``name`` with ``state``: with a server record when ``running``."""
        u = self.db.query(orm.User).filter_by(name=user).first()
        if u is None:
            u = orm.User(name=user)
            self.db.add(u)
        for team in groups:
            group = self.db.query(orm.Group).filter_by(name=team).first() or orm.Group(name=team)
            if group not in u.groups:
                u.groups.append(group)
        spawner = orm.Spawner(user=u, name=name)
        if running:
            spawner.server = orm.Server(base_url=f"/user/{user}/{name}")
        spawner.state = state or {}
        self.db.add(spawner)
        self.db.commit()

    def close(self) -> None:
        self.db.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FakeHub:
    """JupyterHub's REST API (``/hub/api``) and its proxy's routes to servers' kernels, as far as
    gpupool reads them, answered from a JupyterHub database in JupyterHub's model shapes.

    Knobs: ``status`` (answer every call with it: a failing hub), ``body`` (answer every call
    with these bytes), ``page`` (the most users per page), ``pending`` (``"user/name"`` ->
    pending event of that server), ``with_state`` (whether the token holds
    ``admin:server_state``), ``kernels`` (server URL path -> the kernels reply, or a status).
    ``calls`` lists ``(method, path)`` of every call with the right token."""

    def __init__(self, db_url: str, token: str = TOKEN, page: int = 200) -> None:
        self.db = orm.new_session_factory(db_url)
        self.token = token
        self.page = page
        self.status: int | None = None
        self.body: bytes | None = None
        self.pending: dict[str, str] = {}
        self.with_state = True
        self.kernels: dict[str, Any] = {}
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.api_url = f"{self.url}/hub/api"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- JupyterHub's models ---------------------------------------------------------------------
    def server_model(self, user: orm.User, spawner: orm.Spawner) -> dict[str, Any]:
        ref = f"{user.name}/{spawner.name}"
        pending = self.pending.get(ref)
        url = f"/user/{user.name}/" + (f"{spawner.name}/" if spawner.name else "")
        model: dict[str, Any] = {
            "name": spawner.name,
            **({"display_name": spawner.display_name} if HAS_DISPLAY_NAMES else {}),
            "full_name": ref,
            "last_activity": None,
            "started": None,
            "pending": pending,
            "ready": pending is None,
            "stopped": False,
            "url": url,
            "user_options": {},
            "progress_url": f"/hub/api/users/{user.name}/servers/{spawner.name}/progress",
            "full_url": None,
            "full_progress_url": None,
        }
        if self.with_state:
            model["state"] = spawner.state
        return model

    def user_model(self, user: orm.User) -> dict[str, Any]:
        servers = {
            s.name: self.server_model(user, s) for s in user._orm_spawners if s.server is not None
        }
        return {
            "kind": "user",
            "name": user.name,
            "admin": False,
            "roles": ["user"],
            "groups": [g.name for g in user.groups],
            "server": f"/user/{user.name}/" if "" in servers else None,
            "pending": None,
            "created": "2026-01-01T00:00:00.000000Z",
            "last_activity": None,
            "servers": servers,
        }

    def users(self, query: dict[str, list[str]], paged: bool) -> Any:
        offset = int(query.get("offset", ["0"])[0])
        limit = min(int(query.get("limit", [str(self.page)])[0]), self.page)
        with self._lock:
            db = self.db()
            try:
                found = db.query(orm.User).order_by(orm.User.id).all()
                if query.get("state") == ["active"]:
                    found = [u for u in found if any(s.server for s in u._orm_spawners)]
                items = [self.user_model(u) for u in found[offset : offset + limit]]
            finally:
                db.close()
        if not paged:
            return items
        following = offset + limit
        more = {"offset": following, "limit": limit, "url": "..."}
        pagination: dict[str, Any] = {"offset": offset, "limit": limit, "total": len(found)}
        pagination["next"] = more if following < len(found) else None
        return {"items": items, "_pagination": pagination}

    def user(self, name: str) -> Any:
        with self._lock:
            db = self.db()
            try:
                found = db.query(orm.User).filter_by(name=name).first()
                return None if found is None else self.user_model(found)
            finally:
                db.close()

    def set_running(self, user: str, name: str, running: bool) -> None:
        """Give ``user``'s server ``name`` a server record (started) or take it away (stopped)."""
        with self._lock:
            db = self.db()
            try:
                found = db.query(orm.User).filter_by(name=user).first()
                spawner = None
                if found is not None:
                    spawner = next((s for s in found._orm_spawners if s.name == name), None)
                if spawner is None and running and found is not None:
                    spawner = orm.Spawner(user=found, name=name)
                    db.add(spawner)
                if spawner is not None and running and spawner.server is None:
                    spawner.server = orm.Server(base_url=f"/user/{user}/{name}")
                elif spawner is not None and not running and spawner.server is not None:
                    db.delete(spawner.server)
                    spawner.server = None
                db.commit()
            finally:
                db.close()

    # -- HTTP --------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def reply(self, status: int, body: Any = None) -> None:
                data = hub.body if hub.body is not None else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data) if status != 204 else 0))
                self.end_headers()
                if status != 204:
                    self.wfile.write(data)

            def answer(self, method: str) -> None:
                url = urlparse(self.path)
                path = unquote(url.path)
                if hub.status is not None:
                    return self.reply(hub.status, {"status": hub.status, "message": "down"})
                if path == "/hub/api/":
                    return self.reply(200, {"version": JUPYTERHUB_VERSION})
                if self.headers.get("Authorization") != f"token {hub.token}":
                    return self.reply(403, {"status": 403, "message": "Forbidden"})
                hub.calls.append((method, path))
                parts = path.strip("/").split("/")
                if method == "GET" and path == "/hub/api/users":
                    paged = PAGINATION in self.headers.get("Accept", "")
                    return self.reply(200, hub.users(parse_qs(url.query), paged))
                if method == "GET" and parts[:3] == ["hub", "api", "users"] and len(parts) == 4:
                    found = hub.user(parts[3])
                    return self.reply(404 if found is None else 200, found)
                if parts[:3] == ["hub", "api", "users"] and method in ("DELETE", "POST"):
                    # jupyterhub/apihandlers/users.py, UserServerAPIHandler: DELETE stops the
                    # server and answers 204 once it has stopped (its record is gone from the
                    # user's model; 204 also when it was not running); POST starts it and
                    # answers 201 once it is up (the record is there).
                    name = parts[5] if parts[4:5] == ["servers"] and len(parts) > 5 else ""
                    hub.set_running(parts[3], name, running=method == "POST")
                    return self.reply(204 if method == "DELETE" else 201)
                if method == "GET" and path.endswith("/api/kernels"):
                    kernels = hub.kernels.get(path[: -len("api/kernels")], [])
                    if isinstance(kernels, int):
                        return self.reply(kernels, {"message": "no"})
                    return self.reply(200, kernels)
                return self.reply(404, {"status": 404})

            def do_GET(self) -> None:
                self.answer("GET")

            def do_DELETE(self) -> None:
                self.answer("DELETE")

            def do_POST(self) -> None:
                self.answer("POST")

        return Handler


class HubStandIns:
    """JupyterHub's database and REST API for one test (under ``tmp``); a context manager that
    closes both. A test's setting subclasses it and adds the pool and what it tests."""

    def __init__(self, tmp: Path) -> None:
        self.hubdb = HubDB(tmp / "jupyterhub.sqlite")
        self.api = FakeHub(self.hubdb.url)

    def close(self) -> None:
        self.api.close()
        self.hubdb.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()
