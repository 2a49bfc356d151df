"""The device watch: every process NVML reports on a device of the pool either holds it or is
dealt with. Real processes of real unix accounts (``useradd``: two hub users and an account that
is none, and root), which the simulated NVML reports on the pool's devices; JupyterHub's REST API
answered from a JupyterHub database (:class:`tests.hubapi.FakeHub`) says who is a hub user; the
clock is the pool's seam.

- A process of an account that runs user code, on a device it does not hold, is warned through
  the usual channel (``idle.warning`` of the allocations document), then stopped after the grace:
  "stopped" is a real process really signalled.
- Processes of other accounts (root, an account that is no hub user) are never stopped (a real
  root process still runs at the end), but are listed on the admin page, and the pool hands out
  nothing they use, with the reason in the refusal and the spawn page's verdict, until they end.
- A share GPU's memory counts every process on it.
- The policy is a setting, ``stop`` by default in the per-user mode and ``log`` in the shared one.

The pool: node ``n`` with two whole H100s and one with fixed MIG instances; node ``s`` with two
L40S-48GB for shares (a quarter: 12288 MiB); node ``m`` with an A100 whose MIG instances gpupool
makes for each allocation.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import pwd
import signal
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
from traitlets.config import Config

import gpupool.hub as hub_module
from gpupool.config import GPUPool
from gpupool.core.errors import NoCapacity
from gpupool.core.ledger import Allocation
from gpupool.declarations import ConfigError
from gpupool.hub.device_watch import build_device_watch
from gpupool.hub.models import allocation_model
from gpupool.hub.pages_view import admin_view
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.hub.share_watch import build_watch
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool_lab.allocation import idle_state
from tests.accounts import (
    IS_ROOT,
    NOT_ROOT,
    RUNTIME_PYTHON,
    as_account,
    remove_unix_user,
    shared_account,
    shared_mode,
    unix_user,
)
from tests.hubapi import TOKEN, HubStandIns

pytestmark = pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)
LOG = logging.getLogger("gpupool.tests.device_watch")
SPEC = (
    "simulated:n: 3x H100-80GB, mig=1:3g.40gb+2g.20gb+1g.10gb; s: 2x L40S-48GB; "
    "m: 1x A100-80GB, mig=1"
)
ADA, BEN, NOBODY = "gpupool-dw-ada", "gpupool-dw-ben", "gpupool-dw-nobody"
T0 = 1_780_000_000.0
GRACE = 300.0


@pytest.fixture(scope="module", autouse=True)
def accounts() -> Iterator[None]:
    for name in (ADA, BEN, NOBODY):
        unix_user(name)
    try:
        yield
    finally:
        for name in (ADA, BEN, NOBODY):
            remove_unix_user(name)


class Setting(HubStandIns):
    """A pool on the simulated NVML, JupyterHub's stand-ins, and the hub's watches over them."""

    def __init__(self, tmp: Path, per_user: bool = True, **watch: Any) -> None:
        c = Config()
        c.GPUPool.inventory = SPEC
        c.GPUPool.db_url = f"sqlite:///{tmp / 'pool.sqlite'}"
        c.GPUPool.offers = {
            "cpu": {},
            "gpu": {"kind": "gpu", "model": "H100-80GB"},
            "mig-3g": {"kind": "mig", "profile": "3g.40gb", "model": "H100-80GB"},
            "a100-3g": {"kind": "mig", "profile": "3g.40gb", "model": "A100-80GB"},
            "quarter": {"kind": "share", "fraction": 0.25, "model": "L40S-48GB"},
        }
        c.GPUPool.teams = {"vision": {"guarantee": 6}}
        c.GPUPool.managed_mig = ["A100-80GB"]  # its instances are made for each allocation
        c.DeviceWatch.grace_minutes = GRACE / 60
        for key, value in watch.items():
            setattr(c.DeviceWatch, key, value)
        shared_mode(c)
        if per_user:
            c.LocalGPUSpawner.run_as_hub_user = False
        self.config = c
        self.pool = Pool.from_config(GPUPool(config=c))
        self.now = T0
        self.pool.clock = lambda: datetime.fromtimestamp(self.now, UTC)
        self.sim = self.pool.monitor.nvml_by_node["n"]
        gpus = self.pool.inventory.gpus
        self.whole = [g.uuid for g in gpus if g.model == "H100-80GB" and not g.mig_enabled]
        self.l40s = [g.uuid for g in gpus if g.model == "L40S-48GB"]
        self.mig = next(i.uuid for g in gpus for i in g.instances if i.profile == "3g.40gb")
        super().__init__(tmp)
        self.reclaimer = IdleReclaimer(self.pool, TOKEN, self.api.api_url, self.api.url, config=c)
        self.jobs = JobManager(self.pool, config=c)
        self.watch = build_device_watch(self.pool, self.reclaimer, self.jobs, c, LOG)
        self.shares = build_watch(self.pool, self.reclaimer, self.jobs, c, LOG)

    def hub_user(self, name: str) -> None:
        self.hubdb.server(name, ("vision",), {}, running=False)

    def grant(self, user: str, offer: str) -> Allocation:
        """``user``'s server holding ``offer`` (a JupyterHub user with a running server)."""
        a = self.pool.allocate(user, ["vision"], offer, ref=f"{user}/")
        self.hubdb.server(user, ("vision",), {"gpupool_allocation": a.id})
        return a

    def look(self) -> list[tuple[str, int]]:
        return [(action, pid) for action, pid, _device in asyncio.run(self.watch.look())]

    def warning(self, allocation: Allocation) -> dict[str, str] | None:
        model = allocation_model(allocation, self.reclaimer)
        return (model.get("idle") or {}).get("warning")


