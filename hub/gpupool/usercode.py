"""User code and the hub: which unix account runs it, and how the hub reads what it wrote.

Vocabulary
- *per-user mode* (``run_as_hub_user = False``): each user's servers and jobs run as the unix
  account of the same name; the hub runs as root to switch to it.
- *shared mode* (``run_as_hub_user = True``): every user's code runs as one account, the
  *shared account*: the hub's own account when the hub is not root, else the account named by
  ``shared_account`` (the demo's ``gpupool-demo``). Users are not isolated from each other in
  this mode, but never run as root and never read the hub's files.
- *code account*: the :class:`Account` a user's code runs as, in either mode.
  :class:`CodeAccounts` says it for a hub's servers and jobs (which may differ in mode), and
  which allocation a process of an account may count for (:mod:`gpupool.core.holders`).
- *becoming* an account: a child process that runs as it takes its uid, its primary group and
  exactly its supplementary groups (:func:`become`); a child of a root hub that kept root's group
  or supplementary groups would reach what group root may (a venv or checkout under a folder
  that only root's group may enter, say) and could not reach what the account alone may.
- *owned file*: a regular file, reached without following a symbolic link at its last step,
  whose owner is the code account. The hub reads a user's files (job logs, exit codes) only as
  owned files, so a user who plants a link, a hard link, a FIFO or a device gets nothing.

Contract: :func:`code_account` never returns root: a setting that would run user code as root
raises :class:`gpupool.declarations.ConfigError` naming the key. The hub creates and writes nothing
in a place a user controls: job directories are made by the job's own processes, as the code
account (see :mod:`gpupool.jobs.local`). Reads go through :func:`read_owned`, bounded in size.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpupool.core.holders import Holding
from gpupool.core.ledger import Allocation
from gpupool.declarations import ConfigError

DEMO_ACCOUNT = "gpupool-demo"
"""The unprivileged account ``make run`` creates for the demo hub when it runs as root."""

# Where a local spawner's and job backend's shared settings are looked up, most specific first.
SPAWNER_SECTIONS = ("LocalGPUSpawner", "LocalProcessSpawner", "Spawner")


@dataclass(frozen=True)
class Account:
    """A unix account that runs user code."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str


class UnsafeFile(OSError):
    """A file the hub refuses to read: a link, not a regular file, or owned by someone else."""


