"""A real JupyterHub (with configurable-http-proxy and real JupyterLab servers) for the hub tests.

The hub runs the repository's own ``jupyterhub_config.py`` as a subprocess, on free ports, with
its state in a temporary directory and the users' homes in another (owned by the account that
runs user code: ``gpupool-demo`` when the tests run as root, see :mod:`tests.accounts`); a small
extra config adds a test service with the admin role (to read server state and drive the REST
API) and a short poll interval. Waiting is always for a condition with a deadline, never a bare
sleep. Below the hub: what several test modules here do with it (spawn and stop servers, submit
and follow jobs, read processes and metrics).
"""

from __future__ import annotations

import contextlib
import html
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gpupool.core.ledger import Allocation
from gpupool.store import Store
from tests.accounts import RUNTIME_PYTHON, as_account, homes

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "demo-pass-for-tests"
TOKEN = "gpupool-test-service-token-0123456789"
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], T], timeout: float = 60, what: str = "condition") -> T:
    """Poll ``condition`` until it returns something truthy, or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


def demo_config(in_same_config: bool) -> str:
    """Config text that runs the demo's ``jupyterhub_config.py``: as a subconfig (its own fresh
    ``c``, merged afterwards), or in this file's ``c`` so that what was set before it is what its
    ``setup(c)`` sees. The demo's text is written into the config, not read from the checkout:
    a hub run as another account (:func:`exits`) may not be able to enter the checkout."""
    path = str(ROOT / "jupyterhub_config.py")
    code = f"compile({Path(path).read_text()!r}, {path!r}, 'exec')"
    if in_same_config:
        return f"exec({code}, dict(globals(), __file__={path!r}))\n"
    return (
        "from traitlets.config import Config as _Config\n"
        "_demo = _Config()\n"
        f"exec({code}, dict(globals(), c=_demo, get_config=lambda: _demo, __file__={path!r}))\n"
        "c.merge(_demo)\n"
    )


class Hub:
    """One hub process and the helpers tests use against it."""

    def __init__(
        self, state: Path, home_root: Path, extra_config: str = "", prelude: str = ""
    ) -> None:
        """``prelude``: config set before the demo's runs (what its ``setup(c)`` must see);
        ``extra_config``: config read after it."""
        self.state = state
        self.homes = home_root
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "GPUPOOL_STATE_DIR": str(state),
            "GPUPOOL_PORT": str(self.port),
            "GPUPOOL_HUB_PORT": str(free_port()),
            "GPUPOOL_PROXY_API_PORT": str(free_port()),
            "GPUPOOL_DEMO_PASSWORD": PASSWORD,
            "GPUPOOL_HOMES": str(home_root),
            "GPUPOOL_INVENTORY": "nvml",  # no driver here: the simulated fallback
        }
        self.config = state / "test_config.py"
        self.config.write_text(
            prelude
            + demo_config(in_same_config=bool(prelude))
            + "c.JupyterHub.services = [*c.JupyterHub.services,"
            f" {{'name': 'tester', 'api_token': {TOKEN!r}}}]\n"
            "c.JupyterHub.load_roles = [*c.JupyterHub.load_roles,"
            " {'name': 'admin', 'services': ['tester']}]\n"
            "c.JupyterHub.cleanup_servers = False\n"
            "c.Spawner.poll_interval = 1\n" + extra_config
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = state / "hub.log"

    # -- process -----------------------------------------------------------------------------
    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterhub", "-f", str(self.config)],
                cwd=self.state,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(self._up, 90, "the hub to answer")

    def _up(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"hub exited {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return requests.get(f"{self.url}/hub/api", timeout=2).ok
        except requests.ConnectionError:
            return False

    def stop_hub(self) -> None:
        """Stop the hub (and its proxy); single-user servers keep running (cleanup_servers off)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    # -- REST API as the admin service -----------------------------------------------------------
    def api(self, method: str, path: str, **kw: Any) -> requests.Response:
        headers = {"Authorization": f"token {TOKEN}"}
        return requests.request(
            method, f"{self.url}/hub/api{path}", headers=headers, timeout=30, **kw
        )

    def token(self, user: str, scopes: list[str] | None = None) -> str:
        """A fresh API token of ``user`` (by default with the gpupool jobs scope)."""
        body = {"scopes": scopes or ["custom:gpupool:jobs"], "note": "test"}
        r = self.api("POST", f"/users/{user}/tokens", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["token"])

    def as_user(self, token: str, method: str, path: str, **kw: Any) -> requests.Response:
        """A call to ``/hub/api/gpupool{path}`` with a user's token."""
        headers = {"Authorization": f"token {token}"}
        url = f"{self.url}/hub/api/gpupool{path}"
        return requests.request(method, url, headers=headers, timeout=60, **kw)

    def server(self, user: str) -> dict[str, Any] | None:
        model = self.api("GET", f"/users/{user}").json()
        server: dict[str, Any] | None = model.get("servers", {}).get("")
        return server

    def wait_ready(self, user: str, timeout: float = 120) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            s = self.server(user)
            return s if s and s.get("ready") else None

        return wait_for(ready, timeout, f"{user}'s server to be ready")

    def wait_stopped(self, user: str, timeout: float = 60) -> None:
        wait_for(lambda: self.server(user) is None, timeout, f"{user}'s server to be gone")

    def stop_server(self, user: str) -> None:
        r = self.api("DELETE", f"/users/{user}/server")
        assert r.status_code in (202, 204), r.text
        self.wait_stopped(user)

    def pid(self, user: str) -> int:
        server = self.server(user)
        assert server, f"{user} has no server"
        return int(server["state"]["pid"])

    # -- the browser's path: log in, post the spawn form ----------------------------------------
    def login(self, user: str, password: str = PASSWORD) -> requests.Session:
        """A browser-like session logged in as ``user`` (the demo password by default; the
        admin's is in the state dir)."""
        s = requests.Session()
        s.get(f"{self.url}/hub/login", timeout=30)
        r = s.post(
            f"{self.url}/hub/login",
            data={"username": user, "password": password, "_xsrf": s.cookies.get("_xsrf")},
            timeout=30,
            allow_redirects=False,
        )
        assert r.status_code == 302, f"login of {user} failed: {r.status_code}"
        return s

    def spawn_form(self, user: str, choice: str) -> requests.Response:
        s = self.login(user)
        s.get(f"{self.url}/hub/home", timeout=30)  # for the _xsrf cookie (/hub/spawn may start)
        return s.post(
            f"{self.url}/hub/spawn",
            data={"gpupool_choice": choice, "_xsrf": xsrf(s, "/hub/spawn")},
            timeout=60,
            allow_redirects=False,
        )

    # -- the pool's own record -------------------------------------------------------------------
    def allocations(self) -> dict[str, Allocation]:
        """The persisted ledger, read from the pool's database (what a restart would restore)."""
        store = Store(f"sqlite:///{self.state / 'gpupool.sqlite'}", upgrade=False)
        try:
            return {a.ref: a for a in store.load()}
        finally:
            store.close()


