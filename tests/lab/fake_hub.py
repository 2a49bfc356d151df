"""A stand-in for the hub's gpupool REST API over real HTTP, for the notebook side's tests.

``FakeHub`` serves the gpupool REST contract under ``/hub/api/gpupool/`` as the hub does
(``hub/gpupool/hub/openapi.yaml``; ``test_lab_fake_hub_contract.py`` checks its answers against
that document): token auth (``Authorization: token …``; :data:`TOKENS`), JupyterHub's JSON error
bodies ``{"status", "message"}`` with the matching status codes, 201 on submit, users seeing only
their own jobs (an admin all) and their own allocations (``?all=1``: an admin everyone's; the idle
reclaimer's ``idle``, set by tests), ``GET jobs`` in pages newest first (:func:`job_page`),
strict request validation (unknown fields refused, so contract drift shows), the hub's admission
verdicts (:func:`judge`, the hub's rule on the
quota figures of :data:`OFFERS`: the offers document's ``admission``/``reason`` per line, and on
submit a job that could never start refused with the reason, any other queued with
``waiting: <reason>``), and log reads with ``X-Gpupool-Log-Size``/``X-Gpupool-Job-State`` headers
and a chunked ``follow=1`` stream that ends when the job has ended. Tests drive job progress (log
output, finishing) from the test thread; the ``hub`` fixture (``conftest.py``) starts one and
points the single-user environment at it as user ``alice``.
"""

from __future__ import annotations

import itertools
import json
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

TOKENS = {"alice-token": "alice", "admin-token": "admin", "alice-server-token": "alice"}
SERVER_TOKENS = {"alice-server-token"}
"""Tokens that are a starting server's own (``POST /servers/port``: the Slurm spawner's)."""
ADMINS = {"admin"}
TERMINAL = {"succeeded", "failed", "cancelled", "lost"}
DEFAULT_TIME_LIMIT = 4 * 3600  # the hub's JobManager.default_time_limit
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


def fmt(milli: int) -> str:
    """Thousandths of a GPU-equivalent as the hub words them (``gpupool.core.units.fmt``):
    4000 → ``4``, 2500 → ``2.5``."""
    whole, frac = divmod(milli, 1000)
    return f"{milli / 1000:.3f}".rstrip("0") if frac else str(whole)


def judge(
    team: dict[str, Any], line: dict[str, Any], count: int, nodes: int = 1
) -> tuple[str, str]:
    """The hub's verdict and reason (``gpupool.core.admission.admit``) on ``count`` per node
    of the offer of ``line`` (one of the team's lines, for its ``cost`` per unit and ``free``)
    on ``nodes`` nodes, for the user of ``team`` (an entry of :data:`OFFERS`); the pool holds
    :data:`CAPACITY` of a device on one node. ``test_lab_fake_hub_contract.py`` holds it to the
    hub's own rule."""
    name, kind, free = team["team"], line["kind"], line["free"]
    limit, used, user_used = (round(team[k] * 1000) for k in ("limit", "used", "user_used"))
    cap = None if team["user_cap"] is None else round(team["user_cap"] * 1000)
    need = round(line["cost"] / line["count"] * 1000) * count * nodes
    needs = f"needs {fmt(need)} GPU-eq"
    if need > limit:
        return "never", f"{needs}; team {name} may hold at most {fmt(limit)}"
    if cap is not None and need > cap:
        return "never", f"{needs}; your cap in team {name} is {fmt(cap)}"
    devices = kind != "cpu"
    if devices and CAPACITY[kind] < count:
        return "never", f"this pool holds at most {CAPACITY[kind]} of {line['name']} on one node"
    if need and used + need > limit:
        return "wait", f"{needs}; team {name} has {fmt(max(0, limit - used))} left"
    if need and cap is not None and user_used + need > cap:
        return "wait", f"{needs}; you have {fmt(max(0, cap - user_used))} of your cap left"
    if devices and free < count:
        return "wait", "none free right now" if free == 0 else f"only {free} free on one node"
    return "now", ""


