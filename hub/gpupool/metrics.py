"""gpupool's Prometheus metrics, served by JupyterHub's own ``/hub/metrics`` (the default
``prometheus_client`` registry, which JupyterHub's metrics handler writes out).

Vocabulary
- *event metrics*: counters and histograms updated where things happen: allocation latency and
  refusals (in :class:`gpupool.pool.Pool`), queue wait (in the job manager), idle warnings and
  reclaims (in the reclaimer), reconciliation's actions and passes (in
  :mod:`gpupool.hub.reconcile`).
- *state metrics*: gauges computed at scrape time by :class:`PoolCollector` from the ledger, the
  job manager, the reclaimer and the device monitor, so they always equal what the pool holds.

Contract: names carry the ``gpupool_`` prefix and their unit (``_gpu_equivalents``,
``_seconds``, ``_bytes``, ``_ratio``); counters end in ``_total``. Labels are bounded: team,
offer, kind, state, reason, action, and for devices node, device UUID, model and MIG profile (as
many as the hardware has). Never a user name or job id.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .core.units import GPU_MILLI

if TYPE_CHECKING:
    from .pool import Pool

GPU_EQ = "gpu_equivalents"

ALLOCATION_SECONDS = Histogram(
    "gpupool_allocation_duration_seconds",
    "Time the pool took to decide and persist one allocation, by kind (notebook or job).",
    ["kind"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
REFUSALS = PromCounter(
    "gpupool_refusals",
    "Requests the pool refused, by kind (notebook: a spawn; job: a job start) and reason "
    "(quota_exceeded, no_capacity, offer_not_allowed, not_a_team_member, invalid_request).",
    ["kind", "reason"],
)
QUEUE_WAIT_SECONDS = Histogram(
    "gpupool_queue_wait_seconds",
    "Time jobs waited in the queue before their GPUs were granted, by team.",
    ["team"],
    buckets=(1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400),
)
IDLE_WARNINGS = PromCounter(
    "gpupool_idle_warnings",
    "Notebooks warned that their idle GPUs will be reclaimed, by team.",
    ["team"],
)
RECLAIMS = PromCounter(
    "gpupool_reclaims",
    "Idle notebook GPUs taken back, by team, action (stop or cpu: restarted CPU-only) and reason "
    "(idle: below the utilisation threshold and no busy kernel for the configured time).",
    ["team", "action", "reason"],
)
RECONCILE_ACTIONS = PromCounter(
    "gpupool_reconcile_actions",
    "What reconciliation did (at hub start and periodically), by action: released (an "
    "allocation without a live holder), stopped (processes holding devices without an "
    "allocation), adopted (a live server's allocation the pool database had lost, taken back), "
    "reported (what it leaves alone: logged once).",
    ["action"],
)
RECONCILE_SECONDS = Histogram(
    "gpupool_reconcile_duration_seconds",
    "Time one reconciliation pass took (reading JupyterHub's database, this hub's processes and "
    "NVML, deciding, and stopping what it stops).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RECONCILE_FAILURES = PromCounter(
    "gpupool_reconcile_failures",
    "Reconciliation passes that failed (logged; the next pass tries again).",
)


class PoolCollector(Collector):
    """State metrics at scrape time (see the module docstring). ``jobs`` and ``idle`` are
    callables so that the collector is registered once, whatever is built later."""

    def __init__(
        self,
        pool: Pool,
        jobs: Callable[[], Any] = lambda: None,
        idle: Callable[[], dict[str, str]] = dict,
    ) -> None:
        self.pool = pool
        self.jobs = jobs
        self.idle = idle

    def collect(self) -> Iterator[Metric]:
        yield from self._pool()
        yield from self._jobs()
        yield from self._devices()

    def _pool(self) -> Iterator[Metric]:
        ledger = self.pool.ledger
        inventory = ledger.inventory
        info = GaugeMetricFamily(
            "gpupool_inventory_info",
            'Where the pool\'s GPUs come from; simulated="true" for a simulated pool.',
            labels=["source", "simulated"],
        )
        info.add_metric([inventory.source, str(inventory.simulated).lower()], 1)
        yield info
        capacity = GaugeMetricFamily(
            f"gpupool_capacity_{GPU_EQ}", "GPUs in the pool (a GPU is 1, whatever its MIG layout)."
        )
        capacity.add_metric([], len(inventory.gpus))
        yield capacity

        held = GaugeMetricFamily(
            f"gpupool_allocated_{GPU_EQ}",
            "GPU-equivalents held, by team, offer and kind (notebook or job).",
            labels=["team", "offer", "kind"],
        )
        count = GaugeMetricFamily(
            "gpupool_allocations",
            "Allocations held, by team, offer and kind (notebook or job).",
            labels=["team", "offer", "kind"],
        )
        milli: Counter[tuple[str, str, str]] = Counter()
        number: Counter[tuple[str, str, str]] = Counter()
        for a in list(ledger.allocations.values()):
            milli[(a.team, a.offer, a.kind)] += a.cost_milli
            number[(a.team, a.offer, a.kind)] += 1
        for key in sorted(number):
            held.add_metric(list(key), milli[key] / GPU_MILLI)
            count.add_metric(list(key), number[key])
        yield held
        yield count

        families = {
            name: GaugeMetricFamily(f"gpupool_team_{name}_{GPU_EQ}", text, labels=["team"])
            for name, text in (
                ("guarantee", "The team's guaranteed quota."),
                ("borrow_limit", "How much more than its guarantee the team may borrow."),
                ("used", "What the team holds now (notebooks and jobs)."),
                ("borrowed", "What the team holds beyond its guarantee."),
            )
        }
        idle_by_team: Counter[str] = Counter(self.idle().values())
        idle = GaugeMetricFamily(
            "gpupool_idle_notebooks",
            "GPU notebooks idle past their team's threshold now (warned or about to be).",
            labels=["team"],
        )
        for team in [*ledger.teams.values(), ledger.everyone]:
            used = ledger.team_used[team.name]
            for name, value in (
                ("guarantee", team.guarantee_milli),
                ("borrow_limit", team.borrow_limit_milli),
                ("used", used),
                ("borrowed", team.borrowed_milli(used)),
            ):
                families[name].add_metric([team.name], value / GPU_MILLI)
            idle.add_metric([team.name], idle_by_team[team.name])
        yield from families.values()
        yield idle

    def _jobs(self) -> Iterator[Metric]:
        manager = self.jobs()
        if manager is None:
            return
        states = GaugeMetricFamily(
            "gpupool_jobs", "Jobs the hub knows, by state.", labels=["state"]
        )
        queued = GaugeMetricFamily(
            "gpupool_queued_jobs", "Jobs waiting for GPUs, by team.", labels=["team"]
        )
        by_state: Counter[str] = Counter()
        by_team: Counter[str] = Counter()
        for job in list(manager.jobs.values()):
            by_state[job.state] += 1
            if job.state == "queued":
                by_team[job.team] += 1
        for state in ("queued", "starting", "running", "succeeded", "failed", "cancelled", "lost"):
            states.add_metric([state], by_state[state])
        for team in sorted(by_team):
            queued.add_metric([team], by_team[team])
        yield states
        yield queued

    def _devices(self) -> Iterator[Metric]:
        """Per GPU and MIG instance, where NVML can read them (not on Kubernetes nodes)."""
        labels = ["node", "device", "model", "profile"]
        utilisation = GaugeMetricFamily(
            "gpupool_device_utilization_ratio",
            "GPU utilisation (0 to 1) as NVML reports it; absent for MIG instances, where NVML "
            "measures none.",
            labels=labels,
        )
        used = GaugeMetricFamily(
            "gpupool_device_memory_used_bytes", "Device memory in use.", labels=labels
        )
        total = GaugeMetricFamily(
            "gpupool_device_memory_total_bytes", "Device memory.", labels=labels
        )
        monitor = self.pool.monitor
        for node in self.pool.inventory.nodes:
            if not monitor.can_read(node.name):
                continue
            devices: dict[str, tuple[str, str]] = {}
            for gpu in node.gpus:
                if not gpu.instances:
                    devices[gpu.uuid] = (gpu.model, "")
                for inst in gpu.instances:
                    if inst.uuid:
                        devices[inst.uuid] = (gpu.model, inst.profile)
            for uuid, sample in monitor.sample(node.name, devices).items():
                key = [node.name, uuid, *devices[uuid]]
                if sample.utilisation is not None:
                    utilisation.add_metric(key, sample.utilisation / 100)
                used.add_metric(key, sample.memory_used)
                total.add_metric(key, sample.memory_total)
        yield utilisation
        yield used
        yield total


_registered: list[PoolCollector] = []


def register(collector: PoolCollector) -> PoolCollector:
    """Register the hub's collector once (a second call replaces the first: tests, reloads)."""
    for old in _registered:
        REGISTRY.unregister(old)
    _registered[:] = [collector]
    REGISTRY.register(collector)
    return collector


def refusal(kind: str, code: str) -> None:
    REFUSALS.labels(kind=kind, reason=code).inc()
