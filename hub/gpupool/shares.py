"""Shares of GPUs without MIG on this machine: how each is enforced, and what its processes see.

Vocabulary
- *share*: a device of an allocation with ``share_milli`` (thousandths of one GPU's memory), on a
  GPU without MIG; its ``visible_id`` is the GPU's UUID.
- *cap*: the share's memory in MiB, ``GPU memory × share_milli / 1000`` rounded down
  (:func:`cap_mib`): what the share's processes may use on the GPU, together.
- *enforcement* of a share, strongest first, per GPU:
  ``mps``: the admin runs NVIDIA MPS for the GPU (:attr:`ShareEnforcement.mps`); the share's
  processes get MPS client limits, so the driver refuses allocations over the cap
  (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) and bounds the SMs they use
  (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``);
  ``watched`` (every other GPU): cooperative, ``gpupool_lab``'s IPython startup hook caps
  PyTorch at the share (``torch.cuda.set_per_process_memory_fraction``), and watched: the hub
  reads per-process GPU memory through NVML and warns, then stops, a share over its cap
  (:mod:`gpupool.hub.share_watch`).
- *share environment* (:func:`share_env`): what a share's server or job gets on top of
  ``CUDA_VISIBLE_DEVICES=<GPU UUID>``: ``GPUPOOL_SHARE_MILLI``, ``GPUPOOL_SHARE_MIB`` (the cap),
  ``GPUPOOL_SHARE_ENFORCEMENT`` (``mps`` or ``watched``) and, under MPS, the client limits and
  the admin's pipe and log directories.

MPS's one-user rule: an MPS control daemon runs one MPS server at a time, with the Linux user id
of the client that asked for it; a client of another user waits until every client of the
running server has ended. Servers and jobs of different unix users on one MPS GPU would block
each other, so MPS is for the shared mode only (``run_as_hub_user = True``: every server and job
runs as one account): with per-user servers or jobs (``LocalGPUSpawner.run_as_hub_user = False``
or ``LocalJobBackend.run_as_hub_user = False``) a non-empty ``ShareEnforcement.mps`` stops the hub
at start, naming the key (:func:`check_mps_accounts`), and the spawner refuses such a share
(403) should it get one anyway.

``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` takes ``<device ordinal>=<limit>`` pairs (NVIDIA's example:
``0=1G,1=512M``), the ordinal as the client enumerates its devices, that is after
``CUDA_VISIBLE_DEVICES``; NVIDIA documents no UUID form for it. A share's process sees exactly
its GPU (by UUID), so its ordinal is 0: ``0=6144M``.

Contract: pure functions of the allocation, the inventory and the settings, and one configurable
(:class:`ShareEnforcement`) whose values are checked when set (a bad value raises
:class:`gpupool.declarations.ConfigError` naming the key, so the hub stops at start).
"""

from __future__ import annotations

import importlib.util
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from traitlets import Float, List, Unicode, validate
from traitlets.config import LoggingConfigurable

from gpupool.core.inventory import GPU
from gpupool.core.ledger import Allocation, Device
from gpupool.core.offers import Offer
from gpupool.declarations import ConfigError
from gpupool.usercode import spawner_setting

Enforcement = Literal["mps", "watched"]
KEY = "ShareEnforcement"
_MODEL = re.compile(r"^[A-Z][A-Z0-9]*-\d+GB$")
_UUID = re.compile(r"^GPU-[0-9A-Fa-f-]{4,}$")


def cap_mib(memory_mib: int, share_milli: int) -> int:
    """The memory a share of ``share_milli`` thousandths of a ``memory_mib`` GPU may use."""
    return memory_mib * share_milli // 1000


def thread_percentage(share_milli: int) -> int:
    """MPS's active thread percentage for a share: its fraction of the GPU, rounded up, 1..100."""
    return max(1, min(100, math.ceil(share_milli / 10)))


def share_devices(allocation: Allocation | None) -> list[Device]:
    """The devices of ``allocation`` that are shares (none for whole GPUs, MIG and CPU)."""
    if allocation is None:
        return []
    return [d for d in allocation.devices if d.share_milli]


