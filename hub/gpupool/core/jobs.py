"""Batch jobs: what a user submits, and the states a job goes through.

Vocabulary
- *spec*: what the user asked for: the script (code produced from a notebook, or a ``.py`` file),
  where and how to run it (working directory, arguments, environment), the shape (an offer,
  ``gpus`` per node, ``nodes``), a time limit, how often it may be restarted, a priority.
- *restarts* (``max_restarts``): how many times the pool may put the job back in the queue after
  preempting it (its team borrowed GPUs a lender needed back), to start again from the
  beginning; the same on every backend. A job whose process fails is never restarted (torchrun
  runs with ``--max-restarts 0``, a Kubernetes Job with ``backoffLimit: 0``): it ends
  ``failed``, and its owner resubmits.
- *job*: a spec with an owner, the team charged, a state, timestamps, per-rank exit codes, the
  allocations it holds while active, the devices it runs (or last ran) on, and the backend's
  *handle* (a JSON text: pid and start time
  locally, object names on Kubernetes).
- *states*: ``queued`` → ``starting`` → ``running`` → ``succeeded`` | ``failed`` | ``cancelled`` |
  ``lost``. A queued job holds nothing. ``starting``/``running`` jobs may go back to ``queued``
  when preempted. ``lost``: the job's processes vanished without a word (e.g. while the hub was
  down, or a node went away). Every transition records its reason in words.
- *submission*: the JSON fields a user sends for a spec. Every string in it, keys included, is
  storable text (:func:`gpupool.core.parse.check_text`: no lone surrogate, no NUL), and every
  ``env`` name is a portable name (:data:`ENV_NAME`: ASCII letters, digits and ``_``, not
  starting with a digit), so nothing accepted can fail at start after its GPUs were granted, or
  break a page that shows it.

Contract: pure and frozen; :func:`transition` refuses a move the state machine does not allow;
:func:`check_submission` refuses (:class:`~gpupool.core.errors.InvalidRequest`) what no job can
store or run, before anything is stored or granted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from gpupool.core.errors import InvalidRequest
from gpupool.core.ledger import Allocation
from gpupool.core.parse import check_texts, quoted

JobState = Literal["queued", "starting", "running", "succeeded", "failed", "cancelled", "lost"]
ACTIVE: frozenset[str] = frozenset({"starting", "running"})
FINAL: frozenset[str] = frozenset({"succeeded", "failed", "cancelled", "lost"})
ALLOWED: dict[str, frozenset[str]] = {
    "queued": frozenset({"starting", "cancelled", "failed"}),
    "starting": frozenset({"running", "queued", "succeeded", "failed", "cancelled", "lost"}),
    "running": frozenset({"queued", "succeeded", "failed", "cancelled", "lost"}),
}
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
"""A portable environment variable name (POSIX's portable character set: ASCII letters, digits
and ``_``, not starting with a digit). ``A=B`` would set ``A``, and ``""`` none at all."""


def check_submission(fields: Mapping[str, Any]) -> None:
    """Refuse a job submission holding text no job can store or run (see *submission* above),
    naming the field; the fields' types and values are checked where the spec is built."""
    check_texts(fields)
    env = fields.get("env")
    for name in env if isinstance(env, dict) else ():
        if isinstance(name, str) and not ENV_NAME.fullmatch(name):
            raise InvalidRequest(
                f"env name {quoted(name)} is not a portable name: use ASCII letters, digits and"
                " _, not starting with a digit (like MY_SETTING)."
            )


@dataclass(frozen=True)
class JobSpec:
    script: str
    offer: str = "cpu"
    gpus: int = 1
    nodes: int = 1
    team: str | None = None
    name: str = ""
    filename: str = "script.py"
    workdir: str = ""
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    time_limit: int = 3600
    max_restarts: int = 0
    priority: int = 0

    @property
    def ranks(self) -> int:
        return self.gpus * self.nodes


@dataclass(frozen=True)
class Job:
    id: str
    owner: str
    team: str
    spec: JobSpec
    state: JobState = "queued"
    reason: str = "queued"
    created: float = 0.0
    started: float | None = None
    finished: float | None = None
    exit_codes: tuple[tuple[int, int], ...] = ()
    restarts: int = 0
    allocations: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    """The GPU and MIG UUIDs the job holds or last held (kept when it ends)."""
    handle: str = field(default="", repr=False)

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def final(self) -> bool:
        return self.state in FINAL

    def ends_at(self) -> float:
        """When the time limit ends an active job (``inf`` for one that has not started)."""
        return (self.started or float("inf")) + self.spec.time_limit


def job_devices(allocations: Iterable[Allocation]) -> tuple[str, ...]:
    """A job's *devices*: what its allocations hold, in their order (each device's
    ``visible_id``: a GPU or MIG UUID, the UUID read back from the node where one was)."""
    return tuple(d.visible_id for a in allocations for d in a.devices)


def transition(job: Job, state: JobState, reason: str, now: float, **changes: object) -> Job:
    """``job`` moved to ``state`` for ``reason`` at ``now``; ``ValueError`` if not allowed."""
    if state not in ALLOWED.get(job.state, frozenset()):
        raise ValueError(f"job {job.id} cannot go from {job.state} to {state}")
    stamps: dict[str, object] = {}
    if state == "starting":
        stamps["started"] = now
    if state in FINAL:
        stamps["finished"] = now
    if state == "queued":
        stamps.update(started=None, allocations=(), devices=(), handle="", exit_codes=())
    return replace(job, state=state, reason=reason, **{**stamps, **changes})  # type: ignore[arg-type]
