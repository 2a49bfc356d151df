"""MIG instances on demand: the pool creates them where the policy places them, through NVML.

Vocabulary
- *managed GPU*: a MIG-capable GPU the admin hands to the pool (``c.GPUPool.managed_mig``, by GPU
  UUID or model key). In MIG mode it is ``dynamic`` in the inventory: the policy picks a start
  slot, and this manager creates the GPU instance there
  (``nvmlDeviceCreateGpuInstanceWithPlacement``) and its full-size compute instance
  (``nvmlGpuInstanceCreateComputeInstance``), and destroys both on release.
- *record*: a row of ``gpupool_mig_instances`` (:class:`gpupool.store.MigRecord`): an instance
  the pool created. Only recorded instances are ever destroyed.
- *admin instance*: an instance on a managed GPU that is not recorded (an admin made it, by hand
  or while the hub was down). It is never touched (never destroyed, never re-made) and is handed
  out as it is, as a *fixed instance* of the ``dynamic`` GPU (the inventory keeps it in the GPU's
  ``instances``; :mod:`gpupool.core.occupancy` reserves its slots): allocating it creates
  nothing, releasing it destroys nothing, and the pool's own instances go on the free slots
  around it, never over it. Placement prefers it to creating an instance (nothing to create, and
  it costs no free slot). Admin instances are read at start: an allocation that holds one across a
  restart keeps it if NVML still shows it (else the allocation is lost). One that appears while
  the hub runs is only learnt when a creation fails over it (:meth:`MigManager.after_failure`):
  its slots are then *blocked* (:meth:`gpupool.core.ledger.Ledger.block`, reason ``admin``) and
  it is handed out from the next start on. Before one is handed out, NVML is asked whether it
  is still there (one look-up, nothing created): one an admin destroyed while the hub runs fails
  that allocation (503, released, what is free named) and its slots are blocked (reason
  ``gone``) until the next start, which reads the GPU afresh. (A holder at that moment keeps its
  allocation until its server or job ends; on unmanaged, ``fixed`` GPUs nothing is checked.)
- *draining*: a released instance NVML refused to destroy because processes still run on it
  (``NVML_ERROR_IN_USE``); its slots stay blocked (reason ``draining``) and the destroy is
  retried (:meth:`MigManager.retry_draining`) until the processes are gone.
- *off*: the hub may not create MIG instances (NVML answers ``NVML_ERROR_NO_PERMISSION``: not
  root, or no MIG capability). Found by a probe at start; managed GPUs are then ``fixed`` (their
  existing instances handed out as they are) and :attr:`MigManager.off` says why.

Contract: every NVML call for instances goes through
:class:`gpupool.mig.nvml.MigDriver` (the ``nvml`` of the GPU's node: ``pynvml`` or the
simulated NVML, each use inside the node's NVML session); this module keeps the
records, the ledger's view and the policy. An instance is recorded (``creating``) before NVML
is asked and marked ``live`` with its ``MIG-…`` UUID before the allocation that holds it is
handed out; a failed creation leaves no instance and no record.
gpupool never switches MIG mode. The manager is called by :class:`gpupool.pool.Pool` under its
lock; it never raises out of a release.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pynvml

from gpupool.core.errors import NoCapacity
from gpupool.core.inventory import GPU, Inventory, MigInstance
from gpupool.core.ledger import Allocation, Blocked, Ledger
from gpupool.core.mig import GEOMETRIES
from gpupool.declarations import ConfigError
from gpupool.mig.nvml import ManagedGpu, MigDriver, nvml_error

KEY = "GPUPool.managed_mig"
EXAMPLE = (
    'e.g. c.GPUPool.managed_mig = ["H100-80GB"] or '
    '{"GPU-5a1f…": True, "A100-80GB": True, "GPU-0c2e…": False}'
)
_UUID = re.compile(r"^GPU-[0-9A-Fa-f-]{8,}$")

log = logging.getLogger("gpupool")


class DeviceUnavailable(NoCapacity):
    """A placement the ledger made could not be created on the GPU (NVML refused); the
    allocation was released. HTTP 503: the pool itself is fine, the device was not."""

    code = "device_unavailable"


class MigCreateFailed(Exception):
    """NVML refused to create an instance; ``reason`` is the sentence, ``code`` NVML's error."""

    def __init__(
        self, reason: str, code: int | None = None, gpu: str = "", instance: str | None = None
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.gpu = gpu
        self.instance = instance
        """The admin instance that was to be handed out, when it is the one NVML lacks."""


# -- the setting -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ManagedMig:
    """Which GPUs the pool manages MIG instances on: by UUID first, then by model, else ``all``."""

    uuids: Mapping[str, bool] = field(default_factory=dict)
    models: Mapping[str, bool] = field(default_factory=dict)
    all: bool = False

    def covers(self, gpu: GPU) -> bool:
        if gpu.uuid in self.uuids:
            return self.uuids[gpu.uuid]
        if gpu.model in self.models:
            return self.models[gpu.model]
        return self.all

    @property
    def anything(self) -> bool:
        return self.all or any(self.uuids.values()) or any(self.models.values())


def parse_managed(value: Any) -> ManagedMig:
    """``c.GPUPool.managed_mig``: ``True``/``False`` (every MIG GPU, or none), a list of GPU
    UUIDs and model keys, or a dict of them to booleans (a UUID's entry wins over its model's).
    Raises :class:`ConfigError` naming the key and the bad entry."""
    if isinstance(value, bool):
        return ManagedMig(all=value)
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list | tuple | set | frozenset):
        items = [(k, True) for k in value]
    else:
        raise ConfigError(KEY, f"must be a list, a dict or True/False, got {value!r}; {EXAMPLE}")
    uuids: dict[str, bool] = {}
    models: dict[str, bool] = {}
    for key, on in items:
        if not isinstance(key, str) or not isinstance(on, bool):
            raise ConfigError(
                KEY, f"entries are GPU UUIDs or model keys (to True/False), got {key!r}; {EXAMPLE}"
            )
        name = key.strip()
        if _UUID.match(name):
            uuids[name] = on
        elif name.upper() in GEOMETRIES:
            models[name.upper()] = on
        else:
            known = ", ".join(GEOMETRIES)
            raise ConfigError(
                KEY,
                f"{key!r} is neither a GPU UUID (GPU-…, see nvidia-smi -L) nor a MIG-capable "
                f"model key ({known}); {EXAMPLE}",
            )
    return ManagedMig(uuids, models)


