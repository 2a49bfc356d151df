"""The stand-in hub answers what the hub's API document says (``hub/gpupool/hub/openapi.yaml``).

The notebook side's tests trust :class:`tests.lab.fake_hub.FakeHub` to answer as the hub does;
this module holds it to the document. Every response the fake hub sends here passes through
:class:`Contract`: its status must be one the operation lists, its media type one that status
lists, its JSON body must validate against that response's schema (OpenAPI 3.1 schemas are JSON
Schema 2020-12; formats such as ``date-time`` are checked) and its documented headers must be
present and valid. The requests :class:`gpupool_lab.client.Client` sends are held to the request
body schemas the same way. The scenarios drive every operation of the document, each through
its success and its refusals, and the run fails if an operation was never exercised, so a new
operation in the document needs the fake hub (and a scenario) to follow.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from gpupool_lab.client import Client, HubError
from tests.lab.fake_hub import CAPACITY, OFFERS, FakeHub, judge

DOCUMENT = Path(__file__).parents[2] / "hub/gpupool/hub/openapi.yaml"
URI = "urn:gpupool:openapi"
METHODS = ("get", "put", "post", "delete", "patch")
BASE = "/hub/api/gpupool"


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


class Contract:
    """Checks requests and responses against the API document; records what it has seen."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        resource = Resource.from_contents(document, default_specification=DRAFT202012)
        self.registry: Registry[Any] = Registry().with_resource(URI, resource)
        self.operations = {
            (method.upper(), template): re.compile(
                "^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)) + "$"
            )
            for template, item in document["paths"].items()
            for method in METHODS
            if method in item
        }
        self.seen: set[tuple[str, str, int]] = set()

    def operation(self, method: str, path: str) -> str:
        """The path template of the document's operation for ``method path``."""
        found = [t for (m, t), rx in self.operations.items() if m == method and rx.match(path)]
        assert len(found) == 1, f"{method} {path}: {found or 'no operation'} in the document"
        return found[0]

    def _resolve(self, pointer: str) -> tuple[str, dict[str, Any]]:
        """The object at ``pointer``, following a ``$ref`` (returns the pointer it ends at)."""
        node: Any = self.document
        for part in pointer.lstrip("/").split("/"):
            node = node[part.replace("~1", "/").replace("~0", "~")]
        if "$ref" in node:
            return self._resolve(node["$ref"].removeprefix("#"))
        return pointer, node

    def _errors(self, pointer: str, instance: object, what: str) -> list[str]:
        """Every way ``instance`` (``what``: "body", "request", "header X") fails the schema at
        ``pointer``, each as ``"<what> <where in it>: <why>"``."""
        validator = Draft202012Validator(
            {"$ref": f"{URI}#{pointer}"},
            registry=self.registry,
            format_checker=Draft202012Validator.FORMAT_CHECKER,
        )
        return [
            f"{what} {'/'.join(map(str, e.absolute_path))}: {e.message}".replace(" :", ":")
            for e in validator.iter_errors(instance)
        ]

    def check(self, response: requests.Response) -> None:
        """Hold one exchange to the document; AssertionError naming every difference."""
        request = response.request
        path = requests.utils.urlparse(request.url).path
        assert path.startswith(BASE + "/"), path
        method = str(request.method)
        template = self.operation(method, path.removeprefix(BASE))
        where = f"/paths/{_escape(template)}/{method.lower()}"
        problems = []
        if request.body and response.ok:  # an accepted request must be a documented one
            schema = f"{where}/requestBody/content/application~1json/schema"
            problems += self._errors(schema, json.loads(request.body), "request")
        _, operation = self._resolve(where)
        status = str(response.status_code)
        assert status in operation["responses"], (
            f"{method} {template} answered {status}; the document lists "
            f"{sorted(operation['responses'])}"
        )
        answer, described = self._resolve(f"{where}/responses/{status}")
        media = response.headers.get("Content-Type", "").split(";")[0].strip()
        content = described.get("content", {})
        assert media in content, f"{method} {template} {status} sent {media!r}, not {list(content)}"
        if media == "application/json":
            schema = f"{answer}/content/{_escape(media)}/schema"
            problems += self._errors(schema, response.json(), "body")
        for name, header in described.get("headers", {}).items():
            value = response.headers.get(name)
            if value is None:
                problems += [f"header {name}: missing"] if header.get("required") else []
                continue
            typed: object = int(value) if re.fullmatch(r"-?\d+", value) else value
            schema = f"{answer}/headers/{_escape(name)}/schema"
            problems += self._errors(schema, typed, f"header {name}")
        assert not problems, f"{method} {template} {status}:\n" + "\n".join(problems)
        self.seen.add((method, template, response.status_code))


