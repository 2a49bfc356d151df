"""GPU use on Kubernetes from NVIDIA's DCGM exporter, read through Prometheus, in the idle
reclaimer and on the admin page.

A Kubernetes-style pool (its inventory from node objects as the API server gives them, no NVML:
:class:`~gpupool.monitors.activity.DeviceMonitor` reads none of its nodes), JupyterHub's REST API
and proxy from :class:`tests.hubapi.FakeHub`, and Prometheus's query API from the real HTTP server
of :class:`tests.prometheus.Prometheus`, holding series shaped as dcgm-exporter's with
``--kubernetes-enable-pod-labels`` (whole GPUs and MIG instances).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest
from traitlets.config import Config

import gpupool.hub as hub_module
from gpupool.core import Ledger, Offer, Team
from gpupool.core.ledger import Allocation
from gpupool.declarations import ConfigError
from gpupool.hub.pages_view import admin_view
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.jobs.manager import JobManager
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.monitors.dcgm import ENGINE_ACTIVE, FB_FREE, FB_USED, GPU_UTIL, query
from gpupool.pool import Pool
from gpupool.store import Store
from tests.accounts import shared_mode
from tests.conftest import a100_mixed_node, h100_node
from tests.hubapi import TOKEN, HubStandIns, free_port
from tests.prometheus import Prometheus, Silent, dcgm_series

LOG = logging.getLogger("gpupool.tests.dcgm")
ACTIVITY = "2026-03-01T10:00:00.000000Z"
OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=8),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", model="A100-80GB", profile="3g.40gb"),
}
UUIDS = {
    "dgx-h100-1": [f"GPU-5d0c9a5e-3b1f-4a7e-9d0b-2f1c8e6a7b1{i}" for i in range(8)],
    "dgx-a100-1": [f"GPU-1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f{i}" for i in range(8)],
}
TEMPLATES = Path(hub_module.__file__).parent / "templates"


class Cluster(HubStandIns):
    """The pool, the hub's API and Prometheus; ``dcgm_*`` put a notebook's series in."""

    def __init__(self, tmp: Path) -> None:
        nodes = [h100_node("dgx-h100-1"), a100_mixed_node("dgx-a100-1")]
        ledger = Ledger(inventory_from_nodes(nodes), OFFERS, {"vision": Team("vision", 16_000)})
        self.pool = Pool(ledger, Store(f"sqlite:///{tmp / 'gpupool.sqlite'}"))
        super().__init__(tmp)
        self.prometheus = Prometheus()
        self.next_gpu = {"dgx-h100-1": 0, "dgx-a100-1": 1}

    def reclaimer(
        self, url: str | None = None, timeout: float = 30, **policies: Any
    ) -> IdleReclaimer:
        """The reclaimer, reading DCGM from the stand-in Prometheus; a short ``timeout`` only
        where the test expects Prometheus to fail (a healthy one must answer, however loaded
        the machine is)."""
        c = Config()
        c.IdleReclaimer.policies = {"*": policies} if policies else {}
        c.IdleReclaimer.dcgm_prometheus_url = self.prometheus.url if url is None else url
        c.IdleReclaimer.dcgm_timeout = timeout
        return IdleReclaimer(self.pool, TOKEN, self.api.api_url, self.api.url, config=c, log=LOG)

    def notebook(self, user: str, offer: str) -> Allocation:
        """A running GPU notebook whose one kernel is idle (no news since ``ACTIVITY``)."""
        a = self.pool.allocate(user, ["vision"], offer, 1, ref=f"{user}/")
        self.hubdb.server(user, ("vision",), {"gpupool_allocation": a.id})
        self.api.kernels[f"/user/{user}/"] = [
            {"id": f"k-{user}", "execution_state": "idle", "last_activity": ACTIVITY}
        ]
        return a

    def series(self, a: Allocation, values: dict[str, float], labelled: bool = True) -> None:
        """dcgm-exporter's series of the device the device plugin gave ``a``'s pod."""
        assert a.node is not None
        gpu = self.next_gpu[a.node]
        self.next_gpu[a.node] += 1
        labels: dict[str, Any] = {
            "gpu": gpu,
            "uuid": UUIDS[a.node][gpu],
            "host": a.node,
            "pod": f"jupyter-{a.user}",
            "pod_labels": {
                "gpupool.io/team": a.team,
                "gpupool.io/offer": a.offer,
                "component": "singleuser-server",
            }
            | ({"gpupool.io/allocation": a.id} if labelled else {}),
        }
        if a.offer.startswith("mig-"):
            labels |= {"model": "NVIDIA A100-SXM4-80GB", "mig": ("3g.40gb", 2)}
        for metric, value in values.items():
            self.prometheus.add(dcgm_series(metric, **labels), value)

    def close(self) -> None:
        self.prometheus.close()
        super().close()


@pytest.fixture
def k8s(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(tmp_path) as cluster:
        yield cluster


def devices(r: IdleReclaimer, a: Allocation) -> dict[str, int | None]:
    last = r.watches[a.id].last
    assert last is not None
    return {uuid: d.utilisation for uuid, d in last.devices.items()}


def busy_and_idle(k8s: Cluster) -> tuple[Allocation, Allocation, Allocation]:
    """ada's H100 at 87 %, cat's at 2 %, ben's MIG 3g.40gb at 1 % engine activity."""
    ada, cat = k8s.notebook("ada", "h100"), k8s.notebook("cat", "h100")
    ben = k8s.notebook("ben", "mig-3g.40gb")
    mib = {FB_USED: 30000.0, FB_FREE: 51559.0}
    k8s.series(ada, {GPU_UTIL: 87, ENGINE_ACTIVE: 0.9, **mib})
    k8s.series(cat, {GPU_UTIL: 2, ENGINE_ACTIVE: 0.01, **mib})
    k8s.series(ben, {ENGINE_ACTIVE: 0.012, FB_USED: 2000, FB_FREE: 38192})
    return ada, cat, ben


