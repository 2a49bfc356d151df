"""Reading a Kubernetes Job: pure functions from the Job and its pods to an observation.

Vocabulary
- *newest pod* of a completion index: the pod of that index created last (a retried node has
  several).
- *node exit codes*: ``(node index, exit code)`` from each index's newest pod's ``job``
  container (torchrun's exit status): Kubernetes sees one process per node.
- *rank exit codes*: what the observation reports, ``(rank, exit code)`` as the local backend
  does. Only the node's code is known (torchrun ends with the first failing rank's code, or 1,
  and stops the node's other ranks), so every rank ``r`` of node ``r // gpus`` gets its node's
  code: ``exit_codes`` tells which ranks' node failed, not which rank of it. The reason speaks of
  nodes and names their ranks.
- *handle* (:class:`JobRef`): the namespace, the names and the Job's ``uid``, as JSON.
- *stranded pod* (:func:`stranded_pods`): a job pod that can neither end nor start because of its
  node: being deleted (``deletionTimestamp``) on a node that is not ready or gone (the taint
  eviction controller deleted it once its ``tolerationSeconds`` passed, or the Job controller
  did; that node's kubelet never confirms, so it stays Terminating and ``podReplacementPolicy:
  Failed`` never replaces it, nor does the Job ever get its terminal condition), or Pending
  unschedulable while bound (``metadata.name``) to a node that is not ready (the job's nodes are
  fixed, one pod on each). A job with one is stopped and fails with the node's reason.
- *taken back*: a Job with a Kueue queue that Kueue admitted and then preempted: Kueue sets
  ``spec.suspend: true`` again and clears ``startTime``, the Job controller deletes its pods and
  sets ``Suspended`` as at creation, so the Job alone cannot tell it from one never admitted; the
  backend says whether it saw it admitted. Observed as ``queued``: the hub stops it and releases
  its GPUs (see :mod:`gpupool.kube.jobs`).

Contract: pure, no API calls; :mod:`gpupool.kube.jobs` fetches the objects and calls these.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from gpupool.core.jobs import Job
from gpupool.jobs.backend import Observation
from gpupool.kube.manifests import (
    COMPLETION_INDEX_LABEL,
    CONTAINER,
    configmap_name,
    job_name,
    service_name,
)
from gpupool.kube.nodes import not_ready_reason
from gpupool.kube.pods import (
    KUEUE_QUEUE_LABEL,
    NODE_NAME_FIELD,
)

TERMINAL_PHASES = ("Succeeded", "Failed")


class KubeError(RuntimeError):
    """The API server refused a request; the message is its ``Status`` message."""


def api_message(error: Exception) -> str:
    """The API server's own words for an ``ApiException`` (its Status ``message``)."""
    body = getattr(error, "body", None)
    try:
        status = json.loads(body) if body else {}
    except (TypeError, ValueError):
        status = {}
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return f"{getattr(error, 'status', '')} {getattr(error, 'reason', '') or error}".strip()


