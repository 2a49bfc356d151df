"""One gpupool release per node: each hub claims the nodes its pool manages, and a hub whose
nodes another live release claims stops at start.

Vocabulary
- *claim*: a ``coordination.k8s.io/v1`` Lease named :data:`LEASE_NAME` in the hub's namespace,
  labelled :data:`CLAIM_LABEL`, whose annotation :data:`NODES_ANNOTATION` lists (JSON) the nodes
  the pool manages and :data:`SELECTOR_ANNOTATION` the node selector it reads them with;
  ``spec.holderIdentity`` is ``<namespace>/<hub pod>``. One release per namespace (z2jh's and
  gpupool's objects have fixed names there), so the namespace is the release: a restarted hub
  of the same release finds its own Lease and takes it over.
- *live*: a claim whose ``spec.renewTime`` plus ``spec.leaseDurationSeconds`` is after now. The
  API server never expires a Lease (it stores it like any object); whether one is held is the
  reader's judgement, as in client-go's leader election (``tools/leaderelection/
  leaderelection.go``, ``tryAcquireOrRenew``: a record whose holder is set and that is still
  valid is "held by ... and has not yet expired"; LeaseSpec's ``leaseDurationSeconds`` is what
  "candidates for a lease need to wait to force acquire it", ``k8s.io/api/coordination/v1``).
  client-go measures from the time *it* saw the record change; a hub starting has seen nothing,
  so it measures from ``renewTime`` (clocks in a cluster are NTP-synced; the duration is long
  against any skew). A release uninstalled without its hub's cleanup leaves its Lease behind:
  it stops being live ``leaseDurationSeconds`` after its hub's last renewal.
- *conflict*: another namespace's live claim naming a node of this pool.

Contract: :func:`conflicts` and :func:`refusal` are pure. :class:`NodeClaim` does the I/O: at
start :meth:`NodeClaim.acquire` lists every namespace's claims, refuses on a conflict (a
:class:`~gpupool.declarations.ConfigError` naming ``GPUPool.inventory``, the other release and
the shared nodes), else creates or takes over its own Lease, then lists again: of two releases
started together the one whose claim is older keeps the nodes, the other gives its claim up
(an empty holder) and refuses. A hub that stops keeps its claim, so that its restart finds the
nodes still its own. While the hub runs, :meth:`NodeClaim.renewing` renews every third of the
duration with the pool's nodes as they are now. A hub that may not read or write Leases (an
older chart's RBAC) logs why and runs unclaimed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

from gpupool.declarations import ConfigError

LEASE_NAME = "gpupool-nodes"
CLAIM_LABEL = "gpupool.io/node-claim"
NODES_ANNOTATION = "gpupool.io/nodes"
SELECTOR_ANNOTATION = "gpupool.io/node-selector"
RAW: dict[str, Any] = {"_preload_content": False, "_request_timeout": 30.0}
"""Every call's options: the reply's JSON as sent (Lease times stay ``MicroTime`` strings)."""
MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"
"""``metav1.MicroTime``'s JSON form (RFC 3339 with microseconds)."""