class ShareEnforcement(LoggingConfigurable):
    """How shares of GPUs without MIG are enforced on this machine (see the module docstring)."""

    mps = List(
        Unicode(),
        [],
        config=True,
        help="""The GPUs where the admin runs NVIDIA MPS (``nvidia-cuda-mps-control -d``), by
        UUID or by model key, or ``"*"`` for every GPU without MIG. Shares there get MPS client
        limits: a hard memory limit and a bounded share of the SMs. Every other share is capped
        in PyTorch and watched (see ``grace_minutes``). MPS serves one unix user at a time, so it
        needs the shared mode (``run_as_hub_user = True``); with per-user servers or jobs the hub
        refuses to start. Default: none. Example::

            c.ShareEnforcement.mps = ["GPU-5f1c0a7e-2b1d-4c3e-9f00-1234567890ab", "L40S-48GB"]
        """,
    )
    mps_pipe_directory = Unicode(
        "",
        config=True,
        help="""``CUDA_MPS_PIPE_DIRECTORY`` for shares' processes: where the MPS control daemon
        was started with its pipes (empty: MPS's default, ``/tmp/nvidia-mps``). Example:
        ``c.ShareEnforcement.mps_pipe_directory = "/run/nvidia-mps"``""",
    )
    mps_log_directory = Unicode(
        "",
        config=True,
        help="""``CUDA_MPS_LOG_DIRECTORY`` for shares' processes (empty: MPS's default,
        ``/var/log/nvidia-mps``). Example:
        ``c.ShareEnforcement.mps_log_directory = "/var/log/nvidia-mps"``""",
    )
    grace_minutes = Float(
        10.0,
        config=True,
        help="""For shares without MPS: how long a share's processes may stay over its memory cap
        (read through NVML) after the user is warned in JupyterLab, before the server is
        stopped or the job cancelled. Example: ``c.ShareEnforcement.grace_minutes = 5``""",
    )
    period = Float(
        30.0,
        config=True,
        help="""Seconds between two readings of the shares' GPU memory. Example:
        ``c.ShareEnforcement.period = 15``""",
    )

    @validate("mps")
    def _valid_mps(self, proposal: dict[str, Any]) -> list[str]:
        value = list(proposal["value"])
        for i, entry in enumerate(value):
            text = entry.strip()
            if text != "*" and not _UUID.match(text) and not _MODEL.match(text):
                raise ConfigError(
                    f"{KEY}.mps[{i}]",
                    f"must be a GPU UUID ('GPU-…'), a model key like 'L40S-48GB', or '*', got "
                    f"{entry!r}",
                )
        return [e.strip() for e in value]

    @validate("grace_minutes", "period")
    def _valid_minutes(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        name = proposal["trait"].name
        if not math.isfinite(value) or value < 0 or (name == "period" and value == 0):
            bound = "> 0" if name == "period" else ">= 0"
            raise ConfigError(f"{KEY}.{name}", f"must be a number {bound}, got {value!r}")
        return value

    def uses_mps(self, gpu: GPU) -> bool:
        """Whether ``gpu``'s shares run under MPS (never a GPU in MIG mode)."""
        if gpu.mig_enabled:
            return False
        return any(e in ("*", gpu.uuid, gpu.model) for e in self.mps)

    def enforcement(self, gpu: GPU | None) -> Enforcement:
        return "mps" if gpu is not None and self.uses_mps(gpu) else "watched"


def share_env(
    allocation: Allocation | None, gpus: Iterable[GPU], enforcement: ShareEnforcement
) -> dict[str, str]:
    """The variables a share's server or job gets (nothing for any other allocation): the
    share (``GPUPOOL_SHARE_MILLI``), its cap (``GPUPOOL_SHARE_MIB``), how it is enforced
    (``GPUPOOL_SHARE_ENFORCEMENT``) and, under MPS, the client limits and directories.
    ``CUDA_VISIBLE_DEVICES`` is the caller's: the GPU UUID, as for any device."""
    shares = share_devices(allocation)
    if not shares:
        return {}
    by_uuid = {g.uuid: g for g in gpus}
    first = shares[0]
    milli = first.share_milli or 0
    gpu = by_uuid.get(first.gpu)
    env = {
        "GPUPOOL_SHARE_MILLI": str(milli),
        "GPUPOOL_SHARE_MIB": str(cap_mib(gpu.memory_mib, milli)) if gpu else "",
        "GPUPOOL_SHARE_ENFORCEMENT": enforcement.enforcement(gpu),
    }
    if env["GPUPOOL_SHARE_ENFORCEMENT"] == "mps":
        limits = []
        for ordinal, d in enumerate(shares):  # the client's ordinals: CUDA_VISIBLE_DEVICES order
            g = by_uuid.get(d.gpu)
            if g is not None:
                limits.append(f"{ordinal}={cap_mib(g.memory_mib, d.share_milli or 0)}M")
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(limits)
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage(milli))
        if enforcement.mps_pipe_directory:
            env["CUDA_MPS_PIPE_DIRECTORY"] = enforcement.mps_pipe_directory
        if enforcement.mps_log_directory:
            env["CUDA_MPS_LOG_DIRECTORY"] = enforcement.mps_log_directory
    return env


