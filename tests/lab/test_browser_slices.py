"""Slices of GPUs in a real browser (Debian's Chromium through Playwright) against the demo hub.

The demo's simulated pool has a managed A100 in MIG mode with no instances and two L40S without
MIG. A member of team nlp logs in, sees the A100's MIG 3g.40gb line on the spawn page with what is
free now, picks it there and lands in JupyterLab; the server sees exactly one ``MIG-…`` UUID, the
one the hub reports for its allocation, which the simulated driver holds; stopping the server from
the hub's home page destroys the instance. A member of team vision does the same with a 12 GB share
of an L40S: the spawn page says which enforcement is in force, the server sees its L40S's UUID and
the share's cap (the variables and the PyTorch cap hook), and stopping frees the share. No
screenshots: the README's are those of ``test_browser.py``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright

from tests.accounts import homes
from tests.hub.conftest import Hub, environ, running
from tests.hub.mig_records import A100, driver_instances, records
from tests.lab.browser_fixtures import ARGS, CHROMIUM, NEEDS_CHROMIUM, SLOW, log_in, offer_line

MIG = ("nlp", "a100-mig-3g.40gb")
SHARE = ("vision", "share-12gb")
WATCHED = re.compile(  # the demo's enforcement of shares (no MPS): gpupool.shares
    r"Shared; capped in PyTorch and watched; over the cap you are warned, then stopped after "
    r"[0-9.]+ minutes"
)

pytestmark = NEEDS_CHROMIUM


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with homes() as home_root, running(Hub(tmp_path_factory.mktemp("slices"), home_root)) as h:
        yield h


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


def line_now(hub: Hub, token: str, team: str, offer: str) -> dict[str, Any]:
    """The hub's ``GET /offers`` line of ``offer`` (one of it) for ``team``."""
    return offer_line(hub.as_user(token, "GET", "/offers").json(), team, offer, 1)


def choose(page: Page, hub: Hub, user: str, team: str, offer: str) -> tuple[Locator, str]:
    """Log in as ``user``, find the offer's line on the spawn page (its label, cost and free
    count as the hub's API says) and click it; the line and its label."""
    line = line_now(hub, hub.token(user), team, offer)
    assert line["enabled"] and line["free"] >= 1, line
    log_in(page, hub, user)
    page.goto(f"{hub.url}/hub/spawn")
    radio = page.locator(f'input[name=gpupool_choice][value="{team}|{offer}|1"]')
    choice = page.locator(".gpupool-form .radio label").filter(has=radio)
    expect(choice).to_contain_text(f"{line['label']} · {line['cost']:g} GPU-eq")
    expect(choice).to_contain_text(f"{line['free']} free now")
    expect(choice).to_contain_text(line["description"])
    choice.click()
    expect(radio).to_be_checked()
    return choice, str(line["label"])


def start(page: Page, user: str, label: str) -> None:
    """Start the chosen line and wait for JupyterLab, its status bar showing ``label``."""
    page.click("#spawn_form input[type=submit], #spawn_form button[type=submit]")
    page.wait_for_url(re.compile(rf".*/user/{user}/lab.*"), timeout=SLOW)
    expect(page.locator(".gpupool-status")).to_contain_text(label, timeout=SLOW)


def held(hub: Hub, user: str) -> dict[str, Any]:
    """``user``'s one allocation, as the hub's ``GET /allocations`` reports it."""
    (mine,) = hub.as_user(hub.token(user), "GET", "/allocations").json()["allocations"]
    return dict(mine)


def stop_from_the_home_page(page: Page, hub: Hub, user: str) -> None:
    page.goto(f"{hub.url}/hub/home")
    page.wait_for_function("window._jupyterhub_page_loaded")  # home.js hooked up its buttons
    page.click("#stop")
    expect(page.locator("#start")).to_have_text("Start My Server", timeout=SLOW)
    expect(page.locator("#stop")).to_be_hidden()
    hub.wait_stopped(user)
    page.close()


def test_a_mig_instance_made_on_demand(hub: Hub, browser: Browser) -> None:
    assert driver_instances(hub) == {} and records(hub) == []
    free = line_now(hub, hub.token("dee"), *MIG)["free"]
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    choice, label = choose(page, hub, "dee", *MIG)
    expect(choice.locator(".gpupool-enforcement")).to_have_count(0)
    start(page, "dee", label)

    mine = held(hub, "dee")
    assert mine["offer"] == MIG[1] and mine["node"] == "local-a100", mine
    (uuid,) = mine["devices"]
    assert uuid.startswith("MIG-"), mine
    assert environ(hub.pid("dee"))["CUDA_VISIBLE_DEVICES"] == uuid
    (device,) = hub.allocations()["dee/"].devices
    assert (device.gpu, device.instance) == (A100, uuid)
    assert driver_instances(hub) == {uuid: ("3g.40gb", device.start)}
    assert records(hub) == [(uuid, "live", mine["id"])]

    stop_from_the_home_page(page, hub, "dee")
    assert driver_instances(hub) == {} and records(hub) == []
    assert hub.allocations() == {}
    assert line_now(hub, hub.token("dee"), *MIG)["free"] == free


def test_a_share_of_a_gpu_without_mig(hub: Hub, browser: Browser) -> None:
    free = line_now(hub, hub.token("ben"), *SHARE)["free"]
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    choice, label = choose(page, hub, "ben", *SHARE)
    expect(choice.locator(".gpupool-enforcement")).to_have_text(WATCHED)
    start(page, "ben", label)

    mine = held(hub, "ben")
    assert mine["offer"] == SHARE[1] and mine["node"] == "local-l40s", mine
    (uuid,) = mine["devices"]
    assert uuid.startswith("GPU-"), mine
    env = environ(hub.pid("ben"))
    assert env["CUDA_VISIBLE_DEVICES"] == uuid
    assert (env["GPUPOOL_SHARE_MILLI"], env["GPUPOOL_SHARE_MIB"]) == ("250", "12288")
    assert env["GPUPOOL_SHARE_ENFORCEMENT"] == "watched"
    assert env["PYTHONSTARTUP"].endswith("gpupool_lab/ipython_startup.py")
    assert line_now(hub, hub.token("ben"), *SHARE)["free"] == free - 1

    stop_from_the_home_page(page, hub, "ben")
    assert "ben/" not in hub.allocations()
    assert line_now(hub, hub.token("ben"), *SHARE)["free"] == free
