"""What a test run needs before its first test, checked once, at the start: a failed check stops
the run with one message saying what to do, instead of failing every test that needs it.

- As root: the unprivileged account user code runs as exists (created if missing) and can run
  the runtime's Python (:mod:`tests.accounts`), which must also be as new as the sources.
- Whatever the account: Node.js's configurable-http-proxy is installed (the real hubs need it).

What only some tests need and an ordinary user cannot install (root, Debian's Chromium) is not
checked here: those tests skip, saying why, and the run's last lines count the skips by reason.

    python -m tests.preflight      (``make test`` runs it first; pytest runs it at session start)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.accounts import IS_ROOT, ROOT, RUNTIME, shared_account

PACKAGES = ("hub", "spawner", "labextension/gpupool_lab")


STALE_OK = "GPUPOOL_STALE_RUNTIME_OK"
"""Set to 1 while editing: a runtime older than the sources only warns (servers and jobs then run
the code as last built: ``make install`` rebuilds it)."""


def runtime_is_current(runtime: Path = RUNTIME, root: Path = ROOT) -> str | None:
    """A separate runtime (as root) must have been built from the sources as they are now."""
    if runtime == Path(sys.prefix) or os.environ.get(STALE_OK) == "1":
        return None
    stamp = runtime / ".installed"
    if not stamp.exists():
        return f"the runtime {runtime} (where user code runs from) is not built: run make install"
    built = stamp.stat().st_mtime
    for folder in PACKAGES:
        for path in (root / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.stat().st_mtime > built:
                return (
                    f"the runtime {runtime} (where user code runs from) is older than "
                    f"{path.relative_to(root)}: run make install (it rebuilds the runtime)"
                )
    return None


def account_runs_the_runtime() -> str | None:
    """As root, the shared account exists and can run the runtime's Python."""
    if not IS_ROOT:
        return None
    try:
        shared_account()
    except subprocess.CalledProcessError as e:
        return (e.stderr or b"").decode(errors="replace").strip() or str(e)
    return None


def proxy_is_installed() -> str | None:
    if (ROOT / "node_modules" / ".bin" / "configurable-http-proxy").exists():
        return None
    return "configurable-http-proxy is not installed in node_modules/: run make install"


CHECKS = (runtime_is_current, account_runs_the_runtime, proxy_is_installed)


def first_problem() -> str | None:
    """The first check that fails, as one message; ``None`` when all pass."""
    for check in CHECKS:
        problem = check()
        if problem:
            return problem
    return None


if __name__ == "__main__":
    problem = first_problem()
    if problem:
        print(f"gpupool: the tests cannot run here: {problem}", file=sys.stderr)
        sys.exit(1)