def offer(
    name: str,
    kind: str,
    count: int,
    cost: float,
    free: int,
    reason: str = "",
    admission: str | None = None,
) -> dict[str, Any]:
    """One line of the offers document, as given; ``admission`` is ``now`` without a
    ``reason``, else ``wait`` unless given."""
    label = {"cpu": "CPU only", "gpu": f"{count}× H100", "mig": "MIG 3g.40gb"}[kind]
    verdict = admission or ("wait" if reason else "now")
    return {
        "name": name,
        "kind": kind,
        "label": label,
        "description": f"{label} for notebooks and jobs",
        "count": count,
        "cost": cost,
        "free": free,
        "admission": verdict,
        "enabled": verdict == "now",
        "reason": reason,
    }


def judged(team: dict[str, Any], name: str, kind: str, counts: range) -> list[dict[str, Any]]:
    """The lines the hub lists for one offer of ``team`` (a GPU offer: one per count), with
    the verdicts :func:`judge` gives."""
    lines = []
    for count in counts:
        line = offer(name, kind, count, UNIT_COST[kind] * count, FREE[kind])
        verdict, reason = judge(team, line, count)
        lines.append(offer(name, kind, count, line["cost"], line["free"], reason, verdict))
    return lines


#: the pool: one node of 4 H100s, 2 of them free now (a MIG 3g.40gb is half of one)
CAPACITY = {"gpu": 4, "mig": 8}
FREE = {"cpu": 16, "gpu": 2, "mig": 2}
UNIT_COST = {"cpu": 0.0, "gpu": 1.0, "mig": 0.5}
VISION = {
    "team": "vision",
    "used": 1.5,
    "limit": 4.0,
    "guarantee": 3.0,
    "borrow_limit": 1.0,
    "left": 2.5,
    "user_used": 1.0,
    "user_cap": 3.0,
}
NLP = {
    "team": "nlp",
    "used": 0.0,
    "limit": 2.0,
    "guarantee": 2.0,
    "borrow_limit": 0.0,
    "left": 2.0,
    "user_used": 0.0,
    "user_cap": None,
}
#: alice's offers document. In vision: h100 ×1, ×2, MIG and CPU start now; h100 ×3 waits (the
#: team's quota is in use); h100 ×4 could never start (over alice's cap). In nlp: all start now.
OFFERS: dict[str, Any] = {
    "simulated": True,
    "inventory": "simulated: 1 node, 4× H100-80GB",
    "teams": [
        {
            **VISION,
            "offers": [
                *judged(VISION, "cpu", "cpu", range(1, 2)),
                *judged(VISION, "h100", "gpu", range(1, 5)),
                *judged(VISION, "h100-mig-3g", "mig", range(1, 2)),
            ],
        },
        {**NLP, "offers": judged(NLP, "h100-nlp", "gpu", range(1, 3))},
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


PAGE, MAX_PAGE = 50, 500  # the hub's gpupool.core.paging.DEFAULT_PAGE and MAX_PAGE


def job_page(jobs: list[dict[str, Any]], query: dict[str, str]) -> dict[str, Any]:
    """``GET jobs`` as the hub pages it: newest first (here: the highest id), at most ``limit``
    (default :data:`PAGE`), after ``cursor`` (the ``next`` of the page before: opaque to
    clients, here ``after-<id>``), with the next page's cursor or ``null``."""
    limit_text, cursor = query.get("limit", ""), query.get("cursor", "")
    digits = limit_text.isascii() and limit_text.isdigit()
    limit = int(limit_text) if digits else PAGE
    if limit_text and not (digits and 1 <= limit <= MAX_PAGE):
        raise HttpError(400, f"limit must be a whole number from 1 to {MAX_PAGE}.")
    ordered = sorted(jobs, key=lambda j: int(j["id"]), reverse=True)
    if cursor:
        if not cursor.startswith("after-") or not cursor[6:].isdigit():
            raise HttpError(400, "cursor must be the 'next' of a page you were given.")
        ordered = [j for j in ordered if int(j["id"]) < int(cursor[6:])]
    shown = ordered[:limit]
    more = len(ordered) > limit
    return {"jobs": shown, "next": f"after-{shown[-1]['id']}" if more else None}


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
        self.store_problem: str | None = None  # GET health: the database refuses writes
        self.reported_port: int | None = None  # alice's starting server's port report
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
                "reason": fields.get("reason") or "",
                "priority": fields.get("priority") or 0,
                "time_limit": fields.get("time_limit") or DEFAULT_TIME_LIMIT,
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
                    "checked": None,
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

    def report_port(self, headers: Any, raw: bytes) -> dict[str, Any]:
        """The hub's port report: exactly ``{"port": <1..65535>}`` (400), from a starting
        server's own token (403), once (409)."""
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            raise HttpError(400, "Request body is not JSON") from None
        port = body.get("port") if isinstance(body, dict) else None
        if (
            not isinstance(body, dict)
            or set(body) != {"port"}
            or isinstance(port, bool)
            or not isinstance(port, int)
            or not 1 <= port <= 65535
        ):
            raise HttpError(400, 'A port report is exactly {"port": <1..65535>}')
        token = (headers.get("Authorization") or "").partition(" ")[2]
        if token not in SERVER_TOKENS:
            raise HttpError(403, "Only a starting server's own token reports its port.")
        if self.reported_port is not None:
            raise HttpError(409, "alice's server is not waiting for a port report")
        self.reported_port = port
        return {"port": port}

    def visible_job(self, user: str, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None or (job["owner"] != user and user not in ADMINS):
            raise HttpError(404, f"No such job: {job_id}")
        return job

    def submit(self, user: str, body: Any) -> dict[str, Any]:
        """Check and queue a job as the hub does: its verdict (:func:`judge`) refuses a job that
        could never start and gives a queued one its reason."""
        if not isinstance(body, dict):
            raise HttpError(400, "Request body must be a JSON object")
        unknown = sorted(set(body) - JOB_FIELDS)
        if unknown:
            raise HttpError(400, f"Unknown job fields: {', '.join(unknown)}")
        if not isinstance(body.get("script"), str) or not body["script"].strip():
            raise HttpError(400, "A job needs a script")
        gpus, nodes = body.get("gpus") or 1, body.get("nodes") or 1
        if not isinstance(gpus, int) or gpus < 1:
            raise HttpError(400, f"gpus must be a whole number of at least 1, not {gpus!r}")
        team = body.get("team") or "vision"
        teams = {t["team"]: t for t in OFFERS["teams"]}
        if team not in teams:
            raise HttpError(403, f"{user} is not a member of team {team}")
        name = body.get("offer") or "cpu"  # the hub's default offer
        lines = [o for o in teams[team]["offers"] if o["name"] == name]
        if not lines:
            names = sorted({o["name"] for o in teams[team]["offers"]})
            raise HttpError(400, f"No offer {name!r} for team {team}: {names}")
        count = 1 if lines[0]["kind"] == "cpu" else gpus
        line = next((o for o in lines if o["count"] == count), None)
        if line is None:
            top = max(o["count"] for o in lines)
            raise HttpError(400, f"Offer {name} takes a count from 1 to {top}, not {count}.")
        verdict, reason = judge(teams[team], line, count, nodes)
        if verdict == "never":
            status = 409 if reason.startswith("this pool holds") else 403
            raise HttpError(status, f"The job {reason}; it could never start.")
        self.posted.append(body)
        waiting = f"waiting: {reason}" if reason else "waiting to start"
        return self.add_job(user, **{**body, "offer": name, "team": team}, reason=waiting)

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
                    if (method, parts) == ("GET", ["health"]):  # no token needed, as the hub's
                        return self.health()
                    user = hub.user(self.headers.get("Authorization"))
                    self.route(method, parts, query, raw, user)
                except HttpError as exc:
                    self.send_json(exc.status, {"status": exc.status, "message": exc.message})

            def health(self) -> None:
                """The hub's ``GET /health``: 200, or 503 while the store owes writes; an
                admin's token also gets the problem and the database."""
                sick = hub.store_problem is not None
                store: dict[str, Any] = {
                    "healthy": not sick,
                    "pending_writes": 1 if sick else 0,
                    "since": "2025-01-01T13:00:00+00:00" if sick else None,
                }
                auth = (self.headers.get("Authorization") or "").partition(" ")[2]
                if TOKENS.get(auth) in ADMINS:
                    store.update(problem=hub.store_problem, database="/srv/gpupool.sqlite")
                self.send_json(503 if sick else 200, {"store": store})

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
                        return self.send_json(200, job_page(jobs, query))
                    if (method, parts) == ("POST", ["jobs"]):
                        try:
                            body = json.loads(raw or b"null")
                        except ValueError:
                            raise HttpError(400, "Request body is not JSON") from None
                        return self.send_json(201, hub.submit(user, body))
                    if (method, parts) == ("POST", ["servers", "port"]):
                        return self.send_json(200, hub.report_port(self.headers, raw))
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
