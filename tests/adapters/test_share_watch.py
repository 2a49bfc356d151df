"""The share watch against the simulated NVML and real processes: a share whose processes use
more GPU memory than its cap is warned (in JupyterLab's channel, on the admin page, in the
metric), forgiven when it uses less again, and stopped after the grace through JupyterHub's REST
API (:class:`tests.hubapi.FakeHub`) with the reason on the admin page.

The pool: two simulated L40S-48GB without MIG; share allocations are made directly (the
ledger's placing of shares is not needed here). A share of 250 thousandths has a cap of
12288 MiB. Processes are real (:func:`tests.conftest.holder`), carrying gpupool's variables as
the spawner and the job backend set them; the simulated NVML reports their memory.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jinja2
import pytest
from markupsafe import escape
from prometheus_client import REGISTRY
from traitlets.config import Config

import gpupool.hub as hub_module
from gpupool.clock import iso
from gpupool.config import GPUPool
from gpupool.core.ledger import Allocation, Device
from gpupool.declarations import ConfigError
from gpupool.hub.models import allocation_model
from gpupool.hub.pages_view import admin_view
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.hub.share_watch import ShareWatch, build_watch
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool.shares import ShareEnforcement
from gpupool_lab.allocation import idle_state
from tests.accounts import shared_mode
from tests.conftest import holder, holders
from tests.hubapi import TOKEN, HubStandIns

LOG = logging.getLogger("gpupool.tests.shares")
SPEC = "simulated:n: 2x L40S-48GB"
T0 = 1_780_000_000.0
CAP = 12288


class Setting(HubStandIns):
    def __init__(self, tmp: Path, **enforcement: Any) -> None:
        c = Config()
        c.GPUPool.inventory = SPEC
        c.GPUPool.db_url = f"sqlite:///{tmp / 'pool.sqlite'}"
        c.GPUPool.offers = {"cpu": {}}
        c.GPUPool.teams = {"vision": {"guarantee": 2}}
        c.ShareEnforcement.grace_minutes = 5
        for key, value in enforcement.items():
            setattr(c.ShareEnforcement, key, value)
        shared_mode(c)
        self.config = c
        self.pool = Pool.from_config(GPUPool(config=c))
        self.now = T0
        self.pool.clock = lambda: datetime.fromtimestamp(self.now, UTC)
        self.gpus = [g.uuid for g in self.pool.inventory.gpus]
        self.sim = self.pool.monitor.nvml_by_node["n"]
        super().__init__(tmp)
        self.reclaimer = IdleReclaimer(self.pool, TOKEN, self.api.api_url, self.api.url, config=c)
        self.jobs = JobManager(self.pool, config=c)
        self.watch = build_watch(self.pool, self.reclaimer, self.jobs, c, LOG)

    def share(self, user: str, gpu: int = 0, kind: str = "notebook", ref: str = "") -> Allocation:
        """A quarter of GPU ``gpu`` held by ``user``'s server (or a job ``ref``)."""
        ref = ref or f"{user}/"
        a = Allocation(
            f"alloc-{user}-{kind}", user, "vision", "share-q", kind, ref, 1, 250, "n",
            (Device(self.gpus[gpu], share_milli=250),), self.now,
        )  # fmt: skip
        self.pool.ledger.allocations[a.id] = a
        if kind == "notebook":
            self.hubdb.server(user, ("vision",), {"gpupool_allocation": a.id})
        return a

    def look(self) -> list[tuple[str, str]]:
        return [(a.ref, what) for a, what in asyncio.run(self.watch.look())]


@pytest.fixture
def s(tmp_path: Path) -> Iterator[Setting]:
    with Setting(tmp_path) as setting:
        yield setting


def overuse(kind: str, action: str) -> float:
    value = REGISTRY.get_sample_value(
        "gpupool_share_overuse_total", {"kind": kind, "action": action}
    )
    return value or 0.0