def test_a_gpu_busy_per_dcgm_is_active_and_an_idle_one_idle(k8s: Cluster) -> None:
    ada, cat, ben = busy_and_idle(k8s)
    assert not any(k8s.pool.monitor.can_read(n.name) for n in k8s.pool.inventory.nodes)
    r = k8s.reclaimer()

    assert asyncio.run(r.look()) == []

    assert devices(r, ada) == {ada.devices[0].visible_id: 87}
    assert devices(r, cat) == {cat.devices[0].visible_id: 2}
    assert devices(r, ben) == {ben.devices[0].visible_id: 1}  # MIG: engine activity
    assert r.watches[ada.id].idle_since is None
    assert r.watches[cat.id].idle_since is not None
    assert r.watches[ben.id].idle_since is not None
    assert k8s.prometheus.queries == [query()]  # one query a look, for every notebook
    assert r.activity()["source"] == "dcgm"

    # without DCGM the same notebooks are judged by their (idle) kernels alone: all idle
    blind = k8s.reclaimer(url="")
    asyncio.run(blind.look())
    assert blind.dcgm is None and devices(blind, ada) == {}
    assert blind.watches[ada.id].idle_since is not None
    assert blind.activity()["source"] == "none"


def test_idle_per_dcgm_is_reclaimed_and_busy_is_kept(k8s: Cluster) -> None:
    busy_and_idle(k8s)
    r = k8s.reclaimer(idle_minutes=0, warn_minutes=0)
    done: list[tuple[str, str]] = []
    for _ in range(3):
        done += [(a.user, verdict) for a, verdict in asyncio.run(r.look())]
    assert ("cat", "reclaim") in done and ("ben", "reclaim") in done
    assert not [d for d in done if d[0] == "ada"]
    stops = {path for method, path in k8s.api.calls if method == "DELETE"}
    assert stops == {"/hub/api/users/cat/server", "/hub/api/users/ben/server"}