@pytest.fixture
def per_user(tmp_path: Path) -> Iterator[Setting]:
    with Setting(tmp_path) as setting:
        yield setting


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes started with :func:`process`, killed at the end whatever happened."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def process(
    started: list[subprocess.Popen[bytes]], account: str, code: str = "", **env: str
) -> subprocess.Popen[bytes]:
    """A real process of ``account`` (``"root"``: as root, as a daemon would run) with ``env``,
    running ``code`` and then waiting for a signal."""
    p = subprocess.Popen(
        [RUNTIME_PYTHON, "-c", f"import os, signal, sys\n{code}\nprint('ready', flush=True)\n"
         "signal.pause()"],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        cwd="/",
        start_new_session=True,
        stdout=subprocess.PIPE,
        **({} if account == "root" else as_account(account)),
    )  # fmt: skip
    started.append(p)
    assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def ended_by(p: subprocess.Popen[bytes], sig: signal.Signals) -> bool:
    """Whether ``p`` ends, killed by ``sig``, within 30 s (an event: its exit, not a sleep)."""
    try:
        return p.wait(timeout=30) == -sig
    except subprocess.TimeoutExpired:
        return False


IGNORE_TERM = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"


def admin_html(s: Setting) -> str:
    """The admin page as its template renders it (JupyterHub's page.html stubbed)."""
    view = admin_view(s.pool, s.jobs, s.reclaimer, s.now)
    view["shares"] = s.shares.view()
    view["devices"] = s.watch.view()
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(
            [
                jinja2.FileSystemLoader(str(Path(hub_module.__file__).parent / "templates")),
                jinja2.DictLoader({"page.html": "{% block main %}{% endblock %}"}),
            ]
        ),
        autoescape=True,
    )
    return env.get_template("gpupool-admin.html").render(
        view=view, flash="", base_url="/hub/", xsrf="T", pool_admin=True
    )


# -- user code on a device it does not hold: warned, then stopped ---------------------------------
def test_a_users_process_on_a_gpu_it_does_not_hold_is_warned_then_stopped(
    per_user: Setting, started: list[subprocess.Popen[bytes]]
) -> None:
    s = per_user
    ada = s.grant(ADA, "gpu")
    ben = s.grant(BEN, "cpu")  # ben's CPU-only server: his kernel grabs ada's GPU
    gpu = ada.visible_devices
    mine = process(started, ADA)  # ada's own, in a terminal: no marker, her account: hers
    stray = process(started, BEN, GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_ALLOCATION=ben.id)
    s.sim.set_processes(gpu, [mine.pid, stray.pid], used_mib=20000)

    assert s.look() == [("warn", stray.pid)]
    warning = s.warning(ben)
    assert warning is not None and warning["reason"] == "device"
    assert warning["reclaim_at"] == datetime.fromtimestamp(T0 + GRACE, UTC).isoformat()
    assert f"process {stray.pid}" in warning["message"] and gpu in warning["message"]
    lab = idle_state([allocation_model(ben, s.reclaimer)], ben.id)["warning"]
    assert lab is not None and lab["message"] == warning["message"]  # JupyterLab shows it
    assert s.warning(ada) is None
    html = admin_html(s)
    assert f'data-pid="{stray.pid}"' in html and "stop" in s.watch.view()["policy"]

    s.now += GRACE - 1
    assert s.look() == [] and stray.poll() is None
    s.now += 1
    assert s.look() == [("stop", stray.pid)]
    assert ended_by(stray, signal.SIGTERM), "the stray was not stopped"
    assert mine.poll() is None, "ada's own process on her own GPU was stopped"
    s.sim.set_processes(gpu, [mine.pid], used_mib=20000)
    assert s.look() == [] and s.warning(ben) is None


