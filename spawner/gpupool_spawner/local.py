"""``LocalGPUSpawner`` (``gpupool-local``): JupyterHub's local-process spawner, with GPUs.

Vocabulary
- *run as hub user*: servers run as the hub's own unix user, in a home directory made from
  ``home_dir_template`` (JupyterHub's ``SimpleLocalProcessSpawner`` behaviour): the local
  default, since demo users have no unix accounts. Turn it off to run each server as the real
  unix user of the same name (``LocalProcessSpawner``; the hub must then run as root).
- *visible devices*: ``CUDA_VISIBLE_DEVICES`` holds the allocated GPU or MIG UUIDs, never indexes
  (indexes change with MIG and between processes); empty for CPU-only servers.

Contract: the environment also carries ``GPUPOOL_ALLOCATION``, ``GPUPOOL_OFFER``, ``GPUPOOL_TEAM``
and ``GPUPOOL_SIMULATED``. A MIG slice without an instance UUID (a GPU in dynamic MIG mode, whose
instance would have to be created first) is refused, so a server never sees a whole GPU by mistake.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Bool, Unicode, default

from gpupool.core.ledger import Allocation
from gpupool.hub.errors import refuse

from .mixin import GPUSpawnerMixin


class LocalGPUSpawner(GPUSpawnerMixin, LocalProcessSpawner):
    run_as_hub_user = Bool(
        True,
        config=True,
        help="""Run every server as the hub's own unix user (no per-user accounts needed; no
        isolation between users: for a single-user machine or a demo). Example:
        ``c.LocalGPUSpawner.run_as_hub_user = False`` to run as real unix users.""",
    )

    home_dir_template = Unicode(
        "/tmp/gpupool-home/{username}",
        config=True,
        help="""Home directory when ``run_as_hub_user`` is on; ``{username}`` is expanded.
        Example: ``c.LocalGPUSpawner.home_dir_template = "/srv/homes/{username}"``""",
    )

    home_dir = Unicode(help="This user's home directory when running as the hub user.")

    @default("home_dir")
    def _default_home_dir(self) -> str:
        return self.home_dir_template.format(username=self.user.name)

    def gpupool_check_allocation(self, allocation: Allocation) -> None:
        missing = [d for d in allocation.devices if d.profile and not d.instance]
        if missing:
            d = missing[0]
            raise refuse(
                503,
                f"GPU {d.gpu} has MIG on without a {d.profile} instance at slot {d.start}; an "
                "admin must create MIG instances (nvidia-smi mig -cgi … -C) before the local "
                "spawner can hand them out.",
            )

    def get_env(self) -> dict[str, str]:
        env: dict[str, str] = super().get_env()
        allocation = self.gpupool_allocation
        env["CUDA_VISIBLE_DEVICES"] = allocation.visible_devices if allocation else ""
        return env

    # -- running as the hub's user (SimpleLocalProcessSpawner's behaviour) --------------------
    def make_preexec_fn(self, name: str) -> Callable[[], None]:
        if not self.run_as_hub_user:
            fn: Callable[[], None] = super().make_preexec_fn(name)
            return fn
        home = self.home_dir

        def preexec() -> None:
            os.makedirs(home, 0o755, exist_ok=True)
            os.chdir(home)

        return preexec

    def user_env(self, env: dict[str, str]) -> dict[str, str]:
        if not self.run_as_hub_user:
            out: dict[str, str] = super().user_env(env)
            return out
        env["USER"] = self.user.name
        env["HOME"] = self.home_dir
        env["SHELL"] = "/bin/bash"
        return env

    def move_certs(self, paths: Any) -> Any:
        return paths if self.run_as_hub_user else super().move_certs(paths)
