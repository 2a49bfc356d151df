"""Unix accounts for tests that run user code (servers, jobs), as the hub would.

User code never runs as root. Run as root (as CI does), the tests give it what the demo hub
gives it: the unprivileged shared account ``gpupool-demo`` (made by ``scripts/demo-account``,
which also checks that it can run this venv's Python), with the users' homes in a folder that
account owns outside the tests' private temporary folders. Run as an ordinary user, user code
runs as that user, as the demo does. The per-user mode needs real accounts: :func:`unix_user`.
"""

from __future__ import annotations

import atexit
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

from gpupool.usercode import DEMO_ACCOUNT

ROOT = Path(__file__).resolve().parents[1]
IS_ROOT = os.geteuid() == 0
NOT_ROOT = "the per-user mode switches unix accounts, which needs root (CI runs as root)"


def shared_account() -> str:
    """The account user code runs as in the shared mode here: ``''`` (the hub's own) unless the
    tests run as root, then the demo account, created if missing."""
    if not IS_ROOT:
        return ""
    subprocess.run(
        [str(ROOT / "scripts" / "demo-account"), DEMO_ACCOUNT, sys.executable], check=True
    )
    return DEMO_ACCOUNT


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
    run user code: the shared account (as root) and homes in :func:`session_homes`."""
    config.LocalGPUSpawner.shared_account = shared_account()
    config.LocalGPUSpawner.home_dir_template = str(session_homes() / "{username}")


def give_to_shared_account(path: Path) -> None:
    """Hand a folder made by the test (a home with a notebook) to the shared account."""
    owner = shared_account()
    if owner:
        pw = pwd.getpwnam(owner)
        for sub in [path, *path.rglob("*")]:
            os.chown(sub, pw.pw_uid, pw.pw_gid, follow_symlinks=False)


def unix_user(name: str) -> pwd.struct_passwd:
    """A real unix account ``name`` with a home of its own (created if missing; root only)."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    subprocess.run(
        ["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", name], check=True
    )
    return pwd.getpwnam(name)


def remove_unix_user(name: str) -> None:
    """Remove an account made by :func:`unix_user`, with its home and processes."""
    subprocess.run(["pkill", "-KILL", "-u", name], check=False)
    subprocess.run(["userdel", "--remove", name], check=False, capture_output=True)
