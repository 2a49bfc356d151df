"""The pool: the one allocator for notebooks and jobs, in the hub process.

Vocabulary
- *pool*: the ledger (pure decisions) plus the store (persistence) behind one lock. Callers pass
  a user, their JupyterHub groups and an offer; the pool picks the team, checks quota and offer,
  places, persists, and only then answers.
- *restore*: at start, the persisted allocations are re-applied to the inventory found now;
  those that can no longer exist are *lost*, removed from the store and logged.

Contract: ``allocate`` (and ``adopt``) write before they answer: when the database cannot record
the grant, the ledger is rolled back and :class:`~gpupool.store.outbox.StoreUnavailable` (HTTP
503) says so. ``release`` never fails for the database: the devices are free in the ledger at
once, and a delete the database refuses is owed (:class:`~gpupool.store.outbox.Outbox`, ``writes``)
and retried until it is written. Seams: ``clock`` (defaults to :func:`gpupool.clock.utcnow`)
and ``new_id``. On managed MIG GPUs (``GPUPool.managed_mig``) the pool's
:class:`~gpupool.mig.manager.MigManager` creates an allocation's instances inside
``allocate`` (under the lock, recorded before the allocation is persisted and handed out) and
destroys them inside ``release``; a creation NVML refuses releases the allocation again and
raises :class:`~gpupool.mig.manager.DeviceUnavailable` (HTTP 503) naming what is free.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from gpupool import metrics
from gpupool.clock import utcnow
from gpupool.config import GPUPool
from gpupool.core.errors import PoolError
from gpupool.core.inventory import Inventory
from gpupool.core.ledger import Allocation, Ledger
from gpupool.core.offers import Request, RequestKind
from gpupool.core.quota import resolve_team
from gpupool.declarations import ConfigError, config_warnings
from gpupool.mig.manager import (
    DeviceUnavailable,
    MigCreateFailed,
    MigManager,
    parse_managed,
)
from gpupool.monitors.activity import DeviceMonitor
from gpupool.store import Store, StoreError
from gpupool.store.outbox import Outbox

log = logging.getLogger("gpupool")


def load_inventory(
    source: str,
    fallback: str = "",
    logger: logging.Logger = log,
    activity_file: str = "",
    dra: bool = False,
    slurm: Any = None,
) -> tuple[Inventory, DeviceMonitor]:
    """The inventory named by ``GPUPool.inventory`` (``nvml``, ``kubernetes[:<selector>]`` or
    ``simulated:<spec>``), and the monitor that reads its devices' activity through the same NVML
    (none for Kubernetes nodes: NVML is on the nodes). When NVML finds no GPU and a ``fallback``
    spec is set, that simulated inventory instead; a simulated NVML reads ``activity_file``, and
    keeps the MIG instances made on it beside that file (``<name>.mig-state.json``), so they
    outlive a hub restart as real ones do.
    Kubernetes nodes are read on a worker thread's own event loop (this may run inside the hub's
    loop); an unreachable cluster raises ``RuntimeError`` saying so. With ``dra`` (GPUs given
    through Dynamic Resource Allocation), the nodes' GPUs are their ResourceSlices' devices
    (:mod:`gpupool.kube.dra_inventory`). ``slurm`` reads Slurm's nodes (``sinfo``) through
    ``slurm``, the :class:`gpupool.slurm.settings.SlurmSettings` (partition, gres models)."""
    from gpupool.discovery import SimulatedNVML, discover, simulated_inventory

    if source == "slurm":
        from gpupool.slurm.inventory import load_slurm_inventory

        found = load_slurm_inventory(slurm)
        for note in found.notes:
            logger.warning("gpupool: %s", note)
        logger.info("gpupool: Slurm inventory: %s", found.label)
        return found, DeviceMonitor()

    if source == "kubernetes" or source.startswith("kubernetes:"):
        from gpupool.kube.api import load_kubernetes_inventory

        found = load_kubernetes_inventory(source.partition(":")[2].strip() or None, dra=dra)
        for note in found.notes:
            logger.warning("gpupool: %s", note)
        logger.info("gpupool: Kubernetes inventory: %s", found.label)
        return found, DeviceMonitor()
    spec = source.removeprefix("simulated:") if source.startswith("simulated:") else ""
    if not spec:
        found = discover(log=logger)
        if found.gpus or not fallback:
            import pynvml

            return found, DeviceMonitor({node.name: pynvml for node in found.nodes})
        logger.warning("gpupool: NVML found no GPU; using the simulated fallback %r", fallback)
        spec = fallback
    state = Path(activity_file).with_suffix(".mig-state.json") if activity_file else None
    sim = SimulatedNVML(spec, activity_file=activity_file or None, state_file=state)
    inventory = simulated_inventory(sim)
    logger.warning("gpupool: SIMULATED inventory, no real GPUs: %s", inventory.label)
    return inventory, DeviceMonitor({name: sim.for_node(name) for name in sim.node_names})


def with_node_pools(inventory: Inventory, declared: Any, source: str) -> Inventory:
    """``inventory`` with the declared autoscaled node pools (``GPUPool.node_pools``), which only
    a Kubernetes inventory can have (a ConfigError naming the key otherwise)."""
    from gpupool.discovery.node_pools import KEY, parse_node_pools

    if not source.startswith("kubernetes"):
        raise ConfigError(
            KEY, f"is for a Kubernetes inventory (autoscaled node pools); inventory is {source!r}"
        )
    return replace(inventory, node_pools=parse_node_pools(declared))


Decided = TypeVar("Decided")


class Pool:
    def __init__(
        self,
        ledger: Ledger,
        store: Store,
        *,
        logger: logging.Logger = log,
        clock: Callable[[], datetime] = utcnow,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
        monitor: DeviceMonitor | None = None,
        mig: MigManager | None = None,
        max_retry_s: float = 30.0,
    ) -> None:
        self.ledger = ledger
        self.mig = mig
        """Creates and destroys MIG instances on managed GPUs (``None``: none are managed)."""
        self.monitor = monitor or DeviceMonitor()
        """Reads device activity (utilisation, memory, processes) for metrics and reclaim."""
        self.store = store
        self.writes = Outbox(
            store.settle, store.write_check, store.where, logger, max_retry_s=max_retry_s
        )
        """Writes the database owes (releases, job states) and the store's health."""
        self.log = logger
        self.clock = clock
        self.new_id = new_id
        self.on_release: list[Callable[[Allocation], None]] = []
        """Called after every release (the job queue listens, to start what now fits)."""
        self.on_inventory: list[Callable[[], None]] = []
        """Called after the inventory changed (a Kubernetes node came, went or changed; the job
        queue listens: a queued job may fit a new node)."""
        self.on_devices: list[Callable[[Sequence[Allocation]], None]] = []
        """Called with allocations whose devices were renamed in place (read back from the node,
        :mod:`gpupool.kube.readback`); the job manager listens: a job's devices are the ones its
        allocations hold."""
        self._lock = threading.Lock()

    @classmethod
    def from_config(
        cls, config: GPUPool, logger: logging.Logger = log, cohort: str = "", dra: bool = False
    ) -> Pool:
        """Validate the config, open (and check) the store, discover the inventory, warn about
        settings that are odd for it (one line each), and restore the ledger (whose grants
        follow Kueue's ``cohort`` rule too when Kueue admits GPU pods; see
        :mod:`gpupool.core.cohort`).

        A database that cannot be the pool's store (see :mod:`gpupool.store`) raises
        :class:`ConfigError` naming ``GPUPool.db_url``: the hub stops at start with that line.
        """
        settings = config.settings()
        try:
            store = Store(config.db_url)
        except StoreError as e:
            raise ConfigError("GPUPool.db_url", str(e)) from None
        slurm = None
        if config.inventory == "slurm":
            from gpupool.slurm.settings import SlurmSettings

            slurm = SlurmSettings(config=config.config)
        inventory, monitor = load_inventory(
            config.inventory,
            config.simulated_fallback,
            logger,
            config.simulated_activity_file,
            dra,
            slurm,
        )
        if config.node_pools:
            inventory = with_node_pools(inventory, config.node_pools, config.inventory)
        mig = None
        managed = parse_managed(config.managed_mig)
        if managed.anything and not inventory.source.startswith(("kubernetes", "slurm")):
            mig = MigManager(managed, monitor.nvml_by_node, store, logger)
            inventory = mig.prepare(inventory)
        elif managed.anything:
            logger.warning("gpupool: GPUPool.managed_mig is for local (NVML) inventories; ignored")
        for warning in config_warnings(settings, inventory):
            logger.warning("gpupool: %s", warning)
        ledger = Ledger(
            inventory, settings.offers, settings.teams, settings.everyone, config.policy, cohort
        )
        if mig is not None:
            mig.attach(ledger)
        pool = cls(
            ledger,
            store,
            logger=logger,
            monitor=monitor,
            mig=mig,
            max_retry_s=config.store_retry_max_s,
        )
        pool.restore()
        return pool

    @property
    def inventory(self) -> Inventory:
        return self.ledger.inventory

    def allocate(
        self,
        user: str,
        groups: Iterable[str],
        offer: str,
        count: int = 1,
        *,
        team: str | None = None,
        kind: RequestKind = "notebook",
        ref: str = "",
        avoid_nodes: Iterable[str] = (),
    ) -> Allocation:
        """Grant ``count`` of ``offer`` to ``user``, charged to ``team`` (or their only team),
        on none of ``avoid_nodes``."""
        began = time.perf_counter()
        with self._lock:
            ledger = self.ledger
            if self.mig is not None and self.mig.draining:
                self.mig.retry_draining(ledger)
            try:
                chosen = resolve_team(ledger.teams, ledger.everyone, groups, team)
                request = Request(
                    user, chosen.name, offer, count, kind, ref, frozenset(avoid_nodes)
                )
                allocation = ledger.allocate(request, self.new_id(), self.clock().timestamp())
                allocation = self._carve(allocation)
            except PoolError as e:
                metrics.refusal(kind, e.code)
                raise
            try:
                self.writes.grant(lambda: self.store.insert(allocation))
            except Exception as e:
                if self.mig is not None:
                    self.mig.undo(allocation)
                ledger.release(allocation.id)
                if isinstance(e, PoolError):
                    metrics.refusal(kind, e.code)
                raise
            metrics.ALLOCATION_SECONDS.labels(kind=kind).observe(time.perf_counter() - began)
            self.log.info(
                "gpupool: allocated %s to %s (team %s, %s %s): %s",
                allocation.id,
                user,
                chosen.name,
                kind,
                ref or "-",
                allocation.visible_devices or "cpu",
            )
            return allocation

    def _carve(self, allocation: Allocation) -> Allocation:
        """The allocation with the MIG instances of its managed placements created (under the
        lock); when NVML refuses, released again and :class:`DeviceUnavailable` raised."""
        if self.mig is None or not self.mig.manages(allocation):
            return allocation
        try:
            return self.mig.carve(allocation, self.ledger)
        except MigCreateFailed as failed:
            self.ledger.release(allocation.id)
            self.mig.after_failure(failed, self.ledger)
            team = self.ledger.team(allocation.team)
            free = self.ledger.free_now(team, allocation.user)
            raise DeviceUnavailable(f"{failed.reason} Free now: {free}.") from None
        except Exception:
            self.ledger.release(allocation.id)
            raise

    def set_outside_use(self, reasons: dict[str, str]) -> tuple[set[str], set[str]]:
        """The devices in use by processes that do not hold them (device -> why), from the
        device watch (:mod:`gpupool.hub.device_watch`): nothing is handed out on them until
        they are free again (:meth:`Ledger.set_outside_use`). Each change is logged; when a
        device is free again the ``on_inventory`` listeners hear it (a queued job may fit)."""
        with self._lock:
            closed, reopened = self.ledger.set_outside_use(reasons)
        for device in sorted(closed):
            self.log.warning("gpupool: not handed out: %s", reasons[device])
        for device in sorted(reopened):
            self.log.info("gpupool: %s is handed out again: nothing else uses it now", device)
        if reopened:
            for listener in self.on_inventory:
                listener()
        return closed, reopened

    def retry_draining(self) -> int:
        """Try again to destroy MIG instances left draining (processes ran on them at release);
        returns how many were destroyed. The hub calls this periodically."""
        if self.mig is None or not self.mig.draining:
            return 0
        with self._lock:
            return self.mig.retry_draining(self.ledger)

    def release(self, alloc_id: str) -> Allocation:
        """Give an allocation's devices back: the ledger at once (and a managed MIG instance is
        destroyed, or left draining while processes still run on it), the database now or, when
        it refuses, owed (:attr:`writes`)."""
        with self._lock:
            released = self.ledger.release(alloc_id)
            self.writes.release([alloc_id])
            if self.mig is not None and self.mig.manages(released):
                self.mig.released(released, self.ledger)
            self.log.info("gpupool: released %s (%s)", alloc_id, released.user)
        for listener in self.on_release:
            listener(released)
        return released

    def restore(self) -> list[Allocation]:
        """Rebuild the ledger from the store; returns (and forgets) the lost allocations."""
        with self._lock:
            persisted = self.store.load()
            gone: list[Allocation] = []
            if self.mig is not None:
                persisted, gone = self.mig.check_persisted(persisted)
            restored, lost = self.ledger.restore(persisted)
            lost += gone
            before = {a.id: a for a in persisted}
            changed = [a for a in restored if a != before[a.id]]
            if changed:
                self.store.replace(changed)
            if lost:
                self.store.delete(a.id for a in lost)
            if self.mig is not None:
                self.mig.after_restore(self.ledger)
            for a in lost:
                self.log.warning(
                    "gpupool: allocation %s of %s (%s %s) is lost: its devices %s are gone or "
                    "changed since the last start; released",
                    a.id,
                    a.user,
                    a.kind,
                    a.ref or "-",
                    a.visible_devices,
                )
            self.log.info(
                "gpupool: restored %d allocation(s), %d lost, on %s",
                len(restored),
                len(lost),
                self.inventory.label,
            )
            return lost

    # -- reconciliation (:mod:`gpupool.hub.reconcile`) ----------------------------------------
    @staticmethod
    def marker_of(db_url: str) -> str:
        """The ``GPUPOOL_HUB`` marker of a hub whose pool database is ``db_url``: one hash of
        where the database is (its real path for SQLite, the URL without password otherwise),
        so it is stable across restarts and differs between hubs on one machine."""
        import hashlib
        import os

        from sqlalchemy.engine import make_url

        url = make_url(db_url)
        if url.get_backend_name() == "sqlite" and url.database:
            key = f"sqlite:{os.path.realpath(url.database)}"
        else:
            key = url.render_as_string(hide_password=True)
        return hashlib.sha256(key.encode()).hexdigest()[:24]

    @property
    def hub_marker(self) -> str:
        """What every process this hub starts for users carries as ``GPUPOOL_HUB``; only
        processes with it are ever reconciled (stopped or re-adopted). A database that lives
        only in this process (in-memory SQLite) gives a marker of this process and pool."""
        import os

        url = self.store.engine.url
        if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
            return self.marker_of(f"sqlite:///:memory:{os.getpid()}:{id(self)}")
        return self.marker_of(url.render_as_string(hide_password=False))

    def deciding(self, decide: Callable[[Ledger], Decided]) -> Decided:
        """``decide(ledger)`` with no allocate, release or adopt in between: reconciliation
        reads the ledger under the pool's lock, so what it finds unknown stays unknown."""
        with self._lock:
            return decide(self.ledger)

    def adopt(self, allocations: Iterable[Allocation]) -> list[Allocation]:
        """Take allocations found held by live servers back into the ledger (reconciliation:
        the database had lost them), each as a restore does (devices checked, quotas not) and
        persisted; returns those adopted. One whose devices are not free is left out."""
        adopted = []
        with self._lock:
            for allocation in allocations:
                restored, _lost = self.ledger.restore([allocation])
                if not restored:
                    continue
                try:
                    self.writes.grant(partial(self.store.insert, restored[0]))
                except Exception:
                    self.ledger.release(allocation.id)
                    raise
                adopted.append(restored[0])
        return adopted
