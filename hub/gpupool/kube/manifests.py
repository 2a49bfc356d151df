"""Kubernetes objects for a gpupool job: pure functions from a :class:`Job` to API JSON.

Vocabulary
- *job object*: a ``batch/v1`` Job in ``completionMode: Indexed`` with ``completions`` =
  ``parallelism`` = the job's nodes. The Job controller gives each pod its *completion index*
  (env ``JOB_COMPLETION_INDEX``, label ``batch.kubernetes.io/job-completion-index``) and the
  hostname ``<job name>-<index>``; one pod per index is one *node* of the job.
- *rendezvous service*: a headless Service (``clusterIP: None``, ``publishNotReadyAddresses``)
  whose name is the pods' ``subdomain``, so node 0 resolves as ``<job name>-0.<service>`` before
  it is ready. Every node runs ``torchrun --nnodes N --nproc-per-node G --node-rank
  $(JOB_COMPLETION_INDEX) --master-addr <job name>-0.<service> --master-port 29500`` (torchrun's
  static rendezvous: the node rank *is* the completion index, so global rank = index × G + local
  rank; with c10d rendezvous node ranks would be assigned in arrival order). A one-node job uses
  ``127.0.0.1`` and needs no DNS.
- *script config map*: the job's script as one key of a ConfigMap, mounted read-only at
  :data:`SCRIPT_DIR`.
- *job network policy*: a NetworkPolicy named as the Job, selecting the job's pods
  (``gpupool.io/job: <id>``): ingress only from the job's own pods, egress only to them and to
  the cluster DNS (*DNS peers*, by default ``k8s-app: kube-dns`` pods in ``kube-system``, on
  port 53 UDP and TCP). Policies add up, so this lets a job's ranks reach each other (the
  rendezvous on :data:`MASTER_PORT`, NCCL/gloo on any port) and nothing of another job; the Helm
  chart's release-wide policy for every job pod admits nothing but DNS. Owned by the Job, so the
  garbage collector deletes it with the Job.
- *notebook pod template*: the user's notebook pod as API JSON (a Pod, or just its PodSpec), e.g.
  what KubeSpawner built or the running pod read back from the API. The job pod keeps its image,
  volumes and mounts (claims only as *claims* says), security contexts (hardened, see *job pod
  hardening*), service account, node selector, tolerations, affinity, image pull secrets and
  non-GPU resources; it drops what belongs to the notebook server (other containers, init
  containers, ports, probes, lifecycle hooks, ``JUPYTERHUB_*``/``JPY_*`` and ``GPUPOOL_*``
  environment, labels and annotations), what the API server fills in (``nodeName``,
  ``priority``, ``overhead``, the ``kube-api-access-*`` token volume) and the host's namespaces
  (``hostNetwork``, ``hostPID``, ``hostIPC``: a pod on the host's network is out of every
  NetworkPolicy's reach).
- *job pod hardening*: every job pod, from a notebook pod or not (no running notebook:
  ``pod_template``, by default empty), runs with :data:`gpupool.kube.pods.HARDENING`:
  ``runAsNonRoot`` and the ``RuntimeDefault`` seccomp profile on the pod and the job container,
  ``allowPrivilegeEscalation: false`` and every capability dropped on the container, over
  whatever the template says (its ``runAsUser``, groups, ``fsGroup``... are kept; ``privileged``
  and added capabilities are not). A template set to run as user 0 cannot make a job pod
  (``ValueError`` with the reason): the kubelet would refuse to start its container. z2jh's
  ``block-cloud-metadata`` init container (privileged, user 0) is not needed: the *job network
  policy* lets no job pod reach the metadata server.
- *rank logs*: ``python -m gpupool_lab.rank_log LOG_DIR …`` points each rank's output at
  ``LOG_DIR/rank-<rank>.log``; here every such path is a symlink to ``/dev/stdout``, made by the
  container's ``sh`` wrapper, which then becomes torchrun (``exec``), so all ranks of a node land
  in that pod's log (the pod log API), line by line (ranks run as ``python``, not torchrun's
  unbuffered ``python -u``), each rank's start marked by rank_log.

- *node binding*: a GPU job's pods are bound to the nodes the ledger chose (one allocation per
  job node, ``Allocation.node``). An Indexed Job has one pod template for every index, and no
  field of it can differ per index (only the ``JOB_COMPLETION_INDEX`` env and the index label do),
  so "index *i* on node *i*" cannot be written into it. What the ledger counted is how many of the
  job's pods, all of one shape, each node holds, and that can: the template requires one of the
  job's nodes (by name, one node affinity term per node, see :mod:`gpupool.kube.pods`) and, when
  there are several, spreads the job's
  pods over them (``topologySpreadConstraints``: ``maxSkew: 1`` on ``kubernetes.io/hostname``,
  ``DoNotSchedule``, the job's label; only nodes matching the affinity count). ``k`` allocations
  on each of ``m`` nodes (one-node jobs, one node per machine, all nodes on one machine) then
  give exactly ``k`` pods on each: the placement is the ledger's, up to which index runs where
  (ranks follow the index, not the machine). An uneven split (two nodes of the job on one
  machine, one on another) could not be bound exactly, so it is never granted: with binding on,
  the backend says ``distinct_nodes`` and the job manager grants each of a job's nodes on a
  machine its other nodes are not on (``k = 1``). :func:`exact_binding` stays as a guard (the
  backend logs a split that is not exact). One Job per node would bind any split exactly but
  lose the Indexed Job's gang semantics (one failure policy, one Kueue admission); pods created
  with a scheduling gate that the hub lifts after adding each index's node (as Kueue's
  topology-aware scheduling does) would too, at the cost of a hub in the scheduling path.
- *claims*: ``persistentVolumeClaim`` volumes of the template (the user's home, ReadWriteOnce
  under z2jh's default storage: attachable by one node at a time) are kept only when every pod of
  the job is bound to the node the notebook pod runs on (its ``nodeName``), or when named in
  ``keep_claims`` (known ReadWriteMany); otherwise they and their mounts are left out, so no pod
  waits on a ``Multi-Attach error``. A *shared volume* (an admin's ReadWriteMany claim) is
  mounted in every pod, its path in ``GPUPOOL_SHARED_DIR``.
- *one rank per MIG instance*: a pod given N instances of a MIG offer runs N ranks
  (``--nproc-per-node N``) with ``GPUPOOL_DDP_BACKEND=gloo`` and
  ``GPUPOOL_RANK_DEVICES=NVIDIA_VISIBLE_DEVICES``: ``gpupool_lab.rank_log`` gives local rank *r*
  the *r*-th UUID of ``NVIDIA_VISIBLE_DEVICES``, which the NVIDIA device plugin sets in the
  container (its ``envvar`` device-list strategy with ``uuid`` device IDs); where the variable
  holds no UUIDs (``volume-mounts``, CDI, ``index`` IDs) each rank's log says so and every rank
  sees the first instance (:func:`gpupool.core.offers.rank_env`).

Contract: no I/O; every function returns new plain dicts (camelCase keys, as the API expects),
never touching its inputs. GPU-specific parts come from :mod:`gpupool.kube.pods`
(:func:`~gpupool.kube.pods.apply_allocation` on the parts of the pod it owns), so a job
pod carries its allocation exactly as a notebook pod does: equal limits and requests of the
allocation's ``nvidia.com/*`` resources, the offer model's ``nvidia.com/gpu.product`` affinity and
the GPU tolerations; CPU jobs get ``NVIDIA_VISIBLE_DEVICES=void``. Every node's allocation must
have the same shape (``ValueError`` otherwise). Text that Kubernetes would expand as
``$(VAR)`` (script arguments, environment values) is escaped, so it reaches the script verbatim.
"""

