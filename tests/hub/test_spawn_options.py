"""gpupool composes with JupyterHub's own ways of starting servers (a real hub): options of
others are left alone, ``options_from_form`` stays a configurable trait an admin's callable
composes with, spawn links work, a user with nothing to choose gets no form, an admin's
template extending gpupool's form shows on the spawn page (a bad one stops the hub, named), and
a server's token gets gpupool's scopes through JupyterHub's ``server`` role."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.accounts import homes
from tests.hub.conftest import Hub, environ, exits, last_line, running, stop_all

ADMIN_CHOICES = """
def pick_flavour(form_data):  # an admin's options_from_form: it reads only its own field
    return {"flavour": form_data["flavour"][0]} if "flavour" in form_data else {}

c.LocalGPUSpawner.options_from_form = pick_flavour
c.LocalGPUSpawner.apply_user_options = {"flavour": "notebook_dir"}
c.LocalGPUSpawner.spawn_form_template = (  # an admin's block in gpupool's form
    '{% extends "gpupool-spawn-form.html" %}'
    '{% block intro %}<p class="site-help">Ask {{ "<b>" }}#gpu-help</p>{% endblock %}'
)
c.JupyterHub.load_roles = [  # an admin's change to the server role
    {"name": "server",
     "scopes": ["users:activity!user", "access:servers!server", "read:users:name"]},
]
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with homes() as root:
        h = Hub(tmp_path_factory.mktemp("hub"), root, prelude=ADMIN_CHOICES)
        with running(h):
            yield h


def user_options(hub: Hub, user: str) -> dict[str, Any]:
    return dict(hub.api("GET", f"/users/{user}").json()["servers"][""]["user_options"])


def test_a_user_with_nothing_to_choose_starts_at_once_without_a_form(hub: Hub) -> None:
    s = hub.login("eve")  # in no team: CPU only
    r = s.get(f"{hub.url}/hub/spawn", timeout=60, allow_redirects=False)
    assert r.status_code == 302 and "/hub/spawn-pending/eve" in r.headers["Location"], r.text[:300]
    hub.wait_ready("eve")
    assert hub.allocations()["eve/"].offer == "cpu"
    page = hub.login("ada").get(f"{hub.url}/hub/spawn", timeout=60).text  # ada has choices
    assert 'name="gpupool_choice"' in page
    assert '<p class="site-help">Ask &lt;b&gt;#gpu-help</p>' in page  # the admin's template
    stop_all(hub, "eve")


def test_other_keys_of_user_options_are_left_alone_and_gpupools_are_checked(hub: Hub) -> None:
    r = hub.api("POST", "/users/ben/server", json={"offer": "h100", "image": "mine:1", "x": [1]})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("ben")
    assert user_options(hub, "ben") == {"offer": "h100", "image": "mine:1", "x": [1]}
    assert hub.allocations()["ben/"].offer == "h100"
    stop_all(hub, "ben")
    r = hub.api("POST", "/users/ben/server", json={"offer": 5, "image": "mine:1"})
    assert r.status_code == 400 and "user_options.offer must be an offer name" in r.text


def test_an_admins_options_from_form_composes_with_gpupools(hub: Hub) -> None:
    s = hub.login("cal")
    s.get(f"{hub.url}/hub/home", timeout=30)
    r = s.post(
        f"{hub.url}/hub/spawn",
        data={"gpupool_choice": "vision|h100|1", "flavour": "/tmp", "_xsrf": s.cookies["_xsrf"]},
        timeout=60,
        allow_redirects=False,
    )
    assert r.status_code == 302, r.text[-300:]
    hub.wait_ready("cal")
    # the admin's callable saw its field, gpupool added its keys; apply_user_options applied it
    assert user_options(hub, "cal") == {"flavour": "/tmp", "team": "vision", "offer": "h100",
                                        "count": 1}  # fmt: skip
    assert hub.allocations()["cal/"].offer == "h100"
    stop_all(hub, "cal")


def test_a_spawn_link_names_gpupools_options(hub: Hub) -> None:
    s = hub.login("dee")
    r = s.get(f"{hub.url}/hub/spawn?opt-offer=mig-1g.10gb", timeout=60, allow_redirects=False)
    assert r.status_code == 302 and "spawn-pending" in r.headers["Location"], r.text[-300:]
    hub.wait_ready("dee")
    assert hub.allocations()["dee/"].offer == "mig-1g.10gb"
    stop_all(hub, "dee")


def test_a_servers_token_gets_gpupools_scopes_through_the_server_role(hub: Hub) -> None:
    r = hub.api("POST", "/users/eli/server", json={"offer": "cpu"})
    assert r.status_code in (201, 202), r.text
    hub.wait_ready("eli")
    token = environ(hub.pid("eli"))["JUPYTERHUB_API_TOKEN"]
    me = requests.get(f"{hub.url}/hub/api/user", headers={"Authorization": f"token {token}"},
                      timeout=30).json()  # fmt: skip
    scopes = set(me["scopes"])
    assert "custom:gpupool:jobs" in scopes  # gpupool's, added to the role
    assert "read:users:name!user=eli" in scopes  # the admin's own change to the role holds
    assert "custom:gpupool:admin" not in scopes  # eli is no admin: never more than she holds
    stop_all(hub, "eli")


@pytest.mark.parametrize(
    ("setting", "says"),
    [
        ('c.LocalGPUSpawner.spawn_form = "sometimes"',
         "LocalGPUSpawner.spawn_form: must be one of choices, always, never, not 'sometimes'"),
        ("c.LocalGPUSpawner.spawn_form_template = '{% extends \"site-form.html\" %}'",
         "LocalGPUSpawner.spawn_form_template: no template 'site-form.html' in gpupool's "
         "templates nor in spawn_form_template_paths (none set)"),
    ],
)  # fmt: skip
def test_a_bad_spawn_form_setting_stops_the_hub_at_start_naming_the_key(
    tmp_path: Path, setting: str, says: str
) -> None:
    (tmp_path / "state").mkdir()
    with homes() as root:
        h = Hub(tmp_path / "state", root, prelude=f"{setting}\n")
        assert exits(h) == 1
    assert last_line(h).endswith(says), h.log_tail()
