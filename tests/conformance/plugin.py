"""JupyterHub's own tests, from the installed JupyterHub, with gpupool's spawner and ``setup(c)``.

Loaded as a pytest plugin (``-p tests.conformance.plugin``; see ``make test`` and
``tests/conformance/pytest.ini``), so that it is imported before pytest imports
``jupyterhub/tests/conftest.py``, which imports ``jupyterhub.tests.mocking``.

What it changes, and nothing else:
1. **The mock spawner's base.** ``jupyterhub.tests.mocking`` is imported once with
   ``jupyterhub.spawner.SimpleLocalProcessSpawner`` bound to gpupool's ``LocalGPUSpawner``, so
   ``MockSpawner`` and every spawner mocking.py derives from it (slow, failing, form, ...) are
   defined over gpupool's spawner, their class bodies unchanged; the name is restored at once.
2. **``setup(c)`` in every MockHub.** ``MockHub.load_config_file`` (a no-op in MockHub, called
   first thing in ``JupyterHub.initialize``, inside the running loop) builds the config of a
   small pool, runs ``setup(c)`` on it and merges it into the hub's config: a simulated pool of
   2 H100s, offers ``cpu`` and ``h100``, no teams (every test user is in no team, so only
   ``cpu`` applies), a fresh pool database per hub; as root, servers run as the shared account,
   from the runtime (:mod:`tests.accounts`): the hub's Python in a spawner's command (the tests
   write ``sys.executable``) is read as the runtime's, and its commands come first on PATH.
3. **Stopping.** ``MockHub.stop`` stops the job manager and the reclaimer first, so no gpupool
   task outlives a module's event loop; the reconciler runs only its pass at start.

Expected deviations (:data:`EXPECTED`, strict xfails, one line of reason each) are the only
tests allowed to fail. Baseline: the same selection with the unmodified mock spawner
(``GPUPOOL_CONFORMANCE_BASELINE=1``, ``make conformance-baseline``) fails one test, as root:
``test_spawner.py::test_single_user_spawner`` (the mock spawner runs ``jupyterhub-singleuser``
as root, which refuses to start); with gpupool's spawner it passes (servers run as the shared
account), so nothing is excluded.
"""

from __future__ import annotations

import logging
import os
import pwd
import sys
import tempfile
from pathlib import Path
from typing import Any

import jupyterhub.spawner as spawner_module
import pytest
from traitlets.config import Config

from tests import skips
from tests.accounts import RUNTIME_BIN, RUNTIME_PYTHON, shared_account

BASELINE = os.environ.get("GPUPOOL_CONFORMANCE_BASELINE") == "1"

STATE = (
    "the server's state holds gpupool's allocation id and process start time beside 'pid' "
    "(gpupool_allocation, gpupool_process_start); the test compares the whole state dict"
)
EXPECTED: dict[tuple[str, str], str] = {
    ("jupyterhub.tests.test_named_servers", "test_default_server"): STATE,
    ("jupyterhub.tests.test_named_servers", "test_create_or_start_named_server"): STATE,
}
"""(module, test function) → why gpupool's spawner differs there, on purpose."""

if not BASELINE:
    from gpupool.hub import setup
    from gpupool.hub.objects import SETTINGS_KEY
    from gpupool_spawner.local import LocalGPUSpawner

    class RuntimeSpawner(LocalGPUSpawner):  # type: ignore[misc]
        """gpupool's spawner, with the hub's Python in a command read as the runtime's: the
        same JupyterHub, installed where the account that runs user code can run it."""

        async def start(self) -> Any:
            if isinstance(self.cmd, list):
                self.cmd = [RUNTIME_PYTHON if part == sys.executable else part for part in self.cmd]
            return await super().start()

        def get_env(self) -> dict[str, str]:
            env: dict[str, str] = super().get_env()
            env["PATH"] = f"{RUNTIME_BIN}:{env.get('PATH', os.defpath)}"
            return env

    original = spawner_module.SimpleLocalProcessSpawner
    spawner_module.SimpleLocalProcessSpawner = RuntimeSpawner  # type: ignore[misc]
    try:
        from jupyterhub.tests import mocking
    finally:
        spawner_module.SimpleLocalProcessSpawner = original  # type: ignore[misc]
    assert issubclass(mocking.MockSpawner, LocalGPUSpawner), mocking.MockSpawner.__mro__

    WORK = Path(tempfile.mkdtemp(prefix="gpupool-conformance-"))
    WORK.chmod(0o755)

    def pool_config(hub: Any) -> Config:
        """The small pool of the module docstring, for the MockHub ``hub``."""
        c = Config()
        state = Path(tempfile.mkdtemp(prefix="pool-", dir=WORK))
        homes = Path(tempfile.mkdtemp(prefix="homes-", dir=WORK))
        account = shared_account()  # as root: user code never runs as root
        if account:
            pw = pwd.getpwnam(account)
            os.chown(homes, pw.pw_uid, pw.pw_gid)
            c.LocalGPUSpawner.shared_account = account
        url = hub.db_url if "://" in hub.db_url else f"sqlite:///{hub.db_url}"
        c.JupyterHub.db_url = url  # what the reconciliation at start reads
        c.JupyterHub.bind_url = hub.bind_url  # MockHub's random ports: where the services call
        c.JupyterHub.hub_port = hub.hub_port
        c.GPUPool.inventory = "simulated:n: 2x H100-80GB"
        c.GPUPool.db_url = f"sqlite:///{state / 'pool.sqlite'}"
        c.GPUPool.offers = {"cpu": {}, "h100": {"model": "H100-80GB", "max_count": 2}}
        c.LocalGPUSpawner.home_dir_template = str(homes / "{username}")
        c.Reconciler.period = 0  # its pass at start only: no background task in the test loop
        return c

    def load_config_file(self: Any, *args: Any, **kwargs: Any) -> None:
        c = pool_config(self)
        setup(c, logging.getLogger("MockHub").getChild("gpupool"))
        self.update_config(c)

    original_stop = mocking.MockHub.stop

    async def stop(self: Any) -> None:
        hub = (getattr(self, "tornado_settings", None) or {}).get(SETTINGS_KEY)
        if hub is not None and not self._stop_called:
            await hub.jobs.stop()
            await hub.reclaimer.stop()
        await original_stop(self)

    mocking.MockHub.load_config_file = load_config_file
    mocking.MockHub.stop = stop


def pytest_report_header(config: pytest.Config) -> list[str]:
    if BASELINE:
        return ["gpupool conformance: BASELINE, JupyterHub's unmodified mock spawner"]
    chain = " -> ".join(k.__name__ for k in mocking.MockSpawner.__mro__[:5])
    return [f"gpupool conformance: {chain}"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if BASELINE:
        return
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", "")
        reason = EXPECTED.get((module, getattr(item, "originalname", item.name)))
        if reason:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Skipped tests counted by reason, as in gpupool's own runs (:mod:`tests.skips`)."""
    skips.terminal_summary(terminalreporter)
