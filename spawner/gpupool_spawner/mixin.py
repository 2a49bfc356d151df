"""The GPU logic every gpupool spawner shares: choose, check and hold devices around a server.

Vocabulary
- *user options*: gpupool's keys ``{"offer": "h100", "count": 2, "team": "vision"}`` (see
  :mod:`gpupool_spawner.options`), from the spawn form, a spawn link or ``user_options`` of the
  REST API, next to any keys of others, which gpupool leaves alone; ``team`` may be left out by a
  user in one team; a start that names no offer gets the user's only choice, else
  ``default_offer``. A spawner may limit the offers of a start from its other options
  (``gpupool_offer_limit``: KubeGPUSpawner's profiles). Both doors are checked by the same code,
  on the hub.
- *spawn form*: gpupool's radio list, shown per ``spawn_form`` (by default only when there is
  something to choose), printed by a Jinja template an admin may replace or extend
  (``spawn_form_template``, :mod:`gpupool.hub.form`); ``options_from_form`` stays JupyterHub's
  configurable trait, with gpupool's parser as its default, and an admin's callable composes
  with it.
- *allocation*: what the pool granted this server (see :class:`gpupool.core.ledger.Allocation`);
  its id is in the spawner's state, so a hub restart re-attaches the running server to it.
- *ref*: ``user/server-name``, what the allocation is for.

Contract: an allocation is taken before the server starts and released when it stops, when a
start fails, and when ``poll`` finds the server gone. A user with as many servers starting as
``user_limits.spawns`` allows (named servers) is refused at once (429), before anything is
allocated; a start through the REST API that every team of the user would refuse so is refused
before JupyterHub's spawn begins (:mod:`gpupool.hub.spawn_gate`). Refusals become 4xx HTTP
errors carrying the pool's sentence (see :mod:`gpupool.hub.errors`); nothing waits out
``start_timeout``.
Options over ``max_user_options_bytes`` are refused (413) before anything reads them, options
holding text no page can show (a lone surrogate, a NUL, in any key or value, anyone's) or nested
too deep are refused (400, :func:`gpupool.core.parse.check_texts`), and a refused start leaves
no options in JupyterHub's database (it stores them before ``start``).
"""

from __future__ import annotations

import contextlib
from typing import Any

from jupyterhub.spawner import Spawner
from sqlalchemy.orm import object_session
from traitlets import Int, List, TraitError, Unicode, default, validate

