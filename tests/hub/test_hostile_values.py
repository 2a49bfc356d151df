"""Hostile text a user stores breaks no page, no table and no JSON, for anyone, in a real hub.

What is stored, by ben (team vision): one job per value of :data:`HOSTILE` with that value in
every text field a job has (name, filename, working directory, an argument, an environment
value, the script); the options of his server, posted to JupyterHub's own spawn API, with the
values as values and as keys; a named server of his with a hostile display name, started through the
spawn form with a hostile extra field (which JupyterHub keeps in ``user_options``); and API
tokens with the values as notes (JupyterHub's own field, shown on its token page). The values:
markup that would run script if printed unescaped, quotes that would leave an attribute or a
script string, terminal escapes and other control characters, right-to-left overrides,
invisible characters, characters outside the BMP, template syntax, 10 KB of text. What no
page can hold (:data:`UNSTORABLE`: a lone surrogate, a NUL) is refused with 400 at every
gpupool door, and the test checks that too: everything else must be accepted.

What is rendered, as ben, ada (same team) and admin: every page (``/hub/gpupool``,
``/hub/gpupool/mine``, the spawn page, the home page, JupyterHub's admin and token pages),
the ``gpupool`` command's tables and JSON (the real command, as a process, against the real
hub), and the JSON of the lab's server extension in ben's real JupyterLab. A page is 200,
valid UTF-8, with no traceback, no element or event handler that the values made, and the
markup shown as text; a table is printed by a command that exits 0, with no control or
bidirectional-override character left raw for a terminal to obey, one line per job; JSON
parses and gives the values back exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from gpupool.core.parse import json_size
from tests.accounts import homes
from tests.hub.conftest import Hub, running, wait_for, xsrf
from tests.hub.hostile import HOSTILE, UNSTORABLE, check_page, gpupool, safe_for_a_terminal

NAMED = "hostile"
"""ben's named server (JupyterHub 6 takes only slugs as server names)..."""
DISPLAY = "<i>srv</i> &amp; 😀 {{7*7}} \"' x"
"""... and its display name (printable, no control or format characters: JupyterHub's rule)."""
SLEEPER = "import time\nwhile True:\n    time.sleep(1)\n"


