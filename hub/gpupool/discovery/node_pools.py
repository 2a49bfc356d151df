"""Autoscaled node pools declared by the admin: ``c.GPUPool.node_pools``.

Vocabulary
- *declaration*: ``{name: {"node": SPEC, "max_nodes": N, "node_selector": {LABEL: VALUE}}}``,
  where SPEC describes one node of the pool in the simulated-inventory grammar without its name
  (``"8x A100-80GB"``, ``"4x H100-80GB, mig=4:3g.40gb+3g.40gb"``: a MIG node as its
  ``nvidia.com/mig.config`` layout makes it), N is the pool's maximum size (the autoscaler's)
  and the optional node selector names labels only this pool's nodes carry
  (``{"cloud.google.com/gke-nodepool": "a100"}``), so a scale-up request grows this pool.
- *template*: the :class:`~gpupool.core.inventory.Node` a declaration describes, built through the
  simulated NVML so it has exactly the shape discovery gives a real node of that kind; its GPUs
  without MIG are handed out whole only (``share_resource=""``, as the device plugin gives a
  plain node's GPUs: a share waits for no node pool).

Contract: :func:`parse_node_pools` is pure and returns frozen
:class:`~gpupool.core.inventory.NodePool` objects, or raises
:class:`gpupool.declarations.ConfigError` naming ``GPUPool.node_pools.<name>`` and saying what
to write.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from gpupool.core.inventory import NodePool
from gpupool.declarations import ConfigError
from gpupool.discovery.simulated import simulated_inventory

KEY = "GPUPool.node_pools"
EXAMPLE = '{"a100": {"node": "8x A100-80GB", "max_nodes": 4}}'
KEYS = {"node", "max_nodes", "node_selector"}
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


def parse_node_pools(value: Any) -> tuple[NodePool, ...]:
    """The node pools of a ``c.GPUPool.node_pools`` value (see the module docstring)."""
    if not isinstance(value, Mapping):
        raise ConfigError(KEY, f"must be a dict of node pools, like {EXAMPLE}")
    return tuple(_pool(str(name), spec) for name, spec in value.items())


def _pool(name: str, spec: Any) -> NodePool:
    key = f"{KEY}.{name}"
    if not _NAME.match(name):
        raise ConfigError(key, "a node pool's name is lowercase letters, digits, '-' and '.'")
    if not isinstance(spec, Mapping) or not {"node", "max_nodes"} <= set(spec) <= KEYS:
        raise ConfigError(
            key, f"must have the keys 'node', 'max_nodes' and maybe 'node_selector', like {EXAMPLE}"
        )
    most = spec["max_nodes"]
    if isinstance(most, bool) or not isinstance(most, int) or most < 1:
        raise ConfigError(
            f"{key}.max_nodes", f"must be a whole number of nodes, 1 or more: {most!r}"
        )
    node = spec["node"]
    if not isinstance(node, str) or ":" in node or ";" in node:
        raise ConfigError(
            f"{key}.node", f"must describe one node without its name, like '8x A100-80GB': {node!r}"
        )
    try:
        simulated = simulated_inventory(f"{name}: {node}").nodes[0]
    except ValueError as e:
        raise ConfigError(f"{key}.node", str(e)) from None
    whole_only = tuple(
        replace(g, share_resource="") if g.mig_mode == "off" else g for g in simulated.gpus
    )
    template = replace(simulated, gpus=whole_only)
    selector = spec.get("node_selector", {})
    if not isinstance(selector, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in selector.items()
    ):
        raise ConfigError(
            f"{key}.node_selector",
            f"must map label names to values, like {{'cloud.google.com/gke-nodepool': '{name}'}}",
        )
    return NodePool(name, template, most, tuple(sorted(selector.items())))