from gpupool.core.errors import InvalidRequest, PoolError, TooLarge, UnknownAllocation
from gpupool.core.ledger import Allocation
from gpupool.core.offers import MIG_NOTEBOOK_NOTE, Offer
from gpupool.core.parse import check_size, check_texts, json_size
from gpupool.core.quota import EVERYONE, resolve_team
from gpupool.hub.compat import query_options
from gpupool.hub.errors import http_error
from gpupool.hub.form import SPAWN_FORMS, form_template, form_view, render
from gpupool.hub.menu import Choice, menu
from gpupool.hub.objects import hub_objects
from gpupool.hub.records import STATE_KEY
from gpupool.hub.spawn_gate import starting
from gpupool.pool import Pool
from gpupool_spawner.options import OfferLimit, from_form, others, parse_user_options


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

    # -- the spawn page and the options ------------------------------------------------------
    spawn_form = Unicode(
        "choices",
        config=True,
        help="""When the spawn page shows gpupool's form: ``choices`` (when the user has more than
        one thing that could start: offers, counts or teams; with nothing to choose the server
        starts at once, as JupyterHub does without a form), ``always``, or ``never`` (every start
        takes what the REST call or spawn link names, else ``default_offer``). Example:
        ``c.GPUSpawnerMixin.spawn_form = "always"``""",
    )
    spawn_form_template = Unicode(
        "",
        config=True,
        help="""gpupool's spawn form as your own Jinja template (autoescaped), instead of its
        default ``gpupool-spawn-form.html``: replace it, or extend it and override its blocks
        (``intro``, ``simulated``, ``team``, ``legend``, ``quota``, ``choice``, ``nothing``,
        ``outro``). The template gets ``form`` (:class:`gpupool.hub.form.FormView`), and the
        chosen radio button must post ``form.field`` = ``choice.value``. A template that does
        not compile, names a file that is not there or fails on a sample form stops the hub at
        start. Like KubeSpawner's ``profile_form_template``. Example:
        ``c.GPUSpawnerMixin.spawn_form_template = '{% extends "gpupool-spawn-form.html" %}'
        '{% block intro %}<p>GPUs: ask in #gpu-help</p>{% endblock %}'``""",
    )
    spawn_form_template_paths = List(
        Unicode(),
        config=True,
        help="""Folders holding your own templates, which ``spawn_form_template`` may
        ``{% extends %}`` or ``{% include %}`` (searched after gpupool's own: the name
        ``gpupool-spawn-form.html`` always means gpupool's). Example:
        ``c.GPUSpawnerMixin.spawn_form_template_paths = ["/etc/jupyterhub/templates"]`` with
        ``c.GPUSpawnerMixin.spawn_form_template = '{% extends "site-form.html" %}'``""",
    )
    default_offer = Unicode(
        "cpu",
        config=True,
        help="""The offer of a start that names none (a REST call without ``offer``, a spawn page
        without a form) when the user has more than one choice; a user with one choice gets that
        one. Example: ``c.GPUSpawnerMixin.default_offer = "mig-1g.10gb"``""",
    )

    @validate("spawn_form")
    def _valid_spawn_form(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"])
        if value not in SPAWN_FORMS:
            raise TraitError(
                f"GPUSpawnerMixin.spawn_form must be one of {', '.join(SPAWN_FORMS)}, not {value!r}"
            )
        return value

    def gpupool_choices(self) -> list[Choice]:
        """What this user could start (every line of the spawn menu that is not ``never``)."""
        menus = menu(self.gpupool.ledger, self.user.name, self.gpupool_groups())
        return [c for m in menus for c in m.choices if c.admission.verdict != "never"]

    def gpupool_defaults(self, limit: OfferLimit | None = None) -> dict[str, Any]:
        """gpupool's keys for a start that names no offer: the user's only choice (within
        ``limit``), or ``default_offer`` (when ``limit`` allows it; else :class:`InvalidRequest`
        asking for an offer)."""
        choices = self.gpupool_choices()
        if limit is not None:
            choices = [c for c in choices if c.offer in limit.offers]
        if len(choices) == 1:
            c = choices[0]
            return {
                "offer": c.offer,
                "count": c.count,
                "team": None if c.team == EVERYONE else c.team,
            }
        if limit is not None and self.default_offer not in limit.offers:
            raise limit.needs_offer()
        return {"offer": self.default_offer}

    async def gpupool_offer_limit(self, options: dict[str, Any]) -> OfferLimit | None:
        """Hook: the offers this start may take whatever the pool allows (e.g. those of the
        KubeSpawner profile it names), or ``None``; raise :class:`PoolError` (a 4xx) for options
        the spawner itself would refuse. Runs before anything is allocated."""
        return None

    @default("options_form")
    def _gpupool_options_form(self) -> Any:
        return self._render_gpupool_form

    def _render_gpupool_form(self, spawner: Any = None) -> str:
        """gpupool's form, or ``""`` (no form: JupyterHub starts at once) per ``spawn_form``."""
        if self.spawn_form == "never" or (
            self.spawn_form == "choices" and len(self.gpupool_choices()) <= 1
        ):
            return ""
        pool = self.gpupool
        menus = menu(pool.ledger, self.user.name, self.gpupool_groups())
        view = form_view(
            menus, pool.inventory.label, pool.inventory.simulated, self.gpupool_offer_notes()
        )
        return render(view, form_template(self.spawn_form_template, self.spawn_form_template_paths))

    def gpupool_offer_notes(self) -> dict[str, str]:
        """Hook: a sentence per offer name for the spawn page (how a share is enforced; for a
        MIG offer of several instances, that a process sees only the first of them)."""
        return {
            name: MIG_NOTEBOOK_NOTE
            for name, offer in self.gpupool.ledger.offers.items()
            if offer.kind == "mig" and offer.max_count > 1
        }

    @default("options_from_form")
    def _gpupool_default_options_from_form(self) -> Any:
        return self.gpupool_options_from_form

    def gpupool_options_from_form(self, form_data: dict[str, list[str]]) -> dict[str, Any]:
        """gpupool's default ``options_from_form``: its keys parsed, every other field passed
        through as JupyterHub's default does."""
        return {**others(form_data), **self._gpupool_form_keys(form_data)}

    def run_options_from_form(self, form_data: dict[str, list[str]]) -> dict[str, Any]:
        """The configured ``options_from_form`` (an admin's callable, ``"simple"``, or gpupool's
        default), composed with gpupool's: an admin's callable gets the fields gpupool does not
        read, and gpupool's keys are added to what it returns. Over ``max_user_options_bytes``:
        413 before anything reads the data."""
        self._gpupool_check_size(form_data, "The spawn form")
        if self.options_from_form == self.gpupool_options_from_form:
            return self.gpupool_options_from_form(form_data)
        theirs = super().run_options_from_form(others(form_data))
        return {**(theirs or {}), **self._gpupool_form_keys(form_data)}

    def options_from_query(self, query_data: dict[str, list[str]]) -> dict[str, Any]:
        """A spawn link (``/hub/spawn?opt-offer=h100&opt-count=2``): as a form."""
        return self.run_options_from_form(query_options(query_data))

    def _gpupool_form_keys(self, form_data: dict[str, list[str]]) -> dict[str, Any]:
        try:
            return from_form(form_data)
        except PoolError:
            refusal = InvalidRequest("Choose one of the offers on the form.")
            self.log.info(
                "gpupool: refused the spawn form of %s: %s", self.gpupool_ref, refusal.message
            )
            raise http_error(refusal) from None

    def _gpupool_check_size(self, value: Any, what: str) -> None:
        try:
            check_size(json_size(value), self.max_user_options_bytes, what)
        except TooLarge as e:
            self.log.info("gpupool: refused the options of %s: %s", self.gpupool_ref, e.message)
            raise http_error(e) from None

    @default("apply_user_options")
    def _gpupool_apply_user_options(self) -> Any:
        """gpupool reads ``user_options`` itself, in :meth:`start`; this keeps JupyterHub from
        logging their (user-chosen, unbounded) keys as "unhandled" on every start."""
        return _options_read_in_start

    def gpupool_forget_options(self) -> None:
        """Clear the options of a refused start: JupyterHub's ``User.spawn`` stores them in its
        database (``orm_spawner.user_options``, committed) before it calls :meth:`start`, where
        a refusal would leave them, however big, and offer them as the next start's defaults."""
        self.user_options: dict[str, Any] = {}
        orm_spawner = self.orm_spawner
        if orm_spawner is not None and orm_spawner.user_options:
            orm_spawner.user_options = {}
            session = object_session(orm_spawner)
            if session is not None:
                session.commit()

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> Any:
        pool = self.gpupool
        gate = hub_objects(self.user.settings).gate
        self.gpupool_admitted = False
        try:
            options = dict(self.user_options or {})
            check_texts(options, "user_options")  # every key, anyone's, as pages show them
            check_size(json_size(options), self.max_user_options_bytes, "user_options")
            limit = await self.gpupool_offer_limit(options)
            if not options.get("offer"):
                options = {**options, **self.gpupool_defaults(limit)}
            offer, count, team = parse_user_options(options)
            if limit is not None:
                limit.check(offer)
            ledger = pool.ledger
            charged = resolve_team(ledger.teams, ledger.everyone, self.gpupool_groups(), team)
            charged.check_limit("spawns", self.gpupool_starting())  # 429, nothing allocated
            self.gpupool_admitted = True  # counted from here (no await in between)
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
            self.gpupool_admitted = False
            self.log.info("gpupool: refused %s: %s", self.gpupool_ref, e.message)
            self.gpupool_forget_options()
            raise http_error(e) from None
        finally:  # admitted or refused, no await since: it counts as this spawner says now
            if gate is not None:
                gate.decided(self.user.name, self.name)
        self.gpupool_allocation_id = allocation.id
        try:
            self.gpupool_check_allocation(allocation)
            return await super().start()
        except BaseException:
            self.gpupool_admitted = False
            self.gpupool_release()
            raise

    gpupool_admitted = False
    """Whether this server's start passed gpupool's checks (reset at each start)."""

    def gpupool_starting(self) -> int:
        """How many of this user's other servers are starting now: pending a spawn (JupyterHub's
        own state) after gpupool admitted their start; starts that will be refused are not
        counted. ``user_limits.spawns`` bounds it."""
        return starting(self.user, besides=self)

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
