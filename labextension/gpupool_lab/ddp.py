"""The tiny DDP runtime helper that notebook code and jobs import: ``from gpupool_lab import ddp``.

Vocabulary: *rank* is this process's global number (0 … world size − 1), *local rank* its number
on this node (it picks the GPU), *world size* the number of processes. Under torchrun they come
from torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``); outside torchrun (an interactive notebook) this is a world of one: rank 0, local
rank 0, world size 1, and :func:`init` creates a real one-process group (an in-memory store, no
port), so the same code, ``DistributedDataParallel`` included, runs in the notebook and in the job.

Contract:

- Importing this module imports nothing from torch and never touches CUDA; torch is imported
  inside the functions that need it.
- :func:`init` is idempotent; backend ``GPUPOOL_DDP_BACKEND`` when the hub set it (``gloo`` for
  a job on several MIG instances: NCCL does not span them), else ``nccl`` when CUDA is available,
  ``gloo`` otherwise. On CUDA it first selects :func:`device`: ``cuda:<local rank>``, or
  ``cuda:0`` for a rank that has a device of its own (``GPUPOOL_RANK_DEVICE``, set by
  ``gpupool_lab.rank_log``: it sees that one alone). It returns :func:`device`.
- :func:`sampler` always returns a ``DistributedSampler`` (for a world of one it yields every
  index), so ``DataLoader(ds, sampler=ddp.sampler(ds))`` and ``sampler.set_epoch(epoch)`` work
  the same everywhere. Do not also pass ``shuffle=`` to the DataLoader.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch.utils.data import Dataset, DistributedSampler

__all__ = [
    "barrier",
    "cleanup",
    "device",
    "init",
    "is_main",
    "local_rank",
    "rank",
    "sampler",
    "under_torchrun",
    "world_size",
]


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def under_torchrun() -> bool:
    """Whether torchrun (or another env:// launcher) started this process."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def rank() -> int:
    """This process's global rank (0 outside torchrun)."""
    return _env_int("RANK", 0)


def world_size() -> int:
    """The number of processes in the job (1 outside torchrun)."""
    return _env_int("WORLD_SIZE", 1)


def local_rank() -> int:
    """This process's rank on its node, which selects its GPU (0 outside torchrun)."""
    return _env_int("LOCAL_RANK", 0)


def is_main() -> bool:
    """True on rank 0: the process that should print, save checkpoints and write results."""
    return rank() == 0


def device() -> torch.device:
    """``cuda:<local rank>`` (``cuda:0`` for a rank with a device of its own) when CUDA is
    available, else ``cpu``."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", 0 if os.environ.get("GPUPOOL_RANK_DEVICE") else local_rank())
    return torch.device("cpu")


def init(backend: str | None = None) -> torch.device:
    """Create the process group once (later calls do nothing) and return :func:`device`."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return device()
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = os.environ.get("GPUPOOL_DDP_BACKEND") or ("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(device())
    if under_torchrun():
        dist.init_process_group(backend=backend, init_method="env://")
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
    return device()


def sampler(dataset: Dataset[Any], shuffle: bool = True, **kwargs: Any) -> DistributedSampler[Any]:
    """A ``DistributedSampler`` giving this rank its share of ``dataset``.

    ``kwargs`` go to ``DistributedSampler`` (``seed``, ``drop_last``). Call
    ``set_epoch(epoch)`` on it at the start of each epoch so shuffling differs between epochs.
    """
    from torch.utils.data import DistributedSampler

    return DistributedSampler(
        dataset, num_replicas=world_size(), rank=rank(), shuffle=shuffle, **kwargs
    )


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for without a group or in a world of 1)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device().index or 0])
    else:
        dist.barrier()


def cleanup() -> None:
    """Destroy the process group if there is one (safe to call twice)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
