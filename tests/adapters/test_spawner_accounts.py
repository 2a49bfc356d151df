"""The local spawner never runs a server as root (root only: as an ordinary user the hub cannot
switch accounts, and user code runs as that user by design)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tornado import web
from traitlets.config import Config

from gpupool.declarations import ConfigError
from gpupool.hub import _check_local_spawner
from gpupool_spawner.local import LocalGPUSpawner
from tests.accounts import IS_ROOT, NOT_ROOT, shared_account

pytestmark = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)


def spawner(user: str, **settings: object) -> LocalGPUSpawner:
    c = Config()
    for key, value in settings.items():
        setattr(c.LocalGPUSpawner, key, value)
    hub_user = SimpleNamespace(name=user, groups=[], url=f"/user/{user}/", escaped_name=user)
    return LocalGPUSpawner(config=c, user=hub_user)


def test_the_shared_mode_as_root_without_an_account_is_refused_naming_the_key() -> None:
    with pytest.raises(web.HTTPError) as e:
        spawner("ada").code_account()
    assert e.value.status_code == 403
    assert "LocalGPUSpawner.shared_account: the hub runs as root" in e.value.log_message


def test_the_shared_mode_runs_as_the_shared_account() -> None:
    account = spawner("ada", shared_account=shared_account()).code_account()
    assert account.name == "gpupool-demo" and account.uid != 0


def test_a_hub_user_named_root_is_refused_in_the_per_user_mode() -> None:
    with pytest.raises(web.HTTPError) as e:
        spawner("root", run_as_hub_user=False).code_account()
    assert e.value.status_code == 403 and "user code never runs as root" in e.value.log_message


def test_the_hub_stops_at_start_when_servers_would_run_as_root() -> None:
    c = Config()
    c.JupyterHub.spawner_class = "gpupool-local"
    with pytest.raises(
        ConfigError, match=r"^LocalGPUSpawner\.shared_account: the hub runs as root"
    ):
        _check_local_spawner(c)
    c.LocalGPUSpawner.shared_account = "root"
    with pytest.raises(ConfigError, match="is root; user code never runs as root"):
        _check_local_spawner(c)
    c.LocalGPUSpawner.shared_account = shared_account()
    _check_local_spawner(c)  # fine now