def account(name: str, key: str) -> Account:
    """The unix account ``name``; :class:`ConfigError` naming ``key`` if missing or root."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(
            key,
            f"there is no unix account {name!r}; create it (useradd --create-home {name}) "
            "or name another",
        ) from None
    if pw.pw_uid == 0:
        raise ConfigError(key, f"{name!r} is root; user code never runs as root")
    groups = tuple(os.getgrouplist(pw.pw_name, pw.pw_gid))
    return Account(pw.pw_name, pw.pw_uid, pw.pw_gid, groups, pw.pw_dir)


def hub_account() -> Account:
    """The account the hub itself runs as."""
    pw = pwd.getpwuid(os.geteuid())
    return Account(pw.pw_name, pw.pw_uid, pw.pw_gid, tuple(os.getgroups()), pw.pw_dir)


def check_shared_mode(shared_account: str, key: str) -> Account:
    """The shared account, checked: ``shared_account`` if set, else the hub's own account, which
    is refused when the hub runs as root (naming ``key``, the setting to fix)."""
    if shared_account:
        return account(shared_account, key)
    if os.geteuid() == 0:
        raise ConfigError(
            key,
            "the hub runs as root, so servers and jobs in the shared mode (run_as_hub_user) "
            f"would run as root; set it to an unprivileged account (e.g. {DEMO_ACCOUNT!r}, "
            "which `make run` creates) or turn run_as_hub_user off to run each user as their "
            "own unix account",
        )
    return hub_account()


def code_account(owner: str, *, per_user: bool, shared_account: str, key: str) -> Account:
    """The account ``owner``'s code runs as (see the module's vocabulary); never root."""
    if per_user:
        return account(owner, f"{key} (run_as_hub_user is off: one unix account per user)")
    return check_shared_mode(shared_account, key)


def become(account: Account) -> dict[str, Any]:
    """``subprocess`` / ``asyncio`` arguments that run a child as ``account``, with its primary
    group and only its supplementary groups (none of the parent's); none when that is us.

    Every child that runs as another account is started with these (a structural test keeps
    ``user=`` out of every other call): ``user=`` alone keeps the parent's groups.
    """
    if account.uid == os.geteuid():
        return {}
    return {"user": account.uid, "group": account.gid, "extra_groups": list(account.groups)}


def spawner_setting(config: Any, name: str, fallback: Any) -> Any:
    """A local spawner's setting as configured (``LocalGPUSpawner`` over ``Spawner``)."""
    for section in SPAWNER_SECTIONS:
        if section in config and name in config[section]:
            return config[section][name]
    return fallback


@dataclass(frozen=True)
class CodeAccounts:
    """Who runs user code, for servers and for jobs: each user's own account (``per_user``)
    or one shared account (its uid; ``None`` where none could be named, e.g. a root hub whose
    shared mode has no ``shared_account``: it starts no local code then)."""

    servers_per_user: bool
    jobs_per_user: bool
    servers_uid: int | None = None
    jobs_uid: int | None = None

    @property
    def per_user(self) -> bool:
        """Whether any user code runs as its user's own account."""
        return self.servers_per_user or self.jobs_per_user

    @property
    def shared_uids(self) -> frozenset[int]:
        """The shared accounts' uids (never root's)."""
        shared = (
            None if self.servers_per_user else self.servers_uid,
            None if self.jobs_per_user else self.jobs_uid,
        )
        return frozenset(u for u in shared if u)

    def holding(self, allocation: Allocation) -> Holding:
        """How processes count for ``allocation`` (:class:`gpupool.core.holders.Holding`):
        any of its user's own account in the per-user mode, the shared account's with a claim
        of it otherwise."""
        per_user = self.jobs_per_user if allocation.kind == "job" else self.servers_per_user
        if per_user:
            try:
                uid: int | None = pwd.getpwnam(allocation.user).pw_uid or None  # never root
            except KeyError:
                uid = None
        else:
            uid = self.jobs_uid if allocation.kind == "job" else self.servers_uid
        return Holding(allocation.id, allocation.ref, uid, per_user)


def code_accounts(config: Any, jobs: Any = None) -> CodeAccounts:
    """The hub's :class:`CodeAccounts`: servers as the local spawner's settings say, jobs as the
    job backend ``jobs`` runs them (a :class:`gpupool.jobs.local.LocalJobBackend`; else as the
    servers). Never raises: the spawner and the backend check their own settings at start."""
    servers_shared = bool(spawner_setting(config, "run_as_hub_user", True))
    servers_account = str(spawner_setting(config, "shared_account", ""))
    jobs_shared = bool(getattr(jobs, "run_as_hub_user", servers_shared))
    jobs_account = str(getattr(jobs, "shared_account", servers_account))
    return CodeAccounts(
        not servers_shared,
        not jobs_shared,
        _shared_uid(servers_account) if servers_shared else None,
        _shared_uid(jobs_account) if jobs_shared else None,
    )


def _shared_uid(name: str) -> int | None:
    """The shared mode's account (:func:`check_shared_mode`) as a uid; ``None`` where it would
    be root or does not exist (the hub refuses to start such code)."""
    try:
        return check_shared_mode(name, "shared_account").uid
    except ConfigError:
        return None


def read_owned(
    path: Path, owner: Account, offset: int = 0, limit: int = 1 << 20
) -> tuple[bytes, int]:
    """Up to ``limit`` bytes of ``path`` from ``offset`` and its size, if it is an owned file of
    ``owner``.

    ``FileNotFoundError`` if it is missing; :class:`UnsafeFile` if its last step is a link, or it
    is not a regular file, or another account owns it (a hard link to a root-only file, say). A
    FIFO is opened without blocking and refused.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(errno.ELOOP, "a symbolic link; not followed", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeFile(errno.EPERM, "not a regular file; not read", str(path))
        if st.st_uid != owner.uid:
            raise UnsafeFile(errno.EPERM, f"not owned by {owner.name}; not read", str(path))
        return os.pread(fd, max(0, min(limit, st.st_size - offset)), offset), st.st_size
    finally:
        os.close(fd)


def owned_size(path: Path, owner: Account) -> int | None:
    """The size of an owned file of ``owner``, or ``None`` if missing or not an owned file."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != owner.uid:
        return None
    return st.st_size
