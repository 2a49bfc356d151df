"""What differs between the JupyterHub versions gpupool supports, in one place.

gpupool's ``hub`` extra supports JupyterHub 5.5 (what the hub image of the zero-to-jupyterhub
chart release in ``helm/gpupool/Chart.yaml`` ships) and JupyterHub 6 (the latest). Everything
else gpupool uses (``APIHandler``, ``BaseHandler``, custom scopes, ``load_roles`` and the
``server`` role, the spawner's ``options_from_form``/``options_from_query``/
``apply_user_options``, the ORM's users, groups and spawners, ``template_paths``) is the same in
both. What differs:

- **Starting a user's server** is the scope ``start:servers`` from JupyterHub 6 on. JupyterHub 5
  has no such scope (a role naming it stops the hub at start); there it is ``servers``, which
  also holds ``read:servers`` and ``delete:servers``. :data:`START_SERVERS_SCOPE`.
- **Server display names** (``orm.Spawner.display_name``, ``display_name`` in the REST API's
  server model) exist from JupyterHub 6 on. :data:`HAS_DISPLAY_NAMES`.
- **Error pages.** JupyterHub 6 puts an ``HTTPError``'s message in the error page's heading.
  JupyterHub 5 puts it in the page's text, which its own ``404.html`` replaces ("Jupyter has
  lots of moons..."), so a 404 of gpupool's pages would not say what was not found.
  :func:`error_template` shows such a 404 on ``error.html`` there.
- **Spawn links** (``/hub/spawn?opt-offer=h100``): JupyterHub 6 takes the arguments named
  ``opt-...`` off their prefix before ``Spawner.options_from_query`` sees them (and then drops
  the others); JupyterHub 5 passes every argument as it came. :func:`query_options` gives the
  spawner JupyterHub 6's view on both.
"""

from __future__ import annotations

from typing import Any

from jupyterhub import __version__ as JUPYTERHUB_VERSION
from jupyterhub.scopes import scope_definitions

JUPYTERHUB_MAJOR = int(JUPYTERHUB_VERSION.split(".")[0])
"""The installed JupyterHub's major version."""

START_SERVERS_SCOPE = "start:servers" if "start:servers" in scope_definitions else "servers"
"""The narrowest scope that lets a service start a user's server."""

HAS_DISPLAY_NAMES = JUPYTERHUB_MAJOR >= 6
"""Whether servers have a ``display_name`` (ORM and REST API)."""


def error_template(name: str, message: str) -> str:
    """The template to render for JupyterHub's error page ``name`` (from ``write_error``), so
    that ``message`` shows on every JupyterHub version."""
    if JUPYTERHUB_MAJOR < 6 and name == "404.html" and message:
        return "error.html"
    return name


def query_options(query_data: dict[str, Any]) -> dict[str, Any]:
    """A spawn link's arguments as JupyterHub 6 hands them to ``options_from_query``: with any
    ``opt-`` argument, only those, without the prefix; else all of them."""
    if JUPYTERHUB_MAJOR >= 6:
        return query_data  # JupyterHub did it already
    prefixed = {k[4:]: v for k, v in query_data.items() if k.startswith("opt-") and k[4:]}
    return prefixed or query_data
