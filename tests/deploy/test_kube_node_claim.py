"""Issue 26 §2: a second gpupool release on the same nodes is refused at start.

Each hub claims its pool's nodes with a Lease in its namespace (:mod:`gpupool.kube.claim`). The
stand-in stores Leases as the API server does (it never expires one); whether a claim is live is
the reader's judgement from ``spec.renewTime`` + ``spec.leaseDurationSeconds``. On today's main
the second release started, and only logged an error once its pods ran on the first's nodes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Team
from gpupool.declarations import ConfigError
from gpupool.hub import _kube_reconciler
from gpupool.kube.claim import LEASE_NAME, NODES_ANNOTATION
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.reconcile import KubeReconciler
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import h100_node
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import api_cluster

OFFERS = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=8)}
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with api_cluster(tmp_path, monkeypatch) as server:
        server.api.add_node(h100_node("gpu-a"))
        server.api.add_node(h100_node("gpu-b"))
        yield server


class HubRecords:
    """What the hub's start hands ``_kube_reconciler``: JupyterHub's servers (none here)."""

    async def hub_records(self) -> list[Any]:
        return []


def release(
    cluster: Served, tmp_path: Path, namespace: str, selector: str = "", **traits: Any
) -> KubeReconciler:
    """A release's hub at start, on the cluster's nodes (matching ``selector``), made as the
    hub makes it (``gpupool.hub._kube_reconciler``), which now claims the nodes."""
    with cluster.api.lock:
        nodes = [
            n
            for n in cluster.api.nodes.values()
            if not selector or n["metadata"]["labels"].get("pool") == selector.split("=")[1]
        ]
    ledger = Ledger(inventory_from_nodes(nodes), OFFERS, {"big": Team("big", 1_000_000)})
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / f'{namespace}.sqlite'}"))
    c = Config()
    c.KubeReconciler.namespace = namespace
    for k, v in traits.items():
        setattr(c.KubeReconciler, k, v)
    inventory = f"kubernetes:{selector}" if selector else "kubernetes"
    made = _kube_reconciler(pool, inventory, HubRecords(), c, logging.getLogger("test"))  # type: ignore[arg-type]
    assert made is not None
    return made


def at(moment: datetime) -> Callable[[], datetime]:
    return lambda: moment


def lease(cluster: Served, namespace: str) -> dict[str, Any]:
    with cluster.api.lock:
        return dict(cluster.api.objects["leases"][namespace, LEASE_NAME])


def test_a_second_release_on_the_same_nodes_is_refused_at_start_naming_the_first(
    cluster: Served, tmp_path: Path
) -> None:
    first = release(cluster, tmp_path, "jhub")
    claim = lease(cluster, "jhub")
    assert json.loads(claim["metadata"]["annotations"][NODES_ANNOTATION]) == ["gpu-a", "gpu-b"]
    assert first.claim is not None
    with pytest.raises(ConfigError) as refused:
        release(cluster, tmp_path, "jhub2")
    message = str(refused.value)
    assert message.startswith("GPUPool.inventory: another gpupool release (namespace jhub, hub ")
    assert "node selector none) manages node(s) gpu-a, gpu-b of this pool" in message
    assert "kubernetes:<node label selector>" in message
    assert "Lease jhub/gpupool-nodes" in message
    with cluster.api.lock:  # the refused release claimed nothing
        assert ("jhub2", LEASE_NAME) not in cluster.api.objects["leases"]


def test_the_same_release_restarting_is_not_refused(cluster: Served, tmp_path: Path) -> None:
    release(cluster, tmp_path, "jhub")
    before = lease(cluster, "jhub")
    again = release(cluster, tmp_path, "jhub")  # a new hub pod of the same release
    assert again.claim is not None
    after = lease(cluster, "jhub")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]  # taken over, not made anew
    assert after["spec"]["renewTime"] >= before["spec"]["renewTime"]


def test_releases_on_separate_nodes_both_start(cluster: Served, tmp_path: Path) -> None:
    def label(pool: str) -> Callable[[dict[str, Any]], None]:
        def change(node: dict[str, Any]) -> None:
            node["metadata"]["labels"]["pool"] = pool

        return change

    cluster.api.update_node("gpu-a", label("a"))
    cluster.api.update_node("gpu-b", label("b"))
    release(cluster, tmp_path, "jhub", "pool=a")
    release(cluster, tmp_path, "jhub2", "pool=b")
    assert json.loads(lease(cluster, "jhub2")["metadata"]["annotations"][NODES_ANNOTATION]) == [
        "gpu-b"
    ]


def test_a_claim_whose_holder_stopped_renewing_expires(cluster: Served, tmp_path: Path) -> None:
    """Release ``jhub`` claims the nodes for 60 s and is uninstalled without cleanup (its Lease
    stays; the API server does not expire it): ``jhub2`` is refused within the 60 s and starts
    after them; ``jhub`` reinstalled then is refused, naming ``jhub2``."""
    first = release(cluster, tmp_path, "jhub")
    first.claim_nodes(clock=at(T0))  # the last renewal of the first release's hub
    hub2 = KubeReconciler(first.pool, namespace="jhub2")
    with pytest.raises(ConfigError, match=r"namespace jhub, hub "):
        hub2.claim_nodes(clock=at(T0 + timedelta(seconds=59)))
    hub2.claim_nodes(clock=at(T0 + timedelta(seconds=61)))
    assert lease(cluster, "jhub2")["spec"]["holderIdentity"].startswith("jhub2/")
    with pytest.raises(ConfigError, match=r"namespace jhub2, hub "):
        first.claim_nodes(clock=at(T0 + timedelta(seconds=70)))


def test_a_running_hub_renews_its_claim(cluster: Served, tmp_path: Path) -> None:
    """The claim lasts ``claim_seconds`` and the hub renews it every third of that."""
    hub = release(cluster, tmp_path, "jhub", claim_seconds=1)
    renewed = lease(cluster, "jhub")["spec"]["renewTime"]

    async def main() -> None:
        hub.start()
        try:
            deadline = time.monotonic() + 10
            while lease(cluster, "jhub")["spec"]["renewTime"] == renewed:
                assert time.monotonic() < deadline, "not renewed"
                await asyncio.sleep(0.05)
        finally:
            await hub.stop()

    asyncio.run(main())
    assert lease(cluster, "jhub")["spec"]["leaseDurationSeconds"] == 1


def test_a_hub_that_may_not_read_leases_starts_unclaimed_and_says_why(
    cluster: Served, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cluster.api.forbid("list", "leases")
    hub = release(cluster, tmp_path, "jhub")
    assert hub.claim is not None
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert (
        len(errors) == 1 and "could not claim this pool's nodes (listing Leases: 403" in errors[0]
    )
    assert "list Leases in every namespace" in errors[0]


def test_of_two_releases_starting_together_the_older_claim_keeps_the_nodes(
    cluster: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jhub2``'s hub writes its claim while ``jhub``'s is between its check and its write:
    both claims are then live; ``jhub``'s second look finds the older one, gives its own up (an
    empty holder, so ``jhub2``'s restart is not refused by it) and stops."""
    from gpupool.kube.claim import NodeClaim, lease_body

    write = NodeClaim._write

    async def racing(self: NodeClaim, nodes: Any) -> None:
        if self.namespace == "jhub":
            other = lease_body("jhub2", "jhub2/hub-1", ["gpu-a"], None, 60, datetime.now(UTC))
            with cluster.api.lock:
                assert cluster.api.create("leases", "jhub2", other)[0] == 201
        await write(self, nodes)

    monkeypatch.setattr(NodeClaim, "_write", racing)
    with pytest.raises(
        ConfigError,
        match=r"namespace jhub2, hub jhub2/hub-1, node selector none\) manages node\(s\) gpu-a ",
    ):
        release(cluster, tmp_path, "jhub")
    assert lease(cluster, "jhub")["spec"]["holderIdentity"] == ""
    monkeypatch.setattr(NodeClaim, "_write", write)
    assert release(cluster, tmp_path, "jhub2").claim is not None
