"""The pages: ``/hub/gpupool`` for admins and ``/hub/gpupool/mine`` ("My GPUs") for every user;
thin JupyterHub ``BaseHandler`` s over :mod:`gpupool.hub.pages_view`.

Vocabulary
- *actions*: ``POST /hub/gpupool/stop`` (form fields ``user``, ``server``) and
  ``POST /hub/gpupool/cancel`` (``job``), from forms carrying JupyterHub's ``_xsrf`` token
  (JupyterHub's ``BaseHandler.prepare`` checks it for every cookie-authenticated POST); they
  answer 303 back to the admin page with an outcome code (``done``) and the ids of what they
  acted on (``user`` and ``server``, or ``job``).
- *flash*: the admin page's one-line outcome. Its text comes from :data:`OUTCOMES` only; the ids
  in the query string are looked up in JupyterHub's users and the job manager, and only what
  is found there is named. Nothing typed into the URL is ever printed.

Who may do what: the admin page and cancelling any job need JupyterHub admin or the
``custom:gpupool:admin`` scope; stopping a server needs that *and* JupyterHub's own ``servers``
scope for that server (admins hold it).
Everyone else gets 403. "My GPUs" shows only the caller's own allocations, jobs and teams.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from jupyterhub.handlers import BaseHandler
from tornado import web

from gpupool.core.errors import PoolError
from gpupool.hub.compat import error_template
from gpupool.hub.errors import status_of
from gpupool.hub.objects import HubObjects, hub_objects
from gpupool.hub.pages_view import admin_view, mine_view
from gpupool.hub.scopes import ADMIN_SCOPE
from gpupool.kube.tenant_view import outside_pods_rows

OUTCOMES: dict[str, tuple[str, str]] = {
    "stopped": ("Stopped {}.", "Stopped the server."),
    "stopping": (
        "Stopping {} (it is slow to stop; reload in a moment).",
        "Stopping the server (it is slow to stop; reload in a moment).",
    ),
    "cancelled": ("Cancelled job {}.", "Cancelled the job."),
    "ended": ("Job {} had already ended.", "The job had already ended."),
}
"""The only messages the ``done`` code can show: with what it acted on, when the page finds that
in its own data, or else without."""


# -- the handlers -------------------------------------------------------------------------------
class _Page(BaseHandler):
    @property
    def gpupool(self) -> HubObjects:
        return hub_objects(self.settings)

    def render_template(self, name: str, sync: bool = False, **ns: Any) -> Any:
        """JupyterHub's, with its error pages showing gpupool's message on each version."""
        name = error_template(name, str(ns.get("message") or ""))
        return super().render_template(name, sync=sync, **ns)

    def is_pool_admin(self) -> bool:
        """JupyterHub admin, or the pool's admin scope. Pages take only the login cookie (API
        tokens are not accepted here, as on all of JupyterHub's pages)."""
        user = self.current_user
        return bool(user is not None and (user.admin or ADMIN_SCOPE in self.expanded_scopes))

    def require_pool_admin(self) -> None:
        if not self.is_pool_admin():
            raise web.HTTPError(403, "The GPU pool's admin page is for admins only.")

    def back(self, done: str, **ids: str) -> None:
        """303 to the admin page with the outcome code ``done`` and the ids acted on."""
        url = f"{self.hub.base_url}gpupool?{urlencode({'done': done, **ids})}"
        self.redirect(url, status=303)

    def field(self, name: str, required: bool = True) -> str:
        """A form field, stripped; 400 with the reason when missing, empty or too long."""
        value = (self.get_body_argument(name, "") or "").strip()
        if required and not value:
            raise web.HTTPError(400, f"The form field {name!r} is missing or empty.")
        if len(value) > 255:
            raise web.HTTPError(400, f"The form field {name!r} is too long.")
        return value


def slurm_view(hub: HubObjects) -> dict[str, Any] | None:
    """On Slurm: whether the controller answers, and other jobs' GPUs, named for admins."""
    if hub.slurm is None:
        return None
    poller, mirror = hub.slurm.poller, hub.slurm.mirror
    detail = mirror.detail if mirror is not None else {}
    return {
        "failure": poller.failure,
        "jobs": len(poller.last.jobs) if poller.last.answered else None,
        "outside": outside_pods_rows(hub.pool.inventory, detail),
    }


