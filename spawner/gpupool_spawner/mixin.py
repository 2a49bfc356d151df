"""The GPU logic every gpupool spawner shares: choose, check and hold devices around a server.

Vocabulary
- *user options*: ``{"offer": "h100", "count": 2, "team": "vision"}``, from the spawn form or
  from ``user_options`` of the REST API; ``team`` may be left out by a user in one team, and
  ``offer`` defaults to ``cpu``. Both doors are checked by the same code, on the hub.
- *allocation*: what the pool granted this server (see :class:`gpupool.core.ledger.Allocation`);
  its id is in the spawner's state, so a hub restart re-attaches the running server to it.
- *ref*: ``user/server-name``, what the allocation is for.

Contract: an allocation is taken before the server starts and released when it stops, when a
start fails, and when ``poll`` finds the server gone. Refusals become 4xx HTTP errors carrying
the pool's sentence (see :mod:`gpupool.hub.errors`); nothing waits out ``start_timeout``.
Options over ``max_user_options_bytes`` are refused (413) before anything reads them, and a
refused start leaves no options in JupyterHub's database (it stores them before ``start``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from jupyterhub.spawner import Spawner
from sqlalchemy.orm import object_session
from traitlets import Int, Unicode, default

from gpupool.core.errors import InvalidRequest, PoolError, TooLarge, UnknownAllocation
from gpupool.core.ledger import Allocation
from gpupool.core.offers import Offer
from gpupool.core.parse import check_size, clip, clip_names, json_size, whole_number
from gpupool.hub.errors import http_error
from gpupool.hub.form import FIELD, render
from gpupool.hub.menu import menu
from gpupool.hub.objects import hub_objects
from gpupool.hub.reconcile import STATE_KEY
from gpupool.pool import Pool

MAX_COUNT = 64
"""The largest ``count`` a request may name at all (each offer has its own, smaller maximum)."""


def parse_user_options(options: dict[str, Any]) -> tuple[str, int, str | None]:
    """``(offer, count, team)`` from user options, or :class:`InvalidRequest` saying why not."""
    offer = options.get("offer", "cpu")
    team = options.get("team") or None
    if not isinstance(offer, str) or not offer:
        raise InvalidRequest(f"user_options.offer must be an offer name, got {clip(offer)}.")
    count = whole_number(options.get("count", 1), "user_options.count", 1, MAX_COUNT)
    if team is not None and not isinstance(team, str):
        raise InvalidRequest(f"user_options.team must be a team name, got {clip(team)}.")
    unknown = sorted(set(options) - {"offer", "count", "team"})
    if unknown:
        raise InvalidRequest(
            f"Unknown user_options {clip_names(unknown)}; use offer, count and team."
        )
    return offer, count, team


class GPUSpawnerMixin(Spawner):
    """Mix in before a JupyterHub spawner: ``class X(GPUSpawnerMixin, LocalProcessSpawner)``."""

    gpupool_allocation_id = Unicode("", help="The pool allocation this server holds (state).")
    max_user_options_bytes = Int(
        4096,
        config=True,
        help="""The largest server options (``user_options`` from the REST API, or the spawn
        form's fields) a start accepts, in bytes of JSON; bigger ones get HTTP 413 with the limit
        before anything reads them. gpupool's own options take under 200 bytes. Example:
        ``c.GPUSpawnerMixin.max_user_options_bytes = 16384``""",
    )

    # -- the pool and this server's allocation ----------------------------------------------
    @property
    def gpupool(self) -> Pool:
        """The hub's pool, from the hub objects ``setup(c)`` put into the hub's settings."""
        return hub_objects(self.user.settings).pool

    @property
    def gpupool_ref(self) -> str:
        return f"{self.user.name}/{self.name}"

    @property
    def gpupool_allocation(self) -> Allocation | None:
        if not self.gpupool_allocation_id:
            return None
        return self.gpupool.ledger.allocations.get(self.gpupool_allocation_id)

    @property
    def gpupool_offer(self) -> Offer | None:
        allocation = self.gpupool_allocation
        return self.gpupool.ledger.offers.get(allocation.offer) if allocation else None

    def gpupool_groups(self) -> list[str]:
        return [g.name for g in self.user.groups]

    def gpupool_release(self, alloc_id: str | None = None) -> None:
        """Give this server's devices back (idempotent)."""
        alloc_id = alloc_id or self.gpupool_allocation_id
        self.gpupool_allocation_id = ""
        if alloc_id:
            with contextlib.suppress(UnknownAllocation):
                self.gpupool.release(alloc_id)

    # -- the spawn page ----------------------------------------------------------------------
    @default("options_form")
    def _gpupool_options_form(self) -> Any:
        return self._render_gpupool_form

    def _render_gpupool_form(self, spawner: Any = None) -> str:
        pool = self.gpupool
        menus = menu(pool.ledger, self.user.name, self.gpupool_groups())
        return render(menus, pool.inventory.label, pool.inventory.simulated)

    def options_from_form(self, formdata: dict[str, list[str]]) -> dict[str, Any]:
        try:
            check_size(json_size(formdata), self.max_user_options_bytes, "The spawn form")
            parts = (formdata.get(FIELD) or [""])[0].split("|")
            if len(parts) != 3:
                raise InvalidRequest("Choose one of the offers on the form.")
            team, offer, count = parts
            number = whole_number(count, "count", 1, MAX_COUNT)
        except PoolError as e:
            if not isinstance(e, TooLarge):
                e = InvalidRequest("Choose one of the offers on the form.")
            self.log.info("gpupool: refused the spawn form of %s: %s", self.gpupool_ref, e.message)
            raise http_error(e) from None
        return {"team": team or None, "offer": offer, "count": number}

    @default("apply_user_options")
    def _gpupool_apply_user_options(self) -> Any:
        """gpupool reads ``user_options`` itself, in :meth:`start`; this keeps JupyterHub from
        logging their (user-chosen, unbounded) keys as "unhandled" on every start."""
        return _options_read_in_start

    def gpupool_forget_options(self) -> None:
        """Clear the options of a refused start: JupyterHub's ``User.spawn`` stores them in its
        database (``orm_spawner.user_options``, committed) before it calls :meth:`start`, where
        a refusal would leave them, however big, and offer them as the next start's defaults."""
        self.user_options = {}
        orm_spawner = self.orm_spawner
        if orm_spawner is not None and orm_spawner.user_options:
            orm_spawner.user_options = {}
            session = object_session(orm_spawner)
            if session is not None:
                session.commit()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> Any:
        pool = self.gpupool
        try:
            options = dict(self.user_options or {})
            check_size(json_size(options), self.max_user_options_bytes, "user_options")
            offer, count, team = parse_user_options(options)
            stale = [a.id for a in pool.ledger.allocations.values() if a.ref == self.gpupool_ref]
            for alloc_id in stale:  # left by a start the hub did not finish (e.g. a crash)
                pool.release(alloc_id)
            allocation = pool.allocate(
                self.user.name,
                self.gpupool_groups(),
                offer,
                count,
                team=team,
                kind="notebook",
                ref=self.gpupool_ref,
            )
        except PoolError as e:
            self.log.info("gpupool: refused %s: %s", self.gpupool_ref, e.message)
            self.gpupool_forget_options()
            raise http_error(e) from None
        self.gpupool_allocation_id = allocation.id
        try:
            self.gpupool_check_allocation(allocation)
            return await super().start()
        except BaseException:
            self.gpupool_release()
            raise

    def gpupool_check_allocation(self, allocation: Allocation) -> None:
        """Hook: refuse an allocation this spawner cannot honour (raise ``web.HTTPError``)."""

    async def stop(self, now: bool = False) -> Any:
        held = self.gpupool_allocation_id  # the parent's stop may clear the state
        try:
            return await super().stop(now=now)
        finally:
            self.gpupool_release(held)

    async def poll(self) -> int | None:
        held = self.gpupool_allocation_id  # the parent's poll clears the state of a dead server
        status = self.gpupool_exit_status(await super().poll())
        if status is not None and held:
            self.log.info(
                "gpupool: %s is gone (exit status %s); releasing its devices",
                self.gpupool_ref,
                status,
            )
            self.gpupool_release(held)
        return status

    def gpupool_exit_status(self, status: int | None) -> int | None:
        """Hook: what ``poll`` says of the parent's ``status`` (an :class:`UnknownExit` where the
        exit status cannot be known)."""
        return status

    def get_env(self) -> dict[str, str]:
        """The parent's environment plus ``GPUPOOL_ALLOCATION``, ``GPUPOOL_OFFER``,
        ``GPUPOOL_TEAM``, ``GPUPOOL_SIMULATED`` and ``GPUPOOL_HUB`` (this hub's marker: only
        processes carrying it are ever reconciled, see :mod:`gpupool.hub.reconcile`); the local
        spawner adds ``CUDA_VISIBLE_DEVICES`` (on Kubernetes the device plugin sets it)."""
        env: dict[str, str] = super().get_env()
        allocation = self.gpupool_allocation
        env["GPUPOOL_HUB"] = self.gpupool.hub_marker
        env["GPUPOOL_ALLOCATION"] = allocation.id if allocation else ""
        env["GPUPOOL_OFFER"] = allocation.offer if allocation else ""
        env["GPUPOOL_TEAM"] = allocation.team if allocation else ""
        env["GPUPOOL_SIMULATED"] = "1" if self.gpupool.inventory.simulated else "0"
        return env

    # -- state across hub restarts -----------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = super().get_state()
        if self.gpupool_allocation_id:
            state[STATE_KEY] = self.gpupool_allocation_id
        return state

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.gpupool_allocation_id = state.get(STATE_KEY, "")

    def clear_state(self) -> None:
        super().clear_state()
        self.gpupool_allocation_id = ""


class UnknownExit(int):
    """An exit status nobody can know: 0, JupyterHub's "unknown" (see ``Spawner.poll``), that
    says so wherever it is written out, e.g. for a server this hub re-attached to after a
    restart, whose exit status only its parent could read."""

    why: str

    def __new__(cls, why: str) -> UnknownExit:
        status = super().__new__(cls, 0)
        status.why = why
        return status

    def __str__(self) -> str:
        return f"unknown ({self.why})"

    __repr__ = __str__


def _options_read_in_start(spawner: Spawner, user_options: dict[str, Any]) -> None:
    """``Spawner.apply_user_options`` of gpupool's spawners: nothing (see ``start``)."""
