"""Kueue on, ``kueue.hami`` off, HAMi nodes in the pool (issue 26, section 3): a HAMi share is
refused at once, naming the chart key, instead of a pod Kueue never admits.

The chart is rendered (:mod:`tests.deploy.chart_fixtures`); the stand-in's Kueue
(:mod:`tests.deploy.kube_kueue`) is built from its ClusterQueues, which without ``kueue.hami``
cover no ``nvidia.com/gpumem``: Kueue leaves a pod asking for it gated ("resource
nvidia.com/gpumem unavailable in ClusterQueue": ``findFlavorForPodSets`` in Kueue's
``pkg/scheduler/flavorassigner/flavorassigner.go``, as :mod:`tests.deploy.kube_kueue` cites
it), so on main the spawn waited for its start timeout."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from gpupool.config import GPUPool
from gpupool.core import Ledger, NoCapacity
from gpupool.kube.api import ClusterAPI
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.reconcile import KubeReconciler
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import hami_node
from tests.deploy.chart_fixtures import CHART, render_all
from tests.deploy.kube_fixtures import PROFILE_NS, user_nodes
from tests.deploy.kube_kueue import Kueue
from tests.deploy.kueue_fixtures import hub_config, kueue_cluster, refused_start

VALUES: dict[str, Any] = {
    "jupyterhub": {"enabled": False},
    "gpupool": {
        "inventory": "kubernetes",
        "offers": {"cpu": {"kind": "cpu"}, "share-8gb": {"kind": "share", "memory": "8GB"}},
        "teams": {"vision": {"guarantee": 2, "offers": ["cpu", "share-8gb"]}},
    },
    "kueue": {"enabled": True},
}
"""Kueue on, ``kueue.hami`` off (its default)."""


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def test_a_hami_share_kueue_would_never_admit_is_refused_at_once_naming_the_key(
    chart: helm.Chart, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    objects = render_all(chart, VALUES)
    kueue = Kueue.from_chart(objects)
    c = hub_config(objects, tmp_path)
    with kueue_cluster(c, tmp_path, monkeypatch, user_nodes(hami_node())) as (server, pool):
        # the hub's reconciler, as the hub builds it from its config
        KubeReconciler(pool, ClusterAPI(PROFILE_NS), namespace=PROFILE_NS, config=c)
        template = c.KubeGPUSpawner.kueue_queue_template
        refused, key, pod_left = asyncio.run(
            refused_start(server, pool, kueue, template, "share-8gb")
        )
        assert "kueue.hami.enabled" in str(refused), (refused, kueue.pending.get(key))
        assert not pod_left
        with pytest.raises(
            NoCapacity,
            match=r"Not handed out until nothing else uses it: the GPUs of HAMi nodes: Kueue "
            r"admits GPU pods but no HAMi share: .*kueue\.hami\.enabled: true "
            r"\(HAMi's resourceCountName of its own\)\.$",
        ):
            pool.allocate("vic", ["vision"], "share-8gb", 1)


def test_with_kueue_hami_shares_are_handed_out(chart: helm.Chart, tmp_path: Path) -> None:
    values = copy.deepcopy(VALUES)
    values["kueue"]["hami"] = {"enabled": True}
    c = hub_config(render_all(chart, values), tmp_path)
    settings = GPUPool(config=c).settings()
    node = hami_node()
    allocatable = node["status"]["allocatable"]  # HAMi with resourceCountName nvidia.com/vgpu
    allocatable["nvidia.com/vgpu"] = allocatable.pop("nvidia.com/gpu")
    node["status"]["capacity"] = dict(allocatable)
    inventory = inventory_from_nodes([node])
    assert inventory.notes[0] == (
        "node l40s-hami: 2× L40S-48GB shared by HAMi (20 virtual, under HAMi's own count "
        "resource); they take only shares, by memory (nvidia.com/gpumem), at most 10 per GPU"
    )  # main: "(0× nvidia.com/gpu virtual)"
    ledger = Ledger(inventory, settings.offers, settings.teams, settings.everyone)
    pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}"))
    KubeReconciler(pool, ClusterAPI(PROFILE_NS), namespace=PROFILE_NS, config=c)
    assert not pool.ledger.outside
    assert pool.allocate("vic", ["vision"], "share-8gb", 1).node == "l40s-hami"
