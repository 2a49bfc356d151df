"""JupyterHub's restatements of a refused (4xx) spawn leave ERROR; real faults stay ERROR.

The records are made exactly as JupyterHub 6.1 makes them (``jupyterhub/user.py`` ``User.spawn``
and ``jupyterhub/handlers/pages.py`` ``SpawnHandler``); the real hub's log is checked in
``tests/hub/test_bad_input.py``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator

import pytest
from tornado import web

from gpupool.core.errors import QuotaExceeded
from gpupool.hub import refusals
from gpupool.hub.errors import http_error


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def hub_log() -> Iterator[tuple[logging.Logger, Capture]]:
    logger = logging.getLogger("test-gpupool-refusals")
    logger.setLevel(logging.INFO)
    capture = Capture()
    logger.addHandler(capture)
    refusals.install(logger)
    refusals.install(logger)  # once only
    assert sum(isinstance(f, refusals.RefusalFilter) for f in logger.filters) == 1
    yield logger, capture
    logger.removeHandler(capture)
    logger.filters.clear()


def raised(e: BaseException) -> tuple[type[BaseException], BaseException, object]:
    try:
        raise e
    except BaseException:
        info = sys.exc_info()
    assert info[0] is not None and info[1] is not None
    return info[0], info[1], info[2]


def jupyterhub_logs(log: logging.Logger, e: web.HTTPError) -> None:
    """The three records JupyterHub logs for one spawn that fails with ``e`` (the form door)."""
    log.error(f"Error starting ada's server: {e}")  # User.spawn
    log.error(f"Error starting server ada: {e}")  # SpawnHandler._wrap_spawn_single_user
    try:
        raise e
    except web.HTTPError:
        log.error("Failed to spawn single-user server with form", exc_info=True)


def test_a_refusal_leaves_error_and_loses_its_traceback(
    hub_log: tuple[logging.Logger, Capture],
) -> None:
    log, capture = hub_log
    refusal = http_error(QuotaExceeded("Team vision uses 2 of 2 GPU-eq."))
    jupyterhub_logs(log, refusal)
    jupyterhub_logs(log, web.HTTPError(413, "too big"))
    assert capture.records == []  # at DEBUG, which this logger does not emit

    log.setLevel(logging.DEBUG)
    jupyterhub_logs(log, refusal)
    assert [r.levelno for r in capture.records] == [logging.DEBUG] * 3
    assert all(r.exc_info is None for r in capture.records)
    assert "HTTP 403" in capture.records[0].getMessage()


def test_faults_stay_errors_with_their_traceback(hub_log: tuple[logging.Logger, Capture]) -> None:
    log, capture = hub_log
    jupyterhub_logs(log, web.HTTPError(500, "broken"))
    log.error("Error starting ada's server: something else")
    log.error("Failed to spawn single-user server with form", exc_info=raised(ValueError("x")))
    log.error("Error starting %s's server: HTTP 403: x", "ada")  # not JupyterHub's form
    log.exception("Unhandled error starting ada's server: boom", exc_info=raised(OSError()))
    assert [r.levelno for r in capture.records] == [logging.ERROR] * 7
    assert all(capture.records[i].exc_info is not None for i in (2, 4, 6))