@dataclass(frozen=True)
class JobRef:
    """Where a job's objects are: the handle's content."""

    namespace: str
    job: str
    service: str
    configmap: str
    uid: str = ""

    @classmethod
    def named(cls, job: Job, namespace: str) -> JobRef:
        """The names a new start gives the job's objects (from the job id alone)."""
        return cls(namespace, job_name(job), service_name(job), configmap_name(job))

    @classmethod
    def of(cls, job: Job, namespace: str) -> JobRef:
        """From the handle; the computed names where it has none."""
        try:
            handle = json.loads(job.handle) if job.handle else {}
        except ValueError:
            handle = {}
        named = cls.named(job, namespace)
        return cls(
            namespace=str(handle.get("namespace") or named.namespace),
            job=str(handle.get("job") or named.job),
            service=str(handle.get("service") or named.service),
            configmap=str(handle.get("configmap") or named.configmap),
            uid=str(handle.get("uid") or ""),
        )

    def handle(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


# -- pure: API objects to an observation -------------------------------------------------------
def pod_index(pod: Mapping[str, Any]) -> int | None:
    """A job pod's completion index (label, or the annotation older clusters set)."""
    meta = pod.get("metadata") or {}
    for source in (meta.get("labels") or {}, meta.get("annotations") or {}):
        value = str(source.get(COMPLETION_INDEX_LABEL, ""))
        if value.isdigit():
            return int(value)
    return None


def latest_pods(pods: Sequence[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    """The newest pod of each completion index (a failed pod's replacement wins; of two
    created in the same second, the one not yet ended)."""
    out: dict[int, Mapping[str, Any]] = {}
    for pod in sorted(pods, key=_created):
        index = pod_index(pod)
        if index is not None:
            out[index] = pod
    return dict(sorted(out.items()))


def _created(pod: Mapping[str, Any]) -> tuple[str, bool, str]:
    meta = pod.get("metadata") or {}
    stamp = str(meta.get("creationTimestamp") or "")
    return stamp, phase(pod) not in TERMINAL_PHASES, str(meta.get("name") or "")


def _container_status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((s for s in statuses if s.get("name") == CONTAINER), {})


def exit_code(pod: Mapping[str, Any]) -> int | None:
    """The job container's exit code, once it has terminated."""
    terminated = (_container_status(pod).get("state") or {}).get("terminated") or {}
    code = terminated.get("exitCode")
    return int(code) if code is not None else None


def node_exit_codes(pods: Sequence[Mapping[str, Any]]) -> tuple[tuple[int, int], ...]:
    """``(node index, exit code)`` for each index whose newest pod has ended."""
    codes = ((i, exit_code(p)) for i, p in latest_pods(pods).items())
    return tuple((i, c) for i, c in codes if c is not None)


def rank_exit_codes(
    node_codes: Sequence[tuple[int, int]], gpus: int
) -> tuple[tuple[int, int], ...]:
    """Node codes as ``(rank, code)`` for every rank of each node (see *rank exit codes*)."""
    per_node = max(gpus, 1)
    return tuple(
        (node * per_node + local, code) for node, code in node_codes for local in range(per_node)
    )


def ranks_of(node: int, gpus: int) -> str:
    """``"rank 3"`` or ``"ranks 2-3"``: the ranks node ``node`` ran."""
    per_node = max(gpus, 1)
    first, last = node * per_node, node * per_node + per_node - 1
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def phase(pod: Mapping[str, Any]) -> str:
    return str((pod.get("status") or {}).get("phase") or "Pending")


def _conditions(obj: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """The object's conditions that hold (``status: "True"``), by type."""
    conditions = (obj.get("status") or {}).get("conditions") or []
    return {c["type"]: c for c in conditions if c.get("status") == "True"}


def observe_objects(
    job_object: Mapping[str, Any],
    pods: Sequence[Mapping[str, Any]],
    nodes: int,
    gpus: int = 1,
    admitted: bool = False,
) -> Observation:
    """What a Job and its pods say about the job (see the module's contract); ``exit_codes``
    per rank (``gpus`` ranks per node). ``admitted``: Kueue had admitted the Job before (see
    *taken back*), so a suspended Job with a queue is ``queued``, not waiting."""
    conditions = _conditions(job_object)
    node_codes = node_exit_codes(pods)
    codes = rank_exit_codes(node_codes, gpus)
    if "Complete" in conditions:
        return Observation("succeeded", f"all {nodes} node(s) exited 0", codes)
    if "Failed" in conditions:
        why = failure_reason(job_object, conditions["Failed"], node_codes, gpus)
        return Observation("failed", why, codes)
    if "Suspended" in conditions or (job_object.get("spec") or {}).get("suspend"):
        queue = ((job_object.get("metadata") or {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL)
        if queue and admitted:
            return Observation("queued", taken_back_reason(queue), codes)
        why = f"waiting for Kueue to admit it (queue {queue})" if queue else "suspended"
        return Observation("starting", why, codes)
    latest = latest_pods(pods)
    up = [i for i, p in latest.items() if phase(p) != "Pending"]
    ending = conditions.get("FailureTarget") or conditions.get("SuccessCriteriaMet")
    if ending is not None:
        why = f"ending: {ending.get('reason') or ending['type']}"
        return Observation("running" if up else "starting", why, codes)
    if len(up) == nodes:  # every node has started (a failed one until the controller acts)
        return Observation("running", running_reason(latest, nodes), codes)
    return Observation("starting", waiting_reason(latest, nodes, len(up)), codes)


def taken_back_reason(queue: str) -> str:
    """Why a *taken back* job stops (the hub then requeues it or, out of restarts, fails it)."""
    return (
        f"preempted by Kueue (queue {queue}): its Job was suspended after admission and its "
        "pods deleted, so its GPUs are released"
    )


def running_reason(latest: Mapping[int, Mapping[str, Any]], nodes: int) -> str:
    """``"all 2 node(s) running"``, or each node's state once some have ended."""
    if all(phase(p) == "Running" for p in latest.values()):
        return f"all {nodes} node(s) running"
    words = []
    for index, pod in latest.items():
        code = exit_code(pod)
        done = f"exited {code}" if code is not None else phase(pod).lower()
        words.append(f"node {index} {'running' if phase(pod) == 'Running' else done}")
    return ", ".join(words)


def waiting_reason(latest: Mapping[int, Mapping[str, Any]], nodes: int, up: int) -> str:
    """``"1 of 2 nodes running; node 1: Unschedulable: 0/4 nodes are available: …"``."""
    head = f"{up} of {nodes} node(s) running"
    for index in range(nodes):
        pod = latest.get(index)
        if pod is None:
            return f"{head}; node {index}: no pod yet"
        if phase(pod) != "Pending":
            continue
        waiting = (_container_status(pod).get("state") or {}).get("waiting") or {}
        if waiting.get("reason"):
            return f"{head}; node {index}: {_words(waiting)}"
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False":
                return f"{head}; node {index}: {_words(c)}"
        return f"{head}; node {index}: {phase(pod)}"
    return head


def _words(item: Mapping[str, Any]) -> str:
    reason, message = item.get("reason") or "", item.get("message") or ""
    return f"{reason}: {message}" if reason and message else reason or message


def failure_reason(
    job_object: Mapping[str, Any],
    condition: Mapping[str, Any],
    codes: Sequence[tuple[int, int]],
    gpus: int = 1,
) -> str:
    """The ``Failed`` condition in a researcher's words, with the nodes (``codes``: node index,
    code) that exited non-zero and, when a node ran several, their ranks."""
    spec = job_object.get("spec") or {}
    reason = condition.get("reason") or ""
    bad = ", ".join(
        f"node {i}{f' ({ranks_of(i, gpus)})' if gpus > 1 else ''} exited {c}"
        for i, c in codes
        if c != 0
    )
    if reason == "DeadlineExceeded":
        return f"time limit of {spec.get('activeDeadlineSeconds')} s reached"
    if reason == "BackoffLimitExceeded":
        return f"{bad or 'pods failed'}; out of restarts (backoffLimit {spec.get('backoffLimit')})"
    if reason == "PodFailurePolicy":
        return f"{bad or condition.get('message') or 'a node failed'} (see the node's log)"
    return _words(condition) or "the Job failed"


def bound_nodes_of(pod: Mapping[str, Any]) -> list[str]:
    """The nodes a pod's required node affinity names by ``metadata.name`` (every term's)."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    return sorted(
        {
            str(v)
            for term in required.get("nodeSelectorTerms") or []
            for f in term.get("matchFields") or []
            if f.get("key") == NODE_NAME_FIELD and f.get("operator") == "In"
            for v in f.get("values") or []
        }
    )


def _unschedulable(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "PodScheduled" and c.get("status") == "False" for c in conditions)


def nodes_to_read(pods: Sequence[Mapping[str, Any]]) -> set[str]:
    """The nodes whose readiness decides whether a pod of ``pods`` is *stranded*: those of pods
    being deleted, and those a Pending unschedulable pod is bound to. Usually none."""
    out: set[str] = set()
    for pod in pods:
        if phase(pod) in TERMINAL_PHASES:
            continue
        node = (pod.get("spec") or {}).get("nodeName")
        if node and (pod.get("metadata") or {}).get("deletionTimestamp"):
            out.add(str(node))
        elif not node and phase(pod) == "Pending" and _unschedulable(pod):
            out |= set(bound_nodes_of(pod))
    return out


def stranded_pods(
    pods: Sequence[Mapping[str, Any]], nodes: Mapping[str, Mapping[str, Any] | None]
) -> dict[str, str]:
    """The *stranded pods* of ``pods`` by name, each with why (``"node gpu-2 is not ready
    (Ready=Unknown, …)"``); ``nodes``: the nodes of :func:`nodes_to_read` as API JSON, ``None``
    for one that is gone (a node missing from ``nodes`` could not be read: not judged)."""
    out: dict[str, str] = {}
    for pod in pods:
        if phase(pod) in TERMINAL_PHASES:
            continue
        name = str((pod.get("metadata") or {}).get("name") or "")
        node = (pod.get("spec") or {}).get("nodeName")
        if node and (pod.get("metadata") or {}).get("deletionTimestamp"):
            if node in nodes:
                obj = nodes[node]
                why = "is gone" if obj is None else not_ready_reason(obj)
                if why:
                    out[name] = f"node {node} {why}"
        elif not node and phase(pod) == "Pending" and _unschedulable(pod):
            for bound in bound_nodes_of(pod):
                obj = nodes.get(bound)
                why = not_ready_reason(obj) if obj is not None else None
                if why:
                    out[name] = f"node {bound} {why}"
                    break
    return out


# -- the backend --------------------------------------------------------------------------------
