"""A hub shutting down starts nothing: its servers' GPUs come back as it stops them, and the
queued job that was waiting for them stays queued for the next start (a real hub that stops its
servers at shutdown, as `make run` does)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpupool.store import Store
from tests.accounts import homes
from tests.hub.conftest import Hub, job_processes, running, spawn, submit, wait_job


@pytest.fixture
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    with homes() as home_root:
        h = Hub(
            tmp_path_factory.mktemp("shutdown"),
            home_root,
            extra_config="c.JupyterHub.cleanup_servers = True\n",
        )
        with running(h):
            yield h


def test_a_hub_shutting_down_starts_no_queued_job(hub: Hub) -> None:
    spawn(hub, "ada", "vision|h100|2")  # team vision's whole quota
    ada = hub.token("ada")
    job = submit(hub, ada, "print('ran')", offer="h100", gpus=1, time_limit=60)
    wait_job(hub, ada, job["id"], {"queued"})
    hub.stop_hub()  # SIGTERM: JupyterHub stops ada's server, which frees the team's quota
    assert hub.proc is not None and hub.proc.returncode is not None
    store = Store(f"sqlite:///{hub.state / 'gpupool.sqlite'}", upgrade=False)
    try:
        saved = {j.id: j for j in store.load_jobs()}[job["id"]]
        assert saved.state == "queued" and saved.allocations == ()
        assert store.load() == []  # and ada's server gave its GPUs back
    finally:
        store.close()
    assert job_processes(job["id"]) == []