from __future__ import annotations

import copy
import hashlib
import posixpath
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kubernetes_asyncio.client import (
    V1Affinity,
    V1Container,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
    V1ResourceRequirements,
    V1Toleration,
)

from gpupool.core.jobs import Job
from gpupool.core.ledger import Allocation
from gpupool.core.offers import Offer, rank_env
from gpupool.kube.pods import (
    ALLOCATION_LABEL,
    DEFAULT_GPU_TOLERATIONS,
    DEFAULT_PRODUCT_LABELS,
    HOSTNAME_LABEL,
    KUEUE_PRIORITY_LABEL,
    KUEUE_QUEUE_LABEL,
    NO_SHARES,
    NOTEBOOK_CONTAINER,
    TEAM_LABEL,
    ShareRequests,
    allocation_resources,
    apply_allocation,
    bound_nodes,
    hardened_context,
    hardened_pod_context,
    label_value,
    run_as_user,
    share_annotations,
    to_json,
    to_model,
)

JOB_LABEL = "gpupool.io/job"
OWNER_LABEL = "gpupool.io/owner"
OWNER_ANNOTATION = "gpupool.io/owner"
NAME_ANNOTATION = "gpupool.io/job-name"
ALLOCATIONS_ANNOTATION = "gpupool.io/allocations"
NODES_ANNOTATION = "gpupool.io/nodes"
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpupool", "app.kubernetes.io/component": "job"}
COMPLETION_INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
CONTAINER = "job"
MASTER_PORT = 29500
DNS_PORTS: tuple[dict[str, Any], ...] = (
    {"port": 53, "protocol": "UDP"},
    {"port": 53, "protocol": "TCP"},
)
DEFAULT_DNS_PEERS: tuple[dict[str, Any], ...] = (
    {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    },
)
"""Where the cluster DNS runs (CoreDNS keeps kube-dns's label ``k8s-app: kube-dns``)."""
SCRIPT_DIR = "/opt/gpupool/job"
DEFAULT_LOG_DIR = "/opt/gpupool/logs"
SCRIPT_VOLUME, LOG_VOLUME, SHM_VOLUME = "gpupool-script", "gpupool-logs", "gpupool-shm"
SHARED_VOLUME = "gpupool-shared"
DEFAULT_SHARED_PATH = "/home/jovyan/shared"
DEFAULT_TORCHRUN: tuple[str, ...] = ("torchrun",)
DEFAULT_PYTHON = "python"
NAME_PREFIX = "gpupool-"
MAX_JOB_NAME = 50
"""Pod hostnames are ``<job name>-<index>``: a DNS label of at most 63 characters."""

