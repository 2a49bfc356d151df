"""Reconciliation both ways: the decision (a pure function of the ledger, JupyterHub's records and
the processes found), and the layer that reads ``/proc`` and JupyterHub's records (its database
at start, its REST API while it runs) and stops processes, against real processes (started as the
account that runs user code), a real pool database (SQLite; the whole pass also on PostgreSQL:
:mod:`tests.databases`), a real JupyterHub database (made by JupyterHub's own ORM) and
JupyterHub's REST API answered from it (:class:`tests.hubapi.FakeHub`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyterhub import orm
from prometheus_client import REGISTRY

from gpupool.core.ledger import Allocation, Device, Ledger
from gpupool.core.offers import Request
from gpupool.core.reconcile import Action, Proc, Record, lost_database, plan
from gpupool.discovery import SimulatedNVML, simulated_inventory
from gpupool.hub.reconcile import Reconciler
from gpupool.hub.records import START_KEY, STATE_KEY
from gpupool.monitors.activity import DeviceMonitor
from gpupool.pool import Pool
from gpupool.processes import scan, server_alive
from gpupool.procfs import process_start
from gpupool.store import Store
from tests.conftest import gone, holder, holders
from tests.factories import OFFERS, TEAMS, mixed_inventory
from tests.hubapi import TOKEN, FakeHub, free_port

# -- the decision ---------------------------------------------------------------------------------


def ledger_with(*grants: tuple[str, str, str, str, int]) -> Ledger:
    """A ledger over the mixed test inventory with ``(id, user, team, offer, count)`` granted."""
    ledger = Ledger(mixed_inventory(), OFFERS, TEAMS)
    for alloc_id, user, team, offer, count in grants:
        ledger.allocate(Request(user, team, offer, count, "notebook", f"{user}/"), alloc_id)
    return ledger


def proc(pid: int, allocation: str = "", **kw: Any) -> Proc:
    pgid, uid = kw.pop("pgid", pid), kw.pop("uid", 1000)
    return Proc(pid=pid, pgid=pgid, uid=uid, start=1, allocation=allocation, **kw)


def record(user: str, allocation: str, pid: int | None = 100, alive: bool | None = True) -> Record:
    groups = frozenset({"vision"} if user in ("ada", "ben") else {"nlp"})
    return Record(user, "", groups, allocation, pid, alive)


def kinds(actions: list[Action]) -> list[tuple[str, str]]:
    return [(a.action, a.release or (a.adopt.id if a.adopt else "")) for a in actions]


@pytest.mark.parametrize("at_start", [True, False])
def test_a_dead_servers_allocation_is_released_and_what_it_left_is_stopped(at_start: bool) -> None:
    ledger = ledger_with(("a1", "ada", "vision", "gpu", 1))
    kernel = proc(201, "a1", visible=(ledger.allocations["a1"].visible_devices,))
    actions = plan(ledger, [record("ada", "a1", alive=False)], [kernel], at_start=at_start)
    assert kinds(actions) == [("released", "a1")]
    assert actions[0].stop == (kernel,) and "process 100 is gone" in actions[0].message


def test_at_start_an_allocation_no_server_records_is_released_its_processes_stopped_first() -> None:
    ledger = ledger_with(("a1", "ada", "vision", "gpu", 1), ("a2", "ben", "vision", "gpu", 1))
    server = proc(300, "a1", visible=(ledger.allocations["a1"].visible_devices,))
    actions = plan(ledger, [], [server], at_start=True)
    assert kinds(actions) == [("stopped", "a1"), ("released", "a2")]
    assert actions[0].stop == (server,) and "JupyterHub has no record" in actions[0].message
    # while the hub runs, that is a start in progress: left alone
    assert plan(ledger, [], [server], at_start=False) == []


def test_live_and_unchecked_servers_hold_their_allocations() -> None:
    ledger = ledger_with(("a1", "ada", "vision", "gpu", 1), ("a2", "ben", "vision", "gpu", 1))
    records = [record("ada", "a1"), record("ben", "a2", pid=None, alive=None)]  # b: Kubernetes
    for at_start in (True, False):
        assert plan(ledger, records, [proc(100, "a1")], at_start=at_start) == []


PAIR = (Device("GPU-a-2"), Device("GPU-a-3"))
SLICE = (Device("GPU-a-5", "3g.40gb", 0, "MIG-a-5-0"),)


@pytest.mark.parametrize(
    ("visible", "offer", "team", "user", "devices", "cost"),
    [
        (("GPU-a-2", "GPU-a-3"), "h100-pair", "ops", "ada", PAIR, 2000),
        (("MIG-a-5-0",), "mig-3g.40gb", "nlp", "dee", SLICE, 500),
        ((), "cpu", "vision", "ben", (), 0),
    ],
)
def test_at_start_a_lost_allocation_of_a_live_recorded_server_is_adopted(
    visible: tuple[str, ...],
    offer: str,
    team: str,
    user: str,
    devices: tuple[Device, ...],
    cost: int,
) -> None:
    ledger = ledger_with(("other", "cal", "vision", "gpu", 1))
    server = proc(100, "lost", visible=visible, offer=offer, team=team, started_at=1234.5)
    records = [
        Record(user, "", frozenset({team}), "lost", 100, True),
        record("cal", "other", pid=None, alive=None),
    ]
    kernel = proc(101, "lost", visible=visible)
    actions = plan(ledger, records, [server, kernel], at_start=True)
    assert kinds(actions) == [("adopted", "lost")]
    adopted = actions[0].adopt
    node = "a" if devices else None
    count = len(devices) or 1
    assert adopted == Allocation(
        "lost", user, team, offer, "notebook", f"{user}/", count, cost, node, devices, 1234.5
    )
    assert adopted is not None
    ledger.restore([adopted])
    ledger.check_invariants()


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"offer": "tpu"}, "its offer 'tpu' does not exist"),
        ({"team": "nlp"}, "You are not in team 'nlp'"),
        ({"visible": ("GPU-z-9",)}, "are not all in this pool"),
        ({"visible": ("TAKEN",)}, "held by another allocation"),
        ({"visible": ("MIG-a-5-4",)}, "do not fit gpu"),
        (
            {"visible": ("GPU-b-1",), "offer": "h100-pair", "team": "ops", "groups": {"ops"}},
            "do not fit h100-pair",
        ),
        ({"on_devices": ("GPU-a-3",)}, "its processes also use GPU-a-3"),
        ({"alive": False}, "not a live local process"),
        ({"record": None}, "JupyterHub records no running server with it"),
        ({"pid": 999}, "is process 999, not one of these"),
    ],
)
def test_at_start_an_inconsistent_holder_is_stopped_not_adopted(
    change: dict[str, Any], why: str
) -> None:
    ledger = ledger_with(("taken", "cal", "vision", "gpu", 1))
    taken = ledger.allocations["taken"].visible_devices
    fields = {"visible": ("GPU-a-1",), "offer": "gpu", "team": "vision", "on_devices": ()}
    fields.update({k: v for k, v in change.items() if k in fields})
    fields["visible"] = tuple(taken if d == "TAKEN" else d for d in fields["visible"])
    server = proc(100, "lost", **fields)
    groups = frozenset(change.get("groups", {"vision"}))
    rec = Record("ada", "", groups, "lost", change.get("pid", 100), change.get("alive", True))
    records = [record("cal", "taken", pid=None, alive=None)]
    records += [] if "record" in change else [rec]
    actions = plan(ledger, records, [server], at_start=True)
    stopped = [a for a in actions if a.action == "stopped"]
    assert len(stopped) == 1 and stopped[0].stop == (server,), kinds(actions)
    assert why in stopped[0].message
    assert not any(a.adopt for a in actions)


def test_another_accounts_process_claiming_a_lost_allocation_neither_blocks_nor_joins_it() -> None:
    server = proc(100, "lost", visible=("GPU-a-1",), offer="gpu", team="vision")
    stranger = proc(300, "lost", visible=("GPU-a-3",), uid=2000)
    actions = plan(ledger_with(), [record("ada", "lost")], [server, stranger], at_start=True)
    assert kinds(actions) == [("stopped", ""), ("adopted", "lost")]
    assert actions[0].stop == (stranger,) and "run as another account" in actions[0].message
    assert actions[1].adopt is not None and actions[1].adopt.devices == (Device("GPU-a-1"),)


def test_while_the_hub_runs_an_unknown_allocation_is_stopped_never_adopted() -> None:
    server = proc(100, "lost", visible=("GPU-a-1",), offer="gpu", team="vision")
    actions = plan(ledger_with(), [record("ada", "lost")], [server], at_start=False)
    assert kinds(actions) == [("stopped", "")]
    assert "the pool does not know it" in actions[0].message


def test_ranks_of_jobs_the_store_does_not_know_are_stopped_known_ones_left() -> None:
    ranks = [proc(10, job="j-known", visible=("GPU-a-1",)), proc(11, job="j-gone")]
    actions = plan(ledger_with(), [], ranks, ["j-known"], at_start=False)
    assert kinds(actions) == [("stopped", "")]
    assert actions[0].stop == (ranks[1],) and "job j-gone" in actions[0].message


def test_a_process_of_this_hub_holding_devices_without_any_claim_is_stopped() -> None:
    loose = [proc(12, visible=("GPU-a-1",)), proc(13, on_devices=("GPU-a-2",)), proc(14)]
    actions = plan(ledger_with(), [], loose, at_start=False)
    assert [a.stop for a in actions] == [(loose[0],), (loose[1],)]


def test_what_cannot_be_fixed_is_reported_not_touched() -> None:
    ledger = ledger_with(("a1", "ada", "vision", "gpu", 1))
    mine = ledger.allocations["a1"].visible_devices
    unread = record("ben", "lost", pid=None, alive=None)  # Kubernetes: no process to read
    server = proc(100, "a1", visible=(mine,), on_devices=(mine,))
    actions = plan(ledger, [record("ada", "a1"), unread], [server], [], at_start=True)
    assert [a.action for a in actions] == ["reported"] and not actions[0].stop
    assert "server ben/ holds allocation lost, which the pool does not know" in actions[0].message


def test_a_process_on_a_device_its_allocation_does_not_hold_is_the_device_watchs() -> None:
    """Reconciliation leaves it to :mod:`gpupool.hub.device_watch` (which warns, then stops
    user code there), instead of reporting it as left running."""
    ledger = ledger_with(("a1", "ada", "vision", "gpu", 1))
    mine = ledger.allocations["a1"].visible_devices
    over = proc(100, "a1", visible=(mine,), on_devices=(mine, "GPU-a-3"))
    for at_start in (True, False):
        assert plan(ledger, [record("ada", "a1")], [over], [], at_start=at_start) == []


def test_a_lost_pool_database_is_told_from_an_empty_pool() -> None:
    records = [record("ada", "a1"), record("ben", "", pid=5), record("cal", "c1", alive=False)]
    assert lost_database(ledger_with(), records) == [records[0]]
    assert lost_database(ledger_with(("x", "dee", "nlp", "cpu", 1)), records) == []
    assert lost_database(ledger_with(), records[1:]) == []


# -- real processes -------------------------------------------------------------------------------


IGNORE_TERM = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"
CHILD_IN_GROUP = (  # a child in the same process group, without the marker
    "import subprocess\n"
    "subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'], env={})\n"
    "print('ready', flush=True)"
)


def test_the_scan_finds_only_this_hubs_processes_and_reads_what_they_claim() -> None:
    with holders() as ps:
        ours = holder(ps, GPUPOOL_HUB="hub-one", GPUPOOL_ALLOCATION="a1", GPUPOOL_OFFER="h100",
                      GPUPOOL_TEAM="vision", CUDA_VISIBLE_DEVICES="GPU-1, MIG-2")  # fmt: skip
        rank = holder(ps, GPUPOOL_HUB="hub-one", GPUPOOL_JOB="j1", CUDA_VISIBLE_DEVICES="")
        holder(ps, GPUPOOL_HUB="hub-two", GPUPOOL_ALLOCATION="a1")
        holder(ps, GPUPOOL_ALLOCATION="a1", CUDA_VISIBLE_DEVICES="GPU-1")
        found = {p.pid: p for p in scan("hub-one")}
        assert set(found) == {ours.pid, rank.pid}
        p = found[ours.pid]
        assert (p.allocation, p.offer, p.team, p.job) == ("a1", "h100", "vision", "")
        assert p.visible == ("GPU-1", "MIG-2") and p.pgid == ours.pid
        assert p.uid == os.stat(f"/proc/{ours.pid}").st_uid and p.start == process_start(ours.pid)
        assert found[rank.pid].job == "j1" and found[rank.pid].visible == ()


def test_a_server_is_alive_only_as_the_very_process_its_state_names() -> None:
    with holders() as ps:
        server = holder(ps, GPUPOOL_ALLOCATION="a1")
        start = process_start(server.pid)
        assert server_alive(server.pid, start, "a1")
        assert not server_alive(server.pid, (start or 0) + 1, "a1")  # a recycled pid
        assert server_alive(server.pid, None, "a1")  # a state from before start times
        assert not server_alive(server.pid, None, "b2")  # the pid runs something else
        server.kill()
        server.wait()
        assert not server_alive(server.pid, start, "a1") and process_start(server.pid) is None


SIMULATED = "local: 3x H100-80GB, mig=1:3g.40gb+2g.20gb+1g.10gb"


class Setting:
    """A real pool (simulated inventory, its database at ``pool_url``: SQLite unless given),
    JupyterHub's database made by its own ORM, its REST API answered from that database, and a
    reconciler over them, as a hub would have them."""

    def __init__(self, tmp: Path, pool_url: str = "") -> None:
        self.nvml = SimulatedNVML(SIMULATED)
        inventory = simulated_inventory(self.nvml)
        self.whole = [g.uuid for g in inventory.gpus if g.mig_mode == "off"]
        self.mig = next(
            i.uuid for g in inventory.gpus for i in g.instances if i.profile == "3g.40gb"
        )
        offers = {k: v for k, v in OFFERS.items() if k in ("cpu", "gpu", "mig-3g.40gb")}
        ledger = Ledger(inventory, offers, TEAMS)
        monitor = DeviceMonitor({n: self.nvml.for_node(n) for n in self.nvml.node_names})
        self.pool_url = pool_url or f"sqlite:///{tmp / 'gpupool.sqlite'}"
        self.pool = Pool(ledger, Store(self.pool_url), monitor=monitor)
        self.hub_url = f"sqlite:///{tmp / 'jupyterhub.sqlite'}"
        self.db = orm.new_session_factory(self.hub_url)()
        self.api = FakeHub(self.hub_url)
        self.log = logging.getLogger("gpupool.tests.reconcile")
        self.reconciler = Reconciler(
            self.pool, self.hub_url, self.api.api_url, TOKEN, stop_grace=0.5, log=self.log
        )
        self.marker = self.pool.hub_marker

    def close(self) -> None:
        self.api.close()
        self.db.close()
        self.pool.store.close()

    def server(self, user: str, team: str, state: dict[str, Any]) -> None:
        """JupyterHub's record of ``user``'s running server with ``state``."""
        u = orm.User(name=user)
        self.db.add(u)
        group = self.db.query(orm.Group).filter_by(name=team).first() or orm.Group(name=team)
        u.groups.append(group)
        spawner = orm.Spawner(user=u, name="")
        spawner.server = orm.Server()
        spawner.state = state
        self.db.add(spawner)
        self.db.commit()

    def env(self, allocation: Allocation, **more: str) -> dict[str, str]:
        return {
            "GPUPOOL_HUB": self.marker,
            "GPUPOOL_ALLOCATION": allocation.id,
            "GPUPOOL_OFFER": allocation.offer,
            "GPUPOOL_TEAM": allocation.team,
            "CUDA_VISIBLE_DEVICES": allocation.visible_devices,
            **more,
        }


@pytest.fixture
def setting(tmp_path: Path) -> Iterator[Setting]:
    s = Setting(tmp_path)
    yield s
    s.close()


@pytest.fixture
def setting_on(tmp_path: Path, db_url: str) -> Iterator[Setting]:
    """:func:`setting` with the pool's database on SQLite, then on PostgreSQL."""
    s = Setting(tmp_path, db_url)
    yield s
    s.close()