def job_fields(value: str) -> dict[str, Any]:
    return {
        "name": value,
        "filename": value,
        "workdir": value,
        "args": [value, "--flag"],
        "env": {"HOSTILE": value},
        "script": f"print(1)  # {value}",
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    state = tmp_path_factory.mktemp("hostile")
    extra = "c.JupyterHub.allow_named_servers = True\n"
    with homes() as root, running(Hub(state, root, extra)) as h:
        yield h


@pytest.fixture(scope="module")
def stored(hub: Hub) -> dict[str, Any]:
    """Everything of :data:`HOSTILE` stored where a user can store it (see the docstring)."""
    ben = hub.token("ben")
    options: dict[str, Any] = {"offer": "h100", "count": 2}
    options |= {f"v-{name}": v for name, v in HOSTILE.items() if name != "10 KB"}
    options |= {v: name for name, v in HOSTILE.items() if name != "10 KB"}
    options["long"] = "L" * 1000
    assert json_size(options) < 4096  # GPUSpawnerMixin.max_user_options_bytes
    r = hub.api("POST", "/users/ben/server", json=options)
    assert r.status_code in (201, 202), r.text[:300]
    hub.wait_ready("ben")

    jobs: dict[str, str] = {}
    for name, value in HOSTILE.items():  # ben holds his cap (2 GPUs): these wait in the queue
        r = hub.as_user(ben, "POST", "/jobs", json={"offer": "h100", **job_fields(value)})
        assert (r.status_code, r.json()["state"]) == (201, "queued"), (name, r.text[:300])
        jobs[name] = r.json()["id"]
    sleeper = {**job_fields(HOSTILE["script string"]), "script": SLEEPER, "offer": "cpu"}
    r = hub.as_user(ben, "POST", "/jobs", json=sleeper)
    assert r.status_code == 201, r.text[:300]
    jobs["running"] = r.json()["id"]
    wait_for(lambda: state(hub, ben, jobs["running"]) == "running", 120, "the sleeper to run")

    s = hub.login("ben")  # the spawn form's door: an extra field, and a display name
    path = f"/hub/spawn/ben/{NAMED}"
    check_page(s.get(f"{hub.url}{path}", params={"display_name": DISPLAY}, timeout=60), path)
    if not named(hub):  # JupyterHub 6 shows the form; 5 spawns at once from the query's options
        form = {"gpupool_choice": "vision|cpu|1", "note": HOSTILE["markup"] + HOSTILE["bidi"]}
        r = s.post(
            f"{hub.url}{path}",
            data={**form, "_xsrf": xsrf(s, path)},
            timeout=60,
            allow_redirects=False,
        )
        assert r.status_code == 302, r.text[-500:]
    wait_for(lambda: named(hub).get("ready"), 120, "ben's named server to be ready")

    for value in HOSTILE.values():
        r = hub.api("POST", "/users/ben/tokens", json={"note": value, "scopes": []})
        assert r.status_code == 201, r.text[:300]
    return {"ben": ben, "jobs": jobs}


def state(hub: Hub, token: str, job_id: str) -> str:
    return str(hub.as_user(token, "GET", f"/jobs/{job_id}").json()["state"])


def named(hub: Hub) -> dict[str, Any]:
    servers = hub.api("GET", "/users/ben").json().get("servers", {})
    return dict(servers.get(NAMED) or {})


def admin(hub: Hub) -> requests.Session:
    return hub.login("admin", (hub.state / "admin-password").read_text().strip())


# -- what cannot be stored is refused at each door --------------------------------------------
@pytest.mark.parametrize("value", UNSTORABLE.values(), ids=UNSTORABLE.keys())
@pytest.mark.parametrize("field", ["name", "filename", "workdir", "args", "env", "script"])
def test_what_no_page_can_hold_is_refused_in_every_job_field(
    hub: Hub, stored: dict[str, Any], field: str, value: str
) -> None:
    ben = stored["ben"]
    before = {j["id"] for j in hub.as_user(ben, "GET", "/jobs").json()["jobs"]}
    fields = {"script": "print(1)", "offer": "h100", field: job_fields(value)[field]}
    r = hub.as_user(ben, "POST", "/jobs", json=fields)
    assert r.status_code == 400, r.text[:300]
    assert " contains a " in r.json()["message"]
    assert {j["id"] for j in hub.as_user(ben, "GET", "/jobs").json()["jobs"]} == before


@pytest.mark.parametrize("value", UNSTORABLE.values(), ids=UNSTORABLE.keys())
def test_what_no_page_can_hold_is_refused_in_spawn_options(hub: Hub, value: str) -> None:
    for options in ({"offer": "cpu", "note": value}, {"offer": "cpu", value: 1}):
        r = hub.api("POST", "/users/ada/server", json=options)
        assert r.status_code == 400, r.text[:300]
        assert hub.server("ada") is None


# -- pages --------------------------------------------------------------------------------------
def page_of(html: str) -> requests.Response:
    r = requests.Response()
    r.status_code, r._content = 200, html.encode()
    return r


@pytest.mark.parametrize(
    "html",
    [
        "<p><img src=x onerror=alert(1)></p>",
        "<td><b>bold</b></td>",
        '<script>alert("gp-markup")</script>',
        "<td>\" onmouseover=alert(2) x='</td><td title=\"\" onmouseover=alert(2) x=''>",
        "<form onsubmit='return confirm(\"x\");alert(3)'>",
        "<p>Traceback (most recent call last):</p>",
    ],
)
def test_the_page_check_finds_what_unescaped_values_make(html: str) -> None:
    check_page(page_of('<form onsubmit=\'return confirm("a \\"b\\" \\u003c")\'>'), "ok")
    with pytest.raises(AssertionError):
        check_page(page_of(html), "unescaped")


def pages(hub: Hub) -> dict[str, requests.Response]:
    ben, ada, boss = hub.login("ben"), hub.login("ada"), admin(hub)
    got = {}
    for who, session, path in [
        ("admin", boss, "/hub/gpupool"),
        ("admin", boss, "/hub/home"),
        ("admin", boss, "/hub/admin"),
        ("ben", ben, "/hub/gpupool/mine"),
        ("ben", ben, "/hub/home"),
        ("ben", ben, "/hub/token"),
        ("ada", ada, "/hub/gpupool/mine"),
        ("ada", ada, "/hub/spawn"),
        ("ada", ada, "/hub/home"),
    ]:
        got[f"{path} as {who}"] = session.get(f"{hub.url}{path}", timeout=60)
    return got


def test_every_page_shows_the_values_as_text(hub: Hub, stored: dict[str, Any]) -> None:
    got = pages(hub)
    soups = {what: check_page(r, what) for what, r in got.items()}
    for what in ("/hub/gpupool as admin", "/hub/gpupool/mine as ben"):
        text = soups[what].get_text()
        assert '<script>alert("gp-markup")</script>' in text, what  # shown, as text
        assert "&lt;b&gt; &amp;amp;" in text, what  # entities shown as typed
    running_job = stored["jobs"]["running"]
    row = soups["/hub/gpupool as admin"].select_one(
        f'tr[data-allocation] input[value="{running_job}"]'
    )
    assert row is not None, "no cancel form for ben's running job"
    home = soups["/hub/home as ben"].get_text()
    if named(hub).get("display_name"):  # JupyterHub 6 keeps a display name (5 has none)
        assert "<i>srv</i>" in home  # the named server's name, as text


def test_the_spawn_page_of_a_server_with_hostile_options_and_name(
    hub: Hub, stored: dict[str, Any]
) -> None:
    r = hub.api("DELETE", f"/users/ben/servers/{NAMED}")
    assert r.status_code in (202, 204), r.text
    wait_for(lambda: not named(hub).get("ready"), 60, "ben's named server to stop")
    s = hub.login("ben")
    path = f"/hub/spawn/ben/{NAMED}"
    check_page(s.get(f"{hub.url}{path}", timeout=60), path)
    check_page(s.get(f"{hub.url}/hub/home", timeout=60), "/hub/home as ben, named server stopped")


# -- the CLI ------------------------------------------------------------------------------------
def test_the_cli_tables_print_the_values_visibly_and_the_json_exactly(
    hub: Hub, stored: dict[str, Any]
) -> None:
    boss = hub.token("admin", ["custom:gpupool:admin"])
    for who, token in [("ben", stored["ben"]), ("admin", boss)]:
        listed = hub.as_user(token, "GET", "/jobs").json()["jobs"]  # one page: all of them
        table = gpupool(hub, token, "jobs")
        safe_for_a_terminal(table, f"gpupool jobs as {who}")
        assert len(table.splitlines()) == 1 + len(listed), table[:3000]  # a line per job
        assert '<script>alert("gp-markup")</script>' in table
        as_json = json.loads(gpupool(hub, token, "jobs", "--json"))
        names = {j["id"]: j["name"] for j in as_json["jobs"]}
        assert names == {j["id"]: j["name"] for j in listed}
        for name, job_id in stored["jobs"].items():
            shown = gpupool(hub, token, "show", job_id)
            safe_for_a_terminal(shown, f"gpupool show ({name}) as {who}")
            assert (
                json.loads(gpupool(hub, token, "show", job_id, "--json"))["name"] == names[job_id]
            )
        for command in ("teams", "offers"):
            safe_for_a_terminal(gpupool(hub, token, command), f"gpupool {command} as {who}")
    for name, job_id in stored["jobs"].items():
        if name != "running":
            assert names[job_id] == HOSTILE[name][:200]  # names are kept to 200 characters


# -- the lab's server extension, in ben's JupyterLab ---------------------------------------------
def test_the_lab_extension_gives_the_values_back_exactly(hub: Hub, stored: dict[str, Any]) -> None:
    token = hub.token("ben", ["access:servers!user=ben"])
    headers = {"Authorization": f"token {token}"}

    def lab(path: str) -> Any:
        r = requests.get(f"{hub.url}/user/ben/gpupool/{path}", headers=headers, timeout=60)
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text[-500:]}"
        assert "Traceback" not in r.text
        return json.loads(r.content.decode("utf-8"))

    jobs = {j["id"]: j for j in lab("jobs")["jobs"]}
    for name, job_id in stored["jobs"].items():
        expected = HOSTILE["script string" if name == "running" else name][:200]
        assert jobs[job_id]["name"] == expected, name
        assert lab(f"jobs/{job_id}")["name"] == expected, name
    assert lab("allocation")["offer"] == "h100"
    lab("offers")
