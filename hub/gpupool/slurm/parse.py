"""What Slurm's commands print, read into plain data (no I/O).

Vocabulary
- *gres string*: Slurm's text for generic resources, ``name[:type]:count[(IDX:list)]`` joined by
  commas: ``gpu:h100:2(IDX:0-1),gpu:1g.10gb:0(IDX:N/A),shard:0`` (``sinfo``'s ``gres_used``,
  ``squeue``'s ``gres_detail``) or ``gpu:h100:2(S:0-1)`` (``gres``, with the sockets).
- *index list*: ``0-1,3`` (Slurm's ranges); ``N/A`` is none.
- *host list*: ``gpu[1-3,5],cpu1`` (Slurm's compressed node names).
- *Slurm job*: one entry of ``squeue --json`` (openapi v0.0.38 in 22.05) as
  :class:`SlurmJob`: ``gres`` holds, per node of ``nodes`` in order, what ``gres_detail`` says
  that node gave it. Finished jobs stay listed for ``MinJobAge`` seconds, then vanish.

Contract: pure; a field Slurm leaves out reads as empty, and text that is not Slurm's raises
:class:`SlurmOutputError` naming what was wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ENDED_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)
"""``job_state`` values of a job that has ended (Slurm's ``job_state_string``)."""


class SlurmOutputError(ValueError):
    """Output that is not what Slurm prints."""


@dataclass(frozen=True)
class Gres:
    name: str  # "gpu", "shard"
    type: str  # "h100", "1g.10gb"; "" when untyped
    count: int
    indices: tuple[int, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.name}:{self.type}" if self.type else self.name


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    name: str
    user: str
    state: str
    reason: str = ""
    account: str = ""
    partition: str = ""
    nodes: tuple[str, ...] = ()
    gres: tuple[tuple[Gres, ...], ...] = ()
    """Per node of :attr:`nodes`, what Slurm gave the job there (from ``gres_detail``)."""
    start_time: int = 0
    """When it started or (pending) Slurm's estimate, in epoch seconds; 0: none."""
    end_time: int = 0
    exit_code: int = 0
    """The batch script's exit status; a signal shows as 128 + its number."""
    comment: str = ""
    standard_output: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ENDED_STATES

    @property
    def pending(self) -> bool:
        return self.state == "PENDING"

    def gpu_indices(self, node: str) -> tuple[Gres, ...]:
        """What the job holds on ``node`` (empty on a node it is not on)."""
        for name, held in zip(self.nodes, self.gres, strict=False):
            if name == node:
                return held
        return ()


@dataclass(frozen=True)
class SlurmNode:
    name: str
    state: str
    gres: tuple[Gres, ...] = ()
    gres_used: tuple[Gres, ...] = ()
    partitions: tuple[str, ...] = ()
    reason: str = ""
    flags: tuple[str, ...] = field(default=())


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def index_list(text: str) -> tuple[int, ...]:
    """``"0-1,3"`` → ``(0, 1, 3)``; ``"N/A"`` and ``""`` → ``()``."""
    text = text.strip()
    if text in ("", "N/A"):
        return ()
    out: list[int] = []
    for part in text.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise SlurmOutputError(f"not a Slurm index list: {text!r}")
        first = int(m.group(1))
        last = int(m.group(2) or first)
        out.extend(range(first, last + 1))
    return tuple(out)


_GRES = re.compile(r"^(?P<spec>[^()]+?)(?:\((?P<extra>[^)]*)\))?$")


def _split_top(text: str) -> list[str]:
    """Split at commas outside parentheses (``gpu:2(IDX:0,2),shard:1``)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [p.strip() for p in out if p.strip()]


def gres_list(text: str | None) -> tuple[Gres, ...]:
    """A gres string (see the module's vocabulary) as :class:`Gres` items."""
    if not text or text in ("(null)", "N/A"):
        return ()
    out = []
    for part in _split_top(text):
        m = _GRES.match(part)
        if not m:
            raise SlurmOutputError(f"not a Slurm gres: {part!r}")
        bits = m.group("spec").split(":")
        name, gres_type, count = bits[0], "", 1
        if len(bits) == 2:
            if bits[1].isdigit():
                count = int(bits[1])
            else:
                gres_type = bits[1]
        elif len(bits) >= 3:
            gres_type = ":".join(bits[1:-1])
            if not bits[-1].isdigit():
                raise SlurmOutputError(f"not a Slurm gres count: {part!r}")
            count = int(bits[-1])
        indices: tuple[int, ...] = ()
        extra = m.group("extra") or ""
        if extra.startswith("IDX:"):
            indices = index_list(extra[4:])
        out.append(Gres(name, gres_type, count, indices))
    return tuple(out)


_HOSTS = re.compile(r"([^,\[]+)(?:\[([^\]]+)\])?")


def host_list(text: str | None) -> tuple[str, ...]:
    """``"gpu[1-2,5],cpu1"`` → ``("gpu1", "gpu2", "gpu5", "cpu1")`` (zero-padding kept)."""
    if not text or text == "(null)":
        return ()
    out: list[str] = []
    pos = 0
    while pos < len(text):
        m = _HOSTS.match(text, pos)
        if not m or m.end() == pos:
            raise SlurmOutputError(f"not a Slurm host list: {text!r}")
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            out.append(prefix)
        else:
            for part in ranges.split(","):
                first, _, last = part.partition("-")
                width = len(first)
                for n in range(int(first), int(last or first) + 1):
                    out.append(f"{prefix}{n:0{width}d}")
        pos = m.end()
        if pos < len(text) and text[pos] == ",":
            pos += 1
    return tuple(out)


def _int(value: Any) -> int:
    if isinstance(value, Mapping):  # newer openapi versions: {"set": true, "number": 5}
        return int(value.get("number") or 0) if value.get("set", True) else 0
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def slurm_job(obj: Mapping[str, Any]) -> SlurmJob:
    state = obj.get("job_state") or ""
    if isinstance(state, list):  # newer openapi versions: a list of flags
        state = state[0] if state else ""
    nodes = host_list(obj.get("nodes") or "")
    detail = obj.get("gres_detail") or []
    gres = tuple(gres_list(d) for d in detail)
    reason = obj.get("state_reason") or ""
    return SlurmJob(
        job_id=_int(obj.get("job_id")),
        name=str(obj.get("name") or ""),
        user=str(obj.get("user_name") or ""),
        state=str(state),
        reason="" if reason == "None" else str(reason),
        account=str(obj.get("account") or ""),
        partition=str(obj.get("partition") or ""),
        nodes=nodes,
        gres=gres,
        start_time=_int(obj.get("start_time")),
        end_time=_int(obj.get("end_time")),
        exit_code=_int(obj.get("exit_code")),
        comment=str(obj.get("comment") or ""),
        standard_output=str(obj.get("standard_output") or ""),
    )


def squeue_jobs(document: Mapping[str, Any]) -> list[SlurmJob]:
    """``squeue --json`` (or slurmrestd's ``/slurm/v0.0.38/jobs``) as :class:`SlurmJob` items."""
    jobs = document.get("jobs")
    if not isinstance(jobs, Sequence):
        raise SlurmOutputError("squeue --json gave no 'jobs' list")
    return [slurm_job(j) for j in jobs if isinstance(j, Mapping)]


def sinfo_nodes(document: Mapping[str, Any]) -> list[SlurmNode]:
    """``sinfo --json`` as :class:`SlurmNode` items."""
    nodes = document.get("nodes")
    if not isinstance(nodes, Sequence):
        raise SlurmOutputError("sinfo --json gave no 'nodes' list")
    out = []
    for n in nodes:
        if not isinstance(n, Mapping):
            continue
        state = n.get("state") or ""
        if isinstance(state, list):
            state = state[0] if state else ""
        out.append(
            SlurmNode(
                name=str(n.get("name") or n.get("hostname") or ""),
                state=str(state).lower(),
                gres=gres_list(n.get("gres") or ""),
                gres_used=gres_list(n.get("gres_used") or ""),
                partitions=tuple(n.get("partitions") or ()),
                reason=str(n.get("reason") or ""),
                flags=tuple(str(f).lower() for f in n.get("state_flags") or ()),
            )
        )
    return out
