"""Other namespaces' GPU pods, as the hub shows them (issue 26, §2): the admin page lists the
GPUs they take and names the pods (the Kubernetes counterpart of the local device watch's
"other accounts' processes"); a user is told only that a GPU is used outside gpupool, never
another namespace's pod (the design's tenancy rule: users see only their own).

The stand-in schedules as kube-scheduler's NodeResourcesFit does (a pod fits a node only in its
allocatable less the requests of every pod bound there, whatever its namespace), and the hub's
reconciler watches every namespace's pods (:mod:`gpupool.kube.tenants`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bs4 import BeautifulSoup
from traitlets.config import Config

from gpupool.core import Ledger, NoCapacity, Offer, Team
from gpupool.hub.pages_view import admin_view
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.jobs.manager import JobManager
from gpupool.kube.api import ClusterAPI
from gpupool.kube.jobs import KubeJobBackend
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.reconcile import KubeReconciler
from gpupool.kube.tenant_view import outside_pods_rows
from gpupool.pool import Pool
from gpupool.store import Store
from tests.admin_page_render import render_admin as render
from tests.conftest import gpu_node_labels, node
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import IMAGE, api_cluster, served_ledger, until

NS = "jhub"
OFFERS = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=8)}


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    with api_cluster(tmp_path, monkeypatch) as server:
        server.api.add_node(
            node(
                "gpu-a",
                gpu_node_labels("NVIDIA-H100-80GB-HBM3", "81559", 4, "all-disabled"),
                {"nvidia.com/gpu": "4"},
            )
        )
        yield server


def tenant_pod(server: Served, namespace: str, name: str, gpus: int, on: str) -> str:
    """Another namespace's pod asking ``gpus`` whole GPUs on node ``on``, scheduled."""
    body: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": name}},
        "spec": {
            "nodeName": on,
            "containers": [
                {
                    "name": "main",
                    "image": "nvcr.io/nvidia/pytorch:25.01-py3",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
    }
    with server.api.lock:
        code, reply = server.api.create("pods", namespace, body)
        assert code == 201, reply
        return server.api.schedule(namespace, name)


def admin_html(pool: Pool, reconciler: KubeReconciler) -> str:
    """The admin page as :class:`gpupool.hub.pages.AdminPage` builds it on Kubernetes, rendered
    by its template (JupyterHub's page.html stubbed)."""
    view = kube_admin_view(pool)
    view["outside_pods"] = outside_pods_rows(pool.inventory, reconciler.outside_detail)
    return render(view)


def kube_admin_view(pool: Pool) -> dict[str, Any]:
    """:func:`admin_view` of a hub whose jobs run on Kubernetes."""
    c = Config()
    c.JobManager.backend_class = KubeJobBackend
    c.KubeJobBackend.namespace = NS
    c.KubeJobBackend.image = IMAGE
    view = admin_view(pool, JobManager(pool, config=c), IdleReclaimer(pool, config=c), 0.0)
    view["shares"] = view["devices"] = None
    return view


def hub(server: Served, tmp_path: Path) -> tuple[Pool, KubeReconciler]:
    ledger = served_ledger(server, OFFERS)
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))
    reconciler = KubeReconciler(
        pool, ClusterAPI(NS), namespace=NS, grace=0.0, period=0.2, retry=0.1
    )
    return pool, reconciler


def test_a_user_is_not_told_another_namespaces_pod(
    cluster: Served, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On main the refusal a user reads (the spawn page, the jobs API's wait reason) named
    "pod ml/train": another tenant's pod, which the tenancy rule keeps from users. Admins and
    the log keep the pod's name."""
    assert tenant_pod(cluster, "ml", "train", 2, "gpu-a") == "Running"
    pool, reconciler = hub(cluster, tmp_path)

    async def main() -> None:
        reconciler.start()
        try:
            await until(lambda: len(pool.ledger.outside) == 2)
            with pytest.raises(NoCapacity) as refused:
                pool.allocate("ada", ["big"], "h100", 4, team="big", ref="ada/")
            told = str(refused.value)
            assert "used outside gpupool" in told
            assert "ml" not in told.split() and "train" not in told and "pod" not in told
            wait = pool.ledger.admit(pool.ledger.team("big"), "ada", OFFERS["h100"], 4)
            assert wait.verdict == "wait" and "train" not in wait.reason  # a job's reason
            assert "used outside gpupool" in wait.reason
            # the admins' detail and the log name the pod
            assert sorted(reconciler.outside_detail) == sorted(pool.ledger.outside)
            assert all(
                why.endswith("is used by pod ml/train (2 GPUs on gpu-a)")
                for why in reconciler.outside_detail.values()
            )
        finally:
            await reconciler.stop()

    with caplog.at_level(logging.INFO):
        asyncio.run(main())
    assert "is used by pod ml/train (2 GPUs on gpu-a)" in caplog.text


def test_the_admin_page_lists_other_namespaces_gpu_pods(cluster: Served, tmp_path: Path) -> None:
    """The counterpart of the device watch's "processes on GPUs they do not hold": the GPUs
    closed because of another namespace's pod, by node and GPU, with the pod's name."""
    assert tenant_pod(cluster, "ml", "train", 2, "gpu-a") == "Running"
    assert tenant_pod(cluster, "vision", "infer", 1, "gpu-a") == "Running"
    pool, reconciler = hub(cluster, tmp_path)
    html = ""

    async def main() -> None:
        nonlocal html
        reconciler.start()
        try:
            await until(lambda: len(pool.ledger.outside) == 3)
            html = admin_html(pool, reconciler)
        finally:
            await reconciler.stop()

    asyncio.run(main())
    table = BeautifulSoup(html, "html.parser").find("table", id="outside-pods")
    assert table is not None, "no list of other namespaces' pods on the admin page"
    rows = [[td.get_text(" ", strip=True) for td in tr.find_all("td")] for tr in table.tbody("tr")]
    assert len(rows) == 3
    assert {r[0] for r in rows} == {"gpu-a"}
    assert sum("pod ml/train (2 GPUs on gpu-a)" in r[3] for r in rows) == 2
    assert sum("pod vision/infer (1 GPU on gpu-a)" in r[3] for r in rows) == 1
    assert sorted(r[2] for r in rows) == sorted(pool.ledger.outside)


def test_an_admin_view_without_the_list_shows_no_such_section(tmp_path: Path) -> None:
    """A local hub (``outside_pods`` not in its view, or None) shows no empty section."""
    ledger = Ledger(inventory_from_nodes([]), OFFERS, {"big": Team("big", 1000)})
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}"))
    html = render(kube_admin_view(pool))
    assert 'id="outside-pods"' not in html
    view = kube_admin_view(pool)
    view["outside_pods"] = None  # as AdminPage sets it without a Kubernetes reconciler
    assert 'id="outside-pods"' not in render(view)
    view["outside_pods"] = []
    assert "No other pod uses the pool's GPUs." in render(view)
