"""The admin page ``/hub/gpupool`` and "My GPUs" ``/hub/gpupool/mine`` in a real hub, through the
browser's path (cookie login, forms with JupyterHub's ``_xsrf`` token).

Same demo pool as the spawner tests (simulated 4× H100-80GB; GPUs 2 and 3 with MIG instances
3g.40gb + 2g.20gb + 1g.10gb). ``admin`` logs in with the demo's admin password. Every server
started here is stopped at the end of the module.
"""

from __future__ import annotations

import ast
import html
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import requests
from bs4 import BeautifulSoup, Tag

from gpupool.pool import load_inventory
from tests.hub.admin_pages import admin, page, soup_of
from tests.hub.conftest import ROOT, Hub, spawn, stop_all, wait_for

USERS = ("ada", "ben", "cal")
SLEEPER = "import time\nwhile True:\n    time.sleep(0.5)\n"


@pytest.fixture(scope="module", autouse=True)
def stop_servers_afterwards(hub: Hub) -> Iterator[None]:
    yield
    stop_all(hub, *USERS)


def xsrf_of(soup: BeautifulSoup) -> str:
    field = soup.select_one('form[method="post"] input[name="_xsrf"]')
    assert field is not None, "no form with an _xsrf field on the page"
    return str(field["value"])


def cells(row: Tag) -> list[str]:
    return [" ".join(td.get_text(" ").split()) for td in row.find_all("td")]


def running(hub: Hub, user: str, choice: str) -> None:
    """``user``'s server runs (started with ``choice`` if it does not)."""
    server = hub.server(user)
    if not (server and server.get("ready")):
        spawn(hub, user, choice)