# -- pure ------------------------------------------------------------------------------------
def parse_time(text: str) -> datetime | None:
    for layout in (MICROTIME, "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.strptime(text, layout).replace(tzinfo=UTC)
        except (TypeError, ValueError):
            continue
    return None


def expires(lease: Mapping[str, Any]) -> datetime | None:
    """When ``lease`` stops being live (``renewTime`` + ``leaseDurationSeconds``), or ``None``
    when it names no holder or no renewal."""
    spec = lease.get("spec") or {}
    renewed = parse_time(str(spec.get("renewTime") or ""))
    if not spec.get("holderIdentity") or renewed is None:
        return None
    return renewed + timedelta(seconds=int(spec.get("leaseDurationSeconds") or 0))


def claimed_nodes(lease: Mapping[str, Any]) -> set[str]:
    annotations = (lease.get("metadata") or {}).get("annotations") or {}
    try:
        nodes = json.loads(annotations.get(NODES_ANNOTATION) or "[]")
    except ValueError:
        return set()
    return {str(n) for n in nodes} if isinstance(nodes, list) else set()


def conflicts(
    leases: Iterable[Mapping[str, Any]], namespace: str, nodes: Iterable[str], now: datetime
) -> list[tuple[Mapping[str, Any], set[str]]]:
    """Other namespaces' live claims among ``leases`` with the ``nodes`` each shares with this
    pool, oldest claim first."""
    mine = set(nodes)
    out = []
    for lease in leases:
        meta = lease.get("metadata") or {}
        until = expires(lease)
        if meta.get("namespace") == namespace or until is None or until <= now:
            continue
        shared = claimed_nodes(lease) & mine
        if shared:
            out.append((lease, shared))
    return sorted(out, key=lambda c: _age_key(c[0]))


def _age_key(lease: Mapping[str, Any]) -> tuple[str, str]:
    meta = lease.get("metadata") or {}
    return str(meta.get("creationTimestamp") or "~"), str(meta.get("namespace") or "")


def refusal(lease: Mapping[str, Any], shared: set[str], selector: str | None) -> ConfigError:
    """The error that stops the hub: which release claims which of its nodes, and what to do."""
    meta, spec = lease.get("metadata") or {}, lease.get("spec") or {}
    names = sorted(shared)
    listed = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
    theirs = ((meta.get("annotations") or {}).get(SELECTOR_ANNOTATION)) or "none"
    until = expires(lease)
    return ConfigError(
        "GPUPool.inventory",
        f"another gpupool release (namespace {meta.get('namespace')}, hub "
        f"{spec.get('holderIdentity')}, node selector {theirs}) manages node(s) {listed} of "
        f"this pool (node selector {selector or 'none'}): two releases must not manage the "
        "same nodes. "
        "Give each release its own nodes (gpupool.inventory: kubernetes:<node label selector> "
        "matching none of the other's), or uninstall the other release: its claim, Lease "
        f"{meta.get('namespace')}/{meta.get('name')}, lapses "
        f"{spec.get('leaseDurationSeconds')} s after its hub stops renewing it"
        + (f" (at {until:%Y-%m-%d %H:%M:%S} UTC if it has stopped)" if until else ""),
    )


def lease_body(
    namespace: str,
    holder: str,
    nodes: Iterable[str],
    selector: str | None,
    seconds: int,
    now: datetime,
) -> dict[str, Any]:
    stamp = now.strftime(MICROTIME)
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": LEASE_NAME,
            "namespace": namespace,
            "labels": {CLAIM_LABEL: "true"},
            "annotations": {
                NODES_ANNOTATION: json.dumps(sorted(set(nodes))),
                SELECTOR_ANNOTATION: selector or "",
            },
        },
        "spec": {
            "holderIdentity": holder,
            "leaseDurationSeconds": seconds,
            "acquireTime": stamp,
            "renewTime": stamp,
        },
    }


