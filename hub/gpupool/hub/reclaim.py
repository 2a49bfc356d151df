"""The idle GPU reclaimer: a loop in the hub that takes GPUs back from notebooks left idle.

Vocabulary
- *look*: one pass over every GPU notebook allocation (``kind == "notebook"`` with devices; jobs
  are never reclaimed): device activity from the pool's :class:`DeviceMonitor` (NVML) on nodes
  it can read, and on the others (Kubernetes nodes) from NVIDIA's DCGM exporter through
  Prometheus when ``dcgm_prometheus_url`` is set (:class:`gpupool.monitors.dcgm.DCGMSource`;
  a GPU busy per DCGM counts as a busy GPU per NVML does), kernel activity from the server's
  ``/api/kernels`` (read through the proxy), judged by :func:`gpupool.core.idle.observe` under
  the team's policy. Without either, a Kubernetes notebook is judged by its kernels alone.
- *warning*: shown to the user in JupyterLab (the extension's status item reads it through
  ``GET /hub/api/gpupool/allocations``) and on the "my GPUs" page, with the time the GPUs go
  and a reminder that saving work is the user's.
- *reclaim*: stopping the server through the hub's REST API (so the spawner releases the
  allocation as on any stop), or, with ``action = "cpu"``, stopping it and starting it again on
  the ``cpu`` offer. Logged and counted (``gpupool_reclaims_total``) with its reason.
- *server*: the notebook's server as JupyterHub's REST API models it (``GET
  {api_url}/users/{name}``: ``servers[name]`` with ``ready`` and its ``url`` path); its kernels
  are read through the proxy, ``{public_url}{url}api/kernels``, like any client's.

Seams: ``clock`` (default :func:`gpupool.clock.utcnow`), the hub's REST API (:attr:`hub`, a
:class:`gpupool.hub.hub_api.HubAPI`), and the pool's :class:`DeviceMonitor` and
:class:`~gpupool.monitors.dcgm.DCGMSource` (Prometheus) for devices.
The reclaimer talks to the hub like any service, through the REST API only (as
jupyterhub-idle-culler does): as the ``gpupool-reclaimer`` service (:data:`SERVICE`), whose token
``setup(c)`` makes at start (random, in memory, never logged), with :data:`SERVICE_SCOPES`: read
servers, stop and start them, and reach them (their kernels). ``setup(c)`` also passes the hub's
REST API URL (``api_url``) and the proxy's public URL (``public_url``), both as the hub's own
process reaches them (:func:`hub_urls`). Without ``api_url`` the reclaimer does not run (it says so
once).

Contract: the reclaimer never reaches into the hub's objects or database. A server whose kernels
cannot be read (not ready, not found, a call failed) counts as kernels unknown: its devices still
count (the first such failure is a warning, later ones are debug). A reclaim whose calls fail is
logged and leaves the allocation alone. A stop or start is judged by the hub's model afterwards,
not by its reply's speed: JupyterHub carries on with both after a slow reply. The reclaim counts
once the server is stopped (its GPUs are back); a restart on cpu that fails is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable as CallableType
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlparse

from tornado.httpclient import HTTPClientError
from traitlets import Callable, Dict, Float, Unicode, validate
from traitlets.config import LoggingConfigurable

from gpupool import metrics
from gpupool.background import Periodic
from gpupool.clock import iso, utcnow
from gpupool.core.idle import ACTIONS, DeviceReading, IdlePolicy, Reading, Watch, observe
from gpupool.core.ledger import Allocation
from gpupool.declarations import ConfigError
from gpupool.hub.compat import START_SERVERS_SCOPE
from gpupool.hub.hub_api import HubAPI
from gpupool.monitors.dcgm import ALLOCATION_SERIES_LABEL, DCGMSource, by_ledger_device
from gpupool.pool import Pool

SERVICE = "gpupool-reclaimer"
SERVICE_SCOPES = ["read:servers", "delete:servers", START_SERVERS_SCOPE, "access:servers"]
"""Read a user's servers, stop one (``stop``), start it again (``cpu``), read its kernels."""
DEFAULT_POLICY = {"threshold": 5, "idle_minutes": 120, "warn_minutes": 30, "action": "stop"}
_POLICY_KEYS = set(DEFAULT_POLICY)
KERNEL_CALLS_AT_ONCE = 16
"""How many servers' kernels one pass asks for at the same time."""


