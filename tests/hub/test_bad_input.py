"""Bad or heavy input never hurts the hub, in a real JupyterHub.

Whole numbers are read strictly (``"²"`` passes ``str.isdigit()`` but not ``int()``); spawn
options and job submissions over their caps get a short 413 that states the limit; a refused
start leaves nothing of its options in JupyterHub's database; refusals quote at most a few
dozen characters of what was sent; and a refusal is one INFO line in the hub's log, not an
ERROR with a traceback. Same demo pool as the spawner tests (team vision: ada, ben, cal; team
nlp: dee, eli).
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import pytest
import requests

from gpupool.core.parse import ECHO_LIMIT, json_size
from tests.hub.conftest import Hub, refusal, wait_for

BIG = 5 << 20
OPTIONS_LIMIT = 4096  # GPUSpawnerMixin.max_user_options_bytes (default)
SUBMISSION_LIMIT = 2 << 20  # JobManager.max_submission_bytes (default)
SHORT = 2048  # a refusal's reply is at most this long, whatever was sent


def stored_options(hub: Hub, user: str) -> Any:
    """``user_options`` of ``user``'s default server as JupyterHub's database holds them."""
    db = hub.state / "jupyterhub.sqlite"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        row = con.execute(
            "SELECT s.user_options FROM spawners s JOIN users u ON s.user_id = u.id"
            " WHERE u.name = ? AND s.name = ''",
            (user,),
        ).fetchone()
    return json.loads(row[0]) if row and row[0] else {}


def api_options(hub: Hub, user: str) -> Any:
    """``user_options`` of ``user``'s default server as JupyterHub's REST API shows them."""
    r = hub.api("GET", f"/users/{user}", params={"include_stopped_servers": "1"})
    assert r.status_code == 200, r.text
    return r.json()["servers"].get("", {}).get("user_options", {})


def spawn_rest(hub: Hub, user: str, options: dict[str, Any]) -> requests.Response:
    return hub.api("POST", f"/users/{user}/server", json=options)


def assert_nothing_kept(hub: Hub, user: str) -> None:
    assert hub.server(user) is None and f"{user}/" not in hub.allocations()
    assert stored_options(hub, user) == {} and api_options(hub, user) == {}


@pytest.fixture(scope="module")
def ada(hub: Hub) -> str:
    return hub.token("ada")


# -- strict whole numbers ------------------------------------------------------------------------
@pytest.mark.parametrize("count", ["²", "١", "𝟗", "9" * 3000, " 1", True])
def test_a_count_that_is_no_ascii_whole_number_gets_400(hub: Hub, count: object) -> None:
    r = spawn_rest(hub, "ada", {"offer": "h100", "count": count})
    assert r.status_code == 400, r.text
    assert r.json()["message"] == "user_options.count must be a whole number from 1 to 64."
    assert_nothing_kept(hub, "ada")


@pytest.mark.parametrize("choice", ["vision|h100|²", "vision|h100|١", "vision|h100|" + "9" * 3000])
def test_a_form_count_that_is_no_ascii_whole_number_gets_400(hub: Hub, choice: str) -> None:
    r = hub.spawn_form("ada", choice)
    assert r.status_code == 400
    assert refusal(r) == "Choose one of the offers on the form."
    assert hub.server("ada") is None and "ada/" not in hub.allocations()


def test_log_queries_read_whole_numbers_strictly(hub: Hub, ada: str) -> None:
    r = hub.as_user(ada, "POST", "/jobs", json={"script": "print(1)", "offer": "cpu"})
    assert r.status_code == 201, r.text
    job = r.json()["id"]
    for query, message in [
        ({"rank": "²"}, "rank must be a whole number from 0 to 0."),
        ({"rank": "1"}, "rank must be a whole number from 0 to 0."),
        ({"offset": "²"}, "offset must be a whole number >= 0."),
        ({"offset": "9" * 5000}, "offset must be a whole number >= 0."),
        ({"offset": "-1"}, "offset must be a whole number >= 0."),
    ]:
        r = hub.as_user(ada, "GET", f"/jobs/{job}/logs", params=query)
        assert (r.status_code, r.json()["message"]) == (400, message), query
    assert hub.as_user(ada, "GET", f"/jobs/{job}/logs", params={"offset": "0"}).status_code == 200


def test_an_unknown_query_parameter_gets_400_naming_what_the_resource_takes(
    hub: Hub, ada: str
) -> None:
    """A misspelt parameter is refused, not ignored (the API fuzz sends names off the document,
    such as ``J®\x13``); JupyterHub's own ``token`` is not one."""
    for path, query, takes in [
        ("/jobs", {"limt": "5"}, "limit, cursor"),
        ("/jobs", {"J\u00ae\x13": "null", "limit": "1"}, "limit, cursor"),
        ("/offers", {"all": "1"}, "none"),
    ]:
        r = hub.as_user(ada, "GET", path, params=query)
        assert r.status_code == 400, (path, query, r.text)
        assert r.json()["message"].endswith(f"this resource takes {takes}"), r.text
    # JupyterHub's own token parameter is no unknown one (whether JupyterHub then takes a token
    # from the URL is its own setting)
    r = requests.get(f"{hub.url}/hub/api/gpupool/jobs", params={"token": ada}, timeout=60)
    assert "unknown query parameter" not in r.text, r.text