@pytest.fixture(scope="module")
def contract() -> Contract:
    return Contract(yaml.safe_load(DOCUMENT.read_text(encoding="utf-8")))


@pytest.fixture
def checked(contract: Contract, hub: FakeHub) -> Iterator[requests.Session]:
    """A session whose every response is held to the document (the hook runs before the
    client looks at the status)."""
    session = requests.Session()
    session.hooks["response"].append(lambda response, *args, **kwargs: contract.check(response))
    yield session
    session.close()


def client(session: requests.Session, token: str = "alice-token") -> Client:
    return Client(token=token, session=session)


def raw(session: requests.Session, hub: FakeHub, method: str, path: str, **kw: Any) -> int:
    """A request the client does not make (a refusal the fake hub must answer as documented)."""
    headers = {"Authorization": f"token {kw.pop('token', 'alice-token')}"}
    url = f"{hub.api_url}/gpupool/{path}"
    return session.request(method, url, headers=headers, timeout=10, **kw).status_code


# -- the scenarios --------------------------------------------------------------------------------


def test_reading_offers_teams_and_allocations(hub: FakeHub, checked: requests.Session) -> None:
    hub.add_allocation("alice", idle={})
    hub.add_allocation(
        "alice",
        idle={
            "idle_since": "2025-01-01T13:00:00+00:00",
            "warning": {
                "reclaim_at": "2025-01-01T14:05:00+00:00",
                "action": "cpu",
                "reason": "idle",
                "message": "idle; it will be restarted without a GPU",
            },
        },
    )
    hub.add_allocation("bob", kind="job", devices=[])
    alice = client(checked)
    assert alice.offers() == OFFERS
    alice.teams()
    assert len(alice.allocations()) == 2
    assert raw(checked, hub, "GET", "allocations?all=1", token="admin-token") == 200
    assert raw(checked, hub, "GET", "allocations?all=1") == 403
    for path in ("offers", "teams", "allocations"):
        assert raw(checked, hub, "GET", path, token="wrong") == 403
    assert raw(checked, hub, "GET", "health", token="wrong") == 200  # no token needed
    hub.store_problem = "database or disk is full"
    assert raw(checked, hub, "GET", "health", token="admin-token") == 503


def test_jobs_through_their_life(hub: FakeHub, checked: requests.Session) -> None:
    alice = client(checked)
    assert alice.jobs() == []
    job = alice.submit("print(1)", name="n", gpus=2, env={"A": "1"}, time_limit=60, priority=-1)
    hub.add_job("bob")
    alice.jobs()
    hub.start(job["id"])
    hub.write(job["id"], 1, "step ✓\n".encode())
    assert alice.job(job["id"])["state"] == "running"
    assert alice.logs(job["id"], rank=1, offset=2)[0] == "ep ✓\n".encode()
    hub.finish(job["id"], "failed", "rank 1 exited with 1")
    assert b"".join(alice.follow_logs(job["id"], rank=1)) == "step ✓\n".encode()
    assert alice.cancel(job["id"])["state"] == "failed"  # it had ended: nothing changes
    queued = alice.submit("print(2)", offer="h100-nlp", team="nlp", gpus=2)
    assert alice.cancel(queued["id"])["state"] == "cancelled"
    waits = alice.submit("print(3)", offer="h100", gpus=3)  # its line in the offers is wait
    assert (waits["state"], waits["reason"]) == (
        "queued",
        "waiting: needs 3 GPU-eq; team vision has 2.5 left",
    )
    assert len(client(checked, "admin-token").jobs()) == 4


def test_job_refusals(hub: FakeHub, checked: requests.Session) -> None:
    alice = client(checked)
    bobs = hub.add_job("bob")
    mine = alice.submit("pass")
    for call in (
        lambda: alice.submit("print(1)", offer="a100"),  # 400
        lambda: alice.submit("print(1)", offer="h100", gpus=5),  # 400: no such count
        lambda: alice.submit("print(1)", offer="h100", gpus=4),  # 403: never (over the cap)
        lambda: alice.submit("print(1)", offer="h100", gpus=2, nodes=3),  # 403: never (limit)
        lambda: alice.job(bobs["id"]),  # 404: not yours
        lambda: alice.cancel("missing"),  # 404
        lambda: alice.logs(bobs["id"]),  # 404
        lambda: alice.logs(mine["id"], rank=5),  # 400
        lambda: client(checked, "wrong").jobs(),  # 403
    ):
        with pytest.raises(HubError):
            call()
    assert raw(checked, hub, "POST", "jobs", json={"scripts": "x"}) == 400
    assert raw(checked, hub, "GET", f"jobs/{mine['id']}/logs?rank=x") == 400
    for method, path in (("GET", "jobs/1"), ("DELETE", "jobs/1"), ("GET", "jobs/1/logs")):
        assert raw(checked, hub, method, path, token="wrong") == 403


