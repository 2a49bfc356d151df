"""The whole flow in a real browser (Debian's Chromium through Playwright) against the demo hub.

A demo user logs in, spawns a CPU notebook server from the spawn page, opens a notebook that
trains a small model with DDP, clicks "Run distributed", chooses 2 GPUs, and watches the job reach
``succeeded`` in the GPU jobs panel, with both ranks' logs. A second user does not see that job.
Screenshots of the spawn page, the dialog and the panel go to ``docs/img/`` for the README.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.accounts import give_to_shared_account, homes
from tests.hub.conftest import PASSWORD, ROOT, Hub, running
from tests.hub.test_jobs import TRAIN, TRAIN_CELL

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
IMG = ROOT / "docs" / "img"
SLOW = 180_000  # ms: a server start or a DDP job on two CPU cores


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with homes() as home_root:
        h = Hub(tmp_path_factory.mktemp("browser-hub"), home_root)
        home = home_root / "ada"
        home.mkdir()
        nb = nbformat.v4.new_notebook()
        nb.metadata["kernelspec"] = {
            "name": "python3",
            "display_name": "Python 3",
            "language": "python",
        }
        nb.cells = [nbformat.v4.new_code_cell(TRAIN), nbformat.v4.new_code_cell(TRAIN_CELL)]
        nbformat.write(nb, home / "train.ipynb")
        give_to_shared_account(home)
        with running(h):
            yield h


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


def log_in(page: Page, hub: Hub, user: str) -> None:
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", PASSWORD)
    page.click("#login_submit")


def test_run_distributed_from_a_notebook(hub: Hub, browser: Browser) -> None:
    IMG.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    log_in(page, hub, "ada")
    page.goto(f"{hub.url}/hub/spawn")
    expect(page.locator(".gpupool-form")).to_contain_text("Team vision")
    expect(page.locator(".gpupool-simulated")).to_contain_text("Simulated pool")
    page.screenshot(path=IMG / "spawn-page.png", full_page=True)
    page.check('input[value="vision|cpu|1"]')
    page.click("#spawn_form input[type=submit], #spawn_form button[type=submit]")
    page.wait_for_url(re.compile(r".*/user/ada/lab.*"), timeout=SLOW)

    page.goto(f"{hub.url}/user/ada/lab/tree/train.ipynb")
    button = page.locator(".gpupool-run-distributed").first
    button.wait_for(timeout=SLOW)
    kernel = page.get_by_role("button", name="Select")  # asked only if the kernel is unknown
    if kernel.count():
        kernel.click()
    expect(page.locator(".gpupool-status")).to_contain_text("CPU only", timeout=60_000)
    button.click()
    dialog = page.locator(".jp-Dialog")
    expect(dialog.locator("select[name=offer]")).to_be_visible()
    dialog.locator("select[name=team]").select_option("vision")
    dialog.locator("select[name=offer]").select_option("h100")
    dialog.locator("input[name=gpus]").fill("2")
    dialog.locator("input[name=nodes]").fill("1")
    dialog.locator("input[name=cells][value=all]").check()
    dialog.screenshot(path=IMG / "run-distributed-dialog.png")
    dialog.get_by_role("button", name="Submit").click()

    panel = page.locator(".gpupool-jobs-panel")
    expect(panel.locator(".gpupool-job-detail .gpupool-state-succeeded")).to_be_visible(
        timeout=SLOW
    )
    log = panel.locator(".gpupool-log")
    expect(log).to_contain_text("FINAL 0 2", timeout=30_000)
    panel.locator("select[name=rank]").select_option("1")
    expect(log).to_contain_text("FINAL 1 2", timeout=30_000)
    page.screenshot(path=IMG / "jobs-panel.png")
    page.close()

    other = browser.new_page(viewport={"width": 1400, "height": 900})
    log_in(other, hub, "ben")
    other.goto(f"{hub.url}/hub/spawn")
    other.check('input[value="vision|cpu|1"]')
    other.click("#spawn_form input[type=submit], #spawn_form button[type=submit]")
    other.wait_for_url(re.compile(r".*/user/ben/lab.*"), timeout=SLOW)
    other.locator('li[data-id="gpupool-jobs"]').click(timeout=SLOW)
    expect(other.locator(".gpupool-jobs-panel .gpupool-empty")).to_be_visible(timeout=30_000)
    expect(other.locator(".gpupool-jobs-panel")).not_to_contain_text("train")
    ben = hub.as_user(hub.token("ben"), "GET", "/jobs").json()["jobs"]
    assert ben == []
    other.close()


def test_screenshots_are_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in ("spawn-page.png", "run-distributed-dialog.png", "jobs-panel.png"):
        assert f"docs/img/{name}" in readme
        assert Path(IMG / name).exists()
