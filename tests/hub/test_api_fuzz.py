"""Property-based fuzz of the REST API from its own OpenAPI document, against a real hub.

What is fuzzed: every operation of ``hub/gpupool/hub/openapi.yaml``, with the cases schemathesis
generates from the document (its examples, coverage and fuzzing phases, valid and invalid data),
sent to a real hub as ``ada`` (team vision) with her own API token (scope
``custom:gpupool:jobs``); then a stateful run along the document's links (submit a job, then
read it, its log, cancel it). Three hooks widen what generation reaches: an integer query
parameter (``rank``, ``offset``) often carries numeric-looking text instead, which is what a
query string really is (digits ``str.isdigit`` accepts and ``int()`` refuses, such as ``²``,
digits of other scripts, signs, spaces, huge numbers); ``job_id`` is mostly one of the jobs
that exist (ada's queued and ended jobs, and one of ben's, which must answer 404 to her); and a
submitted job's text fields (name, filename, workdir, script, offer, team, an argument, an
environment value or name) often carry hostile text (:data:`tests.hub.hostile.HOSTILE_TEXT`:
markup, quotes, control and bidirectional characters, 10 KB, and lone surrogates and NULs,
which must be refused). The hook only puts such text where the case had a value the document
allows, so a case generated to break the document still breaks it.

Every response must hold to the document: no 5xx, a status code the operation declares, the
declared content type and headers, a body that matches the declared schema (4xx error bodies
included); a request the document forbids must be refused (4xx); and a 2xx must be refused when
asked again without the token or with a wrong one. Afterwards, whatever the fuzz stored renders:
the admin page, ada's "My GPUs" and home page, and the real ``gpupool jobs`` command.

The hub: the repository's ``jupyterhub_config.py`` (simulated 4x H100) with ada's notebook
holding her whole quota (2x H100), so the GPU jobs she submits queue and stay queued; CPU jobs
really start (the job's directory and launcher, as the demo account) but with ``/bin/false``
for the backend's Python, so they fail at once instead of starting torchrun with up to 64 ranks
on this machine. The hub, its proxy and the notebook are stopped at the end.

Bounds: ``GPUPOOL_FUZZ_EXAMPLES`` examples per operation (default 50) and as many stateful
scenarios of at most 6 calls (each from the same hub: what earlier cases left queued is
cancelled first), no deadline, a fixed seed (``GPUPOOL_FUZZ_SEED``, default 11), no Hypothesis
example database. A follow of a log whose job has not ended would stream until the job ends,
which a queued job here never does: :meth:`API.settle_follow` cancels such a job first (or, for
the queued job that must stay, sends the call without ``follow``). The last test prints the
run's figures. To fuzz longer::

    GPUPOOL_FUZZ_EXAMPLES=1000 GPUPOOL_FUZZ_SEED=$RANDOM \\
        .venv/bin/python -m pytest tests/hub/test_api_fuzz.py -s
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import schemathesis
from bs4 import BeautifulSoup
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import (
    content_type_conformance,
    ignored_auth,
    negative_data_rejection,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.accounts import homes
from tests.hub.conftest import FINAL, ROOT, Hub, running, spawn, wait_job
from tests.hub.hostile import (
    HOSTILE,
    HOSTILE_TEXT,
    UNSTORABLE,
    check_page,
    gpupool,
    safe_for_a_terminal,
)

DOCUMENT = ROOT / "hub/gpupool/hub/openapi.yaml"
EXAMPLES = int(os.environ.get("GPUPOOL_FUZZ_EXAMPLES", "50"))
SEED = int(os.environ.get("GPUPOOL_FUZZ_SEED", "11"))
USER, OTHER = "ada", "ben"  # both in team vision

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    ignored_auth,
    negative_data_rejection,
]
SETTINGS = {
    "max_examples": EXAMPLES,
    "deadline": None,
    "database": None,
    "suppress_health_check": list(HealthCheck),
}

schema = schemathesis.openapi.from_path(
    DOCUMENT,
    config=schemathesis.Config.from_dict(
        {"seed": SEED, "generation": {"database": "none", "with-security-parameters": False}}
    ),
)
LINKED = schema.exclude(operation_id="reportServerPort")
"""The scenarios' operations: not the port report, whose answer (403, 409) depends on which
servers are starting, so that a scenario replayed by Hypothesis draws as it did."""


# -- what generation reaches beyond the document ---------------------------------------------
DIGITS = st.characters(categories=["Nd", "No"]).filter(str.isdigit)
"""What ``str.isdigit`` calls a digit: ASCII, other scripts' (``٣``), and more (``²``, ``①``)."""
NOT_DECIMAL = st.characters(categories=["No"]).filter(str.isdigit)
"""Digits that ``int()`` refuses although ``str.isdigit`` accepts them: ``²``, ``①``, ``፩``."""
NUMERIC_TEXT = st.one_of(
    st.tuples(st.text(DIGITS, max_size=2), NOT_DECIMAL).map("".join),
    st.text(DIGITS, min_size=1, max_size=3),
    st.sampled_from(["０", "-1", "+1", " 1", "1.0", "1e3", "0x1", "1_0", "9" * 40, ""]),
)
"""Text a query parameter typed integer may carry: digits of any kind, and near misses."""