def refusal(response: requests.Response) -> str:
    """The message JupyterHub shows above the spawn form."""
    text = response.content.decode("utf-8")
    m = re.search(r'class="spawn-error-msg[^"]*">\s*Error: (.*?)\s*</p>', text, re.S)
    assert m, f"no error message on the page (status {response.status_code})"
    return html.unescape(re.sub(r"\s+", " ", m.group(1)))


@contextmanager
def running(hub: Hub) -> Iterator[Hub]:
    """Start ``hub``; stop it and every server it started at the end."""
    hub.start()
    try:
        yield hub
    finally:
        hub.stop_hub()
        kill_servers(hub)


def exits(hub: Hub, user: str = "", timeout: float = 90) -> int:
    """Start ``hub`` (as the account ``user``, from the runtime; default: this account) and
    wait for it to exit; a hub that comes up instead is stopped and the test fails."""
    env = {**hub.env, "HOME": str(hub.state)}
    with hub.log.open("ab") as log:
        proc = subprocess.Popen(
            [RUNTIME_PYTHON if user else sys.executable, "-m", "jupyterhub", "-f", str(hub.config)],
            cwd=hub.state,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            **as_account(user),
        )
    hub.proc = proc
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        try:
            up = requests.get(f"{hub.url}/hub/api", timeout=2).ok
        except requests.ConnectionError:
            up = False
        if up or time.monotonic() > deadline:
            hub.stop_hub()
            pytest.fail(f"the hub started (or hung) instead of stopping:\n{hub.log_tail()}")
        time.sleep(0.2)
    return proc.returncode


