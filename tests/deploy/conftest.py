"""Fixtures of the Kubernetes tests: the stand-in API server and the hub's pool over a
Kubernetes inventory (the helpers they share are plain modules: :mod:`tests.deploy.kube_fixtures`,
:mod:`tests.deploy.chart_fixtures`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import kubernetes_asyncio.config.kube_config as kube_config
import pytest
from kubespawner.clients import load_config

from gpupool.core import Ledger, Offer, Team
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.pool import Pool
from gpupool.store import Store
from tests.conftest import a100_mixed_node, h100_node, kubeconfig
from tests.deploy.kube_api import Served, served
from tests.deploy.kube_fixtures import OFFERS


@pytest.fixture
def kube() -> Iterator[Served]:
    """The stand-in API server."""
    with served() as server:
        yield server


@pytest.fixture
def pool_offers() -> dict[str, Offer]:
    """The offers of :func:`pool` (a module overrides this fixture to offer others)."""
    return OFFERS


@pytest.fixture
def pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pool_offers: dict[str, Offer]
) -> Iterator[Pool]:
    """The hub's pool over a Kubernetes inventory; a dummy kubeconfig for KubeSpawner."""
    path = kubeconfig(tmp_path / "kubeconfig", "https://127.0.0.1:6443")
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    load_config.cache_clear()
    inventory = inventory_from_nodes([h100_node(), a100_mixed_node()])
    teams = {"vision": Team("vision", 8000)}
    ledger = Ledger(inventory, pool_offers, teams, Team("everyone", offers=frozenset({"cpu"})))
    store = Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}")
    pool = Pool(ledger, store)
    yield pool
    store.close()
    load_config.cache_clear()
