"""DCGM series through Prometheus as gpupool's device samples (:mod:`gpupool.monitors.dcgm`), and
the Grafana dashboard's DCGM panels.

Replies are Prometheus's own JSON shapes with series labelled as NVIDIA dcgm-exporter labels them
(whole GPUs and MIG instances, pod mapping and ``--kubernetes-enable-pod-labels``), built by
:func:`tests.prometheus.dcgm_series`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from gpupool.monitors.dcgm import (
    ALLOCATION_SERIES_LABEL,
    DEVICE_LABELS,
    ENGINE_ACTIVE,
    FB_FREE,
    FB_USED,
    GPU_UTIL,
    METRICS,
    POD_LABELS,
    PrometheusError,
    by_ledger_device,
    parse_reply,
    parse_response,
    prometheus_label,
    query,
    shown_url,
)
from tests.prometheus import dcgm_series, format_value, select

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "gpupool" / "dashboards" / "gpupool.json"
MIB = 1 << 20
H100 = "GPU-5d0c9a5e-3b1f-4a7e-9d0b-2f1c8e6a7b10"
H100_2 = "GPU-8a1e4c2d-7f3b-4e5a-8c9d-0b1a2c3d4e5f"
A100 = "GPU-1f2e3d4c-5b6a-4978-8695-a4b3c2d1e0f9"

DEFAULT_COUNTERS = {
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_MEM_CLOCK",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_ENC_UTIL",
    "DCGM_FI_DEV_DEC_UTIL",
    "DCGM_FI_DEV_XID_ERRORS",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "DCGM_FI_PROF_DRAM_ACTIVE",
    "DCGM_FI_PROF_PCIE_TX_BYTES",
    "DCGM_FI_PROF_PCIE_RX_BYTES",
}
"""Metrics of dcgm-exporter's ``etc/default-counters.csv`` (NVIDIA/dcgm-exporter), with the DCP
(profiling) fields it enables on datacenter GPUs."""


def vector(*series: tuple[dict[str, str], float]) -> dict[str, Any]:
    """Prometheus's instant-query reply holding ``series``."""
    return {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {"metric": labels, "value": [1764583200.123, format_value(value)]}
                for labels, value in series
            ],
        },
    }


def on(alloc: str, pod: str = "jupyter-ada") -> dict[str, Any]:
    return {
        "pod": pod,
        "pod_labels": {
            "gpupool.io/allocation": alloc,
            "gpupool.io/team": "vision",
            "component": "singleuser-server",
            "hub.jupyter.org/username": "ada",
        },
    }


def test_the_allocation_label_is_the_pod_label_as_dcgm_exporter_sanitises_it() -> None:
    assert prometheus_label("gpupool.io/allocation") == ALLOCATION_SERIES_LABEL
    assert ALLOCATION_SERIES_LABEL == "gpupool_io_allocation"
    assert prometheus_label("hub.jupyter.org/username") == "hub_jupyter_org_username"
    labels = dcgm_series(GPU_UTIL, gpu=0, uuid=H100, host="n", **on("a1"))
    assert labels[ALLOCATION_SERIES_LABEL] == "a1"


def test_the_query_selects_gpupools_metrics_of_labelled_devices_only() -> None:
    series = [
        (dcgm_series(GPU_UTIL, gpu=0, uuid=H100, host="n", **on("a1")), 87.0),
        (dcgm_series(GPU_UTIL, gpu=1, uuid=H100_2, host="n"), 100.0),  # no pod: not ours
        (dcgm_series("DCGM_FI_DEV_GPU_TEMP", gpu=0, uuid=H100, host="n", **on("a1")), 40.0),
        (dcgm_series(FB_USED, gpu=0, uuid=H100, host="n", **on("a1")), 1024.0),
    ]
    picked = select(query(), series)
    assert [labels["__name__"] for labels, _ in picked] == [GPU_UTIL, FB_USED]