def test_a_stray_on_a_mig_instance_made_for_another_user_is_stopped(
    per_user: Setting, started: list[subprocess.Popen[bytes]]
) -> None:
    s = per_user
    ada = s.grant(ADA, "a100-3g")
    instance = ada.visible_devices
    assert instance.startswith("MIG-")  # made now, for ada: in no inventory
    s.hub_user(BEN)
    stray = process(started, BEN)
    s.sim.set_processes(instance, [stray.pid])
    assert s.look() == [("warn", stray.pid)]
    s.now += GRACE
    assert s.look() == [("stop", stray.pid)]
    assert ended_by(stray, signal.SIGTERM)


def test_a_stray_that_ignores_sigterm_is_killed_at_the_next_look(
    per_user: Setting, started: list[subprocess.Popen[bytes]]
) -> None:
    s = per_user
    s.hub_user(BEN)  # a hub user without a server: ben's account runs user code
    stray = process(started, BEN, IGNORE_TERM)
    s.sim.set_processes(s.whole[1], [stray.pid])
    assert s.look() == [("warn", stray.pid)]
    s.now += GRACE
    assert s.look() == [("stop", stray.pid)]
    s.now += s.watch.period
    assert s.look() == [("kill", stray.pid)]
    assert ended_by(stray, signal.SIGKILL)


# -- other accounts: never stopped, listed, and their devices not handed out -----------------------
def test_processes_of_other_accounts_are_never_stopped_and_their_devices_not_handed_out(
    per_user: Setting, started: list[subprocess.Popen[bytes]]
) -> None:
    s = per_user
    daemon = process(started, "root")
    other = process(started, NOBODY)  # an account that is no hub user
    s.sim.set_processes(s.whole[0], [daemon.pid])
    s.sim.set_processes(s.mig, [other.pid])

    assert s.look() == []  # nothing to warn: not user code
    with pytest.raises(NoCapacity) as refused:
        for user in ("cal", "dee"):
            s.pool.allocate(user, ["vision"], "gpu", ref=f"{user}/")
    assert refused.value.message.count(s.whole[0]) == 1
    assert f"process {daemon.pid} (root)" in refused.value.message
    team = s.pool.ledger.team("vision")
    offer = s.pool.ledger.offers["mig-3g"]
    verdict = s.pool.ledger.admit(team, "eve", offer, 1)  # what the spawn page shows
    assert verdict.verdict == "wait" and f"process {other.pid} ({NOBODY})" in verdict.reason

    s.now += 10 * GRACE
    assert s.look() == []
    assert daemon.poll() is None and other.poll() is None, "another account's process stopped"
    listed = {p["pid"]: p for p in s.watch.view()["processes"]}
    assert listed[daemon.pid]["account"] == "root" and listed[daemon.pid]["kind"] == "outside"
    assert listed[other.pid]["account"] == NOBODY and listed[other.pid]["device"] == s.mig
    html = admin_html(s)
    assert f'data-pid="{daemon.pid}"' in html and f'data-pid="{other.pid}"' in html

    # the cal/ allocation took the other whole GPU; once the daemon is gone, its GPU comes back
    daemon.kill()
    daemon.wait()
    s.sim.set_processes(s.whole[0], [])
    s.look()
    assert s.pool.allocate("dee", ["vision"], "gpu", ref="dee/").visible_devices == s.whole[0]


def test_a_held_device_used_by_another_account_is_not_handed_out_after_its_release(
    per_user: Setting, started: list[subprocess.Popen[bytes]]
) -> None:
    s = per_user
    ada = s.grant(ADA, "mig-3g")  # the one 3g.40gb instance
    daemon = process(started, "root")
    s.sim.set_processes(ada.visible_devices, [daemon.pid])
    s.look()
    s.pool.release(ada.id)  # before the next look: nothing may take it in between
    with pytest.raises(NoCapacity, match=f"process {daemon.pid} \\(root\\)"):
        s.pool.allocate("cal", ["vision"], "mig-3g", ref="cal/")
    daemon.kill()
    daemon.wait()
    s.look()
    assert s.pool.allocate("cal", ["vision"], "mig-3g", ref="cal/").visible_devices == s.mig


