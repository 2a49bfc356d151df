"""The cooperative cap of a GPU share: PyTorch in this process keeps to the share's memory.

Vocabulary and contract:

- A *share* is a slice of a GPU without MIG, by memory. The hub says so in the environment:
  ``GPUPOOL_SHARE_MILLI`` (thousandths of the GPU's memory), ``GPUPOOL_SHARE_MIB`` (the cap, in
  MiB) and ``CUDA_VISIBLE_DEVICES`` (the GPU's UUID alone, so the share is CUDA device 0).
- The *cap* is applied with ``torch.cuda.set_per_process_memory_fraction(fraction, 0)``. NVML,
  which the hub watches, counts the CUDA context too (a few hundred MiB), which PyTorch's
  allocator does not see, so the fraction leaves :data:`CONTEXT_MIB` of the share for it (never
  less than half the share for PyTorch): :func:`share_fraction`.
- *Lazily*: :func:`install` costs nothing where no share is set; where one is, it arms the cap
  once ``torch`` is imported (at once if it already is; otherwise after ``import torch``, through
  an import hook that removes itself), and the cap itself is queued with
  ``torch.cuda._lazy_call``, so it runs when CUDA is first used: importing torch never creates a
  CUDA context, and without CUDA (a CPU wheel, no GPU) nothing ever runs.
- Quiet and harmless: nothing here prints, and no error leaves :func:`install` or the cap (they
  are logged at debug level on the ``gpupool_lab`` logger); a kernel always starts.
- Loaded in every IPython kernel by the startup file ``gpupool_lab/ipython_startup.py``: the
  local spawner points ``PYTHONSTARTUP`` at it for a share's server, the notebook image installs it
  as ``<sys.prefix>/etc/ipython/startup/50-gpupool-share-cap.py``; jobs' ranks call
  :func:`install` in ``gpupool_lab.rank_log``.
- Never imports the hub package ``gpupool``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

__all__ = ["CONTEXT_MIB", "SharePlan", "install", "plan", "share_fraction"]

log = logging.getLogger("gpupool_lab")

CONTEXT_MIB = 512
"""Room in the share for the CUDA context and libraries, which NVML counts and PyTorch does not."""


@dataclass(frozen=True)
class SharePlan:
    """What to cap: thousandths of the GPU, and the cap in MiB when the hub gave one."""

    milli: int
    mib: int | None


def _whole(text: str | None) -> int | None:
    try:
        return int(text or "")
    except ValueError:
        return None


def plan(env: Mapping[str, str]) -> SharePlan | None:
    """The share of this process, from its environment, or ``None`` (no share, or values that
    make no sense: then nothing is capped)."""
    milli = _whole(env.get("GPUPOOL_SHARE_MILLI"))
    if milli is None or not 0 < milli < 1000:
        return None
    mib = _whole(env.get("GPUPOOL_SHARE_MIB"))
    return SharePlan(milli, mib if mib is not None and mib > 0 else None)


def share_fraction(share: SharePlan, total_mib: int) -> float | None:
    """The fraction of a ``total_mib`` GPU PyTorch may use: the share's cap less
    :data:`CONTEXT_MIB` (at least half the cap), over the GPU's memory; ``None`` for a GPU of no
    memory."""
    if total_mib <= 0:
        return None
    cap = share.mib if share.mib is not None else total_mib * share.milli // 1000
    cap = min(cap, total_mib)
    room = max(cap - CONTEXT_MIB, cap // 2)
    return room / total_mib


def _cap(torch: Any, share: SharePlan) -> None:
    """Cap PyTorch's allocator on device 0 (CUDA is initialised when this runs)."""
    try:
        total_mib = int(torch.cuda.get_device_properties(0).total_memory) >> 20
        fraction = share_fraction(share, total_mib)
        if fraction is not None:
            torch.cuda.set_per_process_memory_fraction(fraction, 0)
            log.debug("gpupool: PyTorch capped at %.3f of GPU 0 (share)", fraction)
    except Exception as e:  # never fail the user's first CUDA call
        log.debug("gpupool: could not cap PyTorch at the share: %s", e)


def arm(torch: Any, share: SharePlan) -> bool:
    """Queue the cap for CUDA's first use in ``torch`` (at once if CUDA is already in use).
    ``False`` when this torch offers no way to (then nothing is capped)."""
    cuda = getattr(torch, "cuda", None)
    lazy_call = getattr(cuda, "_lazy_call", None)
    if lazy_call is None:
        return False
    try:
        lazy_call(lambda: _cap(torch, share))
    except Exception as e:
        log.debug("gpupool: could not arm the share cap: %s", e)
        return False
    return True


class _ArmAfterImport(importlib.abc.MetaPathFinder):
    """Arms the cap once ``torch`` has been imported, then leaves ``sys.meta_path`` (the usual
    post-import hook: the module's own loader runs, and is put back on the module after)."""

    def __init__(self, share: SharePlan) -> None:
        self.share = share

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torch":
            return None
        self.remove()
        spec: importlib.machinery.ModuleSpec | None = None
        for finder in list(sys.meta_path):  # the finders after this one, in their order
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Chained(spec.loader, self.share)
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class _Chained(importlib.abc.Loader):
    """The module's loader, then the cap armed; the original loader is put back afterwards."""

    def __init__(self, loader: Any, share: SharePlan) -> None:
        self.loader = loader
        self.share = share

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        if spec is not None:
            spec.loader = self.loader
        module.__loader__ = self.loader
        self.loader.exec_module(module)
        try:
            arm(module, self.share)
        except Exception as e:
            log.debug("gpupool: could not arm the share cap: %s", e)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def install(
    env: Mapping[str, str] | None = None, modules: Mapping[str, ModuleType] | None = None
) -> str:
    """Cap PyTorch at this process's share, lazily (see the module docstring). Returns what it
    did: ``"none"`` (no share), ``"armed"`` (torch was imported: the cap is queued),
    ``"waiting"`` (the cap is armed when torch is imported) or ``"unavailable"``."""
    try:
        share = plan(os.environ if env is None else env)
        if share is None:
            return "none"
        loaded = sys.modules if modules is None else modules
        torch = loaded.get("torch")
        if torch is not None:
            return "armed" if arm(torch, share) else "unavailable"
        if not any(isinstance(f, _ArmAfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _ArmAfterImport(share))
        return "waiting"
    except Exception as e:  # a kernel always starts
        log.debug("gpupool: share cap not installed: %s", e)
        return "unavailable"