def actions_count(action: str) -> float:
    return REGISTRY.get_sample_value("gpupool_reconcile_actions_total", {"action": action}) or 0.0


def test_at_start_and_while_running_real_processes_are_adopted_stopped_and_released(
    setting_on: Setting,
) -> None:
    s = setting_on
    pool = s.pool
    ada = pool.allocate("ada", ["vision"], "gpu", 1, ref="ada/")
    dee = pool.allocate("dee", ["nlp"], "mig-3g.40gb", ref="dee/")
    crashed = pool.allocate("cal", ["vision"], "gpu", 1, ref="cal/")
    before = {a: actions_count(a) for a in ("adopted", "stopped", "released", "reported")}
    with holders() as ps:
        # ada: a live server (with a kernel in a session of its own) whose allocation the pool
        # database lost; dee: a server that died while the hub was down; cal: a server the hub
        # started but never recorded, which ignores SIGTERM and has a child in its group
        ada_server = holder(ps, **s.env(ada))
        ada_kernel = holder(ps, **s.env(ada))
        s.server("ada", "vision", {"pid": ada_server.pid, STATE_KEY: ada.id,
                                   START_KEY: process_start(ada_server.pid)})  # fmt: skip
        dead = holder(ps, **s.env(dee))
        dead_start = process_start(dead.pid)
        dead.kill()
        dead.wait()
        s.server("dee", "nlp", {"pid": dead.pid, STATE_KEY: dee.id, START_KEY: dead_start})
        orphan = holder(ps, IGNORE_TERM + "\n" + CHILD_IN_GROUP, **s.env(crashed))
        assert len(group_members(orphan.pid)) == 2
        # a rank of a job the store does not know; another hub's server (never touched)
        rank = holder(ps, GPUPOOL_HUB=s.marker, GPUPOOL_JOB="no-such-job",
                      CUDA_VISIBLE_DEVICES=s.whole[1])  # fmt: skip
        other = holder(ps, **s.env(crashed, GPUPOOL_HUB="another-hub"))
        pool.store.delete([ada.id])  # the database lost ada's allocation…
        pool.ledger.release(ada.id)  # …before this hub started

        actions = s.reconciler.at_start()

        assert gone(orphan) and gone(rank) and not gone(other)
        assert not gone(ada_server) and not gone(ada_kernel)
        assert group_members(orphan.pid) == [], "the orphan's child (its group) survived"
        assert sorted(a.action for a in actions) == ["adopted", "released", "stopped", "stopped"]
        reopened = Store(s.pool_url, upgrade=False)
        held = {a.ref: a for a in reopened.load()}
        reopened.close()
        assert set(held) == {"ada/"} and held["ada/"].devices == ada.devices
        assert held["ada/"].id == ada.id and held["ada/"].team == "vision"
        assert set(pool.ledger.allocations) == {ada.id}
        after = {a: actions_count(a) - before[a] for a in before}
        assert after == {"adopted": 1, "stopped": 2, "released": 1, "reported": 0}

        # while the hub runs: ada's server stops but a kernel is left behind with its GPU
        pool.release(ada.id)
        ada_server.kill()
        ada_server.wait()
        s.nvml.set_processes(s.mig, [ada_kernel.pid])  # NVML: the kernel is on dee's old slice
        stray = asyncio.run(s.reconciler.periodic())
        assert gone(ada_kernel) and not gone(other)
        assert [a.action for a in stray] == ["stopped"]
        assert s.mig in stray[0].message and ada.id in stray[0].message
        assert pool.ledger.allocations == {}


