"""Refused spawns are not faults: keep JupyterHub's restatements of a 4xx spawn out of ERROR.

Why a log filter: a spawner refuses a start (quota, offer not allowed, no capacity, bad or too
big options) by raising a 4xx ``tornado.web.HTTPError``, which is JupyterHub's own way to show
the reason above the spawn form and in the REST reply. JupyterHub then logs that one refusal up
to three times at ERROR, and once with a traceback, with no hook to change it:

- ``User.spawn`` (``jupyterhub/user.py``): ``Error starting ada's server: HTTP 403: ...``
  (both doors);
- ``SpawnHandler._wrap_spawn_single_user`` (``jupyterhub/handlers/pages.py``):
  ``Error starting server ada: HTTP 403: ...`` (the form);
- ``SpawnHandler.post`` (same file): ``Failed to spawn single-user server with form`` with the
  traceback (the form, also for a refusal in ``options_from_form``).

The spawner routes are JupyterHub's (``extra_handlers`` are routed after them, so they cannot be
replaced), and these are plain ``log.error`` calls. :class:`RefusalFilter`, installed by
:func:`gpupool.hub.setup` on the two loggers they go to (``User.log`` is tornado's ``app_log``,
which JupyterHub renames "JupyterHub"; the handlers log to the ``JupyterHub`` logger itself; a
logger's filters see only records made on that logger), lowers exactly those records to DEBUG
and drops the traceback when the error is a 4xx: gpupool's spawners log each refusal themselves in
one INFO line (``gpupool: refused ada/: <the sentence>``), and the access log keeps its 4xx line.
Anything else (a 5xx, any other exception, any other message) passes unchanged, so real faults
stay ERROR with their traceback.
"""

from __future__ import annotations

import logging
import re

from tornado import web
from tornado.log import app_log

_RESTATED = re.compile(r"^Error starting (server )?.+?('s server)?: HTTP 4\d\d: ")
_FORM = "Failed to spawn single-user server with form"


class RefusalFilter(logging.Filter):
    """Lowers JupyterHub's ERROR restatements of a 4xx spawn refusal to DEBUG, without traceback
    (see the module docstring)."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self.logger = logger

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and _is_refusal(record):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info, record.exc_text = None, None
            return self.logger.isEnabledFor(logging.DEBUG)
        return True


def _is_refusal(record: logging.LogRecord) -> bool:
    if record.msg == _FORM:
        error = record.exc_info[1] if record.exc_info else None
        return isinstance(error, web.HTTPError) and 400 <= error.status_code < 500
    return isinstance(record.msg, str) and not record.args and bool(_RESTATED.match(record.msg))


def install(*loggers: logging.Logger) -> None:
    """Add :class:`RefusalFilter` to each of ``loggers`` (default: JupyterHub's and tornado's
    ``app_log``), once."""
    for logger in loggers or (logging.getLogger("JupyterHub"), app_log):
        if not any(isinstance(f, RefusalFilter) for f in logger.filters):
            logger.addFilter(RefusalFilter(logger))