DROPPED_ENV_PREFIXES = ("JUPYTERHUB_", "JPY_", "GPUPOOL_")
DROPPED_POD_FIELDS = (
    "containers",  # rebuilt: one job container
    "restartPolicy",
    "hostname",
    "subdomain",
    "setHostnameAsFQDN",
    "nodeName",
    "priority",  # the Priority admission plugin refuses pods that set it
    "preemptionPolicy",
    "overhead",
    "readinessGates",
    "ephemeralContainers",
    "schedulingGates",
    "activeDeadlineSeconds",
    "shareProcessNamespace",
    "initContainers",  # the notebook server's (z2jh's block-cloud-metadata runs as root)
    "hostNetwork",
    "hostPID",
    "hostIPC",
)
KEPT_CONTAINER_FIELDS = (
    "image",
    "imagePullPolicy",
    "env",
    "envFrom",
    "resources",
    "securityContext",
    "volumeMounts",
    "volumeDevices",
    "workingDir",
)
TOKEN_VOLUME_PREFIX = "kube-api-access-"

WRAPPER = (
    'mkdir -p "$GPUPOOL_LOG_DIR" && for r in {ranks}; do '
    'ln -sfn /dev/stdout "$GPUPOOL_LOG_DIR/rank-$r.log" || exit 1; done && exec "$@"'
)
"""The container's ``sh -c`` script: rank logs to the pod log, then torchrun as the shell."""

_INVALID_NAME = re.compile(r"[^a-z0-9-]+")
_INVALID_KEY = re.compile(r"[^-._a-zA-Z0-9]+")


# -- names --------------------------------------------------------------------------------------
def job_name(job: Job) -> str:
    """``gpupool-<job id>``, a DNS-1123 (and DNS-1035) label of at most :data:`MAX_JOB_NAME`
    characters; ids that are not already valid get a slug plus a short hash of the id."""
    slug = _INVALID_NAME.sub("-", job.id.lower()).strip("-")
    name = NAME_PREFIX + slug
    if slug == job.id and len(name) <= MAX_JOB_NAME:
        return name
    digest = hashlib.sha256(job.id.encode()).hexdigest()[:8]
    keep = MAX_JOB_NAME - len(NAME_PREFIX) - len(digest) - 1
    return f"{NAME_PREFIX}{slug[:keep].strip('-') or 'job'}-{digest}"