class AdminPage(_Page):
    @web.authenticated
    async def get(self) -> None:
        self.require_pool_admin()
        hub = self.gpupool
        reported = hub.kube.mig_reported if hub.kube is not None else None
        now = hub.pool.clock().timestamp()
        view = admin_view(hub.pool, hub.jobs, hub.reclaimer, now, reported)
        view["shares"] = hub.shares.view() if hub.shares is not None else None
        view["devices"] = hub.devices.view() if hub.devices is not None else None
        view["outside_pods"] = (  # Kubernetes: other namespaces' GPU pods, named for admins
            outside_pods_rows(hub.pool.inventory, hub.kube.outside_detail)
            if hub.kube is not None
            else None
        )
        view["slurm"] = slurm_view(hub)
        html = await self.render_template(
            "gpupool-admin.html", view=view, flash=self.flash(), pool_admin=True
        )
        self.finish(html)

    def flash(self) -> str:
        """The outcome of the action that sent the admin here (see :data:`OUTCOMES`)."""
        done = self.get_argument("done", "")
        if done not in OUTCOMES:
            return ""
        known, unknown = OUTCOMES[done]
        if done in ("stopped", "stopping"):
            user = self.find_user(self.get_argument("user", ""))
            server = self.get_argument("server", "")
            if user is not None and server in user.orm_spawners:
                return known.format(f"{user.name}'s server" + (f" {server!r}" if server else ""))
        else:
            job = self.gpupool.jobs.jobs.get(self.get_argument("job", ""))
            if job is not None:
                return known.format(job.id)
        return unknown


class StopServer(_Page):
    @web.authenticated
    async def post(self) -> None:
        self.require_pool_admin()
        name = self.field("user")
        server = self.field("server", required=False)
        user = self.find_user(name)
        if user is None:
            raise web.HTTPError(404, f"No user {name!r}.")
        if not self.has_scope(f"servers!server={name}/{server}"):
            raise web.HTTPError(403, f"You may not stop {name}'s servers.")
        label = f"{name}'s server" + (f" {server!r}" if server else "")
        spawner = user.spawners[server] if server in user.orm_spawners else None
        if spawner is None or not spawner.active:
            raise web.HTTPError(404, f"{label} is not running.")
        if spawner.pending:
            raise web.HTTPError(409, f"{label} is busy ({spawner.pending}); try again shortly.")
        self.log.info("gpupool: %s stops %s from the admin page", self.current_user.name, label)
        future = await self.stop_single_user(user, server)
        self.back("stopped" if future.done() else "stopping", user=user.name, server=server)


class CancelJob(_Page):
    @web.authenticated
    async def post(self) -> None:
        self.require_pool_admin()
        job_id = self.field("job")
        manager = self.gpupool.jobs
        try:
            before = manager.get(job_id, self.current_user.name, True)
            job = await manager.cancel(job_id, self.current_user.name, True)
        except PoolError as e:  # the sentence as the page's heading (a 404 page hides the rest)
            raise web.HTTPError(status_of(e), e.message) from None
        self.log.info(
            "gpupool: %s cancels job %s of %s from the admin page",
            self.current_user.name,
            job.id,
            job.owner,
        )
        self.back("ended" if before.final else "cancelled", job=job.id)


class MinePage(_Page):
    @web.authenticated
    async def get(self) -> None:
        user = self.current_user
        hub = self.gpupool
        groups = [g.name for g in getattr(user, "groups", [])]
        now = hub.pool.clock().timestamp()
        view = mine_view(hub.pool, hub.jobs, hub.reclaimer, user.name, groups, now)
        html = await self.render_template(
            "gpupool-mine.html", view=view, pool_admin=self.is_pool_admin()
        )
        self.finish(html)


def pages() -> list[tuple[str, type[BaseHandler]]]:
    """The routes for ``c.JupyterHub.extra_handlers`` (served under ``/hub``)."""
    return [
        (r"/gpupool", AdminPage),
        (r"/gpupool/mine", MinePage),
        (r"/gpupool/stop", StopServer),
        (r"/gpupool/cancel", CancelJob),
    ]
