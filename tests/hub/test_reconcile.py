"""Reconciliation both ways in a real hub: every allocation has a live holder, every live holder of
devices has an allocation, whatever the hub crashed in the middle of or lost.

Processes that hold devices are real: the hub's own servers, or a waiting Python process started
here as the account that runs user code, with the environment a server of this hub would have
(``GPUPOOL_HUB`` = the hub's marker, ``GPUPOOL_ALLOCATION``, ``CUDA_VISIBLE_DEVICES``…). A process
carrying another hub's marker stands for another hub's server on the same machine: never touched.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from gpupool.core.ledger import Allocation, Device
from gpupool.discovery import simulated_inventory
from gpupool.hub.hub_api import HubAPI, HubUnreadable
from gpupool.hub.reconcile import SERVICE_SCOPES
from gpupool.hub.records import read_records, rest_records
from gpupool.pool import Pool
from gpupool.store import Store
from tests.accounts import homes
from tests.conftest import gone, holder, holders
from tests.hub.conftest import Hub, environ, running, scrape, spawn, stop_all, value, wait_for

SIMULATED = "local: 4x H100-80GB, mig=2:3g.40gb+2g.20gb+1g.10gb, nvlink=2"  # the demo fallback
WHOLE = [g.uuid for g in simulated_inventory(SIMULATED).gpus if g.mig_mode == "off"]


def marker(hub: Hub) -> str:
    return Pool.marker_of(f"sqlite:///{hub.state / 'gpupool.sqlite'}")


def log_lines(hub: Hub, text: str) -> list[str]:
    return [line for line in hub.log.read_text(errors="replace").splitlines() if text in line]


def test_a_server_the_hub_crashed_before_recording_is_stopped_and_its_gpu_not_shared(
    tmp_path: Path,
) -> None:
    """A start the hub did not finish: the allocation is in the pool's database and the server
    runs with the GPU, but JupyterHub never recorded it (the restart used to release the GPU
    and leave the server running on it). Later, while the hub runs, strays are stopped too."""
    prelude = "c.Reconciler.period = 1\n"
    with homes() as root, running(Hub(tmp_path, root, prelude=prelude)) as hub, holders() as ps:
        hub.stop_hub()
        crashed = Allocation(
            "crashed-start", "cal", "vision", "h100", "notebook", "cal/", 1, 1000, "local",
            (Device(WHOLE[0]),), 1000.0,
        )  # fmt: skip
        store = Store(f"sqlite:///{hub.state / 'gpupool.sqlite'}", upgrade=False)
        store.insert(crashed)
        store.close()
        server_env = {
            "GPUPOOL_HUB": marker(hub),
            "GPUPOOL_ALLOCATION": crashed.id,
            "GPUPOOL_OFFER": "h100",
            "GPUPOOL_TEAM": "vision",
            "JUPYTERHUB_USER": "cal",
            "CUDA_VISIBLE_DEVICES": WHOLE[0],
        }
        orphan = holder(ps, **server_env)
        hub.start()

        assert gone(orphan), "the orphan server still runs on its GPU after the restart"
        assert "cal/" not in hub.allocations()
        assert any(crashed.id in line for line in log_lines(hub, "gpupool: stopped"))
        spawn(hub, "ada", "vision|h100|1")
        spawn(hub, "ben", "vision|h100|1")
        assert environ(hub.pid("ada"))["GPUPOOL_HUB"] == marker(hub)
        held = {a.devices[0].gpu for a in hub.allocations().values()}
        assert held == set(WHOLE)  # both whole GPUs handed out, each once

        # while the hub runs: a holder whose allocation the pool does not know, a rank of a job
        # it never had, and another hub's server on the same machine (left alone)
        stray = holder(ps, **{**server_env, "GPUPOOL_ALLOCATION": "released-long-ago"})
        rank = holder(ps, GPUPOOL_HUB=marker(hub), GPUPOOL_JOB="no-such-job",
                      CUDA_VISIBLE_DEVICES=WHOLE[1])  # fmt: skip
        other = holder(ps, **{**server_env, "GPUPOOL_HUB": "another-hub"})

        def stopped() -> bool:
            said = any("no-such-job" in line for line in log_lines(hub, "gpupool: stopped"))
            return gone(stray) and gone(rank) and said

        wait_for(stopped, 30, "the periodic pass to stop the strays and say so")
        assert not gone(other)
        metrics = scrape(hub)["gpupool_reconcile_actions"]
        assert value(metrics, "gpupool_reconcile_actions_total", action="stopped") >= 3
        assert {a.ref for a in hub.allocations().values()} == {"ada/", "ben/"}
        stop_all(hub, "ada", "ben")


def test_an_emptied_pool_database_is_reported_and_its_servers_readopted(tmp_path: Path) -> None:
    """The pool's database is deleted while servers run: at the restart the hub says so, and
    takes the servers' allocations back from what they run with, so no GPU is handed out
    twice (the pool used to start empty and hand ada's GPU to ben)."""
    with homes() as root, running(Hub(tmp_path, root)) as hub:
        spawn(hub, "ada", "vision|h100|1")
        spawn(hub, "dee", "nlp|mig-3g.40gb|1")
        spawn(hub, "eve", "everyone|cpu|1")
        before = hub.allocations()
        hub.stop_hub()
        (hub.state / "gpupool.sqlite").unlink()
        hub.start()

        spawn(hub, "ben", "vision|h100|1")
        spawn(hub, "eli", "nlp|mig-3g.40gb|1")
        held = hub.allocations()
        assert held["ben/"].devices[0].gpu != before["ada/"].devices[0].gpu
        assert held["eli/"].devices[0].instance != before["dee/"].devices[0].instance

        def same(a: Allocation) -> tuple[object, ...]:
            return (a.id, a.user, a.team, a.offer, a.kind, a.count, a.cost_milli, a.devices)

        assert {ref: same(held[ref]) for ref in before} == {
            ref: same(a) for ref, a in before.items()
        }
        assert environ(hub.pid("ada"))["GPUPOOL_ALLOCATION"] == held["ada/"].id
        lost = log_lines(hub, "gpupool.sqlite")
        lost = [line for line in lost if "jupyterhub.sqlite" in line and line.startswith("[E")]
        assert len(lost) == 1, lost
        assert "ada/" in lost[0] and "dee/" in lost[0]

        stop_all(hub, "ada", "ben", "dee", "eli", "eve")
        assert hub.allocations() == {}


def test_a_server_killed_after_a_restart_is_logged_with_what_is_known(tmp_path: Path) -> None:
    """JupyterHub cannot read the exit status of a server it re-attached to (it is not its
    parent); it used to log "exit code: 0" as if the server had ended well."""
    with homes() as root, running(Hub(tmp_path, root)) as hub:
        spawn(hub, "ada", "vision|h100|1")
        hub.stop_hub()
        hub.start()
        hub.wait_ready("ada")
        os.kill(hub.pid("ada"), signal.SIGKILL)
        hub.wait_stopped("ada")
        wait_for(lambda: "ada/" not in hub.allocations(), 30, "ada's allocation to be released")
        stopped = log_lines(hub, "User ada server stopped with exit code")
        assert stopped and all("exit code: 0" not in line for line in stopped), stopped
        assert "unknown" in stopped[-1] and "not a child of this hub" in stopped[-1]
        released = log_lines(hub, "gpupool: ada/ is gone")
        assert released and "exit status unknown (process" in released[-1], released


SLOW_CHECK = """
import asyncio, os
from gpupool_spawner.local import LocalGPUSpawner


class SlowCheckSpawner(LocalGPUSpawner):
    async def poll(self):
        while os.path.exists({hold!r}):  # a slow restart: JupyterHub's checks wait
            await asyncio.sleep(0.1)
        return await super().poll()


c.JupyterHub.spawner_class = SlowCheckSpawner
c.JupyterHub.init_spawners_timeout = 1
"""


def test_a_server_that_died_while_the_hub_was_down_holds_nothing_after_the_restart(
    tmp_path: Path,
) -> None:
    """JupyterHub's own check of its servers at start can take long (it waits for the live
    ones); a dead server's GPU is free before it, not after (it used to wait for the check)."""
    hold = tmp_path / "hold-the-checks"
    extra = SLOW_CHECK.format(hold=str(hold))
    (tmp_path / "state").mkdir()
    with homes() as root, running(Hub(tmp_path / "state", root, extra_config=extra)) as hub:
        spawn(hub, "ada", "vision|h100|1")
        spawn(hub, "ben", "vision|h100|1")
        ada = hub.pid("ada")
        hub.stop_hub()
        hold.touch()
        os.kill(ada, signal.SIGKILL)  # dies while the hub is down
        hub.start()
        try:
            assert hub.server("ada") is not None  # JupyterHub has not checked it yet
            held = hub.allocations()
            assert set(held) == {"ben/"}, f"a dead server still holds devices: {sorted(held)}"
            assert any("ada/" in line for line in log_lines(hub, "gpupool: released"))
        finally:
            hold.unlink()
        hub.wait_stopped("ada")
        stop_all(hub, "ben")
        assert hub.allocations() == {}


def test_the_rest_api_names_the_same_servers_as_the_hubs_database(tmp_path: Path) -> None:
    """What the periodic passes read (the REST API, with exactly the reconciler service's
    scopes) is what the pass at start reads (JupyterHub's database, through its ORM)."""
    with homes() as root, running(Hub(tmp_path, root)) as hub:
        spawn(hub, "ada", "vision|h100|1")
        spawn(hub, "dee", "nlp|mig-3g.40gb|1")
        api = f"{hub.url}/hub/api"
        users = asyncio.run(HubAPI(api, hub.token("admin", SERVICE_SCOPES)).active_users())
        from_rest = sorted(rest_records(users), key=lambda r: r.ref)
        hub_db = f"sqlite:///{hub.state / 'jupyterhub.sqlite'}"
        assert from_rest == sorted(read_records(hub_db), key=lambda r: r.ref)
        held = hub.allocations()
        assert [(r.ref, r.groups, r.allocation, r.pid, r.alive) for r in from_rest] == [
            ("ada/", {"vision"}, held["ada/"].id, hub.pid("ada"), True),
            ("dee/", {"nlp"}, held["dee/"].id, hub.pid("dee"), True),
        ]
        fewer = [s for s in SERVICE_SCOPES if s != "list:users"]
        with pytest.raises(HubUnreadable, match="403"):
            asyncio.run(HubAPI(api, hub.token("admin", fewer)).active_users())
        stop_all(hub, "ada", "dee")