@dataclass
class Jobs:
    """Jobs that exist in the hub, for ``job_id``: ada's and ben's."""

    mine: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)


JOBS = Jobs()


@schema.hook
def flatmap_query(ctx: Any, query: Any) -> st.SearchStrategy[Any]:
    names = [p.name for p in ctx.operation.query if p.definition["schema"].get("type") == "integer"]
    if not names or not isinstance(query, dict):
        return st.just(query)
    one_as_text = st.sampled_from(names).flatmap(
        lambda name: NUMERIC_TEXT.map(lambda text: {**query, name: text})
    )
    return st.one_of(one_as_text, st.just(query))


@schema.hook
def flatmap_path_parameters(ctx: Any, path_parameters: Any) -> st.SearchStrategy[Any]:
    known_jobs = [*JOBS.mine, *JOBS.others]  # none yet while pytest collects
    if not known_jobs or not isinstance(path_parameters, dict) or "job_id" not in path_parameters:
        return st.just(path_parameters)
    known = st.sampled_from(known_jobs).map(lambda j: {**path_parameters, "job_id": j})
    return st.one_of(known, known, known, st.just(path_parameters))  # mostly a job that exists


TEXT_FIELDS = ("name", "filename", "workdir", "script", "offer", "team")
"""The job submission's text fields (``args`` and ``env`` hold more text)."""
FUZZ_ENV = "GPUPOOL_FUZZ_HOSTILE"
SAMPLES = {*HOSTILE.values(), *UNSTORABLE.values()}


def allowed_text(value: Any) -> bool:
    """``value`` is text the document allows in every text field (a script needs a letter)."""
    return (
        isinstance(value, str) and "\0" not in value and re.search("[A-Za-z0-9]", value) is not None
    )


