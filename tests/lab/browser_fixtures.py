"""What the browser tests share: Chromium and its flags, logging in, reading the offers (a helper
module: test modules never import each other)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page

from tests.hub.conftest import PASSWORD, Hub

CHROMIUM = "/usr/bin/chromium"


NEEDS_CHROMIUM = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason="needs Debian's chromium, which only root can install (make test does as root; or: "
    "apt-get install chromium)",
)


ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


SLOW = 180_000  # ms: a server start or a DDP job on two CPU cores


def log_in(page: Page, hub: Hub, user: str) -> None:
    page.goto(f"{hub.url}/hub/login")
    page.fill("#username_input", user)
    page.fill("#password_input", PASSWORD)
    page.click("#login_submit")


def offer_line(offers: dict[str, Any], team: str, offer: str, count: int) -> dict[str, Any]:
    lines = [
        line
        for t in offers["teams"]
        if t["team"] == team
        for line in t["offers"]
        if line["name"] == offer and line["count"] == count
    ]
    assert len(lines) == 1, offers
    line: dict[str, Any] = lines[0]
    return line
