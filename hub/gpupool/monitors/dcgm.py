"""GPU activity on Kubernetes: NVIDIA's DCGM exporter, read through Prometheus's HTTP API.

On Kubernetes NVML is on the nodes, not in the hub's pod, so :class:`~.activity.DeviceMonitor`
gives no samples there. Where the cluster runs NVIDIA's dcgm-exporter and a Prometheus scrapes it,
the hub reads the same facts (utilisation, memory used) from Prometheus instead.

Vocabulary
- *DCGM series*: one series of dcgm-exporter, as Prometheus's instant query returns it
  (``{"metric": {labels}, "value": [time, "42"]}``). Its labels (dcgm-exporter's
  ``internal/pkg/transformation`` and its metric template): ``gpu`` (the GPU's index on its node),
  ``UUID`` (the physical GPU's; a MIG instance carries its parent GPU's), ``pci_bus_id``,
  ``device`` (``nvidia0``), ``modelName``, ``Hostname``; a MIG instance adds ``GPU_I_PROFILE``
  (``3g.40gb``) and ``GPU_I_ID`` (the GPU instance's ID). With Kubernetes pod mapping (the
  exporter's default in NVIDIA's Helm chart and GPU operator) the series of a device a pod holds
  add ``pod``, ``namespace`` and ``container``; with ``--kubernetes-enable-pod-labels`` also the
  pod's labels, each name sanitised as Prometheus needs (every character outside ``[a-zA-Z0-9_]``
  becomes ``_``): gpupool's ``gpupool.io/allocation`` arrives as ``gpupool_io_allocation``
  (:data:`ALLOCATION_SERIES_LABEL`). That label, not ``pod``, ties a series to gpupool's
  allocation: it needs no pod name, and it survives a scrape without ``honorLabels`` (where
  Prometheus renames the exporter's ``pod`` to ``exported_pod``).
- *metrics* (dcgm-exporter's ``etc/default-counters.csv``): ``DCGM_FI_DEV_GPU_UTIL`` (gauge,
  percent; NVML's utilisation, none for MIG instances), ``DCGM_FI_PROF_GR_ENGINE_ACTIVE`` (gauge,
  ratio 0-1 of time the graphics/compute engine is active; a profiling (DCP) metric of datacenter
  GPUs, and the one reported per MIG instance; the exporter's help text says "in %", so a value
  above 1 is read as percent), ``DCGM_FI_DEV_FB_USED`` and ``DCGM_FI_DEV_FB_FREE`` (gauges, MiB).
- *DCGM device*: one physical GPU (key ``<UUID>``) or MIG instance (``<UUID>/gi<GPU_I_ID>``).
  Its utilisation in percent is ``DCGM_FI_DEV_GPU_UTIL`` for a whole GPU (else its engine
  activity × 100) and the engine activity × 100 for a MIG instance; ``None`` where neither is
  there. The device plugin, not gpupool, picks the physical device, so an allocation's ledger
  devices (synthetic ``k8s-<node>-gpu<i>`` IDs) are paired with its DCGM devices in order
  (:func:`by_ledger_device`), except those whose UUIDs were read back (:mod:`gpupool.kube.
  readback`), which take their own.

Contract: :func:`query`, :func:`parse_reply`, :func:`parse_response` and
:func:`by_ledger_device` are pure. :class:`DCGMSource` is the one seam to Prometheus: one instant
query per :meth:`DCGMSource.sample`, asynchronous, bounded by its timeout; an unreachable,
failing or garbled Prometheus gives no samples and one log line (a warning the first time in a
row, debug after that, and a line when it answers again); it never raises.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

from gpupool.monitors.activity import DeviceSample

log = logging.getLogger("gpupool")

GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
METRICS = (GPU_UTIL, ENGINE_ACTIVE, FB_USED, FB_FREE)
"""The DCGM metrics gpupool reads (all in dcgm-exporter's default counters)."""

DEVICE_LABELS = frozenset(
    {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "GPU_I_PROFILE", "GPU_I_ID"}
)
POD_LABELS = frozenset({"pod", "namespace", "container"})
"""The labels dcgm-exporter puts on its series: the device's, and with pod mapping the pod's."""

ALLOCATION_LABEL = "gpupool.io/allocation"
"""The pod label gpupool puts on every notebook pod (:mod:`gpupool.kube.pods`)."""

MIB = 1 << 20


def prometheus_label(name: str) -> str:
    """A Kubernetes label name as dcgm-exporter exports it (``utils.SanitizeLabelName``)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


ALLOCATION_SERIES_LABEL = prometheus_label(ALLOCATION_LABEL)
"""``gpupool_io_allocation``: the allocation label on DCGM series."""


class PrometheusError(ValueError):
    """Prometheus answered, but not with a vector of samples (its error, or not its format)."""


# -- pure: the query and its answer -------------------------------------------------------------
def query(label: str = ALLOCATION_SERIES_LABEL) -> str:
    """The instant query: gpupool's DCGM metrics of every device a gpupool pod holds."""
    names = "|".join(METRICS)
    return f'{{__name__=~"{names}",{label}!=""}}'


def parse_reply(code: int, body: bytes | str) -> dict[str, dict[str, DeviceSample]]:
    """An HTTP reply of ``/api/v1/query`` (status ``code``, JSON ``body``) as
    :func:`parse_response` reads it; :class:`PrometheusError` for anything else."""
    try:
        payload = json.loads(body)
    except ValueError:
        text = body[:120] if isinstance(body, str) else body[:120].decode("utf-8", "replace")
        raise PrometheusError(f"HTTP {code}, not Prometheus's JSON: {text!r}") from None
    samples = parse_response(payload)
    if code != 200:
        raise PrometheusError(f"HTTP {code}")
    return samples


def parse_response(
    payload: Any, label: str = ALLOCATION_SERIES_LABEL
) -> dict[str, dict[str, DeviceSample]]:
    """Prometheus's instant-query JSON as samples: allocation id (the series' ``label``) → DCGM
    device key → :class:`DeviceSample` (see the module docstring). Series without the label, or
    with a value that is not a finite number, are left out. Raises :class:`PrometheusError` for
    Prometheus's error reply (``{"status": "error", "errorType": ..., "error": ...}``) and for
    anything that is not a vector result."""
    if not isinstance(payload, dict):
        raise PrometheusError(f"not a Prometheus reply: {payload!r:.80}")
    if payload.get("status") == "error":
        raise PrometheusError(f"{payload.get('errorType', 'error')}: {payload.get('error', '')}")
    data = payload.get("data")
    if payload.get("status") != "success" or not isinstance(data, dict):
        raise PrometheusError(f"not a Prometheus reply: {payload!r:.80}")
    if data.get("resultType") != "vector" or not isinstance(data.get("result"), list):
        raise PrometheusError(f"not a vector result: resultType {data.get('resultType')!r}")
    values: dict[tuple[str, str], dict[str, float]] = {}
    mig: dict[tuple[str, str], bool] = {}
    for series in data["result"]:
        found = _series(series, label)
        if found is None:
            continue
        allocation, key, is_mig, metric, value = found
        seen = values.setdefault((allocation, key), {})
        seen[metric] = max(value, seen.get(metric, value))  # one device scraped twice: the most
        mig[allocation, key] = is_mig
    out: dict[str, dict[str, DeviceSample]] = {}
    for (allocation, key), got in values.items():
        out.setdefault(allocation, {})[key] = _sample(key, got, mig[allocation, key])
    return out


def _series(series: Any, label: str) -> tuple[str, str, bool, str, float] | None:
    """(allocation, device key, is MIG, metric, value) of one result element, or ``None``."""
    if not isinstance(series, dict):
        return None
    labels, pair = series.get("metric"), series.get("value")
    if not isinstance(labels, dict) or not isinstance(pair, list) or len(pair) != 2:
        return None
    metric, allocation = labels.get("__name__"), labels.get(label)
    if metric not in METRICS or not isinstance(allocation, str) or not allocation:
        return None
    try:
        value = float(pair[1])
    except (TypeError, ValueError):
        return None
    if not math.isfinite(value):
        return None
    key = device_key(labels)
    return allocation, key, bool(labels.get("GPU_I_ID")), metric, value


def device_key(labels: Mapping[str, str]) -> str:
    """``<UUID>`` of a whole GPU, ``<UUID>/gi<GPU_I_ID>`` of a MIG instance (``Hostname/gpu``
    where a series has no UUID)."""
    gpu = labels.get("UUID") or f"{labels.get('Hostname', '')}/{labels.get('gpu', '')}"
    instance = labels.get("GPU_I_ID")
    return f"{gpu}/gi{instance}" if instance else gpu


def _sample(key: str, got: Mapping[str, float], is_mig: bool) -> DeviceSample:
    engine = got.get(ENGINE_ACTIVE)
    percent: float | None = None
    if not is_mig and GPU_UTIL in got:
        percent = got[GPU_UTIL]
    elif engine is not None:
        # a ratio (0-1) as DCGM reports it; dcgm-exporter's help says "(in %)", so a value
        # above 1 is read as percent already
        percent = engine * 100 if engine <= 1.0 else engine
    utilisation = None if percent is None else max(0, min(100, round(percent)))
    used = round(got.get(FB_USED, 0.0) * MIB)
    total = used + round(got[FB_FREE] * MIB) if FB_FREE in got else 0
    return DeviceSample(key, utilisation, used, total, ())


def _order(key: str) -> tuple[str, int]:
    gpu, _, instance = key.partition("/gi")
    return gpu, int(instance) if instance.isdigit() else -1


def by_ledger_device(
    ledger_ids: Iterable[str], samples: Mapping[str, DeviceSample]
) -> dict[str, DeviceSample]:
    """An allocation's DCGM devices as its ledger devices: a ledger device read back
    (:mod:`gpupool.kube.readback`: its id is the DCGM device's key) takes its own; the others,
    both sorted, are paired in order (the device plugin chose them; the ledger counts them).
    Devices DCGM does not report yet are left out."""
    ids = sorted(ledger_ids)
    out = {i: samples[i] for i in ids if i in samples}
    keys = sorted((k for k in samples if k not in out), key=_order)
    rest = [i for i in ids if i not in out]
    out.update(zip(rest, (samples[k] for k in keys), strict=False))
    return out


def shown_url(url: str) -> str:
    """``url`` without any user and password in it (for pages and logs)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urlunsplit(parts._replace(netloc=netloc))


# -- the seam ----------------------------------------------------------------------------------
class DCGMSource:
    """Reads DCGM series from the Prometheus at ``url`` (``http://prometheus-operated.monitoring:
    9090``), each query bounded by ``timeout`` seconds (see the module docstring)."""

    def __init__(
        self,
        url: str,
        timeout: float = 5.0,
        logger: logging.Logger | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.log = logger or log
        self.failing: str | None = None
        """Why the last query gave nothing (``None`` when it was answered)."""
        self.answered = False
        """Whether Prometheus has answered a query since the start."""

    @property
    def shown(self) -> str:
        return shown_url(self.url)

    async def sample(self) -> dict[str, dict[str, DeviceSample]]:
        """Allocation id → DCGM device key → sample, from one instant query; ``{}`` when the
        query fails (logged)."""
        try:
            samples = await self._query(query())
        except (HTTPClientError, OSError, PrometheusError, TimeoutError) as e:
            reason = str(e) or type(e).__name__
            level = logging.DEBUG if self.failing is not None else logging.WARNING
            self.failing = reason
            self.log.log(
                level,
                "gpupool: GPU use from DCGM unread this pass (Prometheus at %s: %s)",
                self.shown,
                reason,
            )
            return {}
        if self.failing is not None:
            self.log.info("gpupool: Prometheus at %s answers again", self.shown)
        self.failing = None
        self.answered = True
        return samples

    async def answer(self, promql: str) -> Any:
        """Prometheus's JSON answer to the instant query ``promql``, bounded by the timeout;
        raises :class:`PrometheusError`, ``HTTPClientError``, ``OSError`` or ``TimeoutError``
        (the read-back of :mod:`gpupool.kube.readback` parses it itself)."""
        code, body = await self._fetch(promql)
        try:
            payload = json.loads(body)
        except ValueError:
            raise PrometheusError(f"HTTP {code}, not Prometheus's JSON") from None
        if code != 200:
            raise PrometheusError(f"HTTP {code}: {str(payload)[:200]}")
        return payload

    async def _query(self, promql: str) -> dict[str, dict[str, DeviceSample]]:
        return parse_reply(*await self._fetch(promql))

    async def _fetch(self, promql: str) -> tuple[int, bytes]:
        """The status and body of the instant query ``promql``, bounded by the timeout."""
        request = HTTPRequest(
            f"{self.url}/api/v1/query?{urlencode({'query': promql})}",
            method="GET",
            headers={"Accept": "application/json"},
            connect_timeout=self.timeout,
            request_timeout=self.timeout,
            follow_redirects=False,
        )
        response = await AsyncHTTPClient().fetch(request, raise_error=False)
        return response.code, response.body or b""
