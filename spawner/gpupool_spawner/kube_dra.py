"""A notebook's GPUs as a ResourceClaim (Dynamic Resource Allocation), for ``KubeGPUSpawner``
with ``device_allocation = "dra"`` (see :mod:`gpupool.kube.claims` for the vocabulary).

Contract: :class:`DRAClaims` sits between :class:`~gpupool_spawner.mixin.GPUSpawnerMixin` and
KubeSpawner and only orchestrates I/O; the claim and the pod's reference to it are built by
:mod:`gpupool.kube.claims`. For a start holding GPUs:
- before the pod is created, the node's ResourceSlices are read, the ledger's GPUs resolved to
  their UUIDs (*pinned UUIDs*), and the claim ``<pod>-gpus`` created (an earlier one of that
  name, left by a start that did not finish, is deleted first); a node whose slices lack the
  GPUs refuses the start (503) before any pod exists;
- once the pod exists, the claim is owned by it (``ownerReferences``), so the garbage collector
  deletes it with the pod, also when the hub is gone;
- while KubeSpawner waits for the pod, a pod the scheduler finds ``Unschedulable`` fails the
  start at once with the scheduler's message (the claim pins GPUs the ledger thought free: no
  later retry of the scheduler's will find others), rather than at ``start_timeout``; the pod
  and the claim are deleted and the mixin releases the devices;
- once the pod runs, the claim's allocation result is read back and compared with the pinned
  UUIDs (:attr:`DRAClaims.gpupool_dra_uuids` then holds what the driver gave), and the
  ledger's devices record their UUIDs (``instance``, persisted); a claim given other GPUs fails
  the start (the ledger would count GPUs the pod does not hold);
- ``stop`` deletes the claim after the pod (before the mixin releases the devices).
The hub's Role must allow ``resourceclaims`` (create, get, patch, delete) in the namespace and
its ClusterRole ``resourceslices`` (list) cluster-wide: the Helm chart grants both with
``gpupool.deviceAllocation: dra``.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from kubernetes_asyncio.client import ResourceV1Api
from kubernetes_asyncio.client.exceptions import ApiException

from gpupool.hub.errors import refuse
from gpupool.kube.claims import (
    DRA,
    DRAError,
    allocated_uuids,
    claim_name,
    make_claim,
    owner_reference,
    pinned_uuids,
    slice_devices,
    unhonoured,
    with_uuids,
)

WATCH_PERIOD_S = 0.2
"""How often the start looks at its pod (in KubeSpawner's pod reflector) for a verdict."""


def unschedulable(pod: dict[str, Any] | None) -> str | None:
    """The scheduler's message of a pod it could not place (``PodScheduled`` ``False``,
    ``Unschedulable``), or None."""
    for condition in ((pod or {}).get("status") or {}).get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            return str(condition.get("message") or "Unschedulable")
    return None


class DRAClaims:
    """The DRA steps of a Kubernetes notebook start and stop (see the module docstring)."""

    gpupool_dra_uuids: tuple[str, ...] = ()
    """The GPUs (UUIDs) the DRA driver gave this server's claim, as read back at start."""
    _gpupool_pinned: tuple[str, ...] = ()
    _gpupool_owned = False

    # provided by the spawner classes this is mixed into
    api: Any
    log: Any
    namespace: str
    pod_name: str
    device_allocation: str
    k8s_api_request_timeout: int
    pod_reflector: Any
    gpupool: Any
    gpupool_allocation: Any

    def gpupool_uses_dra(self) -> bool:
        allocation = self.gpupool_allocation
        return self.device_allocation == DRA and allocation is not None and bool(allocation.devices)

    @property
    def gpupool_claim_name(self) -> str:
        return claim_name(self.pod_name)

    def _resource_api(self) -> ResourceV1Api:
        return ResourceV1Api(self.api.api_client)

    async def _gpupool_slices(self) -> list[dict[str, Any]]:
        found = await self._resource_api().list_resource_slice(
            _request_timeout=self.k8s_api_request_timeout
        )
        items: list[dict[str, Any]] = self.api.api_client.sanitize_for_serialization(found.items)
        return items

    async def _gpupool_create_claim(self) -> None:
        allocation = self.gpupool_allocation
        devices = slice_devices(await self._gpupool_slices())
        try:
            pinned = pinned_uuids(allocation, self.gpupool.inventory, devices)
        except DRAError as e:
            raise refuse(
                503, f"Your {allocation.offer} cannot be given to this server: {e}."
            ) from None
        self._gpupool_pinned = pinned
        labels = {"gpupool.io/allocation": allocation.id}
        body: Any = make_claim(self.gpupool_claim_name, self.namespace, pinned, labels)
        api = self._resource_api()
        for attempt in (1, 2):
            try:
                await api.create_namespaced_resource_claim(
                    self.namespace, body, _request_timeout=self.k8s_api_request_timeout
                )
                self.log.info(
                    "gpupool: claim %s/%s pins %s", self.namespace, body["metadata"]["name"], pinned
                )
                return
            except ApiException as e:
                if e.status != 409 or attempt == 2:
                    raise
                await self._gpupool_delete_claim()  # left by a start that did not finish

    async def _gpupool_delete_claim(self) -> None:
        with contextlib.suppress(ApiException):  # 404: gone already (with its pod)
            await self._resource_api().delete_namespaced_resource_claim(
                self.gpupool_claim_name,
                self.namespace,
                _request_timeout=self.k8s_api_request_timeout,
            )

    async def _gpupool_own_claim(self, pod: dict[str, Any]) -> None:
        patch = {"metadata": {"ownerReferences": [owner_reference(pod)]}}
        await self._resource_api().patch_namespaced_resource_claim(
            self.gpupool_claim_name,
            self.namespace,
            patch,
            _request_timeout=self.k8s_api_request_timeout,
        )

    # -- KubeSpawner's steps --------------------------------------------------------------------
    async def _make_create_pod_request(self, pod: Any, request_timeout: int) -> Any:
        if self.gpupool_uses_dra():
            await self._gpupool_create_claim()
        return await super()._make_create_pod_request(pod, request_timeout)  # type: ignore[misc]

    async def _start(self) -> Any:
        if not self.gpupool_uses_dra():
            return await super()._start()  # type: ignore[misc]
        start = asyncio.ensure_future(super()._start())  # type: ignore[misc]
        watch = asyncio.ensure_future(self._gpupool_watch())
        try:
            await asyncio.wait({start, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (start, watch):
                if not task.done():
                    task.cancel()
        if not start.cancelled() and start.done() and start.exception() is None:
            url = start.result()
            if not self._gpupool_owned:  # the pod ran before the watch looked
                key = f"{self.namespace}/{self.pod_name}"
                await self._gpupool_own_claim(self.pod_reflector.pods[key])
            await self._gpupool_read_back()
            return url
        with contextlib.suppress(asyncio.CancelledError):
            await start  # raises the start's own error, if it had one
        await watch  # raises the scheduler's verdict
        raise RuntimeError("the start ended without a verdict")

    async def _gpupool_watch(self) -> None:
        """Own the claim once the pod exists; refuse the start when the pod is Unschedulable."""
        key = f"{self.namespace}/{self.pod_name}"
        self._gpupool_owned = False
        while True:
            reflector = getattr(self, "pod_reflector", None)
            pod = reflector.pods.get(key) if reflector is not None else None
            if pod and not self._gpupool_owned and (pod.get("metadata") or {}).get("uid"):
                await self._gpupool_own_claim(pod)
                self._gpupool_owned = True
            message = unschedulable(pod)
            if message:
                allocation = self.gpupool_allocation
                await self._gpupool_remove()
                raise refuse(
                    503,
                    f"Your {allocation.offer} on node {allocation.node} could not be given to "
                    f"this server: Kubernetes cannot schedule its pod ({message.rstrip('.')}). "
                    f"Its ResourceClaim {self.namespace}/{self.gpupool_claim_name} asks NVIDIA's "
                    f"DRA driver for {', '.join(self._gpupool_pinned)}, which another pod may "
                    "hold. Try again in a moment, or choose another offer.",
                )
            await asyncio.sleep(WATCH_PERIOD_S)

    async def _gpupool_read_back(self) -> None:
        api = self._resource_api()
        found = await api.read_namespaced_resource_claim(
            self.gpupool_claim_name, self.namespace, _request_timeout=self.k8s_api_request_timeout
        )
        claim = self.api.api_client.sanitize_for_serialization(found)
        devices = slice_devices(await self._gpupool_slices())
        uuids = allocated_uuids(claim, devices) or ()
        wrong = unhonoured(self._gpupool_pinned, uuids)
        if wrong:
            await self._gpupool_remove()
            raise refuse(
                503,
                f"The GPUs given to this server are not the ones the pool holds for it ({wrong}); "
                "an admin must check NVIDIA's DRA driver.",
            )
        self.gpupool_dra_uuids = uuids
        self.log.info("gpupool: %s holds %s (%s)", self.pod_name, uuids, self.gpupool_claim_name)
        self._gpupool_record(self._gpupool_pinned)

    def _gpupool_record(self, uuids: tuple[str, ...]) -> None:
        """The ledger's devices of this server's allocation get their UUIDs (persisted; the
        ledger unchanged if the database refuses: logged)."""
        pool, alloc_id = self.gpupool, self.gpupool_allocation.id

        def record(ledger: Any) -> None:
            current = ledger.allocations.get(alloc_id)
            if current is None:
                return
            updated = with_uuids(current, uuids)
            try:
                pool.store.replace([updated])
            except Exception as e:  # the UUIDs are bookkeeping: the server runs regardless
                self.log.warning("gpupool: cannot record the GPUs of %s: %s", alloc_id, e)
                return
            ledger.allocations[alloc_id] = updated

        pool.deciding(record)

    async def _gpupool_remove(self) -> None:
        """Delete the pod (as KubeSpawner's stop does) and the claim."""
        try:
            await super().stop(now=True)  # type: ignore[misc]
        finally:
            await self._gpupool_delete_claim()

    async def stop(self, now: bool = False) -> Any:
        try:
            return await super().stop(now=now)  # type: ignore[misc]
        finally:
            if self.device_allocation == DRA:
                await self._gpupool_delete_claim()