def test_a_whole_gpu_reads_gpu_util_and_a_mig_instance_its_engine_activity() -> None:
    whole = {"gpu": 0, "uuid": H100, "host": "dgx-h100-1", **on("a1")}
    mig = {
        "gpu": 3,
        "uuid": A100,
        "host": "dgx-a100-1",
        "model": "NVIDIA A100-SXM4-80GB",
        "mig": ("3g.40gb", 2),
        **on("b2", "jupyter-ben"),
    }
    reply = vector(
        (dcgm_series(GPU_UTIL, **whole), 87),
        (dcgm_series(ENGINE_ACTIVE, **whole), 0.91),
        (dcgm_series(FB_USED, **whole), 20480),
        (dcgm_series(FB_FREE, **whole), 61079),
        (dcgm_series(ENGINE_ACTIVE, **mig), 0.004),
        (dcgm_series(FB_USED, **mig), 13),
        (dcgm_series(FB_FREE, **mig), 40179),
    )

    samples = parse_response(reply)

    assert set(samples) == {"a1", "b2"}
    gpu = samples["a1"][H100]
    assert (gpu.utilisation, gpu.memory_used, gpu.memory_total) == (87, 20480 * MIB, 81559 * MIB)
    assert gpu.pids == ()
    instance = samples["b2"][f"{A100}/gi2"]
    assert (instance.utilisation, instance.memory_used) == (0, 13 * MIB)
    assert instance.memory_total == 40192 * MIB


def test_a_mig_instance_never_reads_gpu_util_and_a_gpu_without_it_reads_its_engine() -> None:
    mig = {"gpu": 0, "uuid": A100, "host": "n", "mig": ("1g.10gb", 9), **on("a1")}
    whole = {"gpu": 1, "uuid": H100, "host": "n", **on("a1")}
    reply = vector(
        (dcgm_series(GPU_UTIL, **mig), 100),  # what a parent GPU's figure would look like
        (dcgm_series(FB_USED, **mig), 9000),
        (dcgm_series(ENGINE_ACTIVE, **whole), 0.456),
    )
    samples = parse_response(reply)["a1"]
    assert samples[f"{A100}/gi9"].utilisation is None  # memory alone, as NVML gives for MIG
    assert samples[H100].utilisation == 46
    assert samples[H100].memory_used == 0 and samples[H100].memory_total == 0


def test_engine_activity_is_a_ratio_and_never_read_above_100_percent() -> None:
    ours = {"gpu": 0, "uuid": A100, "host": "n", "mig": ("1g.10gb", 9), **on("a1")}
    for value, percent in ((0.0, 0), (0.5, 50), (1.0, 100), (37.0, 37), (250.0, 100)):
        samples = parse_response(vector((dcgm_series(ENGINE_ACTIVE, **ours), value)))
        assert samples["a1"][f"{A100}/gi9"].utilisation == percent, value


def test_series_without_the_label_or_without_a_number_are_left_out() -> None:
    ours = {"gpu": 0, "uuid": H100, "host": "n", **on("a1")}
    reply = vector(
        (dcgm_series(GPU_UTIL, gpu=1, uuid=H100_2, host="n", pod="other"), 12),
        (dcgm_series(GPU_UTIL, **ours), math.nan),
        (dcgm_series(FB_USED, **ours), 100),
    )
    reply["data"]["result"].append({"metric": {"__name__": GPU_UTIL}, "value": "garbled"})
    samples = parse_response(reply)
    assert list(samples) == ["a1"]
    assert samples["a1"][H100].utilisation is None
    assert samples["a1"][H100].memory_used == 100 * MIB


def test_a_device_scraped_twice_counts_its_highest_reading() -> None:
    ours = {"gpu": 0, "uuid": H100, "host": "n", **on("a1")}
    again = dcgm_series(GPU_UTIL, **ours) | {"instance": "10.42.1.3:9400"}
    samples = parse_response(vector((dcgm_series(GPU_UTIL, **ours), 3), (again, 64)))
    assert samples["a1"][H100].utilisation == 64