def parse_policies(value: Any) -> dict[str, IdlePolicy]:
    """``{"*": {...}, "vision": {...}}`` as policies; each team's over ``*`` over the defaults."""
    if not isinstance(value, dict):
        raise ConfigError("IdleReclaimer.policies", f"must be a dict by team, got {value!r}")
    base = {**DEFAULT_POLICY, **value.get("*", {})}
    out = {}
    for team, spec in {"*": {}, **value}.items():
        path = f"IdleReclaimer.policies[{team!r}]"
        if not isinstance(spec, dict):
            raise ConfigError(path, f"must be a dict like {DEFAULT_POLICY}, got {spec!r}")
        unknown = sorted(set(spec) - _POLICY_KEYS)
        if unknown:
            raise ConfigError(path, f"unknown key(s) {unknown}; use {sorted(_POLICY_KEYS)}")
        merged = {**base, **spec}
        action = merged["action"]
        if action not in ACTIONS:
            raise ConfigError(f"{path}.action", f"must be one of {ACTIONS}, got {action!r}")
        numbers = {k: merged[k] for k in ("threshold", "idle_minutes", "warn_minutes")}
        for key, number in numbers.items():
            if isinstance(number, bool) or not isinstance(number, int | float) or number < 0:
                raise ConfigError(f"{path}.{key}", f"must be a number >= 0, got {number!r}")
        if numbers["warn_minutes"] > numbers["idle_minutes"]:
            raise ConfigError(f"{path}.warn_minutes", "must not be more than idle_minutes")
        out[team] = IdlePolicy(
            int(numbers["threshold"]),
            float(numbers["idle_minutes"]) * 60,
            float(numbers["warn_minutes"]) * 60,
            action,
        )
    return out


