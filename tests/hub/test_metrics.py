"""``/hub/metrics`` of the real hub, parsed with prometheus_client's own parser: after spawns, a
job and refusals, gpupool's metrics equal what the pool holds (read back from its database)."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.hub.conftest import Hub, kill_servers, scrape, submit, value, wait_job

ROOT = Path(__file__).resolve().parents[2]
ALLOWED_LABELS = {"team", "offer", "kind", "state", "reason", "action", "le"}
DEVICE_LABELS = {"node", "device", "model", "profile"}


@pytest.fixture(scope="module")
def busy_hub(hub: Hub) -> Iterator[Hub]:
    """Two GPU notebooks, two refusals and one finished CPU job."""
    assert hub.spawn_form("ada", "vision|mig-3g.40gb|1").status_code == 302
    assert hub.spawn_form("ben", "vision|h100|1").status_code == 302
    hub.wait_ready("ada")
    hub.wait_ready("ben")
    # cal: two more H100s would take vision past its limit of 2; eve may only have CPU
    assert hub.spawn_form("cal", "vision|h100|2").status_code == 403
    assert hub.spawn_form("eve", "everyone|h100|1").status_code == 403
    dee = hub.token("dee")
    job = submit(hub, dee, "print('hello')", offer="cpu")
    wait_job(hub, dee, job["id"], {"succeeded"})
    try:
        yield hub
    finally:
        kill_servers(hub)


def test_allocation_metrics_equal_the_pool(busy_hub: Hub) -> None:
    metrics = scrape(busy_hub)
    held = busy_hub.allocations()
    by_key: dict[tuple[str, str, str], list[int]] = defaultdict(list)
    for a in held.values():
        by_key[(a.team, a.offer, a.kind)].append(a.cost_milli)
    samples = metrics["gpupool_allocations"]
    assert {(s.labels["team"], s.labels["offer"], s.labels["kind"]) for s in samples} == set(by_key)
    for (team, offer, kind), costs in by_key.items():
        labels = {"team": team, "offer": offer, "kind": kind}
        assert value(samples, "gpupool_allocations", **labels) == len(costs)
        assert value(
            metrics["gpupool_allocated_gpu_equivalents"],
            "gpupool_allocated_gpu_equivalents",
            **labels,
        ) == pytest.approx(sum(costs) / 1000)
    assert ("vision", "mig-3g.40gb", "notebook") in by_key


def test_team_metrics_equal_the_teams_api(busy_hub: Hub) -> None:
    metrics = scrape(busy_hub)
    reply = busy_hub.as_user(busy_hub.token("ada"), "GET", "/teams").json()
    teams = {t["name"]: t for t in reply["teams"]}
    for name, team in teams.items():
        for field in ("guarantee", "borrow_limit", "used", "borrowed"):
            metric = f"gpupool_team_{field}_gpu_equivalents"
            assert value(metrics[metric], metric, team=name) == pytest.approx(team[field])
    assert teams["vision"]["used"] == 1.5


def test_refusals_latency_and_jobs_are_counted(busy_hub: Hub) -> None:
    metrics = scrape(busy_hub)
    refusals = metrics["gpupool_refusals"]
    total = "gpupool_refusals_total"
    assert value(refusals, total, kind="notebook", reason="quota_exceeded") >= 1
    assert value(refusals, total, kind="notebook", reason="offer_not_allowed") >= 1
    latency = metrics["gpupool_allocation_duration_seconds"]
    count = "gpupool_allocation_duration_seconds_count"
    assert value(latency, count, kind="notebook") >= 2
    assert value(latency, count, kind="job") >= 1
    assert value(metrics["gpupool_jobs"], "gpupool_jobs", state="succeeded") == 1
    waits = metrics["gpupool_queue_wait_seconds"]
    assert value(waits, "gpupool_queue_wait_seconds_count", team="nlp") == 1


def test_device_metrics_follow_nvml(busy_hub: Hub) -> None:
    ben = busy_hub.allocations()["ben/"]
    (device,) = ben.devices
    activity = busy_hub.state / "activity.json"
    activity.write_text(json.dumps({device.gpu: {"gpu": 73, "pids": [4242], "used_mib": 4096}}))
    try:
        metrics = scrape(busy_hub)
    finally:
        activity.unlink()
    utilisation = metrics["gpupool_device_utilization_ratio"]
    (mine,) = [s for s in utilisation if s.labels["device"] == device.gpu]
    assert mine.value == pytest.approx(0.73) and mine.labels["model"] == "H100-80GB"
    used = metrics["gpupool_device_memory_used_bytes"]
    assert [s.value for s in used if s.labels["device"] == device.gpu] == [4096 << 20]
    # the simulated fallback: two whole H100s and two L40S with a utilisation, two MIG GPUs of
    # three instances each, which have memory but no utilisation (as NVML reports them), and a
    # managed MIG A100 with no instance yet (its memory, no utilisation: MIG mode)
    assert len(utilisation) == 4
    assert len(metrics["gpupool_device_memory_total_bytes"]) == 4 + 6 + 1
    assert {s.labels["profile"] for s in used} == {"", "3g.40gb", "2g.20gb", "1g.10gb"}


def test_labels_are_bounded_and_the_dashboard_reads_only_real_metrics(busy_hub: Hub) -> None:
    metrics = scrape(busy_hub)
    for name, samples in metrics.items():
        for s in samples:
            allowed = DEVICE_LABELS if name.startswith("gpupool_device_") else ALLOWED_LABELS
            extra = set(s.labels) - allowed - {"source", "simulated"}
            assert not extra, f"{s.name} has unbounded labels {extra}"
            assert "ada" not in s.labels.values() and "ben" not in s.labels.values()
    dashboard = (ROOT / "helm/gpupool/dashboards/gpupool.json").read_text()
    used = set(re.findall(r"gpupool_[a-z_]+", dashboard))
    names = {s.name for samples in metrics.values() for s in samples}
    # counters and histograms whose first event has not happened yet have no samples
    families = set(metrics) | {"gpupool_reclaims", "gpupool_idle_warnings"}
    exported = (
        names | families | {f"{f}_{suffix}" for f in families for suffix in ("total", "bucket")}
    )
    assert used <= exported, f"the dashboard reads unknown metrics {sorted(used - exported)}"


def test_metrics_need_a_token(busy_hub: Hub) -> None:
    r = requests.get(f"{busy_hub.url}/hub/metrics", timeout=30)
    assert r.status_code == 403
