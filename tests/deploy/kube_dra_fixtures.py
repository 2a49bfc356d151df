"""Shared set-up of the DRA tests (issue 26 §4): two H100 nodes publishing their drivers'
slices (their GPUs in reversed PCI order, :func:`tests.deploy.kube_dra.reversed_slice`), a
two-node job's allocations, the job backend under ``device_allocation = "dra"`` and another
tenant's claim pinning one GPU by UUID."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from traitlets.config import Configurable

from gpupool.core import Ledger, Request, Team
from gpupool.core.ledger import Allocation
from gpupool.kube.jobs import KubeJobBackend
from gpupool.kube.nodes import inventory_from_nodes
from tests.conftest import h100_node
from tests.deploy.kube_api import Served, served
from tests.deploy.kube_dra import reversed_slice
from tests.deploy.kube_fixtures import OFFERS, backend

NODES = ("dgx-h100-1", "dgx-h100-2")


@contextlib.contextmanager
def dra_nodes() -> Iterator[tuple[Served, Ledger]]:
    """The stand-in serving :data:`NODES` and their slices; a ledger over the same nodes with
    one team ``vision``."""
    nodes = [h100_node(n) for n in NODES]
    with served() as server:
        for name, obj in zip(NODES, nodes, strict=True):
            server.api.add_node(obj)
            server.api.dra.add_slice(reversed_slice(name))
        ledger = Ledger(inventory_from_nodes(nodes), OFFERS, {"vision": Team("vision", 16000)})
        yield server, ledger


def two_nodes(ledger: Ledger) -> list[Allocation]:
    """Two GPUs on each node, as the job manager asks for a 2-node job."""
    first = ledger.allocate(Request("alice", "vision", "h100", 2, "job", "j1"), "alloc-0")
    request = Request("alice", "vision", "h100", 2, "job", "j1", frozenset({first.node or ""}))
    return [first, ledger.allocate(request, "alloc-1")]


def dra_backend(server: Served, ledger: Ledger) -> KubeJobBackend:
    """The job backend under ``device_allocation = "dra"``, its parent's pool over ``ledger``'s
    inventory."""
    holder = Configurable()
    holder.pool = type("P", (), {"inventory": ledger.inventory})()  # type: ignore[attr-defined]
    return backend(server, device_allocation="dra", parent=holder)


def uuid_claim(uuid: str) -> dict[str, Any]:
    """Another tenant's ResourceClaim ``train-gpu`` for the GPU ``uuid``."""
    expression = f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "train-gpu"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.nvidia.com",
                            "selectors": [{"cel": {"expression": expression}}],
                        },
                    }
                ]
            }
        },
    }
