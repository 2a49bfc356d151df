"""GPU discovery: what GPUs the pool has, found through NVML or a simulated NVML.

Vocabulary
- *discovery*: reading one node's GPUs (UUID, model key, memory, MIG mode, MIG instances with
  their profiles and start slots, NVLink peers) into a :class:`gpupool.core.inventory.Inventory`.
- *nvml*: the ``pynvml`` module, or :class:`SimulatedNVML`, which answers the same calls with the
  same results and errors for GPUs described by a *spec* (see :func:`parse_spec`).
- *simulated inventory*: the inventory :func:`simulated_inventory` finds by running the very same
  :func:`discover` over a :class:`SimulatedNVML`; it is labelled ``simulated`` wherever it shows.

Contract: :func:`discover` only reads (creating or destroying MIG instances is not its job), fails
soft without a driver (empty inventory, a note, one warning), and holds NVML only while it reads
(:class:`~gpupool.discovery.nvml_session.NVMLSession`, the one session every NVML reader uses).
:func:`parse_spec` raises ``ValueError`` with the bad part, the grammar and an example, so a bad
``c.GPUPool.inventory`` stops the hub with a message the admin can act on.
"""

from gpupool.discovery.nvml import discover
from gpupool.discovery.nvml_session import NVMLSession, NVMLUnavailable
from gpupool.discovery.simulated import SimulatedNVML, simulated_inventory
from gpupool.discovery.spec import NodeSpec, parse_spec

__all__ = [
    "NVMLSession",
    "NVMLUnavailable",
    "NodeSpec",
    "SimulatedNVML",
    "discover",
    "parse_spec",
    "simulated_inventory",
]
