"""How gpupool's Slurm jobs are named and tagged, so the hub finds its own and only its own.

Vocabulary
- *job name* (``--job-name``): for people reading ``squeue``: ``jupyter-<user>`` or
  ``jupyter-<user>-<server>`` for a notebook server, ``gpupool-<user>-<job id prefix>`` for a
  batch job of "Run distributed".
- *tag* (``--comment``): for the hub: ``gpupool:<hub marker>:<kind>:<id>``, where the marker is
  the hub's (:attr:`gpupool.pool.Pool.hub_marker`), ``kind`` is ``server`` (the id is the
  server's allocation) or ``job`` (gpupool's job id). A Slurm job without this hub's tag is
  someone else's: outside use, never cancelled by the hub.

Contract: pure; :func:`parse_tag` returns ``None`` for anything that is not a tag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

TagKind = Literal["server", "job"]
_SAFE = re.compile(r"[^A-Za-z0-9_.@+-]")


def _safe(text: str) -> str:
    return _SAFE.sub("_", text)[:64]


def server_job_name(user: str, server: str) -> str:
    return f"jupyter-{_safe(user)}" + (f"-{_safe(server)}" if server else "")


def batch_job_name(user: str, job_id: str) -> str:
    return f"gpupool-{_safe(user)}-{_safe(job_id)[:8]}"


@dataclass(frozen=True)
class Tag:
    marker: str
    kind: TagKind
    id: str

    def __str__(self) -> str:
        return f"gpupool:{self.marker}:{self.kind}:{self.id}"


def parse_tag(comment: str) -> Tag | None:
    parts = comment.strip().split(":")
    if len(parts) != 4 or parts[0] != "gpupool" or parts[2] not in ("server", "job"):
        return None
    if not parts[1] or not parts[3]:
        return None
    kind: TagKind = "server" if parts[2] == "server" else "job"
    return Tag(parts[1], kind, parts[3])