def group_members(pgid: int) -> list[int]:
    """Live processes (not zombies) of the process group ``pgid``."""
    members = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid and process_start(int(entry.name)):
                    members.append(int(entry.name))
            except ProcessLookupError:
                continue
    return members


def failures() -> float:
    return REGISTRY.get_sample_value("gpupool_reconcile_failures_total") or 0.0


def said(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def test_a_pass_while_the_hub_runs_is_skipped_when_its_rest_api_cannot_be_read(
    setting: Setting, caplog: pytest.LogCaptureFixture
) -> None:
    """Never "could not read" taken for "no servers": nothing is released or stopped on it."""
    s = setting
    ada = s.pool.allocate("ada", ["vision"], "gpu", 1, ref="ada/")
    with holders() as ps, caplog.at_level(logging.WARNING, logger=s.log.name):
        dead = holder(ps, **s.env(ada))
        start = process_start(dead.pid)
        dead.kill()
        dead.wait()
        s.server("ada", "vision", {"pid": dead.pid, STATE_KEY: ada.id, START_KEY: start})
        stray = holder(ps, **s.env(ada, GPUPOOL_ALLOCATION="released-long-ago"))
        before = failures()

        s.api.status = 503  # the hub answers, with an error
        assert asyncio.run(s.reconciler.periodic()) == []
        s.api.status = None
        s.reconciler.hub.api_url = f"http://127.0.0.1:{free_port()}/hub/api"  # nothing listens
        assert asyncio.run(s.reconciler.periodic()) == []

        assert said(caplog, "a reconciliation pass was skipped") == 2
        assert failures() - before == 2
        assert ada.id in s.pool.ledger.allocations and not gone(stray)
        assert TOKEN not in caplog.text

        s.reconciler.hub.api_url = s.api.api_url  # readable again: the pass runs
        actions = asyncio.run(s.reconciler.periodic())
        assert sorted(a.action for a in actions) == ["released", "stopped"]
        assert ada.id not in s.pool.ledger.allocations and gone(stray)
        assert failures() - before == 2


def test_without_the_rest_apis_url_only_the_pass_at_start_runs(
    setting: Setting, caplog: pytest.LogCaptureFixture
) -> None:
    s = setting
    ada = s.pool.allocate("ada", ["vision"], "gpu", 1, ref="ada/")
    reconciler = Reconciler(s.pool, s.hub_url, log=s.log)
    with caplog.at_level(logging.WARNING, logger=s.log.name):
        assert asyncio.run(reconciler.periodic()) == []
        assert asyncio.run(reconciler.periodic()) == []
    assert said(caplog, "reconciliation while the hub runs is off") == 1
    assert ada.id in s.pool.ledger.allocations
    assert s.api.calls == []


def test_a_token_that_cannot_read_servers_state_is_said_once_and_releases_nothing(
    setting: Setting, caplog: pytest.LogCaptureFixture
) -> None:
    s = setting
    ada = s.pool.allocate("ada", ["vision"], "gpu", 1, ref="ada/")
    s.server("ada", "vision", {"pid": 2**22 + 1, STATE_KEY: ada.id})  # no such process
    s.api.with_state = False  # a role without admin:server_state
    with caplog.at_level(logging.WARNING, logger=s.log.name):
        assert asyncio.run(s.reconciler.periodic()) == []
        assert asyncio.run(s.reconciler.periodic()) == []
    assert said(caplog, "needs the admin:server_state scope") == 1
    assert ada.id in s.pool.ledger.allocations
    s.api.with_state = True
    assert [a.action for a in asyncio.run(s.reconciler.periodic())] == ["released"]
