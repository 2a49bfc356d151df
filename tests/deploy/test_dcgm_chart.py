"""The chart's DCGM settings, rendered by real Helm (``helm_python``):
``gpupool.dcgm.prometheusUrl`` reaches the hub's reclaimer through ``gpupool.json`` (only when
set), a URL that is not one is refused naming the key, the PrometheusRule's idle alert is
gpupool's own metric, and the Grafana dashboard ships its DCGM panels.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from traitlets.config import Config

from gpupool.hub.fileconfig import load_config_file
from gpupool.hub.reclaim import IdleReclaimer
from tests.conftest import small_pool

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "gpupool"
URL = "http://prometheus-operated.monitoring:9090"


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def values(**gpupool: Any) -> dict[str, Any]:
    base = yaml.safe_load((CHART / "ci" / "small-values.yaml").read_text())
    out = copy.deepcopy(base)
    out["jupyterhub"] = {"enabled": False}
    out["gpupool"] = {**out["gpupool"], **gpupool}
    out["metrics"] = {
        "prometheusRule": {"enabled": True, "idleMinutes": 45},
        "grafanaDashboard": {"enabled": True},
    }
    return out


def render(chart: helm.Chart, v: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    rendered = chart.render(v, name="gp", namespace="jhub", is_install=True)
    objects = {}
    for path, text in rendered.items():
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                objects[doc["kind"], doc["metadata"]["name"]] = doc
    return objects


def settings(objects: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    data = json.loads(objects["ConfigMap", "gpupool-config"]["data"]["gpupool.json"])
    assert isinstance(data, dict)
    return data


def test_the_prometheus_url_reaches_the_reclaimer(chart: helm.Chart, tmp_path: Path) -> None:
    objects = render(chart, values(dcgm={"prometheusUrl": URL}))
    data = settings(objects)
    assert data["IdleReclaimer"]["dcgm_prometheus_url"] == URL
    path = tmp_path / "gpupool.json"
    path.write_text(json.dumps(data))
    c = Config()
    load_config_file(c, path)
    reclaimer = IdleReclaimer(small_pool(tmp_path), config=c)
    assert reclaimer.dcgm is not None and reclaimer.dcgm.url == URL


def test_without_a_url_the_hub_gets_no_dcgm_setting(chart: helm.Chart) -> None:
    assert "dcgm_prometheus_url" not in settings(render(chart, values()))["IdleReclaimer"]
    empty = values(dcgm={"prometheusUrl": ""})
    assert "dcgm_prometheus_url" not in settings(render(chart, empty))["IdleReclaimer"]


@pytest.mark.parametrize("bad", ["prometheus-operated:9090", "http://", "http://a b"])
def test_a_url_that_is_not_one_is_refused_naming_the_key(chart: helm.Chart, bad: str) -> None:
    with pytest.raises((helm.HelmValuesError, helm.HelmRenderError)) as refused:
        render(chart, values(dcgm={"prometheusUrl": bad}))
    assert "prometheusUrl" in str(refused.value)


def test_the_idle_alert_is_gpupools_own_metric_held_for_idle_minutes(chart: helm.Chart) -> None:
    rule = render(chart, values())["PrometheusRule", "gpupool-alerts"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    idle = alerts["GPUPoolIdleGPUNotebooks"]
    assert idle["expr"] == "sum by (team) (gpupool_idle_notebooks) > 0"
    assert idle["for"] == "45m"
    assert not any("DCGM_" in r["expr"] for r in alerts.values())


def test_the_dashboard_configmap_ships_the_dcgm_panels(chart: helm.Chart) -> None:
    dashboard = render(chart, values())["ConfigMap", "gpupool-dashboard"]
    panels = json.loads(dashboard["data"]["gpupool.json"])["panels"]
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    for metric in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "DCGM_FI_DEV_FB_USED"):
        assert metric in exprs