def service_name(job: Job) -> str:
    """The headless Service (and the pods' ``subdomain``): the job's name, so node 0 is
    ``<name>-0.<name>``."""
    return job_name(job)


def configmap_name(job: Job) -> str:
    return f"{job_name(job)}-script"


def script_key(job: Job) -> str:
    """The ConfigMap key (and file name) of the script: the spec's file name, made valid."""
    base = posixpath.basename(job.spec.filename.replace("\\", "/"))
    key = _INVALID_KEY.sub("_", base).strip(".")
    return key if key else "script.py"


def rank0_address(job: Job) -> str:
    """Where node 0's torchrun listens: its pod's DNS name (loopback for one node)."""
    if job.spec.nodes == 1:
        return "127.0.0.1"
    return f"{job_name(job)}-0.{service_name(job)}"


# -- labels ---------------------------------------------------------------------------------------
def job_labels(job: Job) -> dict[str, str]:
    """Labels on every object of the job (and its pods): job, team, owner, managed-by."""
    return {
        JOB_LABEL: label_value(job.id),
        TEAM_LABEL: label_value(job.team),
        OWNER_LABEL: label_value(job.owner),
        **MANAGED_BY,
    }


def _metadata(job: Job, name: str, namespace: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": job_labels(job),
        "annotations": {OWNER_ANNOTATION: job.owner},
    }


def owner_reference(job_object: Mapping[str, Any]) -> dict[str, Any]:
    """An ``ownerReferences`` entry naming a created Job (its dependents go when it goes)."""
    meta = job_object["metadata"]
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": meta["name"],
        "uid": meta["uid"],
        "blockOwnerDeletion": False,
        "controller": False,
    }


# -- the Service and the ConfigMap ---------------------------------------------------------------
def make_service(
    job: Job, namespace: str, owner: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The headless rendezvous Service selecting the job's pods."""
    meta = _metadata(job, service_name(job), namespace)
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "selector": {JOB_LABEL: label_value(job.id)},
            "publishNotReadyAddresses": True,
            "ports": [
                {
                    "name": "rendezvous",
                    "port": MASTER_PORT,
                    "targetPort": MASTER_PORT,
                    "protocol": "TCP",
                }
            ],
        },
    }


def network_policy_name(job: Job) -> str:
    """The job network policy: named as the Job."""
    return job_name(job)


def make_network_policy(
    job: Job,
    namespace: str,
    owner: Mapping[str, Any] | None = None,
    dns: Sequence[Mapping[str, Any]] = DEFAULT_DNS_PEERS,
) -> dict[str, Any]:
    """The job network policy (see the module docstring): the job's pods reach each other and
    the ``dns`` peers (NetworkPolicy peers) on port 53, and only the job's pods reach them."""
    meta = _metadata(job, network_policy_name(job), namespace)
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    pods = {"podSelector": {"matchLabels": {JOB_LABEL: label_value(job.id)}}}
    egress: list[dict[str, Any]] = [{"to": [copy.deepcopy(pods)]}]
    if dns:
        egress.append({"to": copy.deepcopy(list(dns)), "ports": copy.deepcopy(list(DNS_PORTS))})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta,
        "spec": {
            **copy.deepcopy(pods),
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [copy.deepcopy(pods)]}],
            "egress": egress,
        },
    }


