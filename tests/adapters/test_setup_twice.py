"""``setup(c)`` is idempotent: run twice on one config (a config file that calls it twice, a
test), it wires into JupyterHub what one run does, and no role twice (JupyterHub refuses to start
on "Role gpupool-admin multiply defined")."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from traitlets.config import Config

from gpupool.hub import ADMIN_ROLE, setup
from gpupool.hub.scopes import ADMIN_SCOPE, JOBS_SCOPE
from tests.accounts import shared_mode


def hub_config(tmp_path: Path) -> Config:
    c = Config()
    shared_mode(c)
    c.JupyterHub.db_url = f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}"
    c.JupyterHub.hub_port = 9  # the REST API answers nothing
    c.GPUPool.inventory = "simulated:a: 1x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"h100": {"kind": "gpu", "model": "H100-80GB"}}
    c.GPUPool.teams = {"vision": {"guarantee": 1}}
    c.Reconciler.period = 0
    c.Authenticator.admin_users = {"ada"}
    return c


def wiring(c: Config) -> dict[str, Any]:
    """What ``setup`` puts into JupyterHub's config (the services' tokens are each run's own)."""
    hub = c.JupyterHub
    return copy.deepcopy(
        {
            "roles": hub.load_roles,
            "services": [{k: v for k, v in s.items() if k != "api_token"} for s in hub.services],
            "scopes": hub.custom_scopes,
            "handlers": hub.extra_handlers,
            "templates": hub.template_paths,
        }
    )


def names(items: list[dict[str, Any]]) -> list[str]:
    return [item["name"] for item in items]


def test_setup_twice_wires_in_what_once_does(tmp_path: Path) -> None:
    c = hub_config(tmp_path)
    setup(c)
    once = wiring(c)
    assert ADMIN_ROLE in names(once["roles"])
    second = setup(c)
    assert wiring(c) == once
    roles = names(c.JupyterHub.load_roles)
    assert len(roles) == len(set(roles)), roles
    handlers = [h[0] for h in c.JupyterHub.extra_handlers]
    assert len(handlers) == len(set(handlers)), handlers
    tokens = {s["name"]: s["api_token"] for s in c.JupyterHub.services}
    assert second.reclaimer.token in tokens.values()  # the latest run's services act


def test_an_admins_own_roles_gain_gpupools_scopes_and_admins_once(tmp_path: Path) -> None:
    c = hub_config(tmp_path)
    c.JupyterHub.load_roles = [
        {"name": ADMIN_ROLE, "scopes": ["read:users"], "users": ["bo"]},
        {"name": "user", "scopes": ["self"]},
    ]
    setup(c)
    setup(c)
    roles = {r["name"]: r for r in c.JupyterHub.load_roles}
    assert len(roles) == len(c.JupyterHub.load_roles)
    assert roles[ADMIN_ROLE] == {
        "name": ADMIN_ROLE,
        "scopes": ["read:users", ADMIN_SCOPE],
        "users": ["bo", "ada"],
    }
    assert roles["user"]["scopes"] == ["self", JOBS_SCOPE]
