"""What a job backend does, whatever runs the processes (local torchrun, Kubernetes Jobs).

Vocabulary
- *handle*: a JSON text the backend returns from :meth:`JobBackend.start` and gets back later;
  it is persisted with the job, so a restarted hub can find the job's processes again.
- *observation*: what :meth:`JobBackend.check` sees of a job now (:class:`Observation`): still
  ``starting`` (not every rank is up), ``running``, or ended (``succeeded``, ``failed``, ``lost``)
  with per-rank exit codes and the reason in words.

Contract: backends never decide quotas or order (the manager does); they start what they are
given on the devices they are given, report, cancel and serve logs. Everything is keyed by the
job, so one backend object serves every job. Seams: ``utcnow`` is the manager's; subprocesses are
started only through the backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from traitlets.config import LoggingConfigurable

from gpupool.core.errors import InvalidRequest
from gpupool.core.inventory import NodePool
from gpupool.core.jobs import Job, JobSpec
from gpupool.core.ledger import Allocation
from gpupool.core.queue import ScaleUp


@dataclass(frozen=True)
class Observation:
    state: str  # "starting" | "running" | "queued" (taken back) | "succeeded" | "failed" | "lost"
    reason: str = ""
    exit_codes: tuple[tuple[int, int], ...] = ()

    @property
    def ended(self) -> bool:
        return self.state in ("succeeded", "failed", "lost")


def every_rank_exited(seen: Observation, ranks: int) -> Observation | None:
    """What a job ended as when each of its ``ranks`` has an exit code although ``seen`` says it
    still runs (the launcher tearing down, a process a rank left behind); ``None`` while a
    rank has not exited."""
    codes = dict(seen.exit_codes)
    if seen.ended or any(r not in codes for r in range(ranks)):
        return None
    bad = [f"rank {r} exited {c}" for r, c in sorted(codes.items()) if c != 0]
    if bad:
        return Observation("failed", f"{', '.join(bad)} (see the rank logs)", seen.exit_codes)
    return Observation("succeeded", "all ranks exited 0", seen.exit_codes)


class JobBackend(LoggingConfigurable):
    """Base class; see :class:`gpupool.jobs.local.LocalJobBackend`."""

    name = "base"
    max_ranks = 0
    """Ranks this backend runs at once over all jobs (0: no limit; the cluster decides)."""
    distinct_nodes = False
    """Whether every node of a multi-node job must be a different machine (the job manager
    then grants each node on a machine the job's other nodes are not on)."""
    network_note = ""
    """What keeps a job's network (its rendezvous, its ranks' traffic) from other tenants', in
    one sentence for the admin page; ``""`` when the backend has nothing to say."""
    private_network = False
    """Whether each job's network is out of every other tenant's reach."""
    enforces_time_limit = False
    """Whether the cluster ends a job at its time limit itself, counted from when it really
    starts (Slurm's ``--time``); otherwise the job manager stops it ``time_limit`` seconds
    after its grant."""
    marker = ""
    """This hub's marker (``GPUPOOL_HUB``), which every job process carries, so reconciliation
    finds this hub's processes and only those (set by the job manager from its pool)."""

    async def request_nodes(self, wanted: list[ScaleUp], node_pools: Sequence[NodePool]) -> None:
        """Ask the cluster's autoscaler for the nodes the queue waits for (see
        :mod:`gpupool.kube.scale_up`); ``[]`` withdraws every request. Backends without an
        autoscaler have nothing to ask."""

    def validate(self, spec: JobSpec) -> None:
        """Refuse a spec this backend cannot run (raise :class:`InvalidRequest`)."""
        if spec.nodes < 1 or spec.gpus < 1:
            raise InvalidRequest("A job needs at least 1 node and 1 GPU (or process) per node.")

    async def start(self, job: Job, allocations: list[Allocation]) -> str:
        """Start ``job`` on ``allocations`` (one per node); return its handle."""
        raise NotImplementedError

    async def check(self, job: Job) -> Observation:
        """What the job's processes are doing now (also right after a hub restart)."""
        raise NotImplementedError

    async def wait(self, job: Job, timeout: float) -> None:
        """Return when the job may have changed state, or after ``timeout`` seconds."""
        raise NotImplementedError

    async def cancel(self, job: Job) -> None:
        """Stop every process of the job (politely, then for sure)."""
        raise NotImplementedError

    async def forget(self, job: Job) -> None:
        """Delete what the ended ``job`` left (its logs) when retention forgets it; raise when
        that fails. Backends whose jobs leave nothing (or expire on their own: Kubernetes Jobs
        go with ``ttlSecondsAfterFinished``) have nothing to do."""

    async def read_log(self, job: Job, rank: int, offset: int) -> tuple[bytes, int]:
        """Bytes of ``rank``'s log from ``offset`` (a bounded chunk), and the log's size now;
        never blocks the event loop (files are read in a worker thread, the API asynchronously)."""
        raise NotImplementedError