def make_script_configmap(
    job: Job, namespace: str, owner: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The ConfigMap holding the script under :func:`script_key`."""
    meta = _metadata(job, configmap_name(job), namespace)
    if owner is not None:
        meta["ownerReferences"] = [owner_reference(owner)]
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta,
        "data": {script_key(job): job.spec.script},
    }


# -- the Job ------------------------------------------------------------------------------------
def make_job(
    job: Job,
    allocations: Sequence[Allocation],
    *,
    pod_template: Mapping[str, Any],
    namespace: str,
    script_configmap: str,
    kueue_queue: str | None = None,
    kueue_priority_class: str = "",
    offer: Offer | None = None,
    image: str = "",
    log_dir: str = DEFAULT_LOG_DIR,
    torchrun: Sequence[str] = DEFAULT_TORCHRUN,
    python: str = DEFAULT_PYTHON,
    ttl_seconds_after_finished: int | None = None,
    termination_grace_seconds: int | None = None,
    suspend: bool = False,
    tolerations: Sequence[Mapping[str, Any] | V1Toleration] = DEFAULT_GPU_TOLERATIONS,
    priority_class_name: str = "",
    scheduler_name: str = "",
    product_labels: Mapping[str, Sequence[str]] = DEFAULT_PRODUCT_LABELS,
    bind_to_node: bool = True,
    keep_claims: Sequence[str] = (),
    shared_claim: str = "",
    shared_mount_path: str = DEFAULT_SHARED_PATH,
    shares: ShareRequests = NO_SHARES,
) -> dict[str, Any]:
    """The ``batch/v1`` Indexed Job running ``job`` on ``allocations`` (one per node).

    - GPU pods are bound to the allocations' nodes (see *node binding*; ``bind_to_node=False``
      leaves that out); the template's claims are kept or left out as *claims* says, and
      ``shared_claim`` is mounted at ``shared_mount_path`` in every pod.
    - ``completions = parallelism = nodes``; ``activeDeadlineSeconds`` = the time limit.
    - ``backoffLimit: 0`` and a ``FailJob`` rule: the first non-zero exit ends the job (reason
      ``PodFailurePolicy``): as on every backend, a failed job is never restarted
      (``max_restarts`` counts the pool's preemptions, in the hub: :mod:`gpupool.core.jobs`);
      pods evicted or preempted by Kubernetes (``DisruptionTarget``) are replaced uncounted.
      ``podReplacementPolicy: Failed`` keeps two pods of one index from running at once.
    - ``suspend`` (or a Kueue queue, whose admission then resumes it) creates the Job suspended.
    - ``kueue_priority_class`` labels the Job (with a Kueue queue only: Kueue reads it there).
    - ``image`` stands in when the template has none (``ValueError`` if neither has one).
    - A share asks for what ``shares`` says (:class:`~gpupool.kube.pods.ShareRequests`); a
      HAMi share's pods go to HAMi's scheduler, pinned to the ledger's GPUs (all of the job's,
      as one template serves every pod: :func:`~gpupool.kube.pods.share_annotations`).
    """
    spec = job.spec
    if len(allocations) != spec.nodes:
        raise ValueError(
            f"job {job.id} has {spec.nodes} node(s) but {len(allocations)} allocations"
        )
    shapes = {tuple(allocation_resources(a, shares).items()) for a in allocations}
    if len(shapes) > 1:
        raise ValueError(f"job {job.id}: every node's allocation must have the same devices")
    nodes = bound_nodes(allocations) if bind_to_node else []
    pod_spec, notebook = _template_parts(pod_template, nodes, keep_claims)
    shared = (shared_claim, posixpath.normpath(shared_mount_path)) if shared_claim else None
    container = _job_container(job, notebook, image, log_dir, (torchrun, python), shared)
    own = rank_env(offer, spec.gpus, "NVIDIA_VISIBLE_DEVICES")  # several MIG: one per rank
    if own:
        container["env"] = [e for e in container["env"] if e["name"] not in own]
        container["env"] += [{"name": k, "value": v} for k, v in own.items()]
    if run_as_user(container.get("securityContext"), pod_spec.get("securityContext")) == 0:
        raise ValueError(
            f"job {job.id}: the notebook pod it is made from runs as root (runAsUser 0), and "
            "job pods never do: set a user for notebooks (z2jh: singleuser.uid), or make job "
            "pods from c.KubeJobBackend.pod_template (c.KubeJobBackend.use_notebook_pod = False)"
        )
    container["securityContext"] = hardened_context(container.get("securityContext"))
    pod_spec["securityContext"] = hardened_pod_context(pod_spec.get("securityContext"))
    pod_spec |= {
        "containers": [container],
        "restartPolicy": "Never",
        "subdomain": service_name(job),
        "volumes": [
            *pod_spec.get("volumes", []),
            *_job_volumes(script_configmap, notebook, shared_claim),
        ],
    }
    if len(nodes) > 1:
        pod_spec["topologySpreadConstraints"] = [
            *pod_spec.get("topologySpreadConstraints", []),
            spread_constraint(job),
        ]
    if termination_grace_seconds is not None:
        pod_spec["terminationGracePeriodSeconds"] = termination_grace_seconds
    labels = job_labels(job)
    pod_spec, pod_labels = _with_allocation(
        pod_spec,
        labels,
        allocations[0] if allocations else None,
        offer,
        tolerations=tolerations,
        priority_class_name=priority_class_name,
        scheduler_name=scheduler_name,
        product_labels=product_labels,
        nodes=nodes,
        shares=shares,
    )
    meta = _metadata(job, job_name(job), namespace)
    meta["annotations"] |= {
        NAME_ANNOTATION: spec.name or spec.filename,
        ALLOCATIONS_ANNOTATION: ",".join(a.id for a in allocations),
    }
    if nodes:
        meta["annotations"][NODES_ANNOTATION] = ",".join(str(a.node) for a in allocations)
    if kueue_queue:
        meta["labels"][KUEUE_QUEUE_LABEL] = label_value(kueue_queue)
        if kueue_priority_class:
            meta["labels"][KUEUE_PRIORITY_LABEL] = kueue_priority_class
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": spec.nodes,
        "parallelism": spec.nodes,
        "backoffLimit": 0,
        "podFailurePolicy": pod_failure_policy(),
        "podReplacementPolicy": "Failed",
        "activeDeadlineSeconds": spec.time_limit,
        "suspend": bool(suspend or kueue_queue),
        "template": {
            "metadata": {
                "labels": pod_labels,
                "annotations": {
                    OWNER_ANNOTATION: job.owner,
                    **share_annotations(allocations, shares),  # HAMi: the ledger's GPUs
                },
            },
            "spec": pod_spec,
        },
    }
    if ttl_seconds_after_finished is not None:
        job_spec["ttlSecondsAfterFinished"] = ttl_seconds_after_finished
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec}


def spread_constraint(job: Job) -> dict[str, Any]:
    """The job's pods spread evenly (skew at most 1) over the nodes their affinity allows."""
    return {
        "maxSkew": 1,
        "topologyKey": HOSTNAME_LABEL,
        "whenUnsatisfiable": "DoNotSchedule",
        "labelSelector": {"matchLabels": {JOB_LABEL: label_value(job.id)}},
    }


