"""The settings of the Kubernetes job backend: its traits, their defaults, and what it reads of
the pool (offers, GPU product labels).

Vocabulary
- *shared settings*: the namespace, Kueue queue template, GPU tolerations, priority class,
  scheduler and product labels default to the ``KubeGPUSpawner`` (or ``KubeSpawner``) settings
  of the same name, so notebooks and jobs land alike; set ``c.KubeJobBackend.<name>`` to differ.
  ``kueue_priority_class`` is not shared: a job must rank below notebooks.
- *product labels*: GPU model → ``nvidia.com/gpu.product`` values, for the pods' node affinity.
- *claims*: the notebook pod's ``persistentVolumeClaim`` volumes (the user's home, with z2jh's
  default storage a ReadWriteOnce claim that one node at a time can attach). A job pod keeps
  them only where no second node would attach them (see
  :func:`gpupool.kube.manifests.make_job`); ``keep_claims`` names the ones that are
  ReadWriteMany, and ``shared_volume_claim`` adds one for the job's outputs.
- *notebook pod*: the owner's live notebook pod (KubeSpawner's labels and annotation), whose spec
  a job pod copies: the default server before named ones, a running pod before a pending one.

Contract: no I/O but reading the service account's namespace file once, for the default
namespace; the runtime (API calls) is :mod:`gpupool.kube.jobs`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traitlets import Bool, Callable, Dict, Float, Int, List, Unicode, default, validate

from gpupool.core.ledger import Allocation
from gpupool.core.offers import Offer
from gpupool.jobs.backend import JobBackend
from gpupool.kube.job_status import TERMINAL_PHASES, phase
from gpupool.kube.manifests import (
    DEFAULT_DNS_PEERS,
    DEFAULT_LOG_DIR,
    DEFAULT_PYTHON,
    DEFAULT_TORCHRUN,
)
from gpupool.kube.pods import (
    DEFAULT_GPU_TOLERATIONS,
    DEFAULT_HAMI_RESOURCES,
    DEFAULT_PRODUCT_LABELS,
    ShareRequests,
    check_hami_resources,
    check_priority_class,
    check_queue_template,
)

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
NOTEBOOK_SELECTOR = "component=singleuser-server,hub.jupyter.org/username={user}"
USERNAME_ANNOTATION = "hub.jupyter.org/username"
SERVERNAME_LABEL = "hub.jupyter.org/servername"


class KubeJobSettings(JobBackend):
    """The settings of :class:`gpupool.kube.jobs.KubeJobBackend` (its base class)."""

    name = "kubernetes"

    namespace = Unicode(
        config=True,
        help="""Namespace of the jobs' objects (default: KubeSpawner's ``namespace`` when
        configured, else the hub's own namespace in the cluster, else ``default``). Example:
        ``c.KubeJobBackend.namespace = "jhub"``""",
    )
    image = Unicode(
        "",
        config=True,
        help="""Image of job pods whose notebook pod template names none (no running
        notebook, no ``pod_template`` image). Example:
        ``c.KubeJobBackend.image = "quay.io/jupyter/pytorch-notebook:cuda12-latest"``""",
    )
    pod_template = Dict(
        {},
        config=True,
        help="""Base pod (Pod or PodSpec, API JSON) of job pods when the owner has no running
        notebook pod: image, home volume and mount, security context… Example::

            c.KubeJobBackend.pod_template = {
                "containers": [{"name": "notebook", "image": "ghcr.io/org/torch:2.6",
                                "volumeMounts": [{"name": "home", "mountPath": "/home/jovyan"}]}],
                "volumes": [{"name": "home",
                             "persistentVolumeClaim": {"claimName": "shared-home"}}],
            }
            c.KubeJobBackend.keep_claims = ["shared-home"]  # ReadWriteMany: any node
        """,
    )
    keep_claims = List(
        Unicode(),
        config=True,
        help="""Claims (``persistentVolumeClaim.claimName``) of the notebook pod template that
        are ReadWriteMany (or ReadOnlyMany), which job pods keep on every node. Any other claim
        (such as z2jh's ReadWriteOnce home claim) is left out of a job's pods unless all of them
        run on the node of the notebook pod they are made from: a second node cannot attach a
        ReadWriteOnce volume (the pod would wait on a ``Multi-Attach error``). Example:
        ``c.KubeJobBackend.keep_claims = ["group-datasets"]``""",
    )
    shared_volume_claim = Unicode(
        "",
        config=True,
        help="""A ReadWriteMany PersistentVolumeClaim (in the jobs' namespace) mounted in every
        pod of every job at ``shared_volume_mount_path``, for inputs and outputs that must
        outlive the job (``GPUPOOL_SHARED_DIR`` names the folder). Empty (the default): none;
        job pods then write only to their own pod (logs go to the pod log). Example:
        ``c.KubeJobBackend.shared_volume_claim = "gpupool-shared"`` (a claim with
        ``accessModes: [ReadWriteMany]``, e.g. on NFS or CephFS)""",
    )
    shared_volume_mount_path = Unicode(
        "/home/jovyan/shared",
        config=True,
        help="""Where job pods mount ``shared_volume_claim``. Example:
        ``c.KubeJobBackend.shared_volume_mount_path = "/mnt/shared"``""",
    )
    bind_to_node = Bool(
        True,
        config=True,
        help="""Bind GPU and MIG job pods to the nodes the pool's ledger chose (a required node
        affinity on the nodes' names, plus a topology spread over those nodes for a
        job on several; default: ``KubeGPUSpawner.bind_to_node``). Turn off only when the
        pool's inventory is not the cluster's nodes. Example:
        ``c.KubeJobBackend.bind_to_node = False``""",
    )
    network_policy = Bool(
        True,
        config=True,
        help="""Give each job its own NetworkPolicy, owned by its Job (see
        :mod:`gpupool.kube.manifests`, *job network policy*): its pods reach each other and
        the cluster DNS (``network_policy_dns``), and no other job's pods reach them. Needs
        ``create`` and ``delete`` on ``networkpolicies.networking.k8s.io`` in the namespace (the
        Helm chart's Role grants them); without it the job fails to start, saying so. Turn off
        only where the cluster enforces no NetworkPolicy (the Helm chart does with
        ``networkPolicy.enabled: false``). Example:
        ``c.KubeJobBackend.network_policy = False``""",
    )
    network_policy_dns = List(
        Dict(),
        [dict(p) for p in DEFAULT_DNS_PEERS],
        config=True,
        help="""Where a job's pods may send DNS queries (port 53, UDP and TCP): NetworkPolicy
        peers, as in an egress rule's ``to``. The default is CoreDNS (label ``k8s-app:
        kube-dns``) in ``kube-system``; the Helm chart sets its ``networkPolicy.jobs.dns``.
        Example::

            c.KubeJobBackend.network_policy_dns = [{
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "dns"}},
                "podSelector": {"matchLabels": {"app": "node-local-dns"}},
            }]
        """,
    )
    use_notebook_pod = Bool(
        True,
        config=True,
        help="""Build job pods from the owner's running notebook pod (KubeSpawner's labels
        ``component=singleuser-server``, ``hub.jupyter.org/username``) when there is one.
        Example: ``c.KubeJobBackend.use_notebook_pod = False``""",
    )
    pod_template_hook = Callable(
        None,
        allow_none=True,
        config=True,
        help="""``hook(backend, job)`` (may be async) returning the notebook pod (API JSON) to
        build the job's pods from, or None to fall back. Example::

            def hook(backend, job):
                return {"spec": {"containers": [{"name": "notebook", "image": "img:1"}]}}
            c.KubeJobBackend.pod_template_hook = hook
        """,
    )
    kueue_queue_template = Unicode(
        config=True,
        help="""When set, GPU and MIG jobs get the label ``kueue.x-k8s.io/queue-name`` with
        this template filled in (``{team}``, ``{offer}``, ``{user}``) and wait for Kueue's
        admission (default: ``KubeGPUSpawner.kueue_queue_template``). Example:
        ``c.KubeJobBackend.kueue_queue_template = "{team}-batch"``""",
    )
    kueue_priority_class = Unicode(
        "",
        config=True,
        help="""Kueue ``WorkloadPriorityClass`` of GPU and MIG jobs: the label
        ``kueue.x-k8s.io/priority-class`` on the Job, set only when it has a Kueue queue
        (``kueue_queue_template``). Not shared with ``KubeGPUSpawner.kueue_priority_class``: a
        job should rank below every notebook, so that a queue reclaiming lent quota preempts
        jobs, never notebooks. Empty (the default): no label, Kueue's default priority. The Helm
        chart sets ``<release>-job``. Example:
        ``c.KubeJobBackend.kueue_priority_class = "gpupool-job"``""",
    )
    ttl_seconds_after_finished = Int(
        7 * 24 * 3600,
        allow_none=True,
        config=True,
        help="""Seconds a finished Job (its pods, so its logs, its Service and ConfigMap) is
        kept; None keeps it until cancelled by hand. Example:
        ``c.KubeJobBackend.ttl_seconds_after_finished = 86400``""",
    )
    log_dir = Unicode(
        DEFAULT_LOG_DIR,
        config=True,
        help="""Folder in job containers (an ``emptyDir``) where rank_log's per-rank paths are
        links to the pod log. Example: ``c.KubeJobBackend.log_dir = "/tmp/gpupool-logs"``""",
    )
    torchrun = List(
        list(DEFAULT_TORCHRUN),
        config=True,
        help="""How job images start torchrun. Example:
        ``c.KubeJobBackend.torchrun = ["python", "-m", "torch.distributed.run"]``""",
    )
    python = Unicode(
        DEFAULT_PYTHON,
        config=True,
        help="""The Python of job images (it needs torch and gpupool_lab); torchrun starts each
        rank with it. Example: ``c.KubeJobBackend.python = "/opt/conda/bin/python"``""",
    )
    kill_grace = Float(
        30.0,
        config=True,
        help="""Seconds job pods get between SIGTERM and SIGKILL (their
        ``terminationGracePeriodSeconds``). Example: ``c.KubeJobBackend.kill_grace = 60``""",
    )
    request_timeout = Float(
        30.0,
        config=True,
        help="Seconds one request to the API server may take. Example: ``10``",
    )
    log_chunk_bytes = Int(
        1 << 20,
        config=True,
        help="The most log bytes one read returns. Example: ``4 * 1024 * 1024``",
    )
    gpu_tolerations = List(
        [dict(t) for t in DEFAULT_GPU_TOLERATIONS],
        config=True,
        help="""Tolerations of GPU and MIG job pods (default:
        ``KubeGPUSpawner.gpu_tolerations``). Example::

            c.KubeJobBackend.gpu_tolerations = [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            ]
        """,
    )
    gpu_priority_class_name = Unicode(
        config=True,
        help="""PriorityClass of GPU and MIG job pods (default:
        ``KubeGPUSpawner.gpu_priority_class_name``; empty keeps the notebook pod's). Example:
        ``c.KubeJobBackend.gpu_priority_class_name = "gpu-batch"``""",
    )
    gpu_scheduler_name = Unicode(
        config=True,
        help="""Scheduler of GPU and MIG job pods (default:
        ``KubeGPUSpawner.gpu_scheduler_name``). Example:
        ``c.KubeJobBackend.gpu_scheduler_name = "kai-scheduler"``""",
    )
    gpu_product_labels = Dict(
        config=True,
        help="""``nvidia.com/gpu.product`` values by model key, over the built-in table
        (default: ``KubeGPUSpawner.gpu_product_labels``). Example:
        ``c.KubeJobBackend.gpu_product_labels = {"H100-80GB": ["NVIDIA-H100-80GB-HBM3"]}``""",
    )
    hami_resources = Dict(
        config=True,
        help="""HAMi's resource names, for shares of GPUs on nodes HAMi shares out (default:
        ``KubeGPUSpawner.hami_resources``, else HAMi's defaults). Example:
        ``c.KubeJobBackend.hami_resources = {"count": "nvidia.com/gpu",
        "memory": "nvidia.com/gpumem", "cores": "nvidia.com/gpucores"}``""",
    )
    api_client_factory = Callable(
        None,
        allow_none=True,
        config=True,
        help="""Makes the ``kubernetes_asyncio`` ``ApiClient`` for each use (may be async); None
        loads in-cluster credentials, else the kubeconfig (``KUBECONFIG``). Example::

            from kubernetes_asyncio.client import ApiClient, Configuration
            c.KubeJobBackend.api_client_factory = lambda: ApiClient(
                Configuration(host="http://127.0.0.1:8001"))
        """,
    )
    offers = Dict(
        help="""Offers by name, for the offer model's GPU product affinity (default: the
        manager's pool's offers)."""
    )

    # -- settings shared with KubeGPUSpawner ---------------------------------------------------
    def _spawner_setting(self, name: str, fallback: Any) -> Any:
        for section in ("KubeGPUSpawner", "KubeSpawner"):
            if section in self.config and name in self.config[section]:
                return self.config[section][name]
        return fallback

    @default("namespace")
    def _default_namespace(self) -> str:
        configured = self._spawner_setting("namespace", "")
        if configured:
            return str(configured)
        try:
            return Path(SA_NAMESPACE_FILE).read_text().strip() or "default"
        except OSError:
            return "default"

    @default("kueue_queue_template")
    def _default_queue(self) -> str:
        return str(self._spawner_setting("kueue_queue_template", ""))

    @default("gpu_tolerations")
    def _default_tolerations(self) -> list[Any]:
        return list(self._spawner_setting("gpu_tolerations", DEFAULT_GPU_TOLERATIONS))

    @default("gpu_priority_class_name")
    def _default_priority(self) -> str:
        return str(self._spawner_setting("gpu_priority_class_name", ""))

    @default("gpu_scheduler_name")
    def _default_scheduler(self) -> str:
        return str(self._spawner_setting("gpu_scheduler_name", ""))

    @default("bind_to_node")
    def _default_bind(self) -> bool:
        return bool(self._spawner_setting("bind_to_node", True))

    @validate("shared_volume_mount_path")
    def _valid_shared_path(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"])
        if not value.startswith("/"):
            from gpupool.declarations import ConfigError

            raise ConfigError(
                "KubeJobBackend.shared_volume_mount_path", f"{value!r} is not an absolute path"
            )
        return value

    @default("gpu_product_labels")
    def _default_products(self) -> dict[str, Any]:
        return dict(self._spawner_setting("gpu_product_labels", {}))

    @default("hami_resources")
    def _default_hami(self) -> dict[str, str]:
        found = self._spawner_setting("hami_resources", DEFAULT_HAMI_RESOURCES)
        return check_hami_resources(found, "KubeGPUSpawner.hami_resources")

    @validate("hami_resources")
    def _valid_hami(self, proposal: dict[str, Any]) -> dict[str, str]:
        return check_hami_resources(proposal["value"], "KubeJobBackend.hami_resources")

    @validate("kueue_queue_template")
    def _valid_queue_template(self, proposal: dict[str, Any]) -> str:
        return check_queue_template(str(proposal["value"]), "KubeJobBackend.kueue_queue_template")

    @validate("kueue_priority_class")
    def _valid_priority_class(self, proposal: dict[str, Any]) -> str:
        return check_priority_class(str(proposal["value"]), "KubeJobBackend.kueue_priority_class")

    def _pool(self) -> Any:
        return getattr(self.parent, "pool", None)

    def offer_of(self, allocation: Allocation) -> Offer | None:
        return self.offer_named(allocation.offer)

    def offer_named(self, name: str) -> Offer | None:
        offers = self.offers or getattr(getattr(self._pool(), "ledger", None), "offers", {})
        offer = offers.get(name)
        return offer if isinstance(offer, Offer) else None

    def share_requests(self) -> ShareRequests:
        """What a job pod asks for a share of each GPU the pool's inventory says is shared."""
        return ShareRequests.of(getattr(self._pool(), "inventory", None), self.hami_resources)

    def product_labels(self) -> dict[str, tuple[str, ...]]:
        """Model → ``nvidia.com/gpu.product`` values: built-in, plus what a Kubernetes
        inventory saw on the nodes, with ``gpu_product_labels`` overriding both."""
        labels = {model: list(values) for model, values in DEFAULT_PRODUCT_LABELS.items()}
        inventory = getattr(self._pool(), "inventory", None)
        if inventory is not None and getattr(inventory, "source", "") == "kubernetes":
            for gpu in inventory.gpus:
                if gpu.product_name and gpu.product_name not in labels.get(gpu.model, []):
                    labels.setdefault(gpu.model, []).append(gpu.product_name)
        for model, values in self.gpu_product_labels.items():
            labels[model] = [values] if isinstance(values, str) else list(values)
        return {model: tuple(values) for model, values in labels.items()}


def notebook_pod(pods: list[dict[str, Any]], owner: str) -> dict[str, Any] | None:
    """The notebook pod of ``owner`` a job's pod is built from, among ``pods`` (as the API
    lists them for :data:`NOTEBOOK_SELECTOR`), or ``None``."""
    mine = [
        p
        for p in pods
        if (p["metadata"].get("annotations") or {}).get(USERNAME_ANNOTATION, owner) == owner
        and phase(p) not in TERMINAL_PHASES
    ]
    mine.sort(
        key=lambda p: (
            bool((p["metadata"].get("labels") or {}).get(SERVERNAME_LABEL)),
            phase(p) != "Running",
        )
    )
    return mine[0] if mine else None
