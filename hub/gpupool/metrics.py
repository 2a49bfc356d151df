"""gpupool's Prometheus metrics, served by JupyterHub's own ``/hub/metrics`` (the default
``prometheus_client`` registry, which JupyterHub's metrics handler writes out).

Vocabulary
- *event metrics*: counters and histograms updated where things happen: allocation latency and
  refusals (in :class:`gpupool.pool.Pool`), queue wait (in the job manager), idle warnings and
  reclaims (in the reclaimer), shares over their memory (in the share watch), reconciliation's
  actions and passes (in :mod:`gpupool.hub.reconcile`).
- *state metrics*: gauges computed at scrape time by
  :class:`gpupool.hub.collector.PoolCollector` from the ledger, the job manager, the reclaimer
  and the device monitor, so they always equal what the pool holds.

Contract: a leaf module (it imports nothing of gpupool), so the pool, the job manager and the
hub all count here without import circles. Names carry the ``gpupool_`` prefix and their unit
(``_gpu_equivalents``, ``_seconds``, ``_bytes``, ``_ratio``); counters end in ``_total``. Labels
are bounded: team, offer, kind, state, reason, action, and for devices node, device UUID, model
and MIG profile (as many as the hardware has). Never a user name or job id.
"""

from __future__ import annotations

from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram

GPU_EQ = "gpu_equivalents"

ALLOCATION_SECONDS = Histogram(
    "gpupool_allocation_duration_seconds",
    "Time the pool took to decide and persist one allocation, by kind (notebook or job).",
    ["kind"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
REFUSALS = PromCounter(
    "gpupool_refusals",
    "Requests the pool refused, by kind (notebook: a spawn; job: a job start) and reason "
    "(quota_exceeded, no_capacity, offer_not_allowed, not_a_team_member, invalid_request).",
    ["kind", "reason"],
)
QUEUE_WAIT_SECONDS = Histogram(
    "gpupool_queue_wait_seconds",
    "Time jobs waited in the queue before their GPUs were granted, by team.",
    ["team"],
    buckets=(1, 5, 15, 60, 300, 900, 1800, 3600, 7200, 14400, 43200, 86400),
)
IDLE_WARNINGS = PromCounter(
    "gpupool_idle_warnings",
    "Notebooks warned that their idle GPUs will be reclaimed, by team.",
    ["team"],
)
RECLAIMS = PromCounter(
    "gpupool_reclaims",
    "Idle notebook GPUs taken back, by team, action (stop or cpu: restarted CPU-only) and reason "
    "(idle: below the utilisation threshold and no busy kernel for the configured time).",
    ["team", "action", "reason"],
)
RECONCILE_ACTIONS = PromCounter(
    "gpupool_reconcile_actions",
    "What reconciliation did (at hub start and periodically), by action: released (an "
    "allocation without a live holder), stopped (processes holding devices without an "
    "allocation), adopted (a live server's allocation the pool database had lost, taken back), "
    "reported (what it leaves alone: logged once).",
    ["action"],
)
RECONCILE_SECONDS = Histogram(
    "gpupool_reconcile_duration_seconds",
    "Time one reconciliation pass took (reading JupyterHub's servers, this hub's processes and "
    "NVML, deciding, and stopping what it stops).",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RECONCILE_FAILURES = PromCounter(
    "gpupool_reconcile_failures",
    "Reconciliation passes that failed (logged; the next pass tries again).",
)


def refusal(kind: str, code: str) -> None:
    REFUSALS.labels(kind=kind, reason=code).inc()


SHARE_OVERUSE = PromCounter(
    "gpupool_share_overuse",
    "Shares of GPUs without MIG whose processes used more GPU memory than the share (read "
    "through NVML), by kind (notebook or job) and action: warn (the user was warned) or stop "
    "(the server was stopped, or the job cancelled, after ShareEnforcement.grace_minutes).",
    ["kind", "action"],
)

DEVICE_MISUSE = PromCounter(
    "gpupool_device_misuse",
    "Processes NVML found on a device of the pool that they do not hold, each counted once per "
    "action: warn (user code, warned), stop (SIGTERM after DeviceWatch.grace_minutes), kill "
    "(SIGKILL: still there at the next look), log (user code left running: the log policy), "
    "outside (another account's: never stopped; its device is not handed out while it runs).",
    ["action"],
)