def exact_binding(allocations: Sequence[Allocation]) -> bool:
    """Whether the node binding puts on each node exactly as many of the job's pods as the ledger
    counted there: every node holds the same number of the job's allocations."""
    counts = Counter(a.node for a in allocations)
    return len(set(counts.values())) <= 1


def pod_failure_policy() -> dict[str, Any]:
    """Disruptions (eviction, preemption, node drain) never count; any non-zero exit of the job
    container fails the whole Job at once."""
    return {
        "rules": [
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            {
                "action": "FailJob",
                "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn", "values": [0]},
            },
        ]
    }


def torchrun_args(
    job: Job,
    log_dir: str,
    script_path: str,
    torchrun: Sequence[str] = DEFAULT_TORCHRUN,
    python: str = DEFAULT_PYTHON,
) -> list[str]:
    """torchrun's command line, as container ``args`` (``$(JOB_COMPLETION_INDEX)`` is the one
    reference Kubernetes expands; everything else is escaped). ``--no-python``: torchrun would
    start each rank as ``python -u``, and unbuffered ranks sharing the pod's output interleave
    pieces of lines; rank_log makes their output line-buffered instead."""
    spec = job.spec
    return [
        *map(escape, torchrun),
        "--nnodes", str(spec.nodes),
        "--nproc-per-node", str(spec.gpus),
        "--node-rank", "$(JOB_COMPLETION_INDEX)",
        "--master-addr", rank0_address(job),
        "--master-port", str(MASTER_PORT),
        "--max-restarts", "0",
        "--no-python", escape(python), "-m", "gpupool_lab.rank_log",
        escape(log_dir), escape(script_path), *map(escape, spec.args),
    ]  # fmt: skip


def escape(text: str) -> str:
    """``text`` as Kubernetes must see it in ``command``/``args``/``env`` to leave it as it is:
    ``$$`` reads back as ``$``, so no ``$(VAR)`` in it is expanded."""
    return text.replace("$", "$$")


