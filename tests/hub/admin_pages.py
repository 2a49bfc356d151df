"""The admin's session and the hub's pages as the hub tests read them (a helper module: test
modules never import each other)."""

from __future__ import annotations

import os

import requests
from bs4 import BeautifulSoup

from tests.hub.conftest import Hub


def admin(hub: Hub) -> requests.Session:
    password = os.environ.get("GPUPOOL_ADMIN_PASSWORD") or (
        (hub.state / "admin-password").read_text().strip()
    )
    return hub.login("admin", password)


def page(s: requests.Session, hub: Hub, path: str = "/hub/gpupool") -> BeautifulSoup:
    r = s.get(f"{hub.url}{path}", timeout=30)
    assert r.status_code == 200, f"{path}: {r.status_code} {r.text[-500:]}"
    return soup_of(r)


def soup_of(r: requests.Response) -> BeautifulSoup:
    """The page, decoded as UTF-8 (JupyterHub sends ``text/html`` without a charset)."""
    return BeautifulSoup(r.content.decode("utf-8"), "html.parser")