class IdleReclaimer(LoggingConfigurable):
    """Watches GPU notebooks and reclaims idle ones (see the module docstring)."""

    period = Float(
        60.0,
        config=True,
        help="""Seconds between looks at every GPU notebook. Example:
        ``c.IdleReclaimer.period = 30``""",
    )
    policies = Dict(
        {},
        config=True,
        help="""Idle policy per team (JupyterHub group name; ``*`` for every team, and
        ``everyone`` for users in no team): ``threshold`` (GPU utilisation in percent below which
        a GPU counts as idle), ``idle_minutes`` (how long idle before the GPUs are taken back),
        ``warn_minutes`` (how long before that the user is warned in JupyterLab) and
        ``action``: ``stop`` (stop the server; unsaved work is lost, and the warning says so),
        ``cpu`` (stop it and start it again without a GPU) or ``off``. A notebook with a busy
        kernel is never idle; running jobs are never reclaimed. Defaults: threshold 5,
        idle_minutes 120, warn_minutes 30, action stop. Example::

            c.IdleReclaimer.policies = {
                "*": {"idle_minutes": 60, "warn_minutes": 15},
                "vision": {"action": "cpu"},
                "nlp": {"action": "off"},
            }
        """,
    )
    clock = Callable(
        utcnow,
        config=True,
        help="""The time seam: a callable returning an aware ``datetime``. Example:
        ``c.IdleReclaimer.clock = gpupool.clock.OffsetClock(".run/clock-offset")``""",
    )
    request_timeout = Float(
        10.0, config=True, help="Seconds one call to the hub or a server may take. Example: 5"
    )
    proxy_url = Unicode(
        "",
        config=True,
        help="""Where the reclaimer reaches the proxy to read servers' kernels, when it is not on
        the hub's machine (default: from ``JupyterHub.bind_url``, on the loopback). The Helm
        chart sets the proxy's service. Example: ``c.IdleReclaimer.proxy_url =
        "http://proxy-public"``""",
    )

    dcgm_prometheus_url = Unicode(
        "",
        config=True,
        help="""Where to read GPU use on Kubernetes nodes (where NVML is not in the hub's pod):
        the URL of a Prometheus that scrapes NVIDIA's dcgm-exporter, run with
        ``--kubernetes-enable-pod-labels`` so its series carry the pod label
        ``gpupool.io/allocation`` (as ``gpupool_io_allocation``). The reclaimer and the admin
        page then count DCGM's utilisation (``DCGM_FI_DEV_GPU_UTIL``; for MIG instances
        ``DCGM_FI_PROF_GR_ENGINE_ACTIVE``) as NVML's. Empty (the default): off; Kubernetes
        notebooks are judged by their kernels alone. Example::

            c.IdleReclaimer.dcgm_prometheus_url = "http://prometheus-operated.monitoring:9090"
        """,
    )
    dcgm_timeout = Float(
        5.0,
        config=True,
        help="""Seconds one query to ``dcgm_prometheus_url`` may take; a slower, failing or
        unreachable Prometheus gives no GPU use for that look (logged), never a failed look.
        Example: ``c.IdleReclaimer.dcgm_timeout = 2``""",
    )

    @validate("dcgm_prometheus_url")
    def _valid_dcgm_url(self, proposal: dict[str, Any]) -> str:
        url = str(proposal["value"]).strip()
        parts = urlparse(url)
        if url and (parts.scheme not in ("http", "https") or not parts.netloc):
            raise ConfigError(
                "IdleReclaimer.dcgm_prometheus_url",
                f"must be an http(s) URL like http://prometheus-operated.monitoring:9090, "
                f"got {url!r}",
            )
        return url

    @validate("policies")
    def _valid_policies(self, proposal: dict[str, Any]) -> Any:
        parse_policies(proposal["value"])
        return proposal["value"]

    def __init__(
        self, pool: Pool, token: str = "", api_url: str = "", public_url: str = "", **kwargs: Any
    ) -> None:
        """``token``: the :data:`SERVICE`'s; ``api_url``: the hub's REST API
        (``http://127.0.0.1:8081/hub/api``); ``public_url``: the proxy's public URL
        (``http://127.0.0.1:8000``), where servers' kernels are read."""
        super().__init__(**kwargs)
        self.pool = pool
        self.hub = HubAPI(api_url, token, self.request_timeout)
        """JupyterHub's REST API, as the :data:`SERVICE`."""
        self.public_url = (self.proxy_url or public_url).rstrip("/")
        self.watches: dict[str, Watch] = {}
        self._policies = parse_policies(self.policies)
        self.background = Periodic(
            "idle reclaim pass", self.look, lambda: self.period, self.log, first=self.hub.wait_up
        )
        """Every ``period`` seconds, once the hub's REST API answers."""
        self._kernels_unread = False
        """Whether some server's kernels could not be read yet (said once, at warning level)."""
        self.last_look: float | None = None
        """When the last complete pass began (the reclaimer's clock)."""
        self.dcgm: DCGMSource | None = None
        """The second activity source, for nodes NVML cannot read (``dcgm_prometheus_url``)."""
        if self.dcgm_prometheus_url:
            self.dcgm = DCGMSource(self.dcgm_prometheus_url, self.dcgm_timeout, self.log)
        self._dcgm_unlabelled = False
        """Whether "no DCGM series carries gpupool's allocation label" was said (once)."""
        self.warnings: list[CallableType[[Allocation], dict[str, Any] | None]] = []
        """Other warnings a notebook's ``warning`` carries to JupyterLab, in the same shape
        (the share watch's: GPU memory over a share, :mod:`gpupool.hub.share_watch`); the
        soonest ``reclaim_at`` is shown."""

    @property
    def api_url(self) -> str:
        return self.hub.api_url

    @property
    def token(self) -> str:
        return self.hub.token

    def policy(self, team: str) -> IdlePolicy:
        return self._policies.get(team, self._policies["*"])

    def now(self) -> float:
        return float(self.clock().timestamp())

    # -- what others read ----------------------------------------------------------------------
    def idle(self) -> dict[str, str]:
        """Allocation id -> team of every notebook idle now (for the metrics)."""
        allocations = self.pool.ledger.allocations
        return {
            alloc_id: allocations[alloc_id].team
            for alloc_id, watch in self.watches.items()
            if watch.idle_since is not None and alloc_id in allocations
        }

    def activity(self) -> dict[str, str]:
        """Where device use comes from, for the admin page: ``source`` (``nvml``, ``dcgm``,
        ``nvml+dcgm`` or ``none``) and a sentence saying so (with the last DCGM failure)."""
        monitor = self.pool.monitor
        nodes = [n.name for n in self.pool.inventory.nodes]
        unread = [n for n in nodes if not monitor.can_read(n)]
        nvml = len(unread) < len(nodes)
        if self.dcgm is not None and unread:
            text = (
                "GPU use on Kubernetes nodes: NVIDIA's DCGM exporter, through Prometheus at "
                f"{self.dcgm.shown}"
            )
            if self.dcgm.failing is not None:
                text += f" (the last query failed: {self.dcgm.failing})"
            return {"source": "nvml+dcgm" if nvml else "dcgm", "text": text + "."}
        if unread:
            return {
                "source": "nvml" if nvml else "none",
                "text": "GPU use is not measured on "
                + ("Kubernetes nodes" if not nvml else ", ".join(unread))
                + ": idle notebooks there are judged by their kernels alone (set "
                "IdleReclaimer.dcgm_prometheus_url, Helm: gpupool.dcgm.prometheusUrl).",
            }
        return {"source": "nvml", "text": "GPU use: NVML on the hub's machine."}

    def status(self, allocation: Allocation) -> dict[str, Any]:
        """What the reclaimer knows of one allocation: utilisation per device (percent, ``None``
        where NVML measures none), since when it is idle, and the warning if one is due."""
        watch = self.watches.get(allocation.id, Watch())
        policy = self.policy(allocation.team)
        devices = watch.last.devices if watch.last else {}
        out: dict[str, Any] = {
            "utilisation": {uuid: d.utilisation for uuid, d in devices.items()},
            "checked": iso(self.last_look) if allocation.id in self.watches else None,
            "idle_since": iso(watch.idle_since),
            "action": policy.action,
            "warning": None,
        }
        reclaim_at = watch.reclaim_at(policy)
        if watch.warned_at is not None and reclaim_at is not None:
            out["warning"] = {
                "reclaim_at": iso(reclaim_at),
                "action": policy.action,
                "reason": "idle",
                "message": warning_message(allocation, policy, watch, reclaim_at),
            }
        others = [w(allocation) for w in self.warnings]
        found = [w for w in (out["warning"], *others) if w]
        out["warning"] = min(found, key=lambda w: w["reclaim_at"]) if found else None
        return out

    # -- the loop ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loop in the hub's event loop; it waits for the hub's REST API to answer."""
        if not self.api_url:
            self.log.warning(
                "gpupool: the idle GPU reclaimer is off: no URL of JupyterHub's REST API was "
                "given (IdleReclaimer api_url)"
            )
            return
        self.background.start()

    async def stop(self) -> None:
        await self.background.stop()

    async def look(self) -> list[tuple[Allocation, str]]:
        """One pass; returns what was warned or reclaimed (``(allocation, "warn"|"reclaim")``)."""
        notebooks = [
            a
            for a in list(self.pool.ledger.allocations.values())
            if a.kind == "notebook" and a.devices
        ]
        for gone in set(self.watches) - {a.id for a in notebooks}:
            del self.watches[gone]
        began = self.now()
        limit = asyncio.Semaphore(KERNEL_CALLS_AT_ONCE)

        async def kernels_of(a: Allocation) -> tuple[bool | None, float | None]:
            async with limit:
                return await self.read_kernels(a)

        samples, all_kernels = await asyncio.gather(
            self._samples(notebooks), asyncio.gather(*(kernels_of(a) for a in notebooks))
        )
        done: list[tuple[Allocation, str]] = []
        for allocation, kernels in zip(notebooks, all_kernels, strict=True):
            reading = Reading(
                {
                    d.visible_id: samples[d.visible_id]
                    for d in allocation.devices
                    if d.visible_id in samples
                },
                *kernels,
            )
            policy = self.policy(allocation.team)
            before = self.watches.get(allocation.id, Watch())
            watch, verdict = observe(before, reading, policy, began)
            self.watches[allocation.id] = watch
            if verdict == "warn":
                self._warn(allocation, policy, watch)
                done.append((allocation, verdict))
            elif verdict == "reclaim":
                await self._reclaim(allocation, policy)
                done.append((allocation, verdict))
        self.last_look = began
        return done

    async def _samples(self, notebooks: list[Allocation]) -> dict[str, DeviceReading]:
        """Readings by ledger device: NVML's where the monitor reads the node, else DCGM's."""
        monitor = self.pool.monitor
        by_node: dict[str, list[str]] = defaultdict(list)
        elsewhere: list[Allocation] = []
        for a in notebooks:
            if monitor.can_read(a.node):
                by_node[a.node] += [d.visible_id for d in a.devices]  # type: ignore[index]
            elif a.node is not None:
                elsewhere.append(a)
        out = {}
        for node, uuids in by_node.items():
            for uuid, s in monitor.sample(node, uuids).items():
                out[uuid] = DeviceReading(s.utilisation, s.memory_used, s.pids)
        if self.dcgm is not None and elsewhere:
            found = await self.dcgm.sample()
            for a in elsewhere:
                mine = by_ledger_device([d.visible_id for d in a.devices], found.get(a.id, {}))
                for uuid, s in mine.items():
                    out[uuid] = DeviceReading(s.utilisation, s.memory_used, s.pids)
            if self.dcgm.failing is None and not found and not self._dcgm_unlabelled:
                self._dcgm_unlabelled = True
                self.log.warning(
                    "gpupool: Prometheus at %s has no DCGM series with the pod label %s for "
                    "%d GPU notebook(s): is dcgm-exporter run with "
                    "--kubernetes-enable-pod-labels (and any --kubernetes-pod-label-allowlist-"
                    "regex keeping gpupool.io/allocation)? Until then they are judged by "
                    "their kernels alone.",
                    self.dcgm.shown,
                    ALLOCATION_SERIES_LABEL,
                    len(elsewhere),
                )
        return out

    async def read_kernels(self, allocation: Allocation) -> tuple[bool | None, float | None]:
        """(any kernel busy, newest kernel activity) from the server, or (None, None)."""
        try:
            url = await self.server_url(allocation)
            if not url:
                return None, None
            kernels = await self.hub.call("GET", url + "api/kernels")
            if not isinstance(kernels, list):
                raise ValueError(f"not a list of kernels: {kernels!r:.80}")
            busy = any(k.get("execution_state") == "busy" for k in kernels)
            stamps = [_parse_time(k.get("last_activity")) for k in kernels]
        except (HTTPClientError, OSError, ValueError, AttributeError) as e:
            level = logging.DEBUG if self._kernels_unread else logging.WARNING
            self._kernels_unread = True
            self.log.log(
                level,
                "gpupool: kernels of %s unreadable (its devices alone count): %s",
                allocation.ref,
                e,
            )
            return None, None
        newest = max((t for t in stamps if t is not None), default=None)
        return busy, newest

    async def server_url(self, allocation: Allocation) -> str | None:
        """The notebook server's URL through the proxy (``{public_url}/user/ada/``) from the
        hub's REST API, or ``None`` while it is not ready (or gone)."""
        user, _, name = allocation.ref.partition("/")
        server = await self.hub.server(user, name)
        if server is None or not server.get("ready"):
            return None
        path = server.get("url")
        if not isinstance(path, str) or not path.endswith("/"):
            raise ValueError(f"the server's url is {path!r}")
        return path if urlparse(path).netloc else self.public_url + path

    def _warn(self, allocation: Allocation, policy: IdlePolicy, watch: Watch) -> None:
        metrics.IDLE_WARNINGS.labels(team=allocation.team).inc()
        reclaim_at = watch.reclaim_at(policy) or self.now()
        self.log.info(
            "gpupool: warned %s (%s, team %s): idle GPUs, %s at %s",
            allocation.ref,
            allocation.visible_devices,
            allocation.team,
            "restarted on cpu" if policy.action == "cpu" else "stopped",
            iso(reclaim_at),
        )

    async def _reclaim(self, allocation: Allocation, policy: IdlePolicy) -> None:
        user, _, server = allocation.ref.partition("/")
        action = policy.action
        self.log.warning(
            "gpupool: reclaiming %s of %s (%s, team %s): idle below %d%% for %d min; %s",
            allocation.visible_devices,
            allocation.ref,
            allocation.offer,
            allocation.team,
            policy.threshold,
            policy.idle_after // 60,
            "restarting it on cpu" if action == "cpu" else "stopping the server",
        )
        try:
            await self.hub.stop_server(user, server)
            await self.hub.wait_stopped(user, server)
        except (HTTPClientError, OSError, TimeoutError) as e:
            self.log.error("gpupool: could not reclaim %s: %s", allocation.ref, e)
            return
        self.watches.pop(allocation.id, None)
        metrics.RECLAIMS.labels(team=allocation.team, action=action, reason="idle").inc()
        if action == "cpu":
            await self._restart_on_cpu(allocation)

    async def _restart_on_cpu(self, allocation: Allocation) -> None:
        """Start the stopped server again on the ``cpu`` offer; whether it is starting is read
        back from the hub, not from how fast it answered."""
        user, _, server = allocation.ref.partition("/")
        body = {"offer": "cpu", "team": allocation.team}
        try:
            answered = await self.hub.start_server(user, server, body)
            if not answered and not await self.hub.has_server(user, server):
                raise TimeoutError(f"no server after {self.request_timeout:.0f} s")
        except (HTTPClientError, OSError, TimeoutError) as e:
            self.log.error(
                "gpupool: reclaimed %s but could not restart it on cpu: %s", allocation.ref, e
            )
            return
        self.log.info(
            "gpupool: restart of %s on cpu %s",
            allocation.ref,
            "accepted" if answered else "still starting (JupyterHub carries on with it)",
        )


