"""``LocalGPUSpawner`` (``gpupool-local``): JupyterHub's local-process spawner, with GPUs.

Vocabulary
- *shared mode* (``run_as_hub_user``, the default): every server runs as one unix account, in a
  home directory made from ``home_dir_template`` (JupyterHub's ``SimpleLocalProcessSpawner``
  behaviour), since demo users have no unix accounts. That account is the hub's own, or
  ``shared_account`` when the hub runs as root: a server never runs as root.
- *per-user mode* (``run_as_hub_user = False``): each server runs as the real unix user of the
  same name, in its unix home (``LocalProcessSpawner``; the hub must run as root). A hub user
  without a unix account, or one whose account is root, is refused.
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
from gpupool.settings import ConfigError
from gpupool.usercode import Account, account, check_shared_mode

from .mixin import GPUSpawnerMixin


class LocalGPUSpawner(GPUSpawnerMixin, LocalProcessSpawner):
    run_as_hub_user = Bool(
        True,
        config=True,
        help="""Run every server as the hub's own unix user (no per-user accounts needed; no
        isolation between users: for a single-user machine or a demo). Example:
        ``c.LocalGPUSpawner.run_as_hub_user = False`` to run as real unix users.""",
    )

    shared_account = Unicode(
        "",
        config=True,
        help="""The unprivileged unix account every server runs as in the shared mode when the
        hub runs as root (empty: the hub's own account, refused when that is root; user code
        never runs as root). ``make run`` creates and uses ``gpupool-demo``. Example:
        ``c.LocalGPUSpawner.shared_account = "gpupool-demo"``""",
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

    def code_account(self) -> Account:
        """The account this server runs as; a 403 naming what to do if it would be root or
        does not exist (the hub checks the shared mode's setting at start as well)."""
        try:
            if self.run_as_hub_user:
                return check_shared_mode(self.shared_account, "LocalGPUSpawner.shared_account")
            return account(self.user.name, "LocalGPUSpawner.run_as_hub_user")
        except ConfigError as e:
            raise refuse(403, f"{self.user.name}'s server cannot start here: {e}") from None

    async def start(self) -> Any:
        self.code_account()  # before any allocation: refuse at once, naming the setting
        return await super().start()

    # -- the shared mode (SimpleLocalProcessSpawner's behaviour, never as root) -------------
    def make_preexec_fn(self, name: str) -> Callable[[], None]:
        if not self.run_as_hub_user:
            fn: Callable[[], None] = super().make_preexec_fn(name)
            return fn
        home, shared = self.home_dir, self.code_account()
        switch = shared.uid != os.geteuid()

        def preexec() -> None:
            if switch:  # the hub is root: become the shared account before touching the home
                os.setgid(shared.gid)
                os.setgroups(list(shared.groups))
                os.setuid(shared.uid)
            os.makedirs(home, 0o700, exist_ok=True)
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
