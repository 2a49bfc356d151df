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
  (indexes change with MIG and between processes), in the allocation's order; empty for CPU-only
  servers. A server given several MIG instances gets them all there, but a CUDA process sees only
  the first MIG instance it lists: the spawn page says so, and the user gives each process its
  own UUID (or runs a job, one rank per instance).

Contract: the environment also carries ``GPUPOOL_ALLOCATION``, ``GPUPOOL_OFFER``, ``GPUPOOL_TEAM``,
``GPUPOOL_SIMULATED`` and ``GPUPOOL_HUB``. On a GPU gpupool manages (``GPUPool.managed_mig``) the
pool has created the MIG instance before the server starts, and the server sees exactly its
``MIG-…`` UUID. A MIG slice without an instance UUID (a GPU in MIG mode with no instances that
gpupool does not manage) is refused, so a server never sees a whole GPU by mistake. The state
keeps the server's process start time next to its pid, so a restarted hub never takes (or
signals) a recycled pid for its server; a re-attached server that ends is reported with an
unknown exit status (only its parent could read it). A server's exit is noticed at once, not at
JupyterHub's next poll (``poll_interval``, 30 s): while JupyterHub polls it, a pidfd of its
process (Linux 5.3+) wakes JupyterHub's own ``poll_and_notify`` when the process ends, which
stops the server in the hub and releases its devices within a second or so.