# -- the manager -------------------------------------------------------------------------------


class MigManager:
    """Creates and destroys the MIG instances of managed GPUs (see the module docstring)."""

    def __init__(
        self,
        managed: ManagedMig,
        nvml_by_node: Mapping[str, Any],
        store: Any,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.managed = managed
        self.driver = MigDriver(nvml_by_node)
        self.nvml_by_node = self.driver.nvml_by_node
        self.store = store
        self.log = logger
        self.clock = clock
        self.off = ""
        """Why MIG on demand is off ("": it is on, or no GPU is managed)."""
        self.gpus: dict[str, ManagedGpu] = {}
        """The managed GPUs the pool creates instances on, by UUID."""
        self.records: dict[tuple[str, str, int], Any] = {}
        self.admin: dict[str, tuple[str, MigInstance]] = {}
        """The admin instances of managed GPUs NVML showed at start: MIG UUID to (GPU, instance)."""
        self._appeared: list[Blocked] = []  # admin instances learnt while running: blocked
        self._live: set[str] = set()  # MIG UUIDs of recorded instances NVML showed at start

    # -- start: which GPUs, may we, and what is there already ----------------------------
    def prepare(self, inventory: Inventory) -> Inventory:
        """The inventory as the pool should see it: managed MIG GPUs ``dynamic`` without the
        instances the pool made (re-adopted through restored allocations), their admin
        instances kept as fixed instances. Without permission they are ``fixed``."""
        self.records = {(r.node, r.gpu, r.start): r for r in self.store.mig_records()}
        candidates = [
            (node.name, gpu)
            for node in inventory.nodes
            for gpu in node.gpus
            if gpu.mig_capable
            and gpu.mig_mode in ("dynamic", "fixed")
            and gpu.geometry is not None
            and self.managed.covers(gpu)
            and node.name in self.nvml_by_node
        ]
        if not candidates:
            if self.managed.anything:
                self.log.warning(
                    "gpupool: %s: no managed GPU in MIG mode found (gpupool never switches MIG "
                    "mode: an admin does, with nvidia-smi -i <GPU> -mig 1)",
                    KEY,
                )
            return inventory
        self.off = self.driver.probe(candidates)
        if self.off:
            self.log.warning(
                "gpupool: MIG on demand is off: %s; managed GPUs hand out only the instances "
                "they have",
                self.off,
            )
        changed: dict[str, GPU] = {}
        for node, gpu in candidates:
            assert gpu.geometry is not None
            if self.off:
                changed[gpu.uuid] = replace(gpu, mig_mode="fixed")
                continue
            ours = {r.uuid for r in self.records.values() if r.gpu == gpu.uuid and r.uuid}
            crashed = {  # recorded as being created when the hub stopped: the pool's too
                (r.start, r.profile): r
                for r in self.records.values()
                if r.gpu == gpu.uuid and r.state == "creating" and not r.uuid
            }
            kept: list[MigInstance] = []
            for inst in gpu.instances:
                half = crashed.get((inst.start, inst.profile))
                if half is not None and inst.uuid:
                    self.records[node, gpu.uuid, inst.start] = replace(half, uuid=inst.uuid)
                    ours.add(inst.uuid)
                if inst.uuid in ours:
                    self._live.add(inst.uuid or "")
                    continue
                kept.append(inst)
                if inst.uuid:
                    self.admin[inst.uuid] = (gpu.uuid, inst)
            self.gpus[gpu.uuid] = ManagedGpu(node, gpu.uuid, gpu.index, gpu.model, gpu.geometry)
            changed[gpu.uuid] = replace(gpu, mig_mode="dynamic", instances=tuple(kept))
        nodes = tuple(
            replace(n, gpus=tuple(changed.get(g.uuid, g) for g in n.gpus)) for n in inventory.nodes
        )
        if self.gpus:
            self.log.info(
                "gpupool: MIG on demand on %d GPU(s); %d admin instance(s) handed out as they "
                "are, never destroyed",
                len(self.gpus),
                len(self.admin),
            )
        return replace(inventory, nodes=nodes)

    def attach(self, ledger: Ledger) -> None:
        """Block, in a new ledger (before its restore), the admin instances learnt while the
        hub ran (none at start: those known then are fixed instances of the inventory)."""
        for blocked in self._appeared:
            try:
                ledger.block(blocked)
            except ValueError as e:
                self.log.warning("gpupool: admin MIG instance %s not modelled: %s", blocked, e)

    def check_persisted(
        self, persisted: list[Allocation]
    ) -> tuple[list[Allocation], list[Allocation]]:
        """Split persisted allocations into those to restore and those whose managed instance
        is gone (``lost``): a managed device must name a recorded instance NVML still shows,
        or an admin instance of that GPU NVML still shows at the same place."""
        keep: list[Allocation] = []
        gone: list[Allocation] = []

        def there(d: Any) -> bool:
            if d.instance in self._live:
                return True
            gpu, inst = self.admin.get(d.instance or "", ("", None))
            return inst is not None and gpu == d.gpu and inst.start == d.start

        for a in persisted:
            ok = all(there(d) for d in a.devices if d.profile is not None and d.gpu in self.gpus)
            (keep if ok else gone).append(a)
        return keep, gone

    def after_restore(self, ledger: Ledger) -> None:
        """Re-adopt recorded instances held by restored allocations, destroy the orphans
        (held by none: a draining one if processes still run on it), forget records of
        instances NVML no longer shows. Records of GPUs not managed now are kept as they are."""
        held = {
            (a.node, d.gpu, d.start): (a.id, d.instance)
            for a in ledger.allocations.values()
            for d in a.devices
            if d.profile is not None and d.gpu in self.gpus
        }
        adopted = destroyed = draining = forgotten = 0
        for key, record in sorted(self.records.items(), key=lambda kv: kv[1].created):
            if record.gpu not in self.gpus:
                continue
            holder = held.get(key)
            if record.uuid in self._live and holder and holder[1] == record.uuid:
                if record.allocation_id != holder[0] or record.state != "live":
                    self._save(replace(record, allocation_id=holder[0], state="live"))
                adopted += 1
            elif record.uuid in self._live:
                self.log.warning(
                    "gpupool: MIG instance %s (%s at slot %d of %s) was made by the pool and is "
                    "held by nothing: destroying it",
                    record.uuid,
                    record.profile,
                    record.start,
                    record.gpu,
                )
                if self._release_record(record, ledger):
                    destroyed += 1
                else:
                    draining += 1
            else:
                self._forget_gone(record)
                forgotten += 1
        if self.records or adopted or destroyed or forgotten:
            self.log.info(
                "gpupool: MIG on demand at start: %d instance(s) re-adopted, %d orphan(s) "
                "destroyed, %d draining, %d record(s) of vanished instances dropped",
                adopted,
                destroyed,
                draining,
                forgotten,
            )

    def _forget_gone(self, record: Any) -> None:
        """A record whose MIG device NVML does not show: a crash between creating the GPU
        instance and its compute instance may have left the bare GPU instance, destroyed here
        (only if its ID, profile and start are the recorded ones)."""
        self.driver.destroy_bare(self.gpus[record.gpu], record)
        self._drop(record)

    # -- allocate and release -------------------------------------------------------------
    def manages(self, allocation: Allocation) -> bool:
        return any(d.profile is not None and d.gpu in self.gpus for d in allocation.devices)

    def carve(self, allocation: Allocation, ledger: Ledger) -> Allocation:
        """Create the instances of ``allocation``'s placements on managed GPUs, record them, and
        return (and put into the ledger) the allocation with their ``MIG-…`` UUIDs. On failure
        everything made here is destroyed again and :class:`MigCreateFailed` is raised (the
        caller releases the allocation)."""
        devices = list(allocation.devices)
        made: list[Any] = []
        for i, d in enumerate(devices):
            if d.profile is None or d.gpu not in self.gpus or d.start is None:
                continue
            gpu = self.gpus[d.gpu]
            if d.instance in self.admin:  # handed out as it is, if NVML still has it
                if self.driver.gone(gpu, d.instance or ""):
                    self._undo(made)
                    raise MigCreateFailed(
                        f"The MIG {d.profile} instance at slot {d.start} of GPU {gpu.index} "
                        "(an admin's) is gone: it was destroyed outside gpupool.",
                        pynvml.NVML_ERROR_NOT_FOUND,
                        d.gpu,
                        d.instance,
                    )
                continue
            if d.instance:
                continue
            if self.off:
                self._undo(made)
                raise MigCreateFailed(f"MIG on demand is off: {self.off}.", None, d.gpu)
            from gpupool.store import MigRecord

            record = MigRecord(
                gpu.node, d.gpu, d.start, d.profile, "creating", self.clock(),
                allocation_id=allocation.id,
            )  # fmt: skip
            try:
                self._save(record)
                gi_id, ci_id, uuid = self.driver.create(gpu, d.profile, d.start)
            except pynvml.NVMLError as e:
                self._drop(record)
                self._undo(made)
                raise self._create_failed(gpu, d.profile, d.start, e) from None
            except Exception:
                self._drop(record)
                self._undo(made)
                raise
            record = replace(
                record, state="live", gpu_instance_id=gi_id, compute_instance_id=ci_id, uuid=uuid
            )
            made.append(record)
            try:
                self._save(record)
            except Exception:
                self._undo(made)
                raise
            devices[i] = replace(d, instance=uuid)
            self.log.info(
                "gpupool: created MIG %s at slot %d of GPU %d (%s) for %s: %s",
                d.profile,
                d.start,
                gpu.index,
                gpu.uuid,
                allocation.id,
                uuid,
            )
        if not made:
            return allocation
        carved = replace(allocation, devices=tuple(devices))
        ledger.allocations[carved.id] = carved
        return carved

    def _create_failed(
        self, gpu: ManagedGpu, profile: str, start: int, e: Exception
    ) -> MigCreateFailed:
        code = nvml_error(e)
        where = f"MIG {profile} at slot {start} of GPU {gpu.index}"
        if code == pynvml.NVML_ERROR_NO_PERMISSION:
            self.off = (
                "NVML refused to create a MIG instance (no permission: the hub runs neither as "
                "root nor with the MIG config capability)"
            )
            self.log.warning("gpupool: MIG on demand is off: %s", self.off)
            return MigCreateFailed(f"Could not create {where}: {self.off}.", code, gpu.uuid)
        if code == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES:
            why = "its slots are taken (an instance made outside gpupool may be there)"
        else:
            why = f"NVML says: {e}"
        self.log.warning("gpupool: could not create %s (%s): %s", where, gpu.uuid, e)
        return MigCreateFailed(f"Could not create {where}: {why}.", code, gpu.uuid)

    def after_failure(self, failure: MigCreateFailed, ledger: Ledger) -> None:
        """After a failed creation (the allocation already released): learn what NVML now
        shows on that GPU, so the ledger does not place there again: unrecorded instances are
        blocked as an admin's (those known since the start stay fixed instances); with no
        permission, every managed GPU's free slots are (its admin instances stay allocatable)."""
        if failure.code == pynvml.NVML_ERROR_NO_PERMISSION or self.off:
            for uuid in self.gpus:
                self._block_rest(uuid, ledger)
            return
        gpu = self.gpus.get(failure.gpu)
        if gpu is None:
            return
        if failure.instance in self.admin:  # an admin destroyed it: not handed out again
            uuid, inst = self.admin.pop(failure.instance or "")
            with contextlib.suppress(ValueError):
                ledger.block(Blocked(uuid, inst.profile, inst.start, "gone", inst.uuid))
            self.log.warning(
                "gpupool: the admin's MIG instance %s (%s at slot %d of GPU %d) is gone; its "
                "slots are not used until the next start",
                inst.uuid,
                inst.profile,
                inst.start,
                gpu.index,
            )
        from gpupool.discovery.nvml import discover

        with contextlib.suppress(pynvml.NVMLError):
            found = discover(self.nvml_by_node[gpu.node], gpu.node, self.log)
            ours = {r.uuid for r in self.records.values() if r.uuid}
            for g in found.gpus:
                if g.uuid != gpu.uuid:
                    continue
                for inst in g.instances:
                    known = inst.uuid in ours or inst.uuid in self.admin
                    if known or (g.uuid, inst.start) in ledger.blocked:
                        continue
                    blocked = Blocked(g.uuid, inst.profile, inst.start, "admin", inst.uuid)
                    try:
                        ledger.block(blocked)
                    except ValueError:
                        continue
                    self._appeared.append(blocked)
                    self.log.warning(
                        "gpupool: an instance gpupool did not make appeared on GPU %d: %s %s at "
                        "slot %d; left as it is, not placed over",
                        gpu.index,
                        inst.uuid,
                        inst.profile,
                        inst.start,
                    )

    def _block_rest(self, uuid: str, ledger: Ledger) -> None:
        """Block every placement still free on a managed GPU (MIG on demand went off)."""
        g = ledger.occ.ordinal.get(uuid)
        geometry = self.gpus[uuid].geometry
        if g is None:
            return
        while True:
            free = [
                (p, s)
                for p in geometry.profiles
                for s in geometry.starts_free(ledger.occ.placement_mask(g), p)
            ]
            if not free:
                return
            p, s = max(free, key=lambda ps: (ps[0].memory_slots, -ps[1]))
            ledger.block(Blocked(uuid, p.name, s, "off"))

    def released(self, allocation: Allocation, ledger: Ledger) -> None:
        """Destroy the recorded instances of a released allocation; one with processes still
        on it is kept as *draining* (blocked) for :meth:`retry_draining`. Never raises."""
        for d in allocation.devices:
            if d.profile is None or d.gpu not in self.gpus or d.start is None:
                continue
            record = self.records.get((self.gpus[d.gpu].node, d.gpu, d.start))
            if record is None or record.uuid != d.instance:
                continue  # not made by the pool (or already gone): never touched
            try:
                self._release_record(record, ledger)
            except Exception:  # a database error: the record stays, the next start retries
                self.log.exception("gpupool: could not release MIG instance %s", record.uuid)

    def _release_record(self, record: Any, ledger: Ledger) -> bool:
        """Destroy a recorded instance held by nothing; ``False`` when it is now draining."""
        outcome = self.driver.destroy(self.gpus[record.gpu], record)
        if outcome in ("destroyed", "gone"):
            self._drop(record)
            if outcome == "destroyed":
                self.log.info(
                    "gpupool: destroyed MIG %s at slot %d of %s (%s)",
                    record.profile,
                    record.start,
                    record.gpu,
                    record.uuid,
                )
            return True
        self._save(replace(record, state="draining", allocation_id=None))
        if (record.gpu, record.start) not in ledger.blocked:
            try:
                ledger.block(
                    Blocked(record.gpu, record.profile, record.start, "draining", record.uuid)
                )
            except ValueError as e:  # a bug, never a user's error: say so, keep going
                self.log.error("gpupool: draining MIG instance %s not blocked: %s", record.uuid, e)
        self.log.warning(
            "gpupool: MIG instance %s (%s at slot %d of %s) is draining: %s; retried until it "
            "can be destroyed",
            record.uuid,
            record.profile,
            record.start,
            record.gpu,
            outcome,
        )
        return False

    def retry_draining(self, ledger: Ledger) -> int:
        """Try again to destroy draining instances; returns how many were destroyed."""
        done = 0
        for record in [r for r in self.records.values() if r.state == "draining"]:
            if record.gpu not in self.gpus:
                continue
            try:
                outcome = self.driver.destroy(self.gpus[record.gpu], record)
                if outcome not in ("destroyed", "gone"):
                    continue
                self._drop(record)
            except Exception:
                self.log.exception("gpupool: could not retry MIG instance %s", record.uuid)
                continue
            with contextlib.suppress(KeyError):
                ledger.unblock(record.gpu, record.start)
            self.log.info("gpupool: draining MIG instance %s destroyed", record.uuid)
            done += 1
        return done

    @property
    def draining(self) -> list[Any]:
        return [r for r in self.records.values() if r.state == "draining"]

    def undo(self, allocation: Allocation) -> None:
        """Destroy what :meth:`carve` made for ``allocation`` (its persisting failed)."""
        self._undo(
            [r for r in self.records.values() if r.allocation_id == allocation.id and r.uuid]
        )

    def _undo(self, made: list[Any]) -> None:
        for record in made:
            try:
                outcome = self.driver.destroy(self.gpus[record.gpu], record)
            except Exception as e:  # never hide the first failure
                outcome = str(e)
            if outcome in ("destroyed", "gone"):
                self._drop(record)
            else:
                self.log.error(
                    "gpupool: could not undo MIG instance %s: %s (its record is kept; the next "
                    "start destroys it)",
                    record.uuid,
                    outcome,
                )

    # -- records --------------------------------------------------------------------------
    def _save(self, record: Any) -> None:
        self.store.save_mig(record)
        self.records[record.node, record.gpu, record.start] = record

    def _drop(self, record: Any) -> None:
        self.store.delete_mig(record.node, record.gpu, record.start)
        self.records.pop((record.node, record.gpu, record.start), None)

    # -- what the admin page shows --------------------------------------------------------
    def view(self, ledger: Ledger) -> dict[str, Any]:
        """MIG on demand for the admin page: on or off (and why), the managed GPUs, the
        instances the pool made and who holds them, the draining ones, and the admin instances
        (handed out as they are; ``holder`` is who holds one now, "" if free or blocked)."""
        rows = []
        for r in sorted(self.records.values(), key=lambda r: (r.gpu, r.start)):
            gpu = self.gpus.get(r.gpu)
            holder = ledger.allocations.get(r.allocation_id or "")
            rows.append(
                {
                    "gpu": r.gpu,
                    "index": gpu.index if gpu else None,
                    "profile": r.profile,
                    "start": r.start,
                    "uuid": r.uuid or "",
                    "state": r.state,
                    "holder": holder.user if holder else "",
                }
            )
        return {
            "on": bool(self.gpus) and not self.off,
            "off": self.off,
            "managed": sorted(g.index for g in self.gpus.values()),
            "instances": rows,
            "admin": self._admin_rows(ledger),
        }

    def _admin_rows(self, ledger: Ledger) -> list[dict[str, Any]]:
        holders = {
            d.instance: a.user
            for a in ledger.allocations.values()
            for d in a.devices
            if d.instance in self.admin
        }
        rows = [
            {
                "gpu": gpu,
                "profile": inst.profile,
                "start": inst.start,
                "uuid": uuid,
                "holder": holders.get(uuid, ""),
            }
            for uuid, (gpu, inst) in self.admin.items()
        ]
        rows += [
            {"gpu": b.gpu, "profile": b.profile, "start": b.start, "uuid": b.instance or "",
             "holder": ""}
            for b in ledger.blocked.values()
            if b.reason == "admin"
        ]  # fmt: skip
        return sorted(rows, key=lambda r: (r["gpu"], r["start"]))