def admin_html(s: Setting) -> str:
    """The admin page as its template renders it (JupyterHub's page.html stubbed)."""
    view = admin_view(s.pool, s.jobs, s.reclaimer, s.now)
    view["shares"] = s.watch.view()
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


def test_a_share_over_its_cap_is_warned_then_stopped_after_the_grace(s: Setting) -> None:
    ada = s.share("ada")
    warned, stopped = overuse("notebook", "warn"), overuse("notebook", "stop")
    with holders() as started:
        server = holder(started, GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_ALLOCATION=ada.id)
        s.sim.set_processes(s.gpus[0], [server.pid], used_mib=CAP)
        assert s.look() == []  # at the cap is within it
        s.sim.set_processes(s.gpus[0], [server.pid], used_mib=CAP + 1)

        assert s.look() == [("ada/", "warn")]
        assert overuse("notebook", "warn") == warned + 1
        # the warning reaches JupyterLab as the idle reclaimer's does: idle.warning of the
        # allocations document, which gpupool_lab's status bar reads
        model = allocation_model(ada, s.reclaimer)
        warning = model["idle"]["warning"]
        assert warning["action"] == "stop"
        assert warning["reclaim_at"] == iso(T0 + 300)  # the grace, 5 min, from now
        assert f"{CAP + 1} MiB of GPU memory on {s.gpus[0]}" in warning["message"]
        assert f"{CAP} MiB" in warning["message"] and "stopped at" in warning["message"]
        lab = idle_state([model], ada.id)
        assert lab["warning"] is not None and lab["warning"]["message"] == warning["message"]
        html = admin_html(s)
        assert "⚠ warned" in html and 'data-action="warn"' in html

        s.now += 299
        assert s.look() == []  # still within the grace: warned once, nothing stopped
        assert overuse("notebook", "warn") == warned + 1
        assert not [c for c in s.api.calls if c[0] == "DELETE"]

        s.now += 1
        assert s.look() == [("ada/", "stop")]
        assert ("DELETE", "/hub/api/users/ada/server") in s.api.calls
        assert overuse("notebook", "stop") == stopped + 1
        assert s.look() == []  # stopped once, while the pool still holds it
    reason = (
        f"{CAP + 1} MiB of GPU memory on {s.gpus[0]}, over the share's {CAP} MiB for more than "
        "5 min after a warning"
    )
    events = s.watch.view()["events"]
    assert (events[0]["action"], events[0]["ref"], events[0]["reason"]) == ("stop", "ada/", reason)
    html = admin_html(s)
    assert 'data-action="stop" data-ref="ada/"' in html and escape(reason) in html


def test_a_share_back_under_its_cap_is_forgiven(s: Setting) -> None:
    ada = s.share("ada")
    with holders() as started:
        server = holder(started, GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_ALLOCATION=ada.id)
        s.sim.set_processes(s.gpus[0], [server.pid], used_mib=20000)
        assert s.look() == [("ada/", "warn")]
        s.sim.set_processes(s.gpus[0], [server.pid], used_mib=4000)
        s.now += 60
        assert s.look() == []
        assert s.reclaimer.status(ada)["warning"] is None
        s.now += 3600
        assert s.look() == []
        assert not [c for c in s.api.calls if c[0] == "DELETE"]


def test_only_the_shares_own_processes_and_their_children_count(s: Setting) -> None:
    """Its server, and a child of it without gpupool's variables (found through its parent),
    count; a process of another allocation, one without a marker and one of another hub don't."""
    ada, ben = s.share("ada"), s.share("ben")
    spawn_child = (
        "import subprocess\n"
        "c = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], env={})\n"
        "print('ready', flush=True)\n"
        "print(c.pid, flush=True)\n"
    )
    with holders() as started:
        server = holder(
            started, spawn_child, GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_ALLOCATION=ada.id
        )
        assert server.stdout is not None
        child = int(server.stdout.readline())
        others = [
            holder(started, GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_ALLOCATION=ben.id).pid,
            holder(started).pid,
            holder(started, GPUPOOL_HUB="another-hub", GPUPOOL_ALLOCATION=ada.id).pid,
        ]
        pids = [server.pid, child, *others]
        s.sim.set_processes(s.gpus[0], pids, used_mib=6000)  # ada's two: 12000 of 12288
        assert s.look() == []
        assert ada.id not in s.watch.over
        s.sim.set_processes(s.gpus[0], pids, used_mib=6200)  # ada's two: 12400
        s.look()
        assert s.watch.over[ada.id].used_mib == 12400