A share of a GPU without MIG (see :mod:`gpupool.shares`) also gets ``GPUPOOL_SHARE_MILLI``,
``GPUPOOL_SHARE_MIB`` (its cap), ``GPUPOOL_SHARE_ENFORCEMENT``, under MPS the client limits, and
``PYTHONSTARTUP`` (gpupool_lab's startup file, which caps PyTorch at the share). A per-user server
(``run_as_hub_user = False``) is refused a share on an MPS GPU: MPS serves one unix user at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Any

from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Bool, Int, Unicode, default

from gpupool.core.ledger import Allocation
from gpupool.declarations import ConfigError
from gpupool.hub.errors import refuse
from gpupool.hub.objects import hub_objects
from gpupool.hub.records import START_KEY
from gpupool.procfs import process_start
from gpupool.shares import (
    ShareEnforcement,
    ipython_startup_file,
    mps_refusal,
    offer_enforcement,
    share_env,
)
from gpupool.usercode import Account, account, check_shared_mode
from gpupool_spawner.mixin import GPUSpawnerMixin, UnknownExit


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

    niceness = Int(
        10,
        min=0,
        max=19,
        config=True,
        help="""How much lower than the hub's the CPU priority of user code is (servers, and
        jobs through ``LocalJobBackend.niceness``), so the hub answers everyone while one user's
        code keeps every core busy: ``nice`` values, 0 to 19 (0: the hub's priority). Example:
        ``c.LocalGPUSpawner.niceness = 5``""",
    )

    home_dir = Unicode(help="This user's home directory when running as the hub user.")

    gpupool_process_start: int | None = None
    """When the server's process started (clock ticks since boot; saved in the state)."""
    _gpupool_polled_pid = 0
    _gpupool_gone: UnknownExit | None = None
    _gpupool_exit_fd: int | None = None
    _gpupool_exit_notice: asyncio.Task[Any] | None = None

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
                "admin must create MIG instances (nvidia-smi mig -cgi … -C), or let gpupool "
                "create them (c.GPUPool.managed_mig), before the local spawner can hand them "
                "out.",
            )
        if not self.run_as_hub_user:  # MPS serves one unix user at a time (gpupool.shares)
            gpus = self.gpupool.inventory.gpus
            why = mps_refusal(allocation, gpus, self.gpupool_share_enforcement)
            if why:
                raise refuse(403, why)

    def get_env(self) -> dict[str, str]:
        env: dict[str, str] = super().get_env()
        allocation = self.gpupool_allocation
        env["CUDA_VISIBLE_DEVICES"] = allocation.visible_devices if allocation else ""
        env.update(self.gpupool_share_env(allocation))
        return env

    # -- shares of GPUs without MIG (see gpupool.shares) -------------------------------------
    @property
    def gpupool_share_enforcement(self) -> ShareEnforcement:
        """The hub's share settings (checked at start), from the share watch ``setup(c)`` built."""
        watch = hub_objects(self.user.settings).shares
        return watch.enforcement if watch is not None else ShareEnforcement(config=self.config)

    def gpupool_share_env(self, allocation: Allocation | None) -> dict[str, str]:
        """A share's variables (:func:`gpupool.shares.share_env`) and, unless the environment
        names its own, ``PYTHONSTARTUP``: gpupool_lab's IPython startup file, which caps
        PyTorch at the share in every kernel (IPython runs it at kernel start)."""
        env = share_env(allocation, self.gpupool.inventory.gpus, self.gpupool_share_enforcement)
        if env and "PYTHONSTARTUP" not in self.environment:
            startup = ipython_startup_file()
            if startup:
                env["PYTHONSTARTUP"] = startup
        return env

    def gpupool_offer_notes(self) -> dict[str, str]:
        enforcement = self.gpupool_share_enforcement
        gpus = self.gpupool.inventory.gpus
        notes = {
            name: offer_enforcement(offer, gpus, enforcement)
            for name, offer in self.gpupool.ledger.offers.items()
        }
        return {**super().gpupool_offer_notes(), **{n: note for n, note in notes.items() if note}}

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
        self._gpupool_gone = None
        started = await super().start()
        self.gpupool_process_start = process_start(self.pid) if self.pid else None
        return started

    # -- the server's exit, noticed at once -----------------------------------------------
    def start_polling(self) -> None:
        super().start_polling()
        self._gpupool_watch_exit()

    def stop_polling(self) -> None:
        super().stop_polling()
        self._gpupool_unwatch_exit()

    def _gpupool_watch_exit(self) -> None:
        """Run JupyterHub's ``poll_and_notify`` as soon as the server's process ends (its pidfd
        turns readable), as its periodic poll would later; a pid that is gone already, or a
        kernel without pidfds, leaves it to the periodic poll."""
        self._gpupool_unwatch_exit()
        if not self.pid or not hasattr(os, "pidfd_open"):
            return
        saved = self.gpupool_process_start
        try:
            fd = os.pidfd_open(self.pid)
        except OSError:
            return
        if saved is not None and process_start(self.pid) != saved:  # a recycled pid
            os.close(fd)
            return
        self._gpupool_exit_fd = fd
        asyncio.get_running_loop().add_reader(fd, self._gpupool_exited)

    def _gpupool_exited(self) -> None:
        self._gpupool_unwatch_exit()
        self.log.info("gpupool: %s's server process ended; the hub stops it now", self.gpupool_ref)
        self._gpupool_exit_notice = asyncio.ensure_future(self.poll_and_notify())

    def _gpupool_unwatch_exit(self) -> None:
        fd, self._gpupool_exit_fd = self._gpupool_exit_fd, None
        if fd is not None:
            with contextlib.suppress(RuntimeError, ValueError):  # the loop is closed
                asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)

    # -- a server re-attached after a hub restart: its pid and start time; its exit ---------
    async def _signal(self, sig: int) -> bool:
        """JupyterHub's: signal the server, ``False`` if it is gone. A pid that now names
        another process (its start time is not the one saved) is gone, and never signalled."""
        saved = self.gpupool_process_start
        if self.pid and saved is not None and process_start(self.pid) != saved:
            return False
        alive: bool = await super()._signal(sig)
        return alive

    async def poll(self) -> int | None:
        self._gpupool_polled_pid = self.pid if self.proc is None else 0  # before it is cleared
        return await super().poll()

    def gpupool_exit_status(self, status: int | None) -> int | None:
        """A server this hub did not start (re-attached by pid) has an unknown exit status,
        also in the polls after its state was cleared (JupyterHub's log of the stop)."""
        if status is None or self.proc is not None:
            return status
        if self._gpupool_polled_pid:
            self._gpupool_gone = UnknownExit(
                f"process {self._gpupool_polled_pid} is gone; it is not a child of this hub, so "
                "its exit status cannot be read"
            )
        return self._gpupool_gone if self._gpupool_gone is not None else status

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = super().get_state()
        if self.gpupool_process_start is not None and state.get("pid"):
            state[START_KEY] = self.gpupool_process_start
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        start = state.get(START_KEY)
        self.gpupool_process_start = start if isinstance(start, int) else None

    def clear_state(self) -> None:
        super().clear_state()
        self.gpupool_process_start = None

    # -- the shared mode (SimpleLocalProcessSpawner's behaviour, never as root) -------------
    def make_preexec_fn(self, name: str) -> Callable[[], None]:
        become, niceness = self._make_preexec_fn(name), self.niceness

        def preexec() -> None:
            os.nice(niceness)  # lower only: allowed to anyone, before or after the switch
            become()

        return preexec

    def _make_preexec_fn(self, name: str) -> Callable[[], None]:
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
