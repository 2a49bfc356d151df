"""The pool's state as Prometheus gauges, computed at scrape time (JupyterHub's ``/hub/metrics``).

Vocabulary: see :mod:`gpupool.metrics` (names, units, bounded labels). The *collector* reads the
ledger, the job manager, the reclaimer's idle notebooks and the device monitor each time it is
scraped, so its gauges always equal what the pool holds.

Contract: one collector per hub in the default registry (:func:`register` replaces an earlier
one: tests, reloads); reads only, under no lock (a scrape sees a snapshot of plain dicts).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gpupool.core.units import GPU_MILLI
from gpupool.jobs.manager import JobManager
from gpupool.metrics import GPU_EQ
from gpupool.pool import Pool


class PoolCollector(Collector):
    """State metrics at scrape time (see the module docstring); ``idle`` says which notebook
    allocations are idle now (allocation id → team)."""

    def __init__(
        self,
        pool: Pool,
        jobs: JobManager | None = None,
        idle: Callable[[], dict[str, str]] = dict,
    ) -> None:
        self.pool = pool
        self.jobs = jobs
        self.idle = idle

    def collect(self) -> Iterator[Metric]:
        yield from self._store()
        yield from self._pool()
        yield from self._jobs()
        yield from self._devices()

    def _store(self) -> Iterator[Metric]:
        health = self.pool.writes.health()
        healthy = GaugeMetricFamily(
            "gpupool_store_healthy",
            "1 while the pool's database takes writes; 0 while it owes some (new allocations "
            "and jobs are refused meanwhile).",
        )
        healthy.add_metric([], 1 if health["healthy"] else 0)
        yield healthy
        owed = GaugeMetricFamily(
            "gpupool_store_pending_writes",
            "Releases and job states the database refused, kept and retried until written.",
        )
        owed.add_metric([], health["pending_writes"])
        yield owed

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
        manager = self.jobs
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