def test_a_job_is_found_by_its_marker_and_cancelled_through_the_stop_seam(
    tmp_path: Path,
) -> None:
    s = Setting(tmp_path, grace_minutes=0)
    try:
        job = s.share("cal", gpu=1, kind="job", ref="job123")
        stops: list[tuple[str, str]] = []

        async def stop(a: Allocation, reason: str) -> None:
            stops.append((a.ref, reason))

        watch = ShareWatch(
            s.pool, s.watch.enforcement, stop=stop, log=LOG, accounts=s.watch.accounts
        )
        with holders() as started:
            rank = holder(started, GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_JOB="job123")
            s.sim.set_processes(s.gpus[1], [rank.pid], used_mib=30000)
            done = [(a.ref, what) for a, what in asyncio.run(watch.look())]
        assert done == [("job123", "warn"), ("job123", "stop")]  # no grace: at once
        assert stops == [
            ("job123", f"30000 MiB of GPU memory on {s.gpus[1]}, over the share's {CAP} MiB "
             "for more than 0 min after a warning")
        ]  # fmt: skip
        assert job.id not in watch.over
    finally:
        s.close()


def test_shares_on_mps_gpus_are_left_to_mps(tmp_path: Path) -> None:
    s = Setting(tmp_path, mps=["L40S-48GB"])
    try:
        ada = s.share("ada")
        with holders() as started:
            server = holder(started, GPUPOOL_HUB=s.pool.hub_marker, GPUPOOL_ALLOCATION=ada.id)
            s.sim.set_processes(s.gpus[0], [server.pid], used_mib=40000)
            assert s.watch.watched() == []
            assert s.look() == []
    finally:
        s.close()


def test_memory_nvml_does_not_report_counts_as_nothing_and_is_said_once(
    s: Setting, caplog: pytest.LogCaptureFixture
) -> None:
    ada = s.share("ada")
    watch = ShareWatch(
        s.pool,
        s.watch.enforcement,
        stop=lambda a, r: asyncio.sleep(0),
        log=LOG,
        accounts=s.watch.accounts,
        read=lambda node, uuids: {s.gpus[0]: [(10, None), (11, None)]},
        facts=lambda pid: (s.watch.accounts.servers_uid or 0, ada.id),
    )
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(watch.look()) == []
        asyncio.run(watch.look())
    said = [r for r in caplog.records if "does not report the GPU memory" in r.getMessage()]
    assert len(said) == 1


def test_bad_share_settings_or_mps_with_per_user_jobs_stop_the_hub(tmp_path: Path) -> None:
    s = Setting(tmp_path)
    try:
        c = copy.deepcopy(s.config)
        c.ShareEnforcement.grace_minutes = -2
        with pytest.raises(ConfigError) as e:
            build_watch(s.pool, s.reclaimer, s.jobs, c, LOG)
        assert e.value.path == "ShareEnforcement.grace_minutes"
        c = copy.deepcopy(s.config)
        c.ShareEnforcement.mps = ["*"]
        c.LocalJobBackend.run_as_hub_user = False
        with pytest.raises(ConfigError) as e:
            build_watch(s.pool, s.reclaimer, s.jobs, c, LOG)
        assert e.value.path == "ShareEnforcement.mps"
        assert isinstance(s.watch.enforcement, ShareEnforcement)
    finally:
        s.close()