def warning_message(
    allocation: Allocation, policy: IdlePolicy, watch: Watch, reclaim_at: float
) -> str:
    minutes = int((reclaim_at - (watch.idle_since or reclaim_at)) // 60)
    when = datetime.fromtimestamp(reclaim_at, UTC).strftime("%H:%M UTC")
    what = "restarted without a GPU (CPU only)" if policy.action == "cpu" else "stopped"
    return (
        f"This server's GPU ({allocation.offer}) has been idle (below {policy.threshold}% use, "
        f"no busy kernel); after {minutes} min idle, at {when}, the server will be {what} so "
        "others can use the GPU. Use the GPU to keep it. Save your work now: unsaved changes "
        "and kernel state are lost when the server stops."
    )


def hub_urls(c: Any) -> tuple[str, str]:
    """The hub's REST API URL and the proxy's public URL (scheme, host and port: servers' URL
    paths carry the base URL), as the hub's own process reaches them, from the hub's config
    ``c`` as JupyterHub reads it: ``hub_bind_url`` (else ``hub_ip`` and ``hub_port``),
    ``bind_url`` (or the deprecated ``ip`` and ``port``), ``base_url``, ``ssl_cert`` and
    ``internal_ssl``, with "all interfaces" read as the loopback. The public URL is ``""`` for a
    proxy on a unix socket. Where the proxy is not on the hub's machine (Kubernetes), pass its
    service's URL instead (e.g. ``http://proxy-public``)."""
    hub = c.JupyterHub
    bind = urlparse(str(hub.get("bind_url", "http://:8000")))
    base = str(hub.get("base_url", "") or bind.path or "/").strip("/")
    base = f"/{base}/" if base else "/"
    scheme = "https" if hub.get("ssl_cert") else "http"
    host = hub.get("ip", bind.hostname)
    port = hub.get("port", bind.port) or (443 if scheme == "https" else 80)
    public = "" if bind.scheme.endswith("+unix") else f"{scheme}://{_here(host)}:{port}"
    if hub.get("hub_bind_url"):
        hub_bind = urlparse(str(hub.hub_bind_url))
        hub_host, hub_port = hub_bind.hostname, hub_bind.port
    else:
        hub_host, hub_port = hub.get("hub_ip", ""), hub.get("hub_port")
    hub_scheme = "https" if hub.get("internal_ssl") else "http"
    api = f"{hub_scheme}://{_here(hub_host)}:{hub_port or 8081}{base}hub/api"
    return api, public


def _here(host: str | None) -> str:
    """``host`` to connect to from this machine ("all interfaces": the loopback)."""
    if not host or host in ("0.0.0.0", "*"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _parse_time(text: Any) -> float | None:
    if not isinstance(text, str):
        return None
    with contextlib.suppress(ValueError):
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    return None
