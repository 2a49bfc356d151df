"""The hub's objects, built once at start and handed to whoever needs them.

Vocabulary
- *hub objects* (:class:`HubObjects`): the pool, the job manager, the idle reclaimer, the
  share watch, the device watch and the spawn gate of one hub process, and on a Kubernetes
  inventory the reconciler that follows the cluster.
  ``setup(c)`` builds them and puts them into JupyterHub's tornado settings under
  :data:`SETTINGS_KEY`; REST handlers and pages read ``self.settings``, spawners
  ``self.user.settings`` (JupyterHub hands every ``User`` the same settings dict). Tests build
  their own with :func:`build` and pass them in the same way; nothing reaches them through a
  module global.

Contract: traitlets deep-copies every configured value when it loads it into JupyterHub;
:class:`HubObjects` copies as itself, so the hub's settings hold these very objects (one pool,
one lock). :func:`hub_objects` raises a ``RuntimeError`` naming ``setup(c)`` when the settings
hold none: a hub configured without gpupool's setup, a misconfiguration, not a user's error.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from traitlets.config import Config

from gpupool.hub.device_watch import DeviceWatch, build_device_watch
from gpupool.hub.reclaim import IdleReclaimer, hub_urls
from gpupool.hub.share_watch import ShareWatch, build_watch
from gpupool.hub.spawn_gate import SpawnGate
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool

if TYPE_CHECKING:
    from gpupool.kube.reconcile import KubeReconciler
    from gpupool.slurm.engine import SlurmEngine

SETTINGS_KEY = "gpupool"
"""The tornado settings key that holds the hub's :class:`HubObjects`."""


@dataclass(frozen=True, eq=False)
class HubObjects:
    pool: Pool
    jobs: JobManager
    reclaimer: IdleReclaimer
    kube: KubeReconciler | None = None
    """On a Kubernetes inventory: what keeps the pool in step with the cluster's nodes and pods."""
    shares: ShareWatch | None = None
    """What keeps shares of GPUs without MIG within their memory (:mod:`.share_watch`)."""
    devices: DeviceWatch | None = None
    """What keeps every device to its holders (:mod:`.device_watch`)."""
    gate: SpawnGate | None = None
    """What refuses starts beyond the spawn limit before JupyterHub's spawn (:mod:`.spawn_gate`)."""
    slurm: SlurmEngine | None = None
    """On a Slurm inventory: the commands, the shared poller and the mirror
    (:mod:`gpupool.slurm.engine`)."""

    def __deepcopy__(self, memo: dict[int, Any]) -> HubObjects:
        return self  # one pool per hub: configuration copies must share it


def build(
    pool: Pool,
    config: Config,
    log: logging.Logger,
    kube: KubeReconciler | None = None,
    slurm: SlurmEngine | None = None,
) -> HubObjects:
    """The job manager and the reclaimer over ``pool``, configured from the hub's ``config``;
    the reclaimer gets a fresh random service token (in memory only, never logged). ``kube``:
    the Kubernetes reconciler ``setup(c)`` built, if any."""
    jobs = JobManager(pool, config=config, log=log, slurm=slurm)
    api_url, public_url = hub_urls(config)
    reclaimer = IdleReclaimer(
        pool, secrets.token_hex(32), api_url, public_url, config=config, log=log
    )
    shares = build_watch(pool, reclaimer, jobs, config, log)
    devices = build_device_watch(pool, reclaimer, jobs, config, log)
    return HubObjects(pool, jobs, reclaimer, kube, shares, devices, SpawnGate(pool), slurm)


def hub_objects(settings: Mapping[str, Any]) -> HubObjects:
    """The hub objects in JupyterHub's tornado ``settings``."""
    found = settings.get(SETTINGS_KEY)
    if not isinstance(found, HubObjects):
        raise RuntimeError(
            "gpupool's objects are not in the hub's settings: call gpupool.hub.setup(c) at the "
            "end of jupyterhub_config.py."
        )
    return found