def inventory() -> Any:
    """The pool the demo config finds here: NVML's GPUs, or its simulated fallback."""
    tree = ast.parse((ROOT / "jupyterhub_config.py").read_text())
    (fallback,) = (
        ast.literal_eval(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and ast.unparse(node.targets[0]) == "c.GPUPool.simulated_fallback"
    )
    return load_inventory("nvml", fallback)[0]


def post(s: requests.Session, hub: Hub, action: str, data: dict[str, str]) -> requests.Response:
    return s.post(f"{hub.url}/hub/gpupool/{action}", data=data, timeout=60, allow_redirects=False)


def test_the_pages_send_strangers_to_the_login(hub: Hub) -> None:
    for path in ("/hub/gpupool", "/hub/gpupool/mine"):
        r = requests.get(f"{hub.url}{path}", timeout=30, allow_redirects=False)
        assert r.status_code == 302, path
        assert urlsplit(r.headers["Location"]).path == "/hub/login"
    r = requests.post(f"{hub.url}/hub/gpupool/stop", data={"user": "ada"}, timeout=30)
    assert r.status_code == 403


def test_an_admin_sees_the_inventory_the_allocations_and_the_teams(hub: Hub) -> None:
    running(hub, "ada", "vision|h100|1")
    running(hub, "ben", "vision|cpu|1")
    soup = page(admin(hub), hub)
    inv = inventory()
    assert soup.select_one("#gp-simulated") is not None or not inv.simulated
    drawn = {str(tr["data-uuid"]): tr for tr in soup.select("tr.gp-gpu")}
    assert set(drawn) == {g.uuid for g in inv.gpus}
    for gpu in inv.gpus:
        if gpu.mig_mode != "fixed":
            continue
        slots = {(c["data-profile"], c["data-slots"]) for c in drawn[gpu.uuid].select(".gp-cell")}
        want = {(i.profile, None) for i in gpu.instances}
        assert {p for p, _ in slots} >= {p for p, _ in want}
        if inv.simulated:  # the demo's layout: 3g.40gb@0, 2g.20gb@4, 1g.10gb@6, slot 7 free
            assert slots == {("3g.40gb", "0-3"), ("2g.20gb", "4-5"), ("1g.10gb", "6"), ("", "7")}

    held = hub.allocations()["ada/"]
    row = soup.select_one(f'#allocations tr[data-allocation="{held.id}"]')
    assert row is not None, "no row for ada's allocation"
    text = cells(row)
    assert text[:5] == ["ada", "vision", "notebook ada/", "h100", "1"]
    assert held.devices[0].gpu in text[5]
    assert row.select_one('form[action="/hub/gpupool/stop"] input[name="user"]')["value"] == "ada"
    confirm = row.select_one("form")["onsubmit"]
    assert "Stop ada\\u0027s server? Unsaved work is lost." in confirm
    ada_gpu = drawn[held.devices[0].gpu].select(".gp-cell")
    assert [c["data-holder"] for c in ada_gpu] == ["ada"]  # a whole GPU fills its row
    assert soup.select_one(f'#allocations tr[data-allocation="{hub.allocations()["ben/"].id}"]')

    rest = hub.as_user(hub.token("ada"), "GET", "/teams").json()["teams"]
    assert rest, "the REST API lists no team"
    for team in rest:
        tr = soup.select_one(f'#teams tr[data-team="{team["name"]}"]')
        assert tr is not None, team["name"]
        for key in ("guarantee", "borrow_limit", "used", "borrowed"):
            assert float(tr.select_one(f'td[data-key="{key}"]').get_text()) == team[key], key
        left = float(tr.select_one('td[data-key="left"]').get_text())
        assert left == max(0.0, team["guarantee"] + team["borrow_limit"] - team["used"])
    vision = soup.select_one('#teams tr[data-team="vision"]')
    assert float(vision.select_one('td[data-key="used"]').get_text()) == 1.0


def test_my_gpus_shows_my_own_and_nobody_elses(hub: Hub) -> None:
    running(hub, "ada", "vision|h100|1")
    running(hub, "ben", "vision|cpu|1")
    held = hub.allocations()
    soup = page(hub.login("ada"), hub, "/hub/gpupool/mine")
    rows = soup.select("#my-allocations tr[data-allocation]")
    assert [r["data-allocation"] for r in rows] == [held["ada/"].id]
    assert held["ada/"].devices[0].gpu in cells(rows[0])[4]
    assert held["ben/"].id not in str(soup) and "ben/" not in str(soup)
    team = soup.select_one('#my-teams tr[data-team="vision"]')
    assert [team.select_one(f'td[data-key="{k}"]').get_text() for k in ("used", "mine")] == [
        "1",
        "1",
    ]
    assert soup.select_one('#my-teams tr[data-team="nlp"]') is None
    assert soup.select_one('form[method="post"]') is None  # no admin actions here
    assert soup.select_one('a[href="/hub/gpupool"]') is None  # no link to the admin page
    assert soup.select_one('a[href="/hub/gpupool/mine"]') is not None


def test_users_get_403_for_the_admin_page_and_its_actions(hub: Hub) -> None:
    running(hub, "ben", "vision|cpu|1")
    s = hub.login("ada")
    s.get(f"{hub.url}/hub/gpupool/mine", timeout=30)  # a fresh _xsrf cookie for ada
    token = s.cookies.get("_xsrf")
    r = s.get(f"{hub.url}/hub/gpupool", timeout=30)
    assert r.status_code == 403 and "admins only" in r.text
    r = post(s, hub, "stop", {"user": "ben", "server": "", "_xsrf": token})
    assert r.status_code == 403 and "admins only" in r.text
    r = post(s, hub, "cancel", {"job": "whatever", "_xsrf": token})
    assert r.status_code == 403
    assert hub.server("ben")
    # pages take the login cookie only, as JupyterHub's own: an API token opens nothing
    headers = {"Authorization": f"token {hub.token('admin', ['custom:gpupool:admin'])}"}
    r = requests.get(f"{hub.url}/hub/gpupool", headers=headers, timeout=30, allow_redirects=False)
    assert r.status_code == 302 and "/hub/login" in r.headers["Location"]
    r = requests.post(
        f"{hub.url}/hub/gpupool/stop", data={"user": "ben"}, headers=headers, timeout=30
    )
    assert r.status_code == 403 and hub.server("ben")


def test_bad_input_gets_400_or_404_with_the_reason(hub: Hub) -> None:
    s = admin(hub)
    page(s, hub)
    token = s.cookies.get("_xsrf")  # the page may hold no form (nothing allocated)
    for action, data, status, reason in [
        ("stop", {}, 400, "The form field &#39;user&#39; is missing or empty."),
        ("stop", {"user": "x" * 300}, 400, "too long"),
        ("stop", {"user": "nobody"}, 404, "No user &#39;nobody&#39;."),
        ("stop", {"user": "eli"}, 404, "eli&#39;s server is not running."),
        ("stop", {"user": "eli", "server": "gone"}, 404, "is not running"),
        ("cancel", {}, 400, "The form field &#39;job&#39; is missing or empty."),
        ("cancel", {"job": "no-such-job"}, 404, "No job no-such-job."),
    ]:
        r = post(s, hub, action, {**data, "_xsrf": token})
        text = r.content.decode("utf-8")
        assert r.status_code == status and reason in text, (action, data, r.status_code)


def test_an_admin_cancels_a_queued_job_from_the_page(hub: Hub) -> None:
    running(hub, "ada", "vision|h100|1")  # vision holds 1 of 2: a 2-GPU job must wait
    cal = hub.token("cal")
    r = hub.as_user(
        cal, "POST", "/jobs", json={"script": SLEEPER, "offer": "h100", "gpus": 2, "time_limit": 60}
    )
    assert r.status_code == 201, r.text
    job = r.json()
    assert job["state"] == "queued", job
    s = admin(hub)
    soup = page(s, hub)
    row = soup.select_one(f'#queue tr[data-job="{job["id"]}"]')
    assert row is not None, "the queued job is not on the page"
    text = cells(row)
    assert text[0] == "1" and text[2:5] == ["cal", "vision", "h100 ×2 ×1"]
    assert "team vision uses" in text[6]
    form = row.select_one('form[action="/hub/gpupool/cancel"]')
    fields = {i["name"]: i["value"] for i in form.select("input")}
    assert fields["job"] == job["id"] and fields["_xsrf"]

    r = post(s, hub, "cancel", {"job": job["id"]})  # no _xsrf: refused, nothing happens
    assert r.status_code == 403 and "_xsrf" in r.text
    assert hub.as_user(cal, "GET", f"/jobs/{job['id']}").json()["state"] == "queued"

    r = post(s, hub, "cancel", fields)
    assert r.status_code == 303, r.text
    assert parse_qs(urlsplit(r.headers["Location"]).query) == {
        "done": ["cancelled"],
        "job": [job["id"]],
    }
    done = hub.as_user(cal, "GET", f"/jobs/{job['id']}").json()
    assert done["state"] == "cancelled" and done["reason"] == "cancelled by admin"
    again = post(s, hub, "cancel", fields)  # an ended job: said so, not an error
    assert again.status_code == 303 and "done=ended" in again.headers["Location"]
    assert page(s, hub).select_one(f'#queue tr[data-job="{job["id"]}"]') is None


def test_stop_needs_the_xsrf_token_and_then_stops_the_server(hub: Hub) -> None:
    running(hub, "ada", "vision|h100|1")
    s = admin(hub)
    soup = page(s, hub)
    row = soup.select_one('#allocations tr[data-user="ada"][data-kind="notebook"]')
    assert row is not None
    form = row.select_one('form[action="/hub/gpupool/stop"]')
    fields = {i["name"]: i["value"] for i in form.select("input")}
    assert fields == {"_xsrf": xsrf_of(soup), "user": "ada", "server": ""}

    r = post(s, hub, "stop", {"user": "ada", "server": ""})
    assert r.status_code == 403 and "_xsrf" in r.text
    r = post(s, hub, "stop", {**fields, "_xsrf": "not-the-token"})
    assert r.status_code == 403
    assert hub.server("ada")["ready"] and "ada/" in hub.allocations()

    r = post(s, hub, "stop", fields)
    assert r.status_code == 303, r.text
    location = urlsplit(r.headers["Location"])
    assert location.path == "/hub/gpupool"
    hub.wait_stopped("ada")
    wait_for(lambda: "ada/" not in hub.allocations(), 30, "ada's allocation to be released")
    after = soup_of(s.get(f"{hub.url}{location.path}?{location.query}", timeout=30))
    flash = after.select_one("#gp-flash")
    assert flash is not None and html.unescape(flash.get_text()).strip() in (
        "Stopped ada's server.",
        "Stopping ada's server (it is slow to stop; reload in a moment).",
    )
    assert after.select_one('#allocations tr[data-user="ada"]') is None


@pytest.mark.parametrize(
    ("query", "shown"),
    [
        ({"done": "stopped", "target": "PLANTED"}, "Stopped the server."),
        ({"done": "stopping", "user": "PLANTED", "server": "PLANTED"}, "Stopping the server"),
        ({"done": "stopped", "user": "admin", "server": "PLANTED"}, "Stopped the server."),
        ({"done": "cancelled", "target": "PLANTED", "job": "PLANTED"}, "Cancelled the job."),
        ({"done": "ended", "job": "PLANTED"}, "The job had already ended."),
        ({"done": "PLANTED"}, None),
    ],
)
def test_the_flash_never_prints_text_from_the_url(
    hub: Hub, query: dict[str, str], shown: str | None
) -> None:
    planted = "Your session expired: log in again at https://evil.example/"
    query = {k: v.replace("PLANTED", planted) for k, v in query.items()}
    r = admin(hub).get(f"{hub.url}/hub/gpupool", params=query, timeout=30)
    assert r.status_code == 200
    assert "evil.example" not in r.content.decode("utf-8")
    flash = soup_of(r).select_one("#gp-flash")
    if shown is None:
        assert flash is None
    else:
        assert flash is not None and flash.get_text().strip().startswith(shown)