def last_line(hub: Hub) -> str:
    lines = [line for line in hub.log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1]


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with homes() as home_root, running(Hub(tmp_path_factory.mktemp("hub"), home_root)) as h:
        yield h


def xsrf(session: requests.Session, path: str) -> str | None:
    """The ``_xsrf`` cookie a browser would send to ``path`` (pages may set one per path)."""
    sent = [c for c in session.cookies if c.name == "_xsrf" and path.startswith(c.path or "/")]
    return max(sent, key=lambda c: len(c.path or "")).value if sent else None


def kill_servers(hub: Hub) -> None:
    """End every process this hub started for its users, servers and job ranks alike (found by
    their homes), also those a failed test left running."""
    mine = f"HOME={hub.homes}/".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if any(item.startswith(mine) for item in environ.split(b"\0")):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


# -- servers: spawn through the form, stop, read a server's processes ----------------------------
def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


def spawn(hub: Hub, user: str, choice: str) -> None:
    r = hub.spawn_form(user, choice)
    assert r.status_code == 302, (
        f"spawn of {user} ({choice}) failed {r.status_code}: {r.text[-600:]}"
    )
    hub.wait_ready(user)


def stop_all(hub: Hub, *users: str) -> None:
    for user in users:
        if hub.server(user):
            hub.stop_server(user)


# -- jobs through the REST API, checked against the OpenAPI document -----------------------------
OPENAPI = yaml.safe_load((ROOT / "hub/gpupool/hub/openapi.yaml").read_text())
FINAL = {"succeeded", "failed", "cancelled", "lost"}


def schema(name: str, value: Any) -> None:
    """``value`` is valid against ``#/components/schemas/<name>`` of the OpenAPI document."""
    resolver_doc = {"components": OPENAPI["components"], "$ref": f"#/components/schemas/{name}"}
    jsonschema.validate(value, resolver_doc)


def submit(hub: Hub, token: str, script: str, **fields: Any) -> dict[str, Any]:
    r = hub.as_user(token, "POST", "/jobs", json={"script": script, **fields})
    assert r.status_code == 201, r.text
    schema("Job", r.json())
    return dict(r.json())


def wait_job(hub: Hub, token: str, job_id: str, states: set[str], timeout: float = 120) -> Any:
    def reached() -> Any:
        job = hub.as_user(token, "GET", f"/jobs/{job_id}").json()
        return job if job["state"] in states else None

    return wait_for(reached, timeout, f"job {job_id} to reach {states}")


def log(hub: Hub, token: str, job_id: str, rank: int) -> str:
    r = hub.as_user(token, "GET", f"/jobs/{job_id}/logs", params={"rank": rank})
    assert r.status_code == 200, r.text
    return r.text


def job_processes(job_id: str) -> list[int]:
    """Live processes of a job (found by the GPUPOOL_JOB variable in their environment)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                env = (entry / "environ").read_bytes()
            except OSError:
                continue
            if f"GPUPOOL_JOB={job_id}".encode() in env.split(b"\0"):
                found.append(int(entry.name))
    return found


# -- /hub/metrics, parsed with prometheus_client's own parser ------------------------------------
def scrape(hub: Hub) -> dict[str, list[Sample]]:
    r = requests.get(
        f"{hub.url}/hub/metrics", headers={"Authorization": f"token {TOKEN}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    out: dict[str, list[Sample]] = defaultdict(list)
    for family in text_string_to_metric_families(r.text):
        if family.name.startswith("gpupool_"):
            out[family.name] += family.samples
    return out


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [s.value for s in samples if s.name == name and s.labels == labels]
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]