# -- the pod, piece by piece ----------------------------------------------------------------------
def _template_parts(
    template: Mapping[str, Any], nodes: Sequence[str] = (), keep_claims: Sequence[str] = ()
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A cleaned copy of the template's pod spec (without containers) and of its notebook
    container (only the fields a job keeps); claims only as *claims* says (the pods bound to
    ``nodes``)."""
    raw = template if "containers" in template else template.get("spec") or {}
    spec = copy.deepcopy(dict(raw))
    same_node = bool(spec.get("nodeName")) and list(nodes) == [spec.get("nodeName")]
    containers = spec.get("containers") or []
    notebook = next((c for c in containers if c.get("name") == NOTEBOOK_CONTAINER), None)
    notebook = notebook or (containers[0] if containers else {})
    kept = {k: copy.deepcopy(notebook[k]) for k in KEPT_CONTAINER_FIELDS if k in notebook}
    for key in DROPPED_POD_FIELDS:
        spec.pop(key, None)
    ours = (SCRIPT_VOLUME, LOG_VOLUME, SHM_VOLUME, SHARED_VOLUME)
    volumes = [
        v
        for v in spec.get("volumes") or []
        if not v["name"].startswith(TOKEN_VOLUME_PREFIX)
        and v["name"] not in ours
        and (same_node or _claim(v) is None or _claim(v) in keep_claims)
    ]
    names = {v["name"] for v in volumes}
    if volumes:
        spec["volumes"] = volumes
    else:
        spec.pop("volumes", None)
    mounts = [m for m in kept.get("volumeMounts") or [] if m["name"] in names]
    if mounts:
        kept["volumeMounts"] = mounts
    else:
        kept.pop("volumeMounts", None)
    return spec, kept


def _claim(volume: Mapping[str, Any]) -> str | None:
    """The claim a volume mounts, or None for any other kind of volume."""
    pvc = volume.get("persistentVolumeClaim")
    return str(pvc.get("claimName", "")) if isinstance(pvc, Mapping) else None


def _job_container(
    job: Job,
    notebook: Mapping[str, Any],
    image: str,
    log_dir: str,
    launcher: tuple[Sequence[str], str],
    shared: tuple[str, str] | None = None,
) -> dict[str, Any]:
    container = copy.deepcopy(dict(notebook))
    container["image"] = container.get("image") or image
    if not container["image"]:
        raise ValueError(
            "the notebook pod template has no image; set c.KubeJobBackend.image "
            '(e.g. "quay.io/jupyter/pytorch-notebook:cuda12-latest")'
        )
    script_path = posixpath.join(SCRIPT_DIR, script_key(job))
    ranks = " ".join(str(r) for r in range(job.spec.ranks))
    taken = {posixpath.normpath(p) for p in (log_dir, SCRIPT_DIR, *(shared[1:] if shared else ()))}
    mounts = [
        m
        for m in container.get("volumeMounts", [])
        if posixpath.normpath(m["mountPath"]) not in taken
    ]
    mounts += [
        {"name": SCRIPT_VOLUME, "mountPath": SCRIPT_DIR, "readOnly": True},
        {"name": LOG_VOLUME, "mountPath": log_dir},
    ]
    if shared:
        mounts.append({"name": SHARED_VOLUME, "mountPath": shared[1]})
    if not any(m["mountPath"] == "/dev/shm" for m in mounts):
        mounts.append({"name": SHM_VOLUME, "mountPath": "/dev/shm"})
    workdir = _workdir(job.spec.workdir, container.get("workingDir"))
    container |= {
        "name": CONTAINER,
        "command": ["/bin/sh", "-c", escape(WRAPPER.format(ranks=ranks)), "gpupool-job"],
        "args": torchrun_args(job, log_dir, script_path, *launcher),
        "env": _env(job, container.get("env", []), log_dir, shared[1] if shared else ""),
        "volumeMounts": mounts,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if workdir:
        container["workingDir"] = workdir
    else:
        container.pop("workingDir", None)
    return container


def _workdir(workdir: str, template_workdir: str | None) -> str | None:
    """The spec's working folder: absolute as given, relative to the template's (if that is
    absolute), else the template's (or the image's) own."""
    if posixpath.isabs(workdir):
        return posixpath.normpath(workdir)
    if workdir and template_workdir and posixpath.isabs(template_workdir):
        return posixpath.normpath(posixpath.join(template_workdir, workdir))
    return template_workdir or None


def _env(
    job: Job, template_env: Sequence[Mapping[str, Any]], log_dir: str, shared_dir: str = ""
) -> list[dict[str, Any]]:
    """The template's environment (without the notebook server's own), then the spec's, then
    gpupool's; later names win. ``PYTHONUNBUFFERED`` is turned off: a node's ranks share one
    stream, and unbuffered ``print`` writes each piece of a line on its own (rank_log
    line-buffers instead)."""
    env: dict[str, dict[str, Any]] = {}
    for e in template_env:
        if not e["name"].startswith(DROPPED_ENV_PREFIXES):
            env[e["name"]] = copy.deepcopy(dict(e))
    for name, value in job.spec.env:
        env[name] = {"name": name, "value": escape(value)}
    env.setdefault("OMP_NUM_THREADS", {"name": "OMP_NUM_THREADS", "value": "1"})
    ours = {
        "GPUPOOL_JOB": job.id,
        "GPUPOOL_TEAM": job.team,
        "GPUPOOL_OFFER": job.spec.offer,
        "GPUPOOL_NODES": str(job.spec.nodes),
        "GPUPOOL_LOG_DIR": log_dir,
        "PYTHONUNBUFFERED": "",  # empty: off, even where the image's ENV sets it
    }
    if shared_dir:
        ours["GPUPOOL_SHARED_DIR"] = shared_dir
    for name, value in ours.items():
        env[name] = {"name": name, "value": escape(value)}
    return list(env.values())


def _job_volumes(
    script_configmap: str, notebook: Mapping[str, Any], shared_claim: str = ""
) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [
        {"name": SCRIPT_VOLUME, "configMap": {"name": script_configmap, "defaultMode": 0o444}},
        {"name": LOG_VOLUME, "emptyDir": {}},
    ]
    if shared_claim:
        volumes.append(
            {"name": SHARED_VOLUME, "persistentVolumeClaim": {"claimName": shared_claim}}
        )
    if not any(m["mountPath"] == "/dev/shm" for m in notebook.get("volumeMounts", [])):
        volumes.append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    return volumes


def _with_allocation(
    spec: dict[str, Any],
    labels: Mapping[str, str],
    allocation: Allocation | None,
    offer: Offer | None,
    **gpu: Any,
) -> tuple[dict[str, Any], dict[str, str]]:
    """``spec`` and pod labels with the allocation applied by
    :func:`~gpupool.kube.pods.apply_allocation` (the parts it owns go through the
    client's models and back). The allocation label is dropped: one template serves every node,
    and each node has its own allocation (they are listed in the Job's annotations)."""
    container = spec["containers"][0]
    pod = V1Pod(
        metadata=V1ObjectMeta(labels=dict(labels)),
        spec=V1PodSpec(
            containers=[
                V1Container(
                    name=container["name"],
                    resources=to_model(V1ResourceRequirements, container.get("resources")),
                    env=to_model("list[V1EnvVar]", container.get("env")),
                )
            ],
            affinity=to_model(V1Affinity, spec.get("affinity")),
            node_selector=spec.get("nodeSelector"),
            tolerations=to_model("list[V1Toleration]", spec.get("tolerations")),
            priority_class_name=spec.get("priorityClassName"),
            scheduler_name=spec.get("schedulerName"),
        ),
    )
    out = apply_allocation(pod, allocation, offer, **gpu)
    result = copy.deepcopy(spec)
    c = result["containers"][0]
    _put(c, "resources", to_json(out.spec.containers[0].resources))
    _put(c, "env", to_json(out.spec.containers[0].env))
    _put(result, "affinity", to_json(out.spec.affinity))
    _put(result, "nodeSelector", out.spec.node_selector)
    _put(result, "tolerations", to_json(out.spec.tolerations))
    _put(result, "priorityClassName", out.spec.priority_class_name)
    _put(result, "schedulerName", out.spec.scheduler_name)
    applied = {k: v for k, v in (out.metadata.labels or {}).items() if k != ALLOCATION_LABEL}
    return result, {**labels, **applied}


def _put(target: dict[str, Any], key: str, value: Any) -> None:
    if value:
        target[key] = value
    else:
        target.pop(key, None)
