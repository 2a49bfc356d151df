"""The Kubernetes API server, read: the client configuration, node and pod listing and watching,
and the cluster's inventory (the one place gpupool's node reading meets the API).

Vocabulary
- *configuration*: a private ``kubernetes_asyncio`` ``Configuration``, in-cluster credentials
  first, then the kubeconfig (``KUBECONFIG`` or ``~/.kube/config``); the global one is
  KubeSpawner's and is never changed.
- *API JSON*: objects as the API server sends them (``ApiClient.sanitize_for_serialization``
  of a model, or the reply's JSON itself), what :mod:`gpupool.kube.nodes` reads.

Contract: every function here does I/O and nothing else: what is read is turned into an
inventory by the pure :func:`gpupool.kube.nodes.inventory_from_nodes`. :func:`read_nodes` is the
seam tests replace for the inventory; :class:`ClusterAPI` the reconciler's.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gpupool.core.inventory import Inventory
from gpupool.kube.dra_inventory import inventory_from_slices
from gpupool.kube.nodes import inventory_from_nodes

READ_TIMEOUT_S = 30.0

NodeReader = Callable[[str | None], Awaitable[list[dict[str, Any]]]]


# -- the client -------------------------------------------------------------------------------
async def api_configuration() -> Any:
    """A private ``kubernetes_asyncio`` configuration: in-cluster credentials first, then the
    kubeconfig (``KUBECONFIG`` or ``~/.kube/config``), so KubeSpawner's global one is left alone."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        await config.load_kube_config(
            config_file=os.environ.get("KUBECONFIG") or None,  # now, not at import time
            client_configuration=configuration,
            persist_config=False,
        )
    return configuration


async def read_nodes(label_selector: str | None = None) -> list[dict[str, Any]]:
    """Every node (matching ``label_selector``) as API JSON, through ``kubernetes_asyncio``
    with :func:`api_configuration`."""
    from kubernetes_asyncio import client

    selector = {"label_selector": label_selector} if label_selector else {}
    return await _read_all(lambda api: client.CoreV1Api(api).list_node, selector)


async def read_slices() -> list[dict[str, Any]]:
    """Every ResourceSlice (``resource.k8s.io/v1``) as API JSON, as :func:`read_nodes` reads
    nodes (the inventory under DRA, :mod:`gpupool.kube.dra_inventory`)."""
    from kubernetes_asyncio import client

    return await _read_all(lambda api: client.ResourceV1Api(api).list_resource_slice, {})