# -- size caps, short replies, nothing stored --------------------------------------------------
@pytest.mark.parametrize(
    "options",
    [
        {"offer": "h100", "note": "v" * BIG},
        {"offer": "h100", "k" * BIG: 1},
        {"offer": "h100", **{f"key{i}": i for i in range(OPTIONS_LIMIT)}},
    ],
    ids=["5 MB value", "5 MB key", "4096 keys"],
)
def test_spawn_options_over_the_cap_get_a_short_413_and_are_not_kept(
    hub: Hub, options: dict[str, Any]
) -> None:
    r = spawn_rest(hub, "eli", options)
    assert r.status_code == 413, r.text[:300]
    assert len(r.content) < SHORT
    size = json_size(options)
    assert r.json()["message"] == f"user_options is {size} bytes; the limit is 4096 bytes."
    assert_nothing_kept(hub, "eli")


@pytest.mark.parametrize(
    ("user", "options", "status", "quoted"),
    [
        ("ada", {"offer": "h100", "count": "k" * 3000}, 400, "user_options.count must be a whole"),
        ("ada", {"offer": "o" * 3000}, 400, "Unknown offer 'o"),
        ("ada", {"offer": "h100", "team": "t" * 3000}, 403, "You are not in team 't"),
        ("dee", {"offer": "h100", "count": 1}, 403, "Team nlp may not request h100"),
        ("ada", {"offer": "mig-3g.40gb", "count": 2}, 400, "Offer mig-3g.40gb takes a count"),
    ],
)
def test_a_refused_start_keeps_no_options_and_quotes_little(
    hub: Hub, user: str, options: dict[str, Any], status: int, quoted: str
) -> None:
    r = spawn_rest(hub, user, options)
    assert r.status_code == status, r.text[:300]
    message = r.json()["message"]
    assert message.startswith(quoted) and len(r.content) < SHORT
    longest = max((len(w) for w in message.replace("'", " ").split()), default=0)
    assert longest <= ECHO_LIMIT + 2  # the quoted name, cut, with "…" and punctuation
    assert_nothing_kept(hub, user)


def test_a_big_spawn_form_gets_a_413_with_the_limit(hub: Hub) -> None:
    s = hub.login("ada")
    s.get(f"{hub.url}/hub/spawn", timeout=30)
    data = {"gpupool_choice": "vision|h100|1", "junk": "x" * BIG, "_xsrf": s.cookies.get("_xsrf")}
    r = s.post(f"{hub.url}/hub/spawn", data=data, timeout=60, allow_redirects=False)
    assert r.status_code == 413
    assert refusal(r).startswith("The spawn form is ")
    assert refusal(r).endswith("bytes; the limit is 4096 bytes.")
    assert b"xxxxxxxxxx" not in r.content
    assert_nothing_kept(hub, "ada")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "n" * (3 << 20)}, f"the limit is {SUBMISSION_LIMIT} bytes."),
        ({"env": {"A": "b" * (200 << 10)}}, "the limit is 32768 bytes."),
        ({"args": ["a" * (30 << 10)] * 10}, "the limit is 262144 bytes."),
    ],
    ids=["3 MiB body", "200 KiB env entry", "300 KiB of args"],
)
def test_a_job_submission_over_a_cap_gets_a_short_413(
    hub: Hub, ada: str, fields: dict[str, Any], message: str
) -> None:
    body = json.dumps({"script": "print(1)", "offer": "cpu", **fields})
    before = {j["id"] for j in hub.as_user(ada, "GET", "/jobs").json()["jobs"]}
    r = hub.as_user(ada, "POST", "/jobs", data=body)
    assert r.status_code == 413, r.text[:300]
    assert r.json()["message"].endswith(message) and len(r.content) < SHORT
    assert {j["id"] for j in hub.as_user(ada, "GET", "/jobs").json()["jobs"]} == before