@pytest.mark.parametrize("trouble", ["unreachable", "error", "not prometheus", "hung"])
def test_a_failing_prometheus_gives_no_samples_and_the_look_completes(
    k8s: Cluster, trouble: str, caplog: pytest.LogCaptureFixture
) -> None:
    ada, _, _ = busy_and_idle(k8s)
    silent = Silent()
    url = k8s.prometheus.url
    if trouble == "unreachable":
        url = f"http://127.0.0.1:{free_port()}"
    elif trouble == "error":
        k8s.prometheus.error = (
            422,
            "execution",
            "query processing would load too many samples into memory in query execution",
        )
    elif trouble == "not prometheus":
        k8s.prometheus.raw = (502, b"<html><h1>502 Bad Gateway</h1></html>", "text/html")
    else:
        url = silent.url
    r = k8s.reclaimer(url=url, timeout=0.5)
    try:
        with caplog.at_level(logging.DEBUG, logger=LOG.name):
            assert asyncio.run(r.look()) == []
            assert asyncio.run(r.look()) == []
    finally:
        silent.close()

    assert devices(r, ada) == {}  # no samples...
    assert r.watches[ada.id].last.kernel_busy is False  # type: ignore[union-attr]  # ...kernels read
    assert ("GET", "/user/ada/api/kernels") in k8s.api.calls
    unread = [x for x in caplog.records if "GPU use from DCGM unread" in x.getMessage()]
    assert [x.levelno for x in unread] == [logging.WARNING, logging.DEBUG]  # one line a look
    assert "last query failed" in r.activity()["text"]
    if trouble in ("error", "not prometheus"):
        k8s.prometheus.error = k8s.prometheus.raw = None
        with caplog.at_level(logging.DEBUG, logger=LOG.name):
            asyncio.run(r.look())
        assert devices(r, ada) == {ada.devices[0].visible_id: 87}
        assert "answers again" in caplog.text
        assert "last query failed" not in r.activity()["text"]


def test_series_without_gpupools_pod_label_are_pointed_out_once(
    k8s: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    """dcgm-exporter without ``--kubernetes-enable-pod-labels``: pod mapping only."""
    ada = k8s.notebook("ada", "h100")
    k8s.series(ada, {GPU_UTIL: 87}, labelled=False)
    r = k8s.reclaimer()
    with caplog.at_level(logging.DEBUG, logger=LOG.name):
        asyncio.run(r.look())
        asyncio.run(r.look())
    hints = [x for x in caplog.records if "--kubernetes-enable-pod-labels" in x.getMessage()]
    assert [x.levelno for x in hints] == [logging.WARNING]
    assert devices(r, ada) == {}


def test_the_admin_page_shows_gpu_use_from_dcgm(k8s: Cluster) -> None:
    busy_and_idle(k8s)
    c = Config()
    shared_mode(c)  # the job manager's local backend, as the admin page's tests build it
    r = k8s.reclaimer()
    asyncio.run(r.look())

    view = admin_view(k8s.pool, JobManager(k8s.pool, config=c), r, k8s.pool.clock().timestamp())

    rows = {row["user"]: row for row in view["allocations"]}
    assert [d["utilisation"] for d in rows["ada"]["device_rows"]] == ["87%"]
    assert [d["utilisation"] for d in rows["ben"]["device_rows"]] == ["1%"]
    assert rows["ada"]["state"]["text"] == "in use"
    assert rows["cat"]["state"]["level"] == "idle"
    assert view["activity"]["source"] == "dcgm"
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(
            [
                jinja2.FileSystemLoader(str(TEMPLATES)),
                jinja2.DictLoader({"page.html": "{% block main %}{% endblock %}"}),
            ]
        ),
        autoescape=True,
    )
    html = env.get_template("gpupool-admin.html").render(
        view=view, flash="", base_url="/hub/", xsrf="X", pool_admin=True
    )
    assert "87%" in html and "1%" in html
    assert f"NVIDIA&#39;s DCGM exporter, through Prometheus at {k8s.prometheus.url}" in html


@pytest.mark.parametrize("bad", ["prometheus-operated:9090", "ftp://prom", "http://"])
def test_a_bad_prometheus_url_stops_the_hub_naming_the_key(k8s: Cluster, bad: str) -> None:
    with pytest.raises(ConfigError, match=r"IdleReclaimer\.dcgm_prometheus_url"):
        k8s.reclaimer(url=bad)