@pytest.mark.parametrize(
    ("code", "body", "says"),
    [
        (
            400,
            '{"status":"error","errorType":"bad_data","error":"invalid parameter \\"query\\": '
            '1:1: parse error: no expression found in input"}',
            "bad_data: invalid parameter",
        ),
        (
            422,
            '{"status":"error","errorType":"execution","error":"query processing would load too '
            'many samples into memory in query execution"}',
            "execution: query processing",
        ),
        (502, "<html><body><h1>502 Bad Gateway</h1></body></html>", "HTTP 502, not Prometheus"),
        (200, '{"status":"success","data":{"resultType":"matrix","result":[]}}', "not a vector"),
        (200, "[]", "not a Prometheus reply"),
        (503, '{"status":"success","data":{"resultType":"vector","result":[]}}', "HTTP 503"),
    ],
)
def test_errors_and_other_replies_raise_with_prometheuss_words(
    code: int, body: str, says: str
) -> None:
    with pytest.raises(PrometheusError, match=re.escape(says)):
        parse_reply(code, body)


def test_an_empty_vector_is_no_samples() -> None:
    body = '{"status":"success","data":{"resultType":"vector","result":[]}}'
    assert parse_reply(200, body) == {}


def test_ledger_devices_are_paired_with_dcgm_devices_in_order() -> None:
    reply = vector(
        *(
            (dcgm_series(ENGINE_ACTIVE, gpu=0, uuid=A100, host="n", mig=(p, gi), **on("a1")), v)
            for p, gi, v in (("1g.10gb", 13, 0.1), ("1g.10gb", 9, 0.2), ("2g.20gb", 5, 0.3))
        )
    )
    samples = parse_response(reply)["a1"]
    ledger = ["k8s-n-gpu0-mig6", "k8s-n-gpu0-mig0", "k8s-n-gpu0-mig4"]

    paired = by_ledger_device(ledger, samples)

    assert {k: s.uuid for k, s in paired.items()} == {
        "k8s-n-gpu0-mig0": f"{A100}/gi5",
        "k8s-n-gpu0-mig4": f"{A100}/gi9",
        "k8s-n-gpu0-mig6": f"{A100}/gi13",
    }
    assert by_ledger_device(ledger, {}) == {}  # not exported yet: nothing measured
    assert len(by_ledger_device(ledger[:1], samples)) == 1


def test_a_url_with_a_password_is_shown_without_it() -> None:
    assert shown_url("http://u:secret@prom.monitoring:9090/x") == "http://prom.monitoring:9090/x"
    assert shown_url("http://prometheus-operated.monitoring:9090") == (
        "http://prometheus-operated.monitoring:9090"
    )


# -- the dashboard ------------------------------------------------------------------------------
def dcgm_panels() -> list[dict[str, Any]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [p for p in panels if any("DCGM_" in t["expr"] for t in p.get("targets", []))]


def labels_in(expr: str, legend: str) -> set[str]:
    """Label names a query and its legend use: ``by (...)``, matchers, ``{{label}}``."""
    names = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        names |= {n.strip() for n in group.split(",") if n.strip()}
    for selector in re.findall(r"\{([^{}]*)\}", expr):
        names |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
    names |= set(re.findall(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", legend))
    return names - {"__name__"}


def test_the_dashboards_dcgm_panels_read_real_dcgm_metrics_and_labels() -> None:
    panels = dcgm_panels()
    assert len(panels) >= 3
    used_metrics: set[str] = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            expr, legend = target["expr"], target.get("legendFormat", "")
            metrics = set(re.findall(r"\bDCGM_[A-Z0-9_]+\b", expr))
            assert metrics <= DEFAULT_COUNTERS, f"{panel['title']}: {metrics - DEFAULT_COUNTERS}"
            used_metrics |= metrics
            unknown = labels_in(expr, legend) - DEVICE_LABELS - POD_LABELS
            assert not unknown, f"{panel['title']} uses labels DCGM does not export: {unknown}"
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
    # the panels show what the reclaimer reads
    assert set(METRICS) <= used_metrics


def test_the_dashboard_keeps_the_local_gpu_panels_beside_the_dcgm_row() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert any("gpupool_device_utilization_ratio" in e for e in exprs)
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert any("DCGM" in r for r in rows)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    boxes = [p["gridPos"] for p in dashboard["panels"]]
    for i, a in enumerate(boxes):  # no two panels overlap
        for b in boxes[i + 1 :]:
            apart = (
                a["x"] + a["w"] <= b["x"]
                or b["x"] + b["w"] <= a["x"]
                or a["y"] + a["h"] <= b["y"]
                or b["y"] + b["h"] <= a["y"]
            )
            assert apart, (a, b)