def test_unknown_job_fields_and_job_ids_are_quoted_short(hub: Hub, ada: str) -> None:
    fields = {"script": "print(1)", **{"k" * 5000 + str(i): 1 for i in range(50)}}
    r = hub.as_user(ada, "POST", "/jobs", json=fields)
    assert r.status_code == 400 and len(r.content) < SHORT
    assert r.json()["message"].endswith(" and 45 more.")
    r = hub.as_user(ada, "GET", "/jobs/" + "j" * 5000)
    assert r.status_code == 404 and len(r.content) < SHORT
    log = hub.log.read_text(errors="replace").splitlines()  # written before the answer
    refused = [line for line in log if "gpupool: refused GET /hub/api/gpupool/jobs/jjj" in line]
    assert refused and all(len(line) < 500 for line in refused), [len(x) for x in refused]


# -- refusals in the log -----------------------------------------------------------------------
def test_a_refusal_is_one_info_line_not_an_error_with_a_traceback(hub: Hub) -> None:
    mark = hub.log.stat().st_size
    assert hub.spawn_form("cal", "vision|mig-2g.20gb|1").status_code == 403  # offer not allowed
    assert hub.spawn_form("ada", "vision|h100|²").status_code == 400  # refused by the form
    assert spawn_rest(hub, "dee", {"offer": "h100"}).status_code == 403
    assert spawn_rest(hub, "eli", {"offer": "h100", "k" * BIG: 1}).status_code == 413
    assert spawn_rest(hub, "ada", {"offer": "h100", "count": 3}).status_code == 400

    def logged() -> str | None:
        text = hub.log.read_bytes()[mark:].decode("utf-8", "replace")
        return text if "POST /hub/api/users/ada/server" in text else None

    text = wait_for(logged, 30, "the refusals in the hub's log")
    assert "Traceback" not in text
    assert [line for line in text.splitlines() if line.startswith("[E ")] == []
    refused = [line for line in text.splitlines() if "gpupool: refused" in line]
    assert len(refused) == 5, refused
    assert all(line.startswith("[I ") for line in refused)
    for who, why in [
        ("cal/", "Team vision may not request mig-2g.20gb"),
        ("ada/", "Choose one of the offers on the form."),
        ("dee/", "Team nlp may not request h100"),
        ("eli/", "the limit is 4096 bytes."),
        ("ada/", "Offer h100 takes a count from 1 to 2, not 3."),
    ]:
        assert sum(who in line and why in line for line in refused) == 1, (who, why)
    assert "k" * 1000 not in text  # no 5 MB key in the log (other tests' long URLs may be)


# -- text that can break a page, or a start after its GPUs were granted ------------------------
def job_ids(hub: Hub, token: str) -> set[str]:
    r = hub.as_user(token, "GET", "/jobs")
    assert r.status_code == 200, r.text[:300]
    return {j["id"] for j in r.json()["jobs"]}


def pages_answer(hub: Hub) -> None:
    """The admin page and ada's "My GPUs" answer 200."""
    password = (hub.state / "admin-password").read_text().strip()
    for who, path in [
        (hub.login("admin", password), "/hub/gpupool"),
        (hub.login("ada"), "/hub/gpupool/mine"),
    ]:
        r = who.get(f"{hub.url}{path}", timeout=30)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text[-300:]}"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ('"name": "\\ud800"', "name contains a lone surrogate (U+D800 at character 0)"),
        ('"name": "ok\\udfff"', "name contains a lone surrogate (U+DFFF at character 2)"),
        ('"workdir": "a\\ud83d"', "workdir contains a lone surrogate (U+D83D at character 1)"),
        ('"args": ["x", "\\ude00y"]', "args[1] contains a lone surrogate (U+DE00 at character 0)"),
        ('"env": {"A": "\\ud800"}', "env['A'] contains a lone surrogate (U+D800 at character 0)"),
        (
            '"env": {"\\ud800": "1"}',
            "A key of env contains a lone surrogate (U+D800 at character 0)",
        ),
        ('"args": ["a\\u0000b"]', "args[0] contains a NUL character (at character 1)"),
        ('"workdir": "dir\\u0000"', "workdir contains a NUL character (at character 3)"),
        ('"filename": "a\\u0000.py"', "filename contains a NUL character (at character 1)"),
        ('"env": {"A": "\\u0000"}', "env['A'] contains a NUL character (at character 0)"),
        ('"env": {"A=B": "1"}', "env name 'A=B' is not a portable name"),
        ('"env": {"": "1"}', "env name '' is not a portable name"),
        ('"env": {"1A": "1"}', "env name '1A' is not a portable name"),
        ('"env": {"A B": "1"}', "env name 'A B' is not a portable name"),
    ],
)
def test_text_no_page_or_start_can_hold_gets_400_and_nothing_is_stored(
    hub: Hub, ada: str, fields: str, message: str
) -> None:
    before = job_ids(hub, ada)
    body = '{"script": "print(1)", "offer": "cpu", ' + fields + "}"
    r = hub.as_user(ada, "POST", "/jobs", data=body.encode())
    assert r.status_code == 400, r.text[:300]
    assert r.json()["message"].startswith(message), r.json()["message"]
    assert job_ids(hub, ada) == before
    pages_answer(hub)


