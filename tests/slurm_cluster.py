"""Real Slurm daemons for the Slurm tests: munged, slurmctld and one slurmd per node, with
simulated GPUs (:mod:`gpupool.slurm.devcluster`), started in a fresh folder for each test.

``make install`` installs Debian's Slurm packages when it runs as root (as CI does); elsewhere
these tests skip, saying why. The folder is made outside pytest's own temporary folder, which is
private to root: munged runs as ``munge`` and jobs as the users who submit them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from gpupool.slurm import accounts
from gpupool.slurm.commands import SlurmCommands
from gpupool.slurm.devcluster import DevCluster, NodeLayout, missing
from gpupool.slurm.parse import SlurmJob

TWO_NODES = (
    NodeLayout("gpu1", {"h100": 2, "1g.10gb": 3}),
    NodeLayout("gpu2", {"a100": 2}, shards=8),
)
"""The default layout: whole H100s and fixed 1g.10gb MIG instances on one node, A100s with
8 shards on the other."""


def skip_reason(accounting: bool = False) -> str | None:
    gone = missing(accounting)
    if not gone:
        return None
    return (
        f"needs {', '.join(gone)} for real Slurm daemons (make install installs Debian's Slurm "
        "packages as root; CI does)"
    )


MakeCluster = Callable[..., DevCluster]
T = TypeVar("T")


async def until(check: Callable[[], Awaitable[T | None]], timeout: float = 30.0) -> T:
    """Poll the coroutine ``check`` until it returns something truthy (a deadline, no sleep as
    synchronisation: the pause only spaces the polls)."""
    deadline = time.monotonic() + timeout
    while True:
        found = await check()
        if found:
            return found
        assert time.monotonic() < deadline, f"condition not reached in {timeout} s"
        await asyncio.sleep(0.2)


def with_accounting(gres_costs: dict[str, int]) -> dict[str, object]:
    """A dev cluster's arguments for slurmdbd with what the teams' plan needs: the billing
    weights and tracked gres of ``gres_costs`` (:func:`gpupool.slurm.accounts.gres_costs_of`)."""
    return {
        "accounting": True,
        "billing_weights": accounts.weights_text(accounts.billing_weights(gres_costs)),
        "accounting_tres": ",".join(accounts.accounting_tres(gres_costs)),
    }


async def job_in_state(slurm: SlurmCommands, job_id: int, *states: str) -> SlurmJob | None:
    """The job as ``squeue`` lists it now if it is in one of ``states``."""
    found = {j.job_id: j for j in await slurm.squeue()}.get(job_id)
    return found if found is not None and found.state in states else None


async def gone_or_ended(slurm: SlurmCommands, job_id: int) -> bool:
    found = {j.job_id: j for j in await slurm.squeue()}.get(job_id)
    return found is None or found.ended


@pytest.fixture
def make_slurm_cluster() -> Iterator[MakeCluster]:
    """Start a dev cluster: ``make_slurm_cluster(nodes=..., accounting=..., min_job_age=...)``."""
    started: list[DevCluster] = []

    def make(**kwargs: object) -> DevCluster:
        reason = skip_reason(bool(kwargs.get("accounting")))
        if reason and os.geteuid() == 0:
            pytest.fail(f"as root the Slurm tests must run: {reason}")
        if reason:
            pytest.skip(reason)
        folder = Path(tempfile.mkdtemp(prefix="gpupool-slurm-"))
        folder.chmod(0o755)
        kwargs.setdefault("nodes", TWO_NODES)
        cluster = DevCluster(folder, **kwargs)  # type: ignore[arg-type]
        started.append(cluster)
        return cluster.start()

    yield make
    for cluster in started:
        cluster.stop()
        shutil.rmtree(cluster.folder, ignore_errors=True)


@pytest.fixture
def slurm_cluster(make_slurm_cluster: MakeCluster) -> DevCluster:
    """A running two-node dev cluster (:data:`TWO_NODES`)."""
    return make_slurm_cluster()