# -- I/O -------------------------------------------------------------------------------------
class NodeClaim:
    """This hub's claim on its pool's nodes (see the module docstring). ``clock`` is the seam
    tests move; ``holder`` defaults to ``<namespace>/<hostname>`` (the hub pod's name)."""

    def __init__(
        self,
        namespace: str,
        selector: str | None,
        seconds: int = 60,
        *,
        holder: str = "",
        log: logging.Logger | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.namespace = namespace
        self.selector = selector
        self.seconds = seconds
        self.holder = holder or f"{namespace}/{os.environ.get('HOSTNAME') or 'hub'}"
        self.log = log or logging.getLogger(__name__)
        self.clock = clock

    async def _call(self, call: Callable[[Any], Awaitable[Any]]) -> tuple[int, Any]:
        """``call(coordination)`` on a CoordinationV1Api (with ``_preload_content=False``):
        ``(status, JSON)``; an ``ApiException``'s status and reason instead of raising."""
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        from gpupool.kube.api import api_configuration

        async with client.ApiClient(await api_configuration()) as api:
            try:
                response = await call(client.CoordinationV1Api(api))
                return response.status, json.loads(await response.read())
            except ApiException as e:
                return int(e.status or 0), str(e.reason)

    async def _leases(self) -> list[dict[str, Any]]:
        status, body = await self._call(
            lambda coordination: coordination.list_lease_for_all_namespaces(
                label_selector=CLAIM_LABEL, **RAW
            )
        )
        if status != 200:
            raise PermissionError(f"listing Leases: {status} {body}")
        return list(body.get("items") or [])

    async def _write(self, nodes: Iterable[str]) -> None:
        """Create this release's Lease, or take it over (a restart) and renew it."""
        now = self.clock()
        body = lease_body(self.namespace, self.holder, nodes, self.selector, self.seconds, now)
        ns = self.namespace
        status, reply = await self._call(
            lambda coordination: coordination.read_namespaced_lease(LEASE_NAME, ns, **RAW)
        )
        if status == 404:
            status, reply = await self._call(
                lambda coordination: coordination.create_namespaced_lease(ns, body, **RAW)
            )
        elif status == 200:
            if (reply.get("spec") or {}).get("holderIdentity") == self.holder:
                del body["spec"]["acquireTime"]  # renewed, not acquired again
            status, reply = await self._call(
                lambda coordination: coordination.patch_namespaced_lease(
                    LEASE_NAME, ns, body, **RAW
                )
            )
        if status not in (200, 201):
            raise PermissionError(f"writing Lease {self.namespace}/{LEASE_NAME}: {status} {reply}")

    async def acquire(self, nodes: Iterable[str]) -> None:
        """Claim ``nodes`` or raise the :func:`refusal` (see the module docstring)."""
        nodes = sorted(set(nodes))
        try:
            found = conflicts(await self._leases(), self.namespace, nodes, self.clock())
            if found:
                raise refusal(*found[0], self.selector)
            await self._write(nodes)
            leases = await self._leases()
        except PermissionError as e:
            self.log.error(
                "gpupool: could not claim this pool's nodes (%s): another gpupool release on "
                "the same nodes is not refused; let the hub's ServiceAccount list Leases in "
                "every namespace and get, create and patch them in its own (the chart's RBAC)",
                e,
            )
            return
        mine = next(
            (
                lease
                for lease in leases
                if (lease.get("metadata") or {}).get("namespace") == self.namespace
                and (lease.get("metadata") or {}).get("name") == LEASE_NAME
            ),
            None,
        )
        for lease, shared in conflicts(leases, self.namespace, nodes, self.clock()):
            if mine is None or _age_key(lease) < _age_key(mine):  # started together: older wins
                await self._release()  # so that the other's restart is not refused by it
                raise refusal(lease, shared, self.selector)

    async def _release(self) -> None:
        """Give the claim up: an empty holder (as client-go's ``ReleaseOnCancel``), not live."""
        ns, body = self.namespace, {"spec": {"holderIdentity": ""}}
        await self._call(
            lambda coordination: coordination.patch_namespaced_lease(LEASE_NAME, ns, body, **RAW)
        )

    def acquire_now(self, nodes: Iterable[str]) -> None:
        """:meth:`acquire` from synchronous code (the hub's configuration), on its own loop in a
        worker thread, as :func:`gpupool.kube.api.load_kubernetes_inventory` reads the nodes."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="gpupool-claim")
        try:
            pool.submit(asyncio.run, self.acquire(list(nodes))).result(timeout=60)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    async def renewing(self, nodes: Callable[[], Iterable[str]]) -> None:
        """Renew the claim with ``nodes()`` every third of the duration, until cancelled (a
        failed renewal is logged and tried again at the next)."""
        while True:
            await asyncio.sleep(self.seconds / 3)
            try:
                await self._write(nodes())
            except Exception as e:
                self.log.warning("gpupool: renewing this pool's node claim: %s", e)