def test_a_nul_in_the_script_gets_400(hub: Hub, ada: str) -> None:
    before = job_ids(hub, ada)
    r = hub.as_user(ada, "POST", "/jobs", json={"script": "print(1)\0", "offer": "cpu"})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["message"].startswith("script contains a NUL character (at character 8)")
    assert job_ids(hub, ada) == before


@pytest.mark.parametrize("depth", [33, 1000, 10_000, 100_000])
@pytest.mark.parametrize("where", ["args", "unknown"])
def test_deeply_nested_json_gets_400_without_a_traceback(
    hub: Hub, ada: str, depth: int, where: str
) -> None:
    mark = hub.log.stat().st_size
    before = job_ids(hub, ada)
    body = '{"script": "print(1)", "' + where + '": ' + "[" * depth + "]" * depth + "}"
    r = hub.as_user(ada, "POST", "/jobs", data=body.encode())
    assert r.status_code == 400, r.text[:300]
    assert r.json()["message"] == (
        "The request body nests arrays and objects deeper than 32 levels; send a flatter document."
    )
    assert job_ids(hub, ada) == before
    text = hub.log.read_bytes()[mark:].decode("utf-8", "replace")
    assert "Traceback" not in text and "RecursionError" not in text


def test_nesting_inside_strings_is_only_text(hub: Hub, ada: str) -> None:
    """Brackets in strings (escaped quotes too) are no nesting: such a job is accepted."""
    name = '\\"[[[[' * 40 + "{" * 100
    body = '{"script": "print(\'[[[[\' * 50)", "offer": "cpu", "name": "' + name + '"}'
    r = hub.as_user(ada, "POST", "/jobs", data=body.encode())
    assert r.status_code == 201, r.text[:300]
    hub.as_user(ada, "DELETE", f"/jobs/{r.json()['id']}")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"offer": "h100", "note": "\ud800"}, "user_options['note'] contains a lone surrogate"),
        ({"offer": "h100", "\udfff": 1}, "A key of user_options contains a lone surrogate (U+DFFF"),
        ({"offer": "h100", "note": ["a", "b\0"]}, "user_options['note'][1] contains a NUL"),
        ({"offer": "h100\0"}, "user_options['offer'] contains a NUL character (at character 4)"),
        ({"offer": "h100", "deep": json.loads("[" * 33 + "]" * 33)}, "user_options nests"),
        ({"offer": "h100", "deep": json.loads("[" * 900 + "]" * 900)}, "user_options nests"),
    ],
    ids=["surrogate value", "surrogate key", "NUL in a list", "NUL in the offer", "33", "900"],
)
def test_spawn_options_no_page_can_hold_get_400_and_are_not_kept(
    hub: Hub, options: dict[str, Any], message: str
) -> None:
    r = spawn_rest(hub, "ben", options)
    if r.status_code < 300:  # it started (the old code): stop it for the next case
        hub.wait_ready("ben")
        hub.stop_server("ben")
    assert r.status_code == 400, r.text[:300]
    assert r.json()["message"].startswith(message), r.json()["message"]
    assert_nothing_kept(hub, "ben")


FORGED = "[E 2001-01-01 00:00:00.000 JupyterHub app:1] forged"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/jobs", {"script": "print(1)", f"x\n{FORGED}\x1b[2J": 1}),
        ("GET", "/jobs/x%0A" + FORGED.replace(" ", "%20"), None),
        ("POST", "/jobs", {"script": "print(1)", "offer": f"x\r\n{FORGED}\u202e"}),
    ],
    ids=["unknown field", "job id", "offer"],
)
def test_a_refusal_quotes_control_characters_escaped_and_forges_no_log_line(
    hub: Hub, ada: str, method: str, path: str, body: Any
) -> None:
    r = hub.as_user(ada, method, path, json=body)
    assert r.status_code in (400, 404), r.text[:300]
    message = r.json()["message"]
    assert not {c for c in message if c in "\n\r\x1b\u202e"}, message
    assert "\\n" in message, message
    log = hub.log.read_text(errors="replace").splitlines()  # written before the answer
    assert [line for line in log if "forged" in line and "refused" in line]
    assert [line for line in log if line.startswith(FORGED)] == []