def test_an_account_the_hub_cannot_tell_about_is_not_stopped(
    per_user: Setting, started: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    s = per_user
    s.hub_user(BEN)
    stray = process(started, BEN)
    s.sim.set_processes(s.whole[1], [stray.pid])
    s.api.status = 503  # JupyterHub's REST API does not answer: is ben a hub user?
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert s.look() == []
        s.now += 2 * GRACE
        assert s.look() == []
    assert stray.poll() is None
    said = [r for r in caplog.records if "could not tell" in r.getMessage()]
    assert len(said) == 1
    with pytest.raises(NoCapacity):  # but its GPU is not handed out meanwhile
        for user in ("cal", "dee"):
            s.pool.allocate(user, ["vision"], "gpu", ref=f"{user}/")
    s.api.status = None
    assert s.look() == [("warn", stray.pid)]


# -- a share GPU's memory counts every process on it -----------------------------------------------
def test_every_process_on_a_share_gpu_counts(
    per_user: Setting, started: list[subprocess.Popen[bytes]]
) -> None:
    s = per_user
    ada = s.grant(ADA, "quarter")  # 12288 MiB of an L40S
    s.hub_user(BEN)
    gpu = ada.visible_devices
    hers = process(started, ADA)  # ada's, started outside her server (no marker): hers
    bens = [process(started, BEN), process(started, BEN)]
    s.sim.set_processes(gpu, [hers.pid], used_mib=13000)
    assert [(a.id, what) for a, what in asyncio.run(s.shares.look())] == [(ada.id, "warn")]

    s.sim.set_processes(gpu, [hers.pid, *(p.pid for p in bens)], used_mib=20000)
    assert sorted(s.look()) == sorted(("warn", p.pid) for p in bens)  # 40 GB of others
    assert s.pool.ledger.placeable(s.pool.ledger.offers["quarter"]) == 4  # the other L40S
    s.now += GRACE
    assert sorted(s.look()) == sorted(("stop", p.pid) for p in bens)
    assert all(ended_by(p, signal.SIGTERM) for p in bens)


# -- the policy -----------------------------------------------------------------------------------
@pytest.fixture
def shared(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Setting]:
    """The shared mode (one account runs every user's code), with the watch's ``request.param``
    settings (made before the test: JupyterHub's database setup resets the logging handlers)."""
    with Setting(tmp_path, per_user=False, **request.param) as setting:
        yield setting


@pytest.mark.parametrize("shared", [{}], indirect=True)
def test_in_the_shared_mode_the_default_is_log_and_the_admin_page_says_so(
    shared: Setting, started: list[subprocess.Popen[bytes]], caplog: pytest.LogCaptureFixture
) -> None:
    s = shared
    ada = s.grant("ada", "gpu")
    kernel = process(
        started, shared_account(), GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_ALLOCATION=ada.id
    )
    s.sim.set_processes(s.whole[1], [kernel.pid])  # a GPU ada's server does not hold
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        assert s.look() == [("log", kernel.pid)]
        s.now += 2 * GRACE
        assert s.look() == []
    assert kernel.poll() is None and s.warning(ada) is None
    assert sum("left running" in r.getMessage() for r in caplog.records) == 1
    view = s.watch.view()
    assert view["policy"] == "log" and "shared mode" in view["policy_why"]
    assert 'data-policy="log"' in admin_html(s)
    with pytest.raises(NoCapacity, match=str(kernel.pid)):
        s.pool.allocate("ben", ["vision"], "gpu", ref="ben/")


@pytest.mark.parametrize("shared", [{"policy": "stop"}], indirect=True)
def test_in_the_shared_mode_stop_can_be_chosen(
    shared: Setting, started: list[subprocess.Popen[bytes]]
) -> None:
    s = shared
    ada = s.grant("ada", "gpu")
    kernel = process(
        started, shared_account(), GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_ALLOCATION=ada.id
    )
    s.sim.set_processes(s.whole[1], [kernel.pid])
    assert s.look() == [("warn", kernel.pid)]
    assert s.warning(ada) is not None
    s.now += GRACE
    assert s.look() == [("stop", kernel.pid)]
    assert ended_by(kernel, signal.SIGTERM)
    assert 'data-policy="stop"' in admin_html(s)


def test_a_bad_policy_stops_the_hub_naming_the_key(per_user: Setting) -> None:
    for key, value in (("policy", "kill"), ("grace_minutes", -1), ("period", 0)):
        c = copy.deepcopy(per_user.config)
        setattr(c.DeviceWatch, key, value)
        with pytest.raises(ConfigError) as e:
            build_device_watch(per_user.pool, per_user.reclaimer, per_user.jobs, c, LOG)
        assert e.value.path == f"DeviceWatch.{key}"


def test_root_is_never_signalled_even_when_its_process_claims_an_allocation(
    per_user: Setting, started: list[subprocess.Popen[bytes]]
) -> None:
    s = per_user
    ada = s.grant(ADA, "gpu")
    forged = process(started, "root", GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_ALLOCATION=ada.id)
    s.sim.set_processes(s.whole[1], [forged.pid])
    assert s.look() == []
    s.now += 10 * GRACE
    assert s.look() == [] and forged.poll() is None
    assert pwd.getpwuid(os.stat(f"/proc/{forged.pid}").st_uid).pw_name == "root"