def test_a_starting_server_reports_its_port_once(hub: FakeHub, checked: requests.Session) -> None:
    server = "alice-server-token"
    assert raw(checked, hub, "POST", "servers/port", json={"port": 8000}) == 403  # a user's
    assert raw(checked, hub, "POST", "servers/port", json={"port": 8000, "host": "x"}) == 400
    assert raw(checked, hub, "POST", "servers/port", json={"port": 8000}, token=server) == 200
    assert raw(checked, hub, "POST", "servers/port", json={"port": 8001}, token=server) == 409
    assert hub.reported_port == 8000


SCENARIOS = (
    "test_reading_offers_teams_and_allocations",
    "test_jobs_through_their_life",
    "test_job_refusals",
    "test_a_starting_server_reports_its_port_once",
)


def test_every_operation_of_the_document_was_exercised(
    contract: Contract, request: pytest.FixtureRequest
) -> None:
    ran = {item.name for item in request.session.items if item.module is request.module}
    if not ran >= set(SCENARIOS):
        pytest.skip("counts what the scenarios above exercised; they were not all selected")
    seen = {(method, template) for method, template, _ in contract.seen}
    assert set(contract.operations) - seen == set()
    statuses = {
        (m, t): sorted(c for mm, tt, c in contract.seen if (mm, tt) == (m, t)) for m, t in seen
    }
    assert all(len(codes) >= 2 for codes in statuses.values()), statuses  # success and refusal


# -- the fake hub's verdicts are the hub's --------------------------------------------------------


def test_the_fake_hubs_verdicts_are_the_hubs_admission_rule() -> None:
    """:func:`tests.lab.fake_hub.judge` (the offers document's lines, and submits on several
    nodes) gives what ``gpupool.core.admission.admit`` gives on the same figures."""
    core = pytest.importorskip("gpupool.core.admission")
    from gpupool.core.offers import Offer
    from gpupool.core.quota import Team

    def milli(value: float | None) -> int | None:
        return None if value is None else round(value * 1000)

    checked = 0
    for entry in OFFERS["teams"]:
        team = Team(
            entry["team"],
            guarantee_milli=milli(entry["guarantee"]) or 0,
            borrow_limit_milli=milli(entry["borrow_limit"]) or 0,
            user_cap_milli=milli(entry["user_cap"]),
        )
        lines = entry["offers"]
        for line in lines:
            top = max(o["count"] for o in lines if o["name"] == line["name"])
            offer = Offer(
                line["name"],
                line["kind"],
                model="H100-80GB" if line["kind"] != "cpu" else None,
                max_count=top if line["kind"] == "gpu" else 1,
                profile="3g.40gb" if line["kind"] == "mig" else None,
            )
            capacity = CAPACITY.get(line["kind"], 1)
            usage = core.Usage(
                milli(entry["used"]), milli(entry["user_used"]), line["free"], capacity
            )
            hub = core.admit(team, offer, line["count"], 1, usage)
            assert (line["admission"], line["reason"]) == (hub.verdict, hub.reason), line
            assert line["enabled"] is hub.now
            for nodes in (1, 2, 3):
                hub = core.admit(team, offer, line["count"], nodes, usage)
                assert judge(entry, line, line["count"], nodes) == (hub.verdict, hub.reason)
                checked += 1
    verdicts = {o["admission"] for t in OFFERS["teams"] for o in t["offers"]}
    assert verdicts == {"now", "wait", "never"} and checked == 24


# -- the check itself -----------------------------------------------------------------------------


def test_the_check_catches_a_dropped_required_field(
    hub: FakeHub, checked: requests.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delitem(OFFERS["teams"][0]["offers"][1], "admission")
    with pytest.raises(AssertionError, match="body teams/0/offers/1: 'admission' is a required"):
        client(checked).offers()
    job = hub.add_job("alice")
    del hub.jobs[job["id"]]["queue_position"]
    with pytest.raises(AssertionError, match="'queue_position' is a required property"):
        client(checked).job(job["id"])


def test_the_check_catches_a_wrong_type_an_undocumented_status_and_a_bad_header(
    hub: FakeHub, checked: requests.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(OFFERS["teams"][0]["offers"][0], "admission", "maybe")
    with pytest.raises(AssertionError, match="'maybe' is not one of"):
        client(checked).offers()
    hub.allocations_fail = 500
    with pytest.raises(
        AssertionError, match=r"answered 500; the document lists \['200', '400', '403'\]"
    ):
        client(checked).allocations()
    job = hub.add_job("alice")
    hub.jobs[job["id"]]["state"] = "paused"
    with pytest.raises(AssertionError, match="header X-Gpupool-Job-State: 'paused' is not one"):
        client(checked).logs(job["id"])