STARTUP_FILE = "ipython_startup.py"
"""gpupool_lab's IPython startup file (in the package), which caps PyTorch at a share."""


def ipython_startup_file() -> str:
    """Where gpupool_lab's IPython startup file is (found, never imported: the hub does not
    import the notebook side), or ``""`` where gpupool_lab is not installed."""
    try:
        spec = importlib.util.find_spec("gpupool_lab")
    except (ImportError, ValueError):
        return ""
    if spec is None or not spec.origin:
        return ""
    path = Path(spec.origin).parent / STARTUP_FILE
    return str(path) if path.is_file() else ""


def check_mps_accounts(enforcement: ShareEnforcement, config: Any) -> None:
    """Stop the hub at start, naming the key, when MPS is on for some GPU while servers or jobs
    run as their users' own unix accounts (MPS's one-user rule, see the module docstring)."""
    if not enforcement.mps:
        return
    spawner_per_user = not spawner_setting(config, "run_as_hub_user", True)
    jobs = config.get("LocalJobBackend", {})
    jobs_per_user = not jobs.get("run_as_hub_user", not spawner_per_user)
    if spawner_per_user or jobs_per_user:
        which = "LocalGPUSpawner" if spawner_per_user else "LocalJobBackend"
        raise ConfigError(
            f"{KEY}.mps",
            f"MPS serves one unix user at a time (a client of another user waits until every "
            f"client of the running MPS server has ended), but {which}.run_as_hub_user = False "
            "runs each user's code as their own account; run servers and jobs in the shared "
            "mode (run_as_hub_user = True), or leave ShareEnforcement.mps empty (shares are "
            "then capped in PyTorch and watched)",
        )


def mps_refusal(allocation: Allocation, gpus: Iterable[GPU], enforcement: ShareEnforcement) -> str:
    """Why a per-user server cannot take ``allocation`` (a share on an MPS GPU), or ``""``."""
    by_uuid = {g.uuid: g for g in gpus}
    for d in share_devices(allocation):
        gpu = by_uuid.get(d.gpu)
        if gpu is not None and enforcement.uses_mps(gpu):
            return (
                f"GPU {gpu.uuid} shares its memory through NVIDIA MPS, which serves one unix user "
                "at a time, and this hub runs each user's server as their own account; ask an "
                "admin to run servers in the shared mode or to leave this GPU out of "
                "ShareEnforcement.mps."
            )
    return ""


def offer_enforcement(offer: Offer, gpus: Iterable[GPU], enforcement: ShareEnforcement) -> str:
    """What the spawn page says of a share offer's enforcement, over the GPUs it may land on
    (``""`` for other offers): MPS's hard limit, the watched cap, or both where GPUs differ."""
    if offer.kind != "share":
        return ""
    able = [
        g
        for g in gpus
        if not g.mig_enabled and g.share_resource != "" and offer.model in (None, g.model)
    ]
    if able and all(g.share_resource for g in able):  # shared out by Kubernetes, not the hub
        hami = {g.share_resource == "hami" for g in able}
        plugin = "one replica of a GPU the device plugin shares (MPS: its memory limit)"
        return "; ".join(["HAMi: hard memory limit"] * (True in hami) + [plugin] * (False in hami))
    kinds = {enforcement.enforcement(g) for g in able}
    watched = (
        "shared; capped in PyTorch and watched; over the cap you are warned, then stopped "
        f"after {enforcement.grace_minutes:g} minutes"
    )
    if kinds == {"mps"}:
        return "MPS: hard memory limit"
    if kinds == {"mps", "watched"}:
        return f"MPS: hard memory limit on some GPUs; elsewhere {watched}"
    return watched[0].upper() + watched[1:]
