"""The hub API client and the ``gpupool`` command against a stand-in hub over real HTTP.

``FakeHub`` serves the gpupool REST contract under ``/hub/api/gpupool/`` as the hub does:
token auth (``Authorization: token …``), JupyterHub's JSON error bodies ``{"status", "message"}``
with the matching status codes, 201 on submit, users seeing only their own jobs (an admin all)
and their own allocations (``?all=1``: an admin everyone's; the idle reclaimer's ``idle``, set
by tests),
strict request validation (unknown fields refused, so contract drift shows), and log reads with
``X-Gpupool-Log-Size``/``X-Gpupool-Job-State`` headers and a chunked ``follow=1`` stream that ends
when the job has ended. Tests drive job progress (log output, finishing) from the test thread.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from gpupool_lab import cli
from gpupool_lab.client import Client, HubError, HubUnreachable, NotConfigured, hub_api_url

TOKENS = {"alice-token": "alice", "admin-token": "admin"}
ADMINS = {"admin"}
TERMINAL = {"succeeded", "failed", "cancelled", "lost"}
JOB_FIELDS = {
    "script",
    "name",
    "filename",
    "workdir",
    "args",
    "env",
    "offer",
    "gpus",
    "nodes",
    "team",
    "time_limit",
    "max_restarts",
    "priority",
}


def offer(name: str, kind: str, count: int, cost: float, free: int, reason: str = "") -> dict:
    label = {"cpu": "CPU only", "gpu": f"{count}× H100", "mig": "MIG 3g.40gb"}[kind]
    return {
        "name": name,
        "kind": kind,
        "label": label,
        "description": f"{label} for notebooks and jobs",
        "count": count,
        "cost": cost,
        "free": free,
        "enabled": not reason,
        "reason": reason,
    }


OFFERS: dict[str, Any] = {
    "simulated": True,
    "inventory": "simulated: 1 node, 4× H100-80GB",
    "teams": [
        {
            "team": "vision",
            "used": 1.5,
            "limit": 4.0,
            "guarantee": 3.0,
            "borrow_limit": 1.0,
            "left": 2.5,
            "user_used": 1.0,
            "user_cap": 2.0,
            "offers": [
                offer("cpu", "cpu", 1, 0.0, 16),
                offer("h100", "gpu", 1, 1.0, 2),
                offer("h100", "gpu", 2, 2.0, 1),
                offer("h100", "gpu", 4, 4.0, 0, "team vision has 2.5 GPU-eq left; this needs 4"),
                offer("h100-mig-3g", "mig", 1, 0.5, 2),
            ],
        },
        {
            "team": "nlp",
            "used": 0.0,
            "limit": 2.0,
            "guarantee": 2.0,
            "borrow_limit": 0.0,
            "left": 2.0,
            "user_used": 0.0,
            "user_cap": None,
            "offers": [offer("h100-nlp", "gpu", 2, 2.0, 1)],
        },
    ],
}
TEAMS = [
    {
        "name": "vision",
        "guarantee": 3.0,
        "borrow_limit": 1.0,
        "used": 1.5,
        "borrowed": 0.0,
        "jobs_queued": 1,
        "jobs_running": 2,
    },
    {
        "name": "nlp",
        "guarantee": 2.0,
        "borrow_limit": 0.0,
        "used": 0.0,
        "borrowed": 0.0,
        "jobs_queued": 0,
        "jobs_running": 0,
    },
]


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class FakeHub:
    """The hub's gpupool state: jobs, their per-rank logs, and every request body received."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.jobs: dict[str, dict[str, Any]] = {}
        self.logs: dict[tuple[str, int], bytearray] = {}
        self.posted: list[dict[str, Any]] = []
        self.ids = itertools.count(1)
        self.follow_cut_after: int | None = None  # close a follow stream after N bytes (a proxy)
        self.allocations: list[dict[str, Any]] = []
        self.allocations_fail: int | None = None  # GET allocations answers this status instead
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler_class())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.api_url = self.url + "/hub/api"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    # -- test controls ----------------------------------------------------------------------------

    def add_job(self, owner: str, **fields: Any) -> dict[str, Any]:
        with self.lock:
            job_id = str(next(self.ids))
            gpus, nodes = fields.get("gpus", 1), fields.get("nodes") or 1
            job = {
                "id": job_id,
                "name": fields.get("name") or f"job-{job_id}",
                "owner": owner,
                "team": fields.get("team") or "vision",
                "offer": fields.get("offer") or "h100",
                "gpus": gpus,
                "nodes": nodes,
                "state": "queued",
                "reason": "",
                "priority": fields.get("priority") or 0,
                "time_limit": fields.get("time_limit"),
                "max_restarts": fields.get("max_restarts") or 0,
                "restarts": 0,
                "created": now(),
                "started": None,
                "finished": None,
                "exit_codes": {},
                "ranks": gpus * nodes,
                "queue_position": 1 + sum(j["state"] == "queued" for j in self.jobs.values()),
                "devices": [],
            }
            self.jobs[job_id] = job
            for rank in range(job["ranks"]):
                self.logs[(job_id, rank)] = bytearray()
            self.lock.notify_all()
            return dict(job)

    def add_allocation(
        self,
        user: str,
        *,
        kind: str = "notebook",
        idle: dict[str, Any] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """An allocation as the hub lists it; ``idle`` (GPU notebooks) is the reclaimer's view."""
        with self.lock:
            allocation_id = fields.pop("id", f"alloc-{len(self.allocations) + 1}")
            allocation = {
                "id": allocation_id,
                "user": user,
                "team": "vision",
                "offer": "h100",
                "kind": kind,
                "ref": f"{user}/" if kind == "notebook" else allocation_id,
                "count": 1,
                "cost": 1.0,
                "node": "local",
                "devices": ["GPU-a-0"],
                "since": now(),
                **fields,
            }
            if idle is not None:
                allocation["idle"] = {
                    "utilisation": {d: 0 for d in allocation["devices"]},
                    "idle_since": None,
                    "action": "stop",
                    "warning": None,
                    **idle,
                }
            self.allocations.append(allocation)
            return dict(allocation)

    def _job(self, job_id: str) -> dict[str, Any]:
        """The job, waiting (a little) for a submission still on its way; call under the lock."""
        if not self.lock.wait_for(lambda: job_id in self.jobs, timeout=30):
            raise AssertionError(f"job {job_id} was never submitted")
        return self.jobs[job_id]

    def start(self, job_id: str) -> None:
        with self.lock:
            job = self._job(job_id)
            job.update(state="running", started=now(), queue_position=None)
            job["devices"] = [f"GPU-a-{i}" for i in range(job["ranks"])]
            self.lock.notify_all()

    def write(self, job_id: str, rank: int, data: bytes) -> None:
        with self.lock:
            self.logs[(job_id, rank)] += data
            self.lock.notify_all()

    def finish(self, job_id: str, state: str = "succeeded", reason: str = "") -> None:
        with self.lock:
            job = self._job(job_id)
            code = 0 if state == "succeeded" else 1
            codes = {str(r): code for r in range(job["ranks"])}
            job.update(state=state, reason=reason, finished=now(), queue_position=None)
            job["exit_codes"] = codes if state in ("succeeded", "failed") else {}
            self.lock.notify_all()

    # -- the API ----------------------------------------------------------------------------------

    def user(self, authorization: str | None) -> str:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "token" or token not in TOKENS:
            raise HttpError(403, "Missing or invalid credentials.")
        return TOKENS[token]

    def visible_job(self, user: str, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None or (job["owner"] != user and user not in ADMINS):
            raise HttpError(404, f"No such job: {job_id}")
        return job

    def submit(self, user: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise HttpError(400, "Request body must be a JSON object")
        unknown = sorted(set(body) - JOB_FIELDS)
        if unknown:
            raise HttpError(400, f"Unknown job fields: {', '.join(unknown)}")
        if not isinstance(body.get("script"), str) or not body["script"].strip():
            raise HttpError(400, "A job needs a script")
        gpus = body.get("gpus", 1)
        if not isinstance(gpus, int) or gpus < 1:
            raise HttpError(400, f"gpus must be a whole number of at least 1, not {gpus!r}")
        team = body.get("team") or "vision"
        teams = {t["team"]: t for t in OFFERS["teams"]}
        if team not in teams:
            raise HttpError(403, f"{user} is not a member of team {team}")
        names = {o["name"] for o in teams[team]["offers"]}
        if body.get("offer") is not None and body["offer"] not in names:
            raise HttpError(400, f"No offer {body['offer']!r} for team {team}: {sorted(names)}")
        if gpus * (body.get("nodes") or 1) > 4:
            raise HttpError(
                403,
                f"Team {team} may use 4 GPU-eq; this job needs {gpus * (body.get('nodes') or 1)}",
            )
        self.posted.append(body)
        return self.add_job(user, **body)

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                self.dispatch("GET")

            def do_POST(self) -> None:
                self.dispatch("POST")

            def do_DELETE(self) -> None:
                self.dispatch("DELETE")

            def send_json(self, status: int, value: Any) -> None:
                data = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def dispatch(self, method: str) -> None:
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    if not url.path.startswith("/hub/api/gpupool/"):
                        raise HttpError(404, "Not Found")
                    parts = url.path.removeprefix("/hub/api/gpupool/").strip("/").split("/")
                    user = hub.user(self.headers.get("Authorization"))
                    self.route(method, parts, query, raw, user)
                except HttpError as exc:
                    self.send_json(exc.status, {"status": exc.status, "message": exc.message})

            def route(
                self, method: str, parts: list[str], query: dict[str, str], raw: bytes, user: str
            ) -> None:
                with hub.lock:
                    if (method, parts) == ("GET", ["offers"]):
                        return self.send_json(200, OFFERS)
                    if (method, parts) == ("GET", ["teams"]):
                        return self.send_json(200, {"teams": TEAMS})
                    if (method, parts) == ("GET", ["allocations"]):
                        if hub.allocations_fail is not None:
                            raise HttpError(hub.allocations_fail, "allocations are unavailable")
                        everyone = query.get("all") in ("1", "true", "yes")
                        if everyone and user not in ADMINS:
                            raise HttpError(403, "Listing everyone's allocations needs admin.")
                        mine = [a for a in hub.allocations if everyone or a["user"] == user]
                        return self.send_json(200, {"allocations": mine})
                    if (method, parts) == ("GET", ["jobs"]):
                        jobs = [
                            j for j in hub.jobs.values() if j["owner"] == user or user in ADMINS
                        ]
                        return self.send_json(200, {"jobs": jobs})
                    if (method, parts) == ("POST", ["jobs"]):
                        try:
                            body = json.loads(raw or b"null")
                        except ValueError:
                            raise HttpError(400, "Request body is not JSON") from None
                        return self.send_json(201, hub.submit(user, body))
                    if len(parts) == 2 and parts[0] == "jobs":
                        job = hub.visible_job(user, parts[1])
                        if method == "GET":
                            return self.send_json(200, job)
                        if method == "DELETE":
                            if job["state"] not in TERMINAL:
                                job.update(state="cancelled", finished=now(), queue_position=None)
                                job["reason"] = f"cancelled by {user}"
                                hub.lock.notify_all()
                            return self.send_json(200, job)
                if (
                    len(parts) == 3
                    and parts[0] == "jobs"
                    and parts[2] == "logs"
                    and method == "GET"
                ):
                    return self.logs(hub.visible_job(user, parts[1]), query)
                raise HttpError(404, "Not Found")

            def logs(self, job: dict[str, Any], query: dict[str, str]) -> None:
                try:
                    rank, offset = int(query.get("rank", 0)), int(query.get("offset", 0))
                except ValueError:
                    raise HttpError(400, "rank and offset must be whole numbers") from None
                if not 0 <= rank < job["ranks"] or offset < 0:
                    raise HttpError(400, f"Job {job['id']} has ranks 0 to {job['ranks'] - 1}")
                log = hub.logs[(job["id"], rank)]
                if query.get("follow") != "1":
                    with hub.lock:
                        data, state = bytes(log[offset:]), job["state"]
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; charset=utf-8")
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("X-Gpupool-Log-Size", str(offset + len(data)))
                    self.send_header("X-Gpupool-Job-State", state)
                    self.end_headers()
                    self.wfile.write(data)
                    return
                self.follow(job, log, offset)

            def follow(self, job: dict[str, Any], log: bytearray, offset: int) -> None:
                with hub.lock:
                    size, state = len(log), job["state"]
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("X-Gpupool-Log-Size", str(size))
                self.send_header("X-Gpupool-Job-State", state)
                self.end_headers()
                sent = 0
                while True:
                    with hub.lock:
                        ended = job["state"] in TERMINAL
                        data = bytes(log[offset:])
                        if not data and not ended:
                            hub.lock.wait(0.5)
                            continue
                    if data:
                        if hub.follow_cut_after is not None and sent >= hub.follow_cut_after:
                            self.close_connection = True
                            return  # cut off without the final chunk, as a proxy timeout does
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                        offset, sent = offset + len(data), sent + len(data)
                    elif ended:
                        self.wfile.write(b"0\r\n\r\n")
                        self.wfile.flush()
                        return

        return Handler


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.thread.start()
    monkeypatch.setenv("JUPYTERHUB_API_URL", fake.api_url)
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "alice-token")
    monkeypatch.setenv("JUPYTERHUB_USER", "alice")
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def later(seconds: float, action: Any, *args: Any) -> threading.Thread:
    def act() -> None:
        time.sleep(seconds)
        action(*args)

    thread = threading.Thread(target=act, daemon=True)
    thread.start()
    return thread


# -- the client -----------------------------------------------------------------------------------


def test_client_configures_itself_from_the_single_user_environment(hub: FakeHub) -> None:
    client = Client()
    assert client.base_url == hub.api_url + "/gpupool/"
    assert client.user == "alice"
    assert client.offers() == OFFERS
    assert client.teams() == TEAMS
    assert client.jobs() == []
    assert client.allocations() == []


def test_client_allocations_are_the_users_own_with_the_idle_warning(hub: FakeHub) -> None:
    warning = {"reclaim_at": "2025-01-01T14:05:00+00:00", "action": "stop", "message": "idle"}
    mine = hub.add_allocation("alice", idle={"warning": warning})
    hub.add_allocation("bob")
    assert Client().allocations() == [mine]
    assert mine["idle"]["warning"] == warning
    assert len(Client(token="admin-token").allocations()) == 0
    hub.allocations_fail = 403
    with pytest.raises(HubError, match="allocations are unavailable"):
        Client().allocations()


def test_hub_api_url_accepts_the_hub_address_in_several_forms() -> None:
    assert hub_api_url("https://hub.example.org") == "https://hub.example.org/hub/api"
    assert hub_api_url("https://x.org/jupyter/hub/") == "https://x.org/jupyter/hub/api"
    assert hub_api_url("http://127.0.0.1:8081/hub/api/") == "http://127.0.0.1:8081/hub/api"


def test_client_raises_the_hubs_message_word_for_word(hub: FakeHub) -> None:
    client = Client()
    with pytest.raises(HubError) as info:
        client.job("404")
    assert (info.value.status, info.value.message, str(info.value)) == (
        404,
        "No such job: 404",
        "No such job: 404",
    )
    with pytest.raises(HubError) as info:
        Client(token="wrong").jobs()
    assert (info.value.status, info.value.message) == (403, "Missing or invalid credentials.")
    with pytest.raises(HubError, match=r"^No offer 'a100' for team vision"):
        client.submit("print(1)", offer="a100")


def test_client_submit_sends_only_given_fields_and_users_see_their_own_jobs(hub: FakeHub) -> None:
    other = hub.add_job("bob", name="bobs")
    job = Client().submit("print(1)", name="mine", gpus=2, env={"A": "1"}, time_limit=60)
    assert hub.posted == [
        {"script": "print(1)", "gpus": 2, "name": "mine", "env": {"A": "1"}, "time_limit": 60}
    ]
    assert (job["state"], job["owner"], job["ranks"]) == ("queued", "alice", 2)
    assert [j["id"] for j in Client().jobs()] == [job["id"]]
    assert {j["id"] for j in Client(token="admin-token").jobs()} == {job["id"], other["id"]}
    with pytest.raises(HubError, match=f"No such job: {other['id']}"):
        Client().cancel(other["id"])
    assert Client().cancel(job["id"])["state"] == "cancelled"


def test_client_logs_and_follow_stream_while_the_job_runs(hub: FakeHub) -> None:
    job = hub.add_job("alice", gpus=2)
    hub.start(job["id"])
    hub.write(job["id"], 1, b"hello from rank 1\n")
    client = Client()
    assert client.logs(job["id"], rank=1) == (b"hello from rank 1\n", 18, "running")
    assert client.logs(job["id"], rank=1, offset=6) == (b"from rank 1\n", 18, "running")
    stream = client.follow_logs(job["id"], rank=1, offset=6)
    assert next(stream) == b"from rank 1\n"  # arrives while the job still runs
    later(0.1, hub.write, job["id"], 1, "step 1 ✓\n".encode())
    assert next(stream) == "step 1 ✓\n".encode()
    later(0.1, hub.finish, job["id"])
    assert list(stream) == []


def test_follow_resumes_a_stream_that_is_cut_off(hub: FakeHub) -> None:
    job = hub.add_job("alice")
    hub.start(job["id"])
    hub.follow_cut_after = 1
    hub.write(job["id"], 0, b"one\n")
    later(0.2, hub.write, job["id"], 0, b"two\n")
    later(0.4, hub.write, job["id"], 0, b"three\n")
    later(0.6, hub.finish, job["id"])
    received = b"".join(Client().follow_logs(job["id"], poll=0.05))
    assert received == b"one\ntwo\nthree\n"


def test_wait_polls_until_the_job_has_ended(hub: FakeHub) -> None:
    job = hub.add_job("alice")
    later(0.1, hub.start, job["id"])
    later(0.3, hub.finish, job["id"], "failed", "rank 0 exited with 1")
    ended = Client().wait(job["id"], poll=0.05, timeout=10)
    assert (ended["state"], ended["reason"], ended["exit_codes"]) == (
        "failed",
        "rank 0 exited with 1",
        {"0": 1},
    )
    other = hub.add_job("alice")
    with pytest.raises(TimeoutError, match=f"job {other['id']} is still queued after 0.2 seconds"):
        Client().wait(other["id"], poll=0.05, timeout=0.2)


def test_unreachable_hub_and_missing_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        HubUnreachable, match=r"cannot reach the hub at http://127\.0\.0\.1:9/hub/api"
    ):
        Client(url="http://127.0.0.1:9", token="t", timeout=2).teams()
    monkeypatch.delenv("JUPYTERHUB_API_URL", raising=False)
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    with pytest.raises(NotConfigured, match="no hub URL and API token: not inside a JupyterHub"):
        Client()


# -- the command line: reading ---------------------------------------------------------------------


def test_offers_table_and_json(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "offers")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (
        "Inventory: simulated: 1 node, 4× H100-80GB  (SIMULATED: no real GPUs behind these offers)"
    )
    assert lines[2] == (
        "Team vision: 1.5 of 4 GPU-eq used (guarantee 3, may borrow 1), 2.5 left; "
        "you use 1 of your cap 2"
    )
    assert lines[3:9] == [
        "OFFER        KIND  LABEL        COUNT  COST  FREE  AVAILABLE",
        "cpu          cpu   CPU only         1     0    16  yes",
        "h100         gpu   1× H100          1     1     2  yes",
        "h100         gpu   2× H100          2     2     1  yes",
        "h100         gpu   4× H100          4     4     0  no: team vision has 2.5 GPU-eq left; "
        "this needs 4",
        "h100-mig-3g  mig   MIG 3g.40gb      1   0.5     2  yes",
    ]
    assert lines[10].endswith("2 left; you use 0")
    code, out, _ = run(capsys, "offers", "--json")
    assert (code, json.loads(out)) == (0, OFFERS)


def test_teams_table_and_json(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "teams")
    assert code == 0
    assert out.splitlines() == [
        "TEAM    GUARANTEE  BORROW LIMIT  USED  BORROWED  QUEUED  RUNNING",
        "vision          3             1   1.5         0       1        2",
        "nlp             2             0     0         0       0        0",
    ]
    code, out, _ = run(capsys, "teams", "--json")
    assert json.loads(out) == {"teams": TEAMS}


def test_jobs_show_cancel(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "jobs") == (0, "No jobs.\n", "")
    first = hub.add_job("alice", name="train", gpus=2, nodes=2, time_limit=3600)
    second = hub.add_job("alice", name="eval", offer="h100-mig-3g", team="nlp")
    hub.add_job("bob", name="hidden")
    hub.start(first["id"])
    code, out, _ = run(capsys, "jobs")
    rows = out.splitlines()
    assert code == 0 and len(rows) == 3
    assert rows[0].split() == ["ID", "NAME", "OWNER", "TEAM", "OFFER", "GPUS", "STATE", "CREATED"]
    assert rows[1].split()[:7] == ["1", "train", "alice", "vision", "h100", "2×2", "running"]
    assert rows[2].split()[:8] == ["2", "eval", "alice", "nlp", "h100-mig-3g", "1", "queued", "#2"]
    assert rows[0].index("STATE") == rows[1].index("running") == rows[2].index("queued")

    code, out, _ = run(capsys, "show", first["id"])
    assert code == 0
    shown = dict(line.split(":", 1) for line in out.splitlines())
    assert {k: v.strip() for k, v in shown.items() if k in ("state", "ranks", "time limit")} == {
        "state": "running",
        "ranks": "4",
        "time limit": "3600 s",
    }
    assert shown["devices"].strip() == "GPU-a-0, GPU-a-1, GPU-a-2, GPU-a-3"
    code, out, _ = run(capsys, "show", second["id"], "--json")
    assert json.loads(out) == hub.jobs[second["id"]]

    assert run(capsys, "cancel", second["id"]) == (0, f"Job {second['id']}: cancelled\n", "")
    code, out, _ = run(capsys, "cancel", first["id"], "--json")
    assert (code, json.loads(out)["reason"]) == (0, "cancelled by alice")


def test_logs_print_bytes_and_follow(hub: FakeHub, capsys: pytest.CaptureFixture[str]) -> None:
    job = hub.add_job("alice", gpus=2)
    hub.start(job["id"])
    hub.write(job["id"], 1, "epoch 1 loss 0.5 ✓\n".encode())
    assert run(capsys, "logs", job["id"], "--rank", "1") == (0, "epoch 1 loss 0.5 ✓\n", "")
    code, out, _ = run(capsys, "logs", job["id"], "--rank", "1", "--json")
    assert code == 0
    assert json.loads(out) == {
        "id": job["id"],
        "rank": 1,
        "size": len("epoch 1 loss 0.5 ✓\n".encode()),
        "state": "running",
        "log": "epoch 1 loss 0.5 ✓\n",
    }
    later(0.2, hub.write, job["id"], 1, b"epoch 2\n")
    later(0.4, hub.finish, job["id"])
    assert run(capsys, "logs", job["id"], "-f", "--rank", "1") == (
        0,
        "epoch 1 loss 0.5 ✓\nepoch 2\n",
        "",
    )


# -- the command line: submitting ------------------------------------------------------------------


def write_notebook(path: Path, *cells: nbformat.NotebookNode) -> Path:
    nbformat.write(new_notebook(cells=list(cells)), path)
    return path


def test_submit_converts_a_notebook(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    nb = write_notebook(
        tmp_path / "train.ipynb",
        new_markdown_cell("# Train"),
        new_code_cell("%matplotlib inline\nimport sys\nprint('args', sys.argv[1:])"),
        new_code_cell("!nvidia-smi", metadata={"tags": ["skip-distributed"]}),
        new_code_cell("print('last')"),
    )
    code, out, err = run(
        capsys,
        "submit",
        str(nb),
        "--gpus",
        "2",
        "--time-limit",
        "1h30m",
        "--priority",
        "5",
        "--max-restarts",
        "1",
        "-e",
        "SEED=1",
        "--cells",
        "upto:3",
        "--",
        "--lr",
        "0.1",
    )
    assert code == 0, err
    assert out == "Submitted job 1 (train): queued #1\n"
    assert err == "offer: h100 (the default for --gpus 2; --offer chooses another)\n"
    (body,) = hub.posted
    script = body.pop("script")
    assert body == {
        "gpus": 2,
        "name": "train",
        "filename": "train.ipynb",
        "workdir": str(tmp_path.resolve()),
        "args": ["--lr", "0.1"],
        "env": {"SEED": "1"},
        "offer": "h100",
        "time_limit": 5400,
        "max_restarts": 1,
        "priority": 5,
    }
    assert "# Cells included: #2" in script and "print('last')" not in script
    assert "get_ipython" not in script and "nvidia-smi" not in script
    result = subprocess.run(
        [sys.executable, "-", "--lr", "0.1"], input=script, capture_output=True, text=True
    )
    assert result.stdout == "args ['--lr', '0.1']\n"


def test_submit_refuses_a_notebook_with_magics_before_asking_the_hub(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    nb = write_notebook(
        tmp_path / "t.ipynb", new_code_cell("x = 1"), new_code_cell("%pip install x")
    )
    code, out, err = run(capsys, "submit", str(nb), "--offer", "h100")
    assert (code, out) == (1, "")
    assert err == (
        "t.ipynb: cannot run as a job:\n"
        "cell #2 uses %pip install x (line 1): remove it or tag the cell skip-distributed\n"
    )
    assert hub.posted == []


def test_submit_a_script_as_is_and_wait(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "job.py"
    script.write_text("print('plain script')\n", encoding="utf-8")
    later(0.3, hub.start, "1")
    later(0.5, hub.finish, "1")
    code, out, err = run(
        capsys,
        "submit",
        str(script),
        "--offer",
        "h100-nlp",
        "--team",
        "nlp",
        "--name",
        "n",
        "-w",
        "--poll",
        "0.05",
    )
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "Submitted job 1 (n): queued #1",
        "Waiting for job 1 to end (Ctrl-C stops waiting, not the job)…",
        "Job 1 succeeded",
    ]
    assert hub.posted[0]["script"] == "print('plain script')\n"
    assert (hub.posted[0]["team"], hub.posted[0]["offer"]) == ("nlp", "h100-nlp")

    later(0.3, hub.finish, "2", "failed", "rank 1 exited with 1")
    code, out, _ = run(
        capsys, "submit", str(script), "--offer", "h100", "--wait", "--json", "--poll", "0.05"
    )
    assert code == 1
    assert json.loads(out)["reason"] == "rank 1 exited with 1"


def test_default_offer_rules() -> None:
    assert cli.choose_offer(OFFERS, 1) == "h100"
    assert cli.choose_offer(OFFERS, 2, "nlp") == "h100-nlp"
    assert cli.choose_offer(OFFERS, 4) == "h100"  # busy or over quota: the job queues
    cpu_only = {"teams": [{"team": "t", "offers": [offer("cpu", "cpu", 1, 0.0, 8)]}]}
    assert cli.choose_offer(cpu_only, 4) == "cpu"
    with pytest.raises(cli.UsageError, match=r"no GPU offer comes with 3 GPU\(s\) per node"):
        cli.choose_offer(OFFERS, 3)
    with pytest.raises(cli.UsageError, match="you are not in team 'audio'"):
        cli.choose_offer(OFFERS, 1, "audio")


def test_hub_errors_pass_through_word_for_word(
    hub: FakeHub, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = tmp_path / "big.py"
    script.write_text("pass\n", encoding="utf-8")
    assert run(capsys, "submit", str(script), "--offer", "h100", "--gpus", "3", "--nodes", "2") == (
        1,
        "",
        "Team vision may use 4 GPU-eq; this job needs 6\n",
    )
    assert run(capsys, "show", "77") == (1, "", "No such job: 77\n")
    assert run(capsys, "jobs", "--token", "nope") == (1, "", "Missing or invalid credentials.\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["submit", "missing.ipynb"], "gpupool submit: no such file: missing.ipynb"),
        (["submit", "EXISTING.py", "--cells", "1,2"], "--cells applies to notebooks only"),
        (["submit", "EXISTING.py", "--time-limit", "soon"], "not a duration: 'soon'"),
        (["submit", "EXISTING.py", "--gpus", "0"], "must be at least 1"),
        (["submit", "EXISTING.py", "--cells", "upto:x"], "not a cell choice"),
        (["submit", "EXISTING.py", "--gpus", "3"], "no GPU offer comes with 3 GPU(s) per node"),
        (["jobs", "--", "x"], 'arguments after "--" are for submit only'),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(
    hub: FakeHub,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    argv: list[str],
    message: str,
) -> None:
    (tmp_path / "EXISTING.py").write_text("pass\n", encoding="utf-8")
    argv = [str(tmp_path / a) if a == "EXISTING.py" else a for a in argv]
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert hub.posted == []


def test_cell_and_duration_parsing() -> None:
    assert cli.parse_cells("all") == "all"
    assert cli.parse_cells("upto:3") == 2
    assert cli.parse_cells("5, 1,2-3") == [0, 1, 2, 4]
    assert [cli.parse_duration(t) for t in ("90", "90s", "30m", "2h", "1h30m", "1d")] == [
        90,
        90,
        1800,
        7200,
        5400,
        86400,
    ]


def test_outside_a_single_user_server(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("JUPYTERHUB_API_URL", raising=False)
    monkeypatch.delenv("JUPYTERHUB_API_TOKEN", raising=False)
    code, out, err = run(capsys, "jobs")
    assert (code, out) == (2, "")
    assert "not inside a JupyterHub single-user server" in err
    assert "Pass --url https://HUB-ADDRESS and --token TOKEN" in err
    code, _, err = run(capsys, "teams", "--url", "http://127.0.0.1:9", "--token", "t")
    assert code == 1 and err.startswith("cannot reach the hub at http://127.0.0.1:9/hub/api")


def test_the_installed_command_runs_as_a_process(hub: FakeHub) -> None:
    hub.add_job("alice", name="proc")
    env = dict(os.environ)
    script = Path(sys.executable).with_name("gpupool")  # the console script
    command = [str(script)] if script.exists() else [sys.executable, "-m", "gpupool_lab.cli"]
    result = subprocess.run(
        [*command, "show", "99"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (1, "", "No such job: 99\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpupool_lab.cli", "jobs", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0
    assert [j["name"] for j in json.loads(result.stdout)["jobs"]] == ["proc"]
