"""Pool errors to HTTP, in one place.

``http_error`` turns a :class:`gpupool.core.errors.PoolError` into a ``tornado.web.HTTPError``
whose status follows :data:`STATUS` and whose message is the pool's sentence, word for word. The
sentence also rides on ``jupyterhub_message``, which JupyterHub's spawn page shows above the form.
"""

from __future__ import annotations

from tornado import web

from gpupool.core import errors
from gpupool.mig.manager import DeviceUnavailable
from gpupool.slurm.commands import SlurmUnavailable
from gpupool.slurm.notebook import NotStarting, NotTheServersToken
from gpupool.store.outbox import StoreUnavailable

STATUS: dict[type[errors.PoolError], int] = {
    errors.UnknownAllocation: 404,
    errors.TooLarge: 413,
    errors.InvalidRequest: 400,
    errors.NotATeamMember: 403,
    errors.OfferNotAllowed: 403,
    errors.QuotaExceeded: 403,
    errors.NoCapacity: 409,
    errors.LimitReached: 429,
    DeviceUnavailable: 503,
    StoreUnavailable: 503,
    SlurmUnavailable: 503,
    NotTheServersToken: 403,
    NotStarting: 409,
}


def status_of(error: errors.PoolError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 400


def refuse(status: int, message: str, reason: str | None = None) -> web.HTTPError:
    """A refusal carrying ``message``, which JupyterHub also shows above the spawn form."""
    e = web.HTTPError(status, message, reason=reason)
    e.jupyterhub_message = message  # type: ignore[attr-defined]
    return e


def http_error(error: errors.PoolError) -> web.HTTPError:
    return refuse(status_of(error), error.message, error.code.replace("_", " "))
