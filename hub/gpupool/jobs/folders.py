"""A job's folder (script, rank logs, exit codes), made and written by the job's own account.

Contract: the hub reads a rank log only as a file owned by that account, never through a link
(:func:`read_rank_log`: anything else reads as empty, and is logged), and removes the folder only
as that account (:func:`remove_job_folder`: ``rm -rf`` run as the owner, so nothing goes that
the owner could not remove). Local and Slurm backends alike.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpupool.usercode import Account, UnsafeFile, become, read_owned


def exit_code(text: str | None) -> int | None:
    """An exit code the job wrote in its folder (``None`` if absent or not a number)."""
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def read_rank_log(
    jdir: Path, owner: Account, rank: int, offset: int, limit: int, log: logging.Logger, job: str
) -> tuple[bytes, int]:
    """At most ``limit`` bytes of ``rank-<rank>.log`` in ``jdir`` from ``offset``, and the
    offset after them; ``(b"", 0)`` when it is missing, a link or anyone else's file."""
    path = jdir / f"rank-{rank}.log"
    try:
        return read_owned(path, owner, offset, limit)
    except FileNotFoundError:
        return b"", 0
    except UnsafeFile as e:
        log.warning("gpupool: not reading %s for job %s: %s", path, job, e.strerror)
        return b"", 0


async def remove_job_folder(jdir: Path, job: str, owner: Account, sudo: Sequence[str] = ()) -> None:
    """``rm -rf jdir`` as ``owner``: a root hub becomes the account; any other goes through
    ``sudo`` (``{user}`` in it is the owner's name) unless it is the owner itself."""
    if jdir.name != job:
        raise RuntimeError(f"{jdir} is not the folder of job {job}")
    argv = ["/bin/rm", "-rf", "--", str(jdir)]
    how: dict[str, Any] = become(owner)
    if how and os.geteuid() != 0 and sudo:
        argv = [part.replace("{user}", owner.name) for part in sudo] + argv
        how = {}
    proc = await asyncio.create_subprocess_exec(
        *argv,
        cwd="/",
        env={"PATH": "/usr/bin:/bin"},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        **how,
    )
    _, said = await proc.communicate()
    if proc.returncode:
        why = said.decode(errors="replace").strip()[:300]
        raise RuntimeError(f"rm -rf {jdir} as {owner.name} failed: {why}")
