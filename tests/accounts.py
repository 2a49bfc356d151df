"""Unix accounts for tests that run user code (servers, jobs), as the hub would.

User code never runs as root. Run as root (as CI does), the tests give it what the demo hub
gives it: the unprivileged shared account ``gpupool-demo`` (made by ``scripts/demo-account``,
which also checks that it can run the runtime's Python), with the users' homes in a folder that
account owns outside the tests' private temporary folders. Run as an ordinary user, user code
runs as that user, as the demo does. The per-user mode needs real accounts: :func:`unix_user`.

User code runs from the *runtime* (:data:`RUNTIME`): the installation ``make`` recorded in this
venv's ``gpupool-runtime`` (as root, a venv outside the checkout that every account can run,
since the checkout may lie in a folder they cannot enter), else this venv. A child that runs as
another account is started with :func:`gpupool.usercode.become` (its own groups, none of root's).
"""

from __future__ import annotations

import atexit
import fcntl
import functools
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gpupool.usercode import DEMO_ACCOUNT, account, become

ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
NOT_ROOT = "needs root: it switches unix accounts (make test as root runs it; CI does)"


def _runtime() -> Path:
    record = Path(sys.prefix) / "gpupool-runtime"
    return Path(record.read_text().strip()) if record.is_file() else Path(sys.prefix)


RUNTIME = _runtime()
"""The prefix of the installation user code runs from (see the module's docstring)."""
RUNTIME_BIN = RUNTIME / "bin" if Path(sys.prefix) != RUNTIME else Path(sys.executable).parent
RUNTIME_PYTHON = str(RUNTIME_BIN / "python") if Path(sys.prefix) != RUNTIME else sys.executable


@functools.cache
def shared_account() -> str:
    """The account user code runs as in the shared mode here: ``''`` (the hub's own) unless the
    tests run as root, then the demo account, created if missing (the session's preflight does
    it first, so a failure stops the run once)."""
    if not IS_ROOT:
        return ""
    subprocess.run(
        [str(ROOT / "scripts" / "demo-account"), DEMO_ACCOUNT, RUNTIME_PYTHON],
        check=True,
        capture_output=True,
    )
    return DEMO_ACCOUNT


def as_account(name: str) -> dict[str, Any]:
    """``subprocess`` arguments that run a child as the account ``name`` (``''``: as us)."""
    return become(account(name, "the tests' account")) if name else {}


@contextmanager
def homes(owner: str = "") -> Iterator[Path]:
    """A fresh folder for the users' homes, owned by ``owner`` (default: the shared account),
    removed afterwards."""
    owner = owner or shared_account()
    path = Path(tempfile.mkdtemp(prefix="gpupool-homes-", dir="/tmp"))
    if owner:
        pw = pwd.getpwnam(owner)
        os.chown(path, pw.pw_uid, pw.pw_gid)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@functools.cache
def session_homes() -> Path:
    """One homes folder for in-process tests of this run (owned by the shared account)."""
    context = homes()
    path = context.__enter__()
    atexit.register(context.__exit__, None, None, None)
    return path


def shared_mode(config: Any) -> None:
    """Set ``config`` (a traitlets ``Config``) to run local jobs and servers the way the tests
    run user code: the shared account (as root), homes in :func:`session_homes`, the runtime."""
    config.LocalGPUSpawner.shared_account = shared_account()
    config.LocalGPUSpawner.home_dir_template = str(session_homes() / "{username}")
    runtime(config)


def runtime(config: Any) -> None:
    """Set ``config`` to run servers and jobs from the runtime (:data:`RUNTIME`)."""
    config.Spawner.cmd = [str(RUNTIME_BIN / "jupyterhub-singleuser")]
    config.LocalJobBackend.python = RUNTIME_PYTHON


def give_to_shared_account(path: Path) -> None:
    """Hand a folder made by the test (a home with a notebook) to the shared account."""
    owner = shared_account()
    if owner:
        pw = pwd.getpwnam(owner)
        for sub in [path, *path.rglob("*")]:
            os.chown(sub, pw.pw_uid, pw.pw_gid, follow_symlinks=False)


@contextmanager
def accounts_lock() -> Iterator[None]:
    """One change to the account files at a time, across the test run's workers (``useradd``
    gives up when another holds ``/etc/passwd``'s lock)."""
    with open("/run/lock/gpupool-test-accounts", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def unix_user(name: str) -> pwd.struct_passwd:
    """A real unix account ``name`` with a home of its own (created if missing; root only)."""
    with accounts_lock():
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
        subprocess.run(
            ["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", name],
            check=True,
        )
        return pwd.getpwnam(name)


def remove_unix_user(name: str) -> None:
    """Remove an account made by :func:`unix_user`, with its home and processes."""
    subprocess.run(["pkill", "-KILL", "-u", name], check=False)
    with accounts_lock():
        subprocess.run(["userdel", "--remove", name], check=False, capture_output=True)