async def _read_all(
    lister: Callable[[Any], Callable[..., Awaitable[Any]]], kwargs: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every object ``lister(api)`` lists, page by page (500 each), as API JSON."""
    from kubernetes_asyncio import client

    async with client.ApiClient(await api_configuration()) as api:
        list_page = lister(api)
        objects: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            more: dict[str, Any] = {"limit": 500, "_request_timeout": READ_TIMEOUT_S}
            if token:
                more["_continue"] = token
            page = await list_page(**kwargs, **more)
            objects += [api.sanitize_for_serialization(o) for o in page.items]
            token = page.metadata._continue if page.metadata else None
            if not token:
                return objects


# -- listing and watching (the reconciler's seam) --------------------------------------------
class Gone(Exception):
    """The API server answered ``410 Gone``: the resourceVersion watched from is too old (it
    compacted its history); list again and watch from the list's version."""


class ClusterAPI:
    """Lists and watches ``nodes`` (cluster-wide, matching ``node_selector``), ``pods`` (in
    ``namespace``, matching ``pod_selector``) and ``tenants`` (every namespace's pods) as API
    JSON, through ``kubernetes_asyncio``: the one seam between :mod:`gpupool.kube.reconcile`
    and the API server (tests point ``KUBECONFIG`` at a stand-in, or pass any object with these
    two methods).

    ``list(kind)`` gives ``(items, resourceVersion)``; ``watch(kind, resource_version,
    timeout_s)`` yields ``(type, object)`` events (``ADDED``, ``MODIFIED``, ``DELETED``, and
    ``BOOKMARK``, whose object has only ``metadata.resourceVersion``: where to resume from, so a
    quiet watch is not resumed from a compacted version) until the server ends the watch after
    ``timeout_s``, and raises :class:`Gone` on a 410 (as an ``ERROR`` event or as the reply's
    status)."""

    def __init__(
        self,
        namespace: str = "default",
        node_selector: str | None = None,
        pod_selector: str | None = "gpupool.io/team",
    ) -> None:
        self.namespace = namespace
        self.selectors = {"nodes": node_selector, "pods": pod_selector, "tenants": None}
        self._api: Any = None

    async def _client(self) -> Any:
        from kubernetes_asyncio import client

        if self._api is None:
            self._api = client.ApiClient(await api_configuration())
        return client.CoreV1Api(self._api)

    def _call(
        self, core: Any, kind: str
    ) -> tuple[Callable[..., Any], tuple[str, ...], dict[str, Any]]:
        kwargs: dict[str, Any] = {}
        if self.selectors.get(kind):
            kwargs["label_selector"] = self.selectors[kind]
        if kind == "nodes":
            return core.list_node, (), kwargs
        if kind == "resourceslices":  # under DRA (gpupool.kube.dra_inventory), cluster-wide
            from kubernetes_asyncio import client

            return client.ResourceV1Api(core.api_client).list_resource_slice, (), kwargs
        if kind == "tenants":  # every namespace's pods (gpupool.kube.tenants)
            return core.list_pod_for_all_namespaces, (), kwargs
        return core.list_namespaced_pod, (self.namespace,), kwargs

    async def list(self, kind: str) -> tuple[list[dict[str, Any]], str]:
        from kubernetes_asyncio.client.exceptions import ApiException

        func, args, kwargs = self._call(await self._client(), kind)
        items: list[dict[str, Any]] = []
        token, version = None, ""
        while True:
            more = {"limit": 500, "_request_timeout": READ_TIMEOUT_S, "_preload_content": False}
            if token:
                more["_continue"] = token
            try:
                response = await func(*args, **kwargs, **more)
            except ApiException as e:
                if e.status == 410:
                    raise Gone(str(e.reason)) from e
                raise
            page = json.loads(await response.read())
            items += page.get("items") or []
            meta = page.get("metadata") or {}
            version, token = str(meta.get("resourceVersion", "")), meta.get("continue")
            if not token:
                return items, version

    async def watch(
        self, kind: str, resource_version: str, timeout_s: int = 300
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        from kubernetes_asyncio import watch
        from kubernetes_asyncio.client.exceptions import ApiException

        func, args, kwargs = self._call(await self._client(), kind)
        stream = watch.Watch()
        try:
            async for event in stream.stream(
                func,
                *args,
                **kwargs,
                resource_version=resource_version,
                timeout_seconds=timeout_s,  # given: no silent retries inside the Watch
                allow_watch_bookmarks=True,
                _request_timeout=timeout_s + READ_TIMEOUT_S,
            ):
                kind_of = str(event.get("type", ""))
                if kind_of in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
                    yield kind_of, event["raw_object"]
        except ApiException as e:
            if e.status == 410:
                raise Gone(str(e.reason)) from e
            raise
        finally:
            await stream.close()

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()
            self._api = None


async def kubernetes_inventory(
    label_selector: str | None = None, reader: NodeReader = read_nodes, dra: bool = False
) -> Inventory:
    """The inventory of the cluster's GPU nodes (``reader`` is the seam tests replace); with
    ``dra``, their GPUs are NVIDIA's DRA driver's ResourceSlices' devices."""
    if dra:
        return inventory_from_slices(await reader(label_selector), await read_slices())
    return inventory_from_nodes(await reader(label_selector))


def load_kubernetes_inventory(
    label_selector: str | None = None,
    timeout: float = 2 * READ_TIMEOUT_S,
    reader: NodeReader = read_nodes,
    dra: bool = False,
) -> Inventory:
    """:func:`kubernetes_inventory` from synchronous code, even inside a running event loop
    (the hub's): it runs on its own loop in a worker thread. Raises ``RuntimeError`` saying
    what to fix when no cluster can be reached."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="gpupool-k8s")
    try:
        future = pool.submit(asyncio.run, kubernetes_inventory(label_selector, reader, dra))
        return future.result(timeout=timeout)
    except Exception as e:
        where = f" (nodes matching {label_selector!r})" if label_selector else ""
        raise RuntimeError(
            f"GPUPool.inventory = 'kubernetes'{where}: could not read the cluster's nodes: "
            f"{type(e).__name__}: {e or 'timed out'}. Run the hub in the cluster with a "
            "service account that may list nodes, or point KUBECONFIG at a cluster."
        ) from e
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a hung read must not hold the hub
