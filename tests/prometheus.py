"""Prometheus's HTTP query API as gpupool reads it, for tests without a Prometheus: a real tornado
HTTP server on the loopback (its own thread and event loop) answering ``/api/v1/query`` (GET and
POST, as Prometheus does) in Prometheus's JSON shapes, and series shaped like NVIDIA
dcgm-exporter's (:func:`dcgm_series`).

What it answers, as Prometheus does (``web/api/v1``, "Format overview" and "Instant queries"):
- ``{"status": "success", "data": {"resultType": "vector", "result": [{"metric": {...},
  "value": [<unix time>, "<value as text>"]}]}}`` for a vector selector (``metric{...}`` or
  ``{__name__=~"...", ...}``): every stored series whose labels match, ``__name__`` kept;
  matchers ``=``, ``!=``, ``=~`` and ``!~``, regular expressions fully anchored, a missing label
  read as ``""``;
- ``400`` ``{"status": "error", "errorType": "bad_data", "error": "invalid parameter \\"query\\":
  ..."}`` for no query, for a selector whose matchers all match the empty string ("vector
  selector must contain at least one non-empty matcher"), and for any expression other than one
  vector selector: this stand-in does not evaluate PromQL beyond that (a limit, said here);
- whatever ``error`` (status, errorType, text) or ``raw`` (status, body, content type) says
  instead, for a failing Prometheus or something else answering at its address (a proxy).

``queries`` lists every query received. :class:`Silent` is an address that accepts connections
and never answers (a hung Prometheus); :func:`tests.hubapi.free_port` gives one nobody listens on.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from typing import Any

from tornado.httpserver import HTTPServer
from tornado.netutil import bind_sockets
from tornado.web import Application, RequestHandler

Series = tuple[dict[str, str], float]

_MATCHER = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')
_SELECTOR = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*(?:\{(.*)\})?\s*$", re.S)


class BadData(ValueError):
    pass


def _matchers(text: str) -> list[tuple[str, str, str]]:
    out = []
    rest = text.strip()
    while rest:
        m = _MATCHER.match(rest)
        if not m:
            raise BadData(f'1:1: parse error: unexpected character inside braces: "{rest[:1]}"')
        name, op, value = m.group(1), m.group(2), json.loads(f'"{m.group(3)}"')
        out.append((name, op, value))
        rest = rest[m.end() :]
        if rest.startswith(","):
            rest = rest[1:]
        elif rest:
            raise BadData(f'1:1: parse error: unexpected "{rest[:1]}" in label matching')
    return out


def _holds(op: str, have: str, want: str) -> bool:
    if op == "=":
        return have == want
    if op == "!=":
        return have != want
    matched = re.fullmatch(want, have) is not None
    return matched if op == "=~" else not matched


def select(promql: str, series: list[Series]) -> list[Series]:
    """The series one vector selector picks, as Prometheus picks them; :class:`BadData` for
    anything else."""
    if not promql.strip():
        raise BadData("1:1: parse error: no expression found in input")
    m = _SELECTOR.match(promql)
    if not m or (m.group(1) is None and m.group(2) is None):
        raise BadData(f"1:1: parse error: not one vector selector: {promql[:40]!r}")
    matchers = _matchers(m.group(2) or "")
    if m.group(1):
        matchers.append(("__name__", "=", m.group(1)))
    if all(_holds(op, "", want) for _, op, want in matchers):
        raise BadData(
            "1:1: parse error: vector selector must contain at least one non-empty matcher"
        )
    return [
        (labels, value)
        for labels, value in series
        if all(_holds(op, labels.get(name, ""), want) for name, op, want in matchers)
    ]


def format_value(value: float) -> str:
    """A sample value as Prometheus writes it (Go's ``strconv.FormatFloat(v, 'f', -1, 64)``)."""
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value == int(value) else repr(value)


class Prometheus:
    """The stand-in server (see the module docstring); ``url`` is its base URL."""

    def __init__(self) -> None:
        self.series: list[Series] = []
        self.error: tuple[int, str, str] | None = None
        self.raw: tuple[int, bytes, str] | None = None
        self.queries: list[str] = []
        self._lock = threading.Lock()
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sockets = bind_sockets(0, "127.0.0.1")
        self.url = f"http://127.0.0.1:{self._sockets[0].getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self._started.wait(10)

    def add(self, labels: dict[str, str], value: float) -> None:
        with self._lock:
            self.series.append((dict(labels), value))

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        owner = self

        class Query(RequestHandler):
            def get(self) -> None:
                self._answer()

            def post(self) -> None:
                self._answer()

            def _answer(self) -> None:
                promql = self.get_argument("query", "")
                with owner._lock:
                    owner.queries.append(promql)
                    series = list(owner.series)
                    error, raw = owner.error, owner.raw
                if raw is not None:
                    status, body, content_type = raw
                    self.set_status(status)
                    self.set_header("Content-Type", content_type)
                    self.finish(body)
                    return
                if error is not None:
                    self._error(*error)
                    return
                try:
                    picked = select(promql, series)
                except BadData as e:
                    self._error(400, "bad_data", f'invalid parameter "query": {e}')
                    return
                now = round(time.time(), 3)
                result = [
                    {"metric": labels, "value": [now, format_value(value)]}
                    for labels, value in picked
                ]
                self._json(
                    200, {"status": "success", "data": {"resultType": "vector", "result": result}}
                )

            def _error(self, status: int, kind: str, text: str) -> None:
                self._json(status, {"status": "error", "errorType": kind, "error": text})

            def _json(self, status: int, body: dict[str, Any]) -> None:
                self.set_status(status)
                self.set_header("Content-Type", "application/json")
                self.finish(json.dumps(body))

        server = HTTPServer(Application([(r"/api/v1/query", Query)]))
        server.add_sockets(self._sockets)
        loop.call_soon(self._started.set)
        try:
            loop.run_forever()
        finally:
            server.stop()
            loop.run_until_complete(server.close_all_connections())
            loop.close()

    def close(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class Silent:
    """An address that accepts TCP connections (into the backlog) and never answers."""

    def __init__(self) -> None:
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.socket.listen(16)
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"

    def close(self) -> None:
        self.socket.close()


# -- dcgm-exporter's series -----------------------------------------------------------------------
def dcgm_series(
    metric: str,
    *,
    gpu: int,
    uuid: str,
    host: str,
    model: str = "NVIDIA H100 80GB HBM3",
    mig: tuple[str, int] | None = None,
    pod: str = "",
    namespace: str = "jhub",
    container: str = "notebook",
    pod_labels: dict[str, str] | None = None,
) -> dict[str, str]:
    """The labels of one dcgm-exporter series as Prometheus stores it: the exporter's device
    labels (``gpu``, ``UUID``, ``pci_bus_id``, ``device``, ``modelName``, ``Hostname``, and for a
    MIG instance ``GPU_I_PROFILE`` and ``GPU_I_ID``, with the parent GPU's ``UUID``), its pod
    mapping (``pod``, ``namespace``, ``container``) when a pod holds the device, the pod's labels
    as ``--kubernetes-enable-pod-labels`` exports them (names sanitised: ``gpupool.io/team`` is
    ``gpupool_io_team``), and the scrape's ``instance`` and ``job``."""
    labels = {
        "__name__": metric,
        "gpu": str(gpu),
        "UUID": uuid,
        "pci_bus_id": f"00000000:{0x18 + 0x10 * gpu:02X}:00.0",
        "device": f"nvidia{gpu}",
        "modelName": model,
        "Hostname": host,
    }
    if mig is not None:
        labels["GPU_I_PROFILE"], labels["GPU_I_ID"] = mig[0], str(mig[1])
    if pod:
        labels |= {"container": container, "namespace": namespace, "pod": pod}
        for key, value in (pod_labels or {}).items():
            labels[re.sub(r"[^a-zA-Z0-9_]", "_", key)] = value
    labels |= {"instance": "10.42.0.17:9400", "job": "nvidia-dcgm-exporter"}
    return labels