def queued(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` asking for one H100 (which ada's notebook keeps busy, so the job waits in the
    queue and the pages show it) where its offer, gpus and nodes were allowed or left out."""
    shape = {"offer": "h100", "gpus": 1, "nodes": 1}
    if not (allowed_text(body.get("offer")) or body.get("offer") is None):
        return body
    for key in ("gpus", "nodes"):
        value = body.get(key)
        if not (value is None or (type(value) is int and 1 <= value <= 64)):
            return body
    return {**body, **shape}


@schema.hook
def flatmap_body(ctx: Any, body: Any) -> st.SearchStrategy[Any]:
    """A job submission with hostile text in one place where it had allowed text (or an
    optional field had none), so that a case made to break the document still breaks it."""
    where = (ctx.operation.method.upper(), ctx.operation.path)
    if not isinstance(body, dict) or where != ("POST", "/jobs"):
        return st.just(body)
    base = queued(body)  # the text where the pages show it
    variants = [
        HOSTILE_TEXT.map(lambda text, key=key: {**base, key: text})
        for key in TEXT_FIELDS
        if allowed_text(base.get(key)) or (key != "script" and base.get(key) is None)
    ]
    args, env = base.get("args"), base.get("env")
    if args is None or isinstance(args, list):
        variants.append(HOSTILE_TEXT.map(lambda text: {**base, "args": [*(args or []), text]}))
    if env is None or (isinstance(env, dict) and FUZZ_ENV not in env):
        variants.append(
            HOSTILE_TEXT.map(lambda text: {**base, "env": {**(env or {}), FUZZ_ENV: text}})
        )
        variants.append(
            HOSTILE_TEXT.filter(lambda text: text not in (env or {})).map(
                lambda text: {**base, "env": {**(env or {}), text: "x"}}
            )
        )
    return st.one_of(*variants, st.just(body))


def hostile(body: Any) -> bool:
    """Whether a submission carries what :func:`flatmap_body` put there: one of the samples of
    :mod:`tests.hub.hostile`, or the environment variable it sets."""
    if not isinstance(body, dict):
        return False
    env = body.get("env") if isinstance(body.get("env"), dict) else {}
    texts = [*body.values(), *(body.get("args") or []), *env.keys(), *env.values()]
    return FUZZ_ENV in env or any(isinstance(t, str) and t in SAMPLES for t in texts)


# -- the run's figures -----------------------------------------------------------------------
@dataclass
class Figures:
    """Cases by phase and responses by status class, per operation (``undeclared methods``:
    the coverage phase's calls with methods the document does not list, e.g. PUT /offers)."""

    cases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    by_operation: dict[str, Counter[str]] = field(default_factory=dict)
    numeric_text: int = 0
    hostile: Counter[str] = field(default_factory=Counter)
    failed: int = 0

    def record(self, case: Any, status: int) -> None:
        declared = case.method.upper() == case.operation.method.upper()
        label = case.operation.label if declared else "undeclared methods"
        self.cases[case.meta.phase.name.value if case.meta else "explicit"] += 1
        self.statuses[f"{status // 100}xx"] += 1
        self.by_operation.setdefault(label, Counter())[f"{status // 100}xx"] += 1
        query = case.query if isinstance(case.query, dict) else {}
        self.numeric_text += any(isinstance(v, str) and not v.isascii() for v in query.values())
        if case.method.upper() == "POST" and hostile(case.body):
            self.hostile[f"{status // 100}xx"] += 1

    def table(self) -> str:
        def counts(c: Counter[str]) -> str:
            return ", ".join(f"{k}: {v}" for k, v in sorted(c.items()))

        operations = len(self.by_operation) - ("undeclared methods" in self.by_operation)
        return "\n".join(
            [
                f"API fuzz: schemathesis {schemathesis.__version__}, seed {SEED}, "
                f"{EXAMPLES} examples per operation and stateful scenarios",
                f"{operations} operations, {self.cases.total()} cases ({counts(self.cases)}), "
                f"{self.numeric_text} with non-ASCII text in the query, "
                f"{self.hostile.total()} submissions with hostile samples ({counts(self.hostile)})",
                f"responses: {counts(self.statuses)}; {self.failed} failed a check",
                *(f"  {label:28} {counts(c)}" for label, c in sorted(self.by_operation.items())),
            ]
        )


FIGURES = Figures()


# -- the hub -----------------------------------------------------------------------------------
CHEAP_JOBS = 'c.LocalJobBackend.python = "/bin/false"\nc.LocalJobBackend.job_network = "host"\n'
"""Jobs start and fail at once (set before the demo's config builds the job manager), on the
machine's network: the admin page must then say that jobs' rendezvous are reachable."""


@dataclass
class API:
    base_url: str
    headers: dict[str, str]
    hub: Hub

    @property
    def token(self) -> str:
        return self.headers["Authorization"].removeprefix("token ")

    def prepare(self, case: Any) -> None:
        """What every case goes through before it is sent: :meth:`send_nulls`, then
        :meth:`settle_follow`."""
        self.send_nulls(case)
        self.settle_follow(case)

    @staticmethod
    def send_nulls(case: Any) -> None:
        """A query value generated as ``null`` is sent as the text ``null``. The HTTP client
        drops a ``None`` parameter, so the request that went out was valid while schemathesis
        still counted it as negative data, and a 200 failed ``negative_data_rejection``
        (schemathesis issues #2312, #2900 are this family; seen on CI: ``GET /jobs`` with
        ``limit`` null)."""
        for name, value in list((case.query or {}).items()):
            if value is None:
                case.query[name] = "null"

    def settle_follow(self, case: Any) -> None:
        """A followed log streams until its job ends, and GPU jobs never leave the queue here
        (ada's notebook holds her quota): a follow of a job that has not ended is sent after
        cancelling the job, or, for the queued job ``job_id`` points at (which must stay),
        without ``follow``. Whatever the timing, no call waits out its timeout."""
        job_id = (case.path_parameters or {}).get("job_id")
        if not case.path.endswith("/logs") or "follow" not in (case.query or {}):
            return
        job = self.hub.as_user(self.token, "GET", f"/jobs/{job_id}")
        if job.status_code != 200 or job.json()["state"] in FINAL:
            return
        if job_id in JOBS.mine:
            del case.query["follow"]
        else:
            self.hub.as_user(self.token, "DELETE", f"/jobs/{job_id}")

    def check(self, case: Any, response: Any) -> None:
        """``response`` to ``case`` holds to the document (and to who may see which job)."""
        FIGURES.record(case, response.status_code)
        try:
            case.validate_response(response, checks=CHECKS, headers=self.headers)
            if (case.path_parameters or {}).get("job_id") in JOBS.others:
                assert response.status_code == 404, f"{USER} reached {OTHER}'s job"
        except BaseException:
            FIGURES.failed += 1
            raise


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[API]:
    state = tmp_path_factory.mktemp("fuzz-hub")
    with homes() as home_root, running(Hub(state, home_root, prelude=CHEAP_JOBS)) as hub:
        yield prepared(hub)
        cancel_all_but_the_fixed_jobs(hub, hub.token(USER))


ACTIVE = {"queued", "starting", "running"}


def cancel_all_but_the_fixed_jobs(hub: Hub, token: str) -> None:
    """Cancel every job of the token's user that is queued or running, on every page of
    ``GET /jobs``, except the ones ``job_id`` points at (:data:`JOBS`)."""
    active, cursor = [], None
    while True:
        params = {"limit": 500, **({"cursor": cursor} if cursor else {})}
        page = hub.as_user(token, "GET", "/jobs", params=params).json()
        active += [j["id"] for j in page["jobs"] if j["state"] in ACTIVE]
        if not (cursor := page["next"]):
            break
    for job_id in set(active) - set(JOBS.mine):
        hub.as_user(token, "DELETE", f"/jobs/{job_id}")


def prepared(hub: Hub) -> API:
    """ada's notebook takes her whole quota; the jobs ``job_id`` points at: ada's CPU job (2
    ranks, failed at once), her GPU job (2 ranks, queued behind her notebook), one of ben's."""
    spawn(hub, USER, "vision|h100|2")
    token = hub.token(USER)

    def submit(token: str, **fields: Any) -> str:
        r = hub.as_user(token, "POST", "/jobs", json={"script": "print('hi')", **fields})
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    JOBS.mine += [submit(token, offer="cpu", gpus=2), submit(token, offer="h100", gpus=2)]
    JOBS.others.append(submit(hub.token(OTHER), offer="cpu"))
    failed = wait_job(hub, token, JOBS.mine[0], FINAL)
    assert failed["reason"] == "torchrun exited 1 (see the rank logs)"  # /bin/false, not torch
    assert hub.as_user(token, "GET", f"/jobs/{JOBS.mine[1]}").json()["state"] == "queued"
    return API(f"{hub.url}/hub/api/gpupool", {"Authorization": f"token {token}"}, hub)


# -- the fuzz ----------------------------------------------------------------------------------
@schema.parametrize()
@settings(**SETTINGS)
def test_every_operation_answers_as_its_document_says(case: Any, api: API) -> None:
    api.prepare(case)
    api.check(case, case.call(base_url=api.base_url, headers=api.headers, timeout=30))


def test_linked_operations_answer_as_the_document_says(api: API) -> None:
    """Scenarios along the document's links: POST /jobs, then GET, logs and DELETE of the job."""

    class Scenarios(LINKED.as_state_machine()):  # type: ignore[misc]
        def setup(self) -> None:
            # Every scenario starts from the same hub: what earlier cases left queued is
            # cancelled. Otherwise a POST answers 201 or 429 (the per-user job limit) by what
            # ran before, the links it offers differ, and Hypothesis, replaying a scenario,
            # finds it drew differently (FlakyStrategyDefinition).
            cancel_all_but_the_fixed_jobs(api.hub, api.token)

        def before_call(self, case: Any) -> None:
            api.prepare(case)

        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": api.base_url, "headers": api.headers, "timeout": 30}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            api.check(case, response)

    Scenarios.run(settings=settings(**SETTINGS, stateful_step_count=6, derandomize=True))


def test_what_the_fuzz_stored_renders_on_the_pages_and_in_the_cli(api: API) -> None:
    """Every job the fuzz stored, hostile text and all, on the pages and in ``gpupool jobs``."""
    hub, token = api.hub, api.token
    assert FIGURES.hostile["2xx"], "the fuzz stored no job with a hostile sample"
    password = (hub.state / "admin-password").read_text().strip()
    for session, path in [
        (hub.login("admin", password), "/hub/gpupool"),
        (hub.login(USER), "/hub/gpupool/mine"),
        (hub.login(USER), "/hub/home"),
    ]:
        check_page(session.get(f"{hub.url}{path}", timeout=60), path)
    listed = json.loads(gpupool(hub, token, "jobs", "--json"))["jobs"]
    table = gpupool(hub, token, "jobs")
    safe_for_a_terminal(table, "gpupool jobs")
    assert len(table.splitlines()) == 1 + len(listed)  # a line per job


def test_the_admin_page_warns_when_jobs_share_the_machines_network(api: API) -> None:
    """Without a private network per job (``host``, or where the kernel refuses one) the admin
    page says, in warning style, that any account can reach a job's rendezvous."""
    hub = api.hub
    password = (hub.state / "admin-password").read_text().strip()
    r = hub.login("admin", password).get(f"{hub.url}/hub/gpupool", timeout=60)
    assert r.status_code == 200
    line = BeautifulSoup(r.content.decode(), "html.parser").select_one("#gp-job-network")
    assert line is not None, "the admin page does not say what network jobs have"
    assert "text-warning-emphasis" in (line.get("class") or [])
    assert "any account on this machine can reach a job's rendezvous" in line.get_text()


SERVERS_ONLY = {"POST /servers/port"}
"""Operations only a starting server's own token may use (the Slurm spawner's port report,
tested in tests/slurm/test_slurm_spawner.py): the fuzz, with ada's token, meets only refusals."""


def test_the_fuzz_reached_every_operation(capsys: pytest.CaptureFixture[str]) -> None:
    with capsys.disabled():
        print("\n" + FIGURES.table())
    if FIGURES.failed:
        pytest.skip("the fuzz failed (above): it stopped early")
    for label in {o.ok().label for o in schema.get_all_operations()}:
        if label in SERVERS_ONLY:  # ada's own token must never have got through
            assert not FIGURES.by_operation.get(label, {}).get("2xx"), f"{label} took ada's token"
            continue
        assert FIGURES.by_operation.get(label, {}).get("2xx"), (
            f"{label} never answered 2xx: the fuzz met only refusals there"
        )
