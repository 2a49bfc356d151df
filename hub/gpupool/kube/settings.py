"""The settings of Kubernetes GPU pods: those notebooks and jobs share (:class:`KubeGPUSettings`)
and the job backend's own (:class:`KubeJobSettings`), with their defaults and validation.

Vocabulary
- *GPU pod settings*: :class:`KubeGPUSettings`, a traitlets ``Configurable`` holding each setting
  that both notebook pods (``KubeGPUSpawner``) and job pods (``KubeJobBackend``) use, once, with
  its validator. Both classes inherit it, so ``c.KubeGPUSettings.<name>`` applies to both and
  ``c.KubeGPUSpawner.<name>`` or ``c.KubeJobBackend.<name>`` overrides it for one class.
- *inherited setting*: where neither ``c.KubeJobBackend`` nor ``c.KubeGPUSettings`` names a GPU
  pod setting, the job backend takes the value notebooks get (``c.KubeGPUSpawner.<name>``, as
  configurations written before :class:`KubeGPUSettings` existed say it), read through
  :func:`notebook_settings`, validated as the spawner validates it, so jobs and notebooks land
  alike. ``kueue_priority_class`` is not inherited: a job must rank below notebooks.
- *setting key*: where a value came from, as an error names it: ``KubeGPUSpawner.hami_resources``
  (the most specific config section of the object that sets it, else its class's name).
- *product labels*: GPU model → ``nvidia.com/gpu.product`` values, for the pods' node affinity
  (:func:`gpupool.kube.pods.product_labels_in_force`).
- *claims*: the notebook pod's ``persistentVolumeClaim`` volumes (the user's home, with z2jh's
  default storage a ReadWriteOnce claim that one node at a time can attach). A job pod keeps
  them only where no second node would attach them (see
  :func:`gpupool.kube.manifests.make_job`); ``keep_claims`` names the ones that are
  ReadWriteMany, and ``shared_volume_claim`` adds one for the job's outputs.
- *notebook pod*: the owner's live notebook pod (KubeSpawner's labels and annotation), whose spec
  a job pod copies: the default server before named ones, a running pod before a pending one.
- *MIG ranks*: a job on several MIG instances per node runs one rank per instance, each
  taking its own from ``NVIDIA_VISIBLE_DEVICES`` (:mod:`gpupool_lab.rank_log`). Only the
  device plugin's ``envvar`` strategy lists them there; under CDI (``cdi-cri``, the GPU
  Operator's default since v25.10) the variable is ``void`` and a CUDA process sees only the
  first instance, so :meth:`KubeJobSettings.validate` refuses such a job at submit (400, with
  the reason and what to ask for instead) unless ``device_list_strategy`` is ``envvar``.

Contract: no I/O but reading the service account's namespace file once, for the default
namespace; the runtime (API calls) is :mod:`gpupool.kube.jobs`. A bad value stops the hub at
start naming its setting key (:func:`gpupool.kube.jobs.check_kube_settings`, called by
``gpupool.hub.setup``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traitlets import Bool, Callable, Dict, Float, Int, List, Unicode, default, validate
from traitlets.config import Config, Configurable

from gpupool.core.errors import InvalidRequest
from gpupool.core.inventory import Inventory
from gpupool.core.jobs import JobSpec
from gpupool.core.ledger import Allocation
from gpupool.core.offers import Offer, one_rank_per_instance
from gpupool.declarations import ConfigError
from gpupool.jobs.backend import JobBackend
from gpupool.kube.claims import DEVICE_PLUGIN, check_device_allocation
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
    DEFAULT_HAMI_SCHEDULER,
    GPU_RESOURCE,
    HAMI,
    ShareRequests,
    check_cohort_name,
    check_hami_resources,
    check_priority_class,
    check_product_labels,
    check_queue_template,
    check_scheduler_name,
    check_tolerations,
    product_labels_in_force,
)

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
NOTEBOOK_SELECTOR = "component=singleuser-server,hub.jupyter.org/username={user}"
USERNAME_ANNOTATION = "hub.jupyter.org/username"
SERVERNAME_LABEL = "hub.jupyter.org/servername"
NOTEBOOK_SECTIONS = ("KubeGPUSettings", "KubeGPUSpawner")
"""The config sections ``KubeGPUSpawner`` reads the GPU pod settings from, most general first."""
NAMESPACE_SECTIONS = ("KubeGPUSpawner", "KubeSpawner")
"""Where KubeSpawner's ``namespace`` may be set, most specific first."""


def default_namespace(config: Any) -> str:
    """The namespace the hub's objects go to when no ``namespace`` is set for them: KubeSpawner's
    (a plain string), else the hub's own pod's (its service account's), else ``default``."""
    for section in NAMESPACE_SECTIONS:
        if section in config and config[section].get("namespace"):
            return str(config[section]["namespace"])
    try:
        return Path(SA_NAMESPACE_FILE).read_text().strip() or "default"
    except OSError:
        return "default"


class KubeGPUSettings(Configurable):
    """The GPU pod settings of notebooks and jobs (see *GPU pod settings*)."""

    gpu_tolerations = List(
        [dict(t) for t in DEFAULT_GPU_TOLERATIONS],
        config=True,
        help="""Tolerations added to GPU and MIG pods only (notebooks and jobs; Kubernetes JSON,
        as ``KubeSpawner.tolerations``); CPU-only pods lose any toleration with these keys.
        Example::

            c.KubeGPUSettings.gpu_tolerations = [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"},
            ]
        """,
    )
    gpu_priority_class_name = Unicode(
        "",
        config=True,
        help="""PriorityClass of GPU and MIG pods (empty: KubeSpawner's ``priority_class_name``
        for notebooks, the notebook pod's for jobs). Example:
        ``c.KubeGPUSpawner.gpu_priority_class_name = "gpu-interactive"``""",
    )
    gpu_scheduler_name = Unicode(
        "",
        config=True,
        help="""Scheduler of GPU and MIG pods (empty: KubeSpawner's ``scheduler_name``); pods
        holding a HAMi share get ``hami_scheduler_name`` instead.
        Example: ``c.KubeGPUSettings.gpu_scheduler_name = "kai-scheduler"``""",
    )
    gpu_product_labels = Dict(
        {},
        config=True,
        help="""``nvidia.com/gpu.product`` values by gpupool model key, for offers with a
        ``model``; overrides the built-in table (and what the node inventory saw) per model.
        Example::

            c.KubeGPUSettings.gpu_product_labels = {
                "H100-80GB": ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"],
            }
        """,
    )
    bind_to_node = Bool(
        True,
        config=True,
        help="""Bind GPU and MIG pods to the nodes the pool's ledger chose for them (a required
        node affinity on the nodes' names; a job on several nodes also spreads its pods over
        them), so that kube-scheduler cannot put them on another node than the one the pool
        counted. Turn off only when the pool's inventory is not the cluster's nodes (a simulated
        inventory in a test cluster). Example: ``c.KubeGPUSettings.bind_to_node = False``""",
    )
    hami_resources = Dict(
        dict(DEFAULT_HAMI_RESOURCES),
        config=True,
        help="""HAMi's resource names (its ``resourceCountName``, ``resourceMemoryName`` and,
        optionally, ``resourceCoreName``), for shares of GPUs on nodes HAMi shares out (the
        annotation ``hami.io/node-nvidia-register``): a share there asks for one ``count`` and
        its memory in MiB as ``memory``, and with ``cores`` its percentage of the GPU's compute.
        Example::

            c.KubeGPUSettings.hami_resources = {
                "count": "nvidia.com/gpu",
                "memory": "nvidia.com/gpumem",
                "cores": "nvidia.com/gpucores",
            }
        """,
    )
    hami_scheduler_name = Unicode(
        DEFAULT_HAMI_SCHEDULER,
        config=True,
        help="""Scheduler of pods holding a share of a GPU HAMi shares out (HAMi's chart's
        ``schedulerName``), whatever KubeSpawner's ``scheduler_name`` (z2jh sets it to its
        user-scheduler) or ``gpu_scheduler_name`` say: HAMi's webhook routes only pods of the
        default scheduler to HAMi, and no other scheduler can place ``nvidia.com/gpumem``.
        Empty: leave the pod's scheduler as it is (HAMi's webhook then routes it only if it is
        ``default-scheduler``; with z2jh's user-scheduler enabled such pods stay Pending).
        Example: ``c.KubeGPUSettings.hami_scheduler_name = "hami-scheduler"``""",
    )
    kueue_queue_template = Unicode(
        "",
        config=True,
        help="""When set, GPU and MIG pods (and jobs) get the label ``kueue.x-k8s.io/queue-name``
        with this template filled in (``{team}``, ``{offer}``, ``{user}``), so a Kueue
        ``LocalQueue`` per team admits them (a job waits for Kueue's admission). Empty (the
        default): no Kueue label. Example:
        ``c.KubeGPUSettings.kueue_queue_template = "{team}-gpu"``""",
    )
    kueue_priority_class = Unicode(
        "",
        config=True,
        help="""Kueue ``WorkloadPriorityClass`` of GPU and MIG pods and jobs: the label
        ``kueue.x-k8s.io/priority-class``, set only with ``kueue_queue_template`` (Kueue reads it
        on queued workloads only). Set it per class: a notebook should rank above every job, so
        that a queue reclaiming lent quota preempts jobs, never notebooks (the job backend does
        not inherit the spawner's). Empty (the default): no label, Kueue's default priority. The
        Helm chart sets ``<release>-notebook`` and ``<release>-job``. Example:
        ``c.KubeGPUSpawner.kueue_priority_class = "gpupool-notebook"``""",
    )

    kueue_cohort = Unicode(
        "gpupool",
        config=True,
        help="""The Kueue cohort of the teams' ClusterQueues (the Helm chart's ``kueue.cohort``),
        used only with ``kueue_queue_template``: then the hub grants GPUs only as Kueue's cohort
        rule would admit them (a team borrows only what the others leave unused of their
        guarantees; :mod:`gpupool.core.cohort`), and names the cohort when a request waits for
        it. It assumes the chart's queues: one ClusterQueue per team in this cohort, nominal
        quota = the team's guarantee, borrowing limit = its borrow limit. Example:
        ``c.KubeGPUSettings.kueue_cohort = "gpupool"``""",
    )

    device_allocation = Unicode(
        DEVICE_PLUGIN,
        config=True,
        help="""How GPU pods get their GPUs: ``"device-plugin"`` (the default: extended
        resources such as ``nvidia.com/gpu``; the NVIDIA device plugin picks the GPU) or
        ``"dra"`` (Dynamic Resource Allocation, Kubernetes 1.34 or later with NVIDIA's DRA
        driver: a notebook's GPUs are a ResourceClaim, a job's a ResourceClaimTemplate, pinning
        the GPUs the pool chose by UUID; whole GPUs only, MIG instances and shares are refused;
        see :mod:`gpupool.kube.claims`). Example:
        ``c.KubeGPUSettings.device_allocation = "dra"``""",
    )

    def setting_key(self, name: str) -> str:
        """The *setting key* of ``name`` on this object."""
        for section in reversed(self.section_names()):
            if section in self.config and name in self.config[section]:
                return f"{section}.{name}"
        return f"{type(self).__name__}.{name}"

    @validate("gpu_tolerations")
    def _valid_tolerations(self, proposal: dict[str, Any]) -> list[dict[str, Any]]:
        return check_tolerations(proposal["value"], self.setting_key("gpu_tolerations"))

    @validate("device_allocation")
    def _valid_device_allocation(self, proposal: dict[str, Any]) -> str:
        key = self.setting_key("device_allocation")
        return check_device_allocation(proposal["value"], key)

    @validate("gpu_product_labels")
    def _valid_product_labels(self, proposal: dict[str, Any]) -> dict[str, list[str]]:
        return check_product_labels(proposal["value"], self.setting_key("gpu_product_labels"))

    @validate("hami_resources")
    def _valid_hami(self, proposal: dict[str, Any]) -> dict[str, str]:
        return check_hami_resources(proposal["value"], self.setting_key("hami_resources"))

    @validate("hami_scheduler_name")
    def _valid_hami_scheduler(self, proposal: dict[str, Any]) -> str:
        key = self.setting_key("hami_scheduler_name")
        return check_scheduler_name(str(proposal["value"]), key)

    @validate("kueue_queue_template")
    def _valid_queue_template(self, proposal: dict[str, Any]) -> str:
        key = self.setting_key("kueue_queue_template")
        return check_queue_template(str(proposal["value"]), key)

    @validate("kueue_cohort")
    def _valid_cohort(self, proposal: dict[str, Any]) -> str:
        return check_cohort_name(str(proposal["value"]), self.setting_key("kueue_cohort"))

    @validate("kueue_priority_class")
    def _valid_priority_class(self, proposal: dict[str, Any]) -> str:
        key = self.setting_key("kueue_priority_class")
        return check_priority_class(str(proposal["value"]), key)

    def product_labels_for(self, inventory: Inventory | None) -> dict[str, tuple[str, ...]]:
        """The *product labels* in force over ``inventory`` (the pool's)."""
        return product_labels_in_force(inventory, self.gpu_product_labels)

    def share_requests_for(self, inventory: Inventory | None) -> ShareRequests:
        """What a pod asks for a share of each GPU ``inventory`` says is shared."""
        return ShareRequests.of(inventory, self.hami_resources, self.hami_scheduler_name)


SHARED_SETTINGS = tuple(KubeGPUSettings.class_own_traits(config=True))
"""The GPU pod settings, by name."""
INHERITED_SETTINGS = tuple(n for n in SHARED_SETTINGS if n != "kueue_priority_class")
"""The GPU pod settings the job backend takes from notebooks (see *inherited setting*)."""


class NotebookGPUSettings(KubeGPUSettings):
    """The GPU pod settings as ``KubeGPUSpawner`` resolves them (:data:`NOTEBOOK_SECTIONS`),
    without a spawner."""

    @classmethod
    def section_names(cls) -> list[str]:
        return list(NOTEBOOK_SECTIONS)


def notebook_settings(config: Config) -> KubeGPUSettings:
    """The GPU pod settings notebooks get under ``config``, validated (a bad value raises
    :class:`gpupool.declarations.ConfigError` naming its setting key). Only the settings' own
    keys are read (the spawner's other settings are not this object's)."""
    picked = Config()
    for section in NOTEBOOK_SECTIONS:
        if section in config:
            picked[section] = Config(
                {k: v for k, v in config[section].items() if k in SHARED_SETTINGS}
            )
    return NotebookGPUSettings(config=picked)


class KubeJobSettings(JobBackend, KubeGPUSettings):
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
    device_list_strategy = Unicode(
        "cdi-cri",
        config=True,
        help="""How the NVIDIA device plugin on the GPU nodes hands a container its devices (its
        ``deviceListStrategy``, env ``DEVICE_LIST_STRATEGY``): ``cdi-cri`` (the GPU Operator's
        default since v25.10), ``cdi-annotations``, ``envvar`` or ``volume-mounts``. Only under
        ``envvar`` does ``NVIDIA_VISIBLE_DEVICES`` list the MIG instances' UUIDs, which a job on
        several MIG instances per node needs to give each rank its own; under the others such a
        job is refused at submit (*MIG ranks*). Example:
        ``c.KubeJobBackend.device_list_strategy = "envvar"``""",
    )

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        mine = self._find_my_config(self.config)  # this object's sections, as traitlets reads them
        inherited = [n for n in INHERITED_SETTINGS if n not in mine and n not in kwargs]
        if inherited:  # see *inherited setting*
            notebooks = notebook_settings(self.config)
            for name in inherited:
                setattr(self, name, getattr(notebooks, name))

    @default("namespace")
    def _default_namespace(self) -> str:
        return default_namespace(self.config)

    @validate("shared_volume_mount_path")
    def _valid_shared_path(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"])
        if not value.startswith("/"):
            raise ConfigError(
                "KubeJobBackend.shared_volume_mount_path", f"{value!r} is not an absolute path"
            )
        return value

    @validate("device_list_strategy")
    def _valid_device_list_strategy(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"])
        if value not in DEVICE_LIST_STRATEGIES:
            raise ConfigError(
                self.setting_key("device_list_strategy"),
                f"{value!r} is not one of {', '.join(DEVICE_LIST_STRATEGIES)}",
            )
        return value

    def validate(self, spec: JobSpec) -> None:
        """Refuse what the base refuses, and (*MIG ranks*) several MIG instances per node
        unless the device plugin lists them in ``NVIDIA_VISIBLE_DEVICES``."""
        super().validate(spec)
        offer = self.offer_named(spec.offer)
        if offer is None or not one_rank_per_instance(offer, spec.gpus):
            return
        if self.device_list_strategy != "envvar":
            raise InvalidRequest(
                mig_ranks_refusal(offer, spec.gpus, self.setting_key("device_list_strategy"))
            )

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
        return self.share_requests_for(getattr(self._pool(), "inventory", None))

    def product_labels(self) -> dict[str, tuple[str, ...]]:
        """The *product labels* in force over the pool's inventory."""
        return self.product_labels_for(getattr(self._pool(), "inventory", None))


DEVICE_LIST_STRATEGIES = ("cdi-cri", "cdi-annotations", "envvar", "volume-mounts")
"""The NVIDIA device plugin's device-list strategies (``api/config/v1`` in
NVIDIA/k8s-device-plugin)."""


def mig_ranks_refusal(offer: Offer, count: int, key: str) -> str:
    """Why a job on ``count`` instances of MIG ``offer`` per node cannot run under CDI."""
    return (
        f"A job on {count}× {offer.label} per node cannot run on this cluster: the NVIDIA device "
        f"plugin hands out devices through CDI ({key} is not 'envvar'; CDI is the GPU "
        "Operator's default since v25.10), so the container's NVIDIA_VISIBLE_DEVICES is 'void' "
        "and its ranks cannot tell the instances apart, while CUDA shows a process only the "
        "first MIG instance: every rank would run on the same one. Ask for 1 instance per node "
        "(a job's nodes run on different machines), or for whole GPUs."
    )


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


def kueue_cohort(config: Config) -> str:
    """The Kueue cohort the hub's admission follows under ``config``: ``kueue_cohort`` when a
    Kueue queue template is set for notebooks or jobs, else '' (Kueue admits nothing of gpupool's).
    A bad value raises :class:`gpupool.declarations.ConfigError` naming its setting key."""
    notebooks = notebook_settings(config)
    jobs = KubeJobSettings(config=config) if "KubeJobBackend" in config else None
    for settings in (notebooks, jobs):
        if settings is not None and settings.kueue_queue_template:
            return str(settings.kueue_cohort)
    return ""


def kueue_hami_refusal(config: Config) -> str:
    """Why no HAMi share is handed out under ``config`` ('' when they are): Kueue admits
    gpupool's pods but HAMi's count is ``nvidia.com/gpu``, so the chart renders no ClusterQueue
    quota for HAMi's memory (``kueue.hami`` off) and Kueue never admits a share pod."""
    if not kueue_cohort(config):
        return ""
    hami = notebook_settings(config)
    if hami.hami_resources.get("count") != GPU_RESOURCE:
        return ""
    key = hami.setting_key("hami_resources").replace(type(hami).__name__, "KubeGPUSpawner")
    return (
        f"Kueue admits GPU pods but no HAMi share: {key} counts HAMi shares as "
        f"{GPU_RESOURCE} and the ClusterQueues cover no HAMi memory, so Kueue would never "
        "admit the pod; set the chart's kueue.hami.enabled: true (HAMi's resourceCountName of "
        "its own)"
    )


def kueue_warnings(config: Config, inventory: Inventory) -> list[str]:
    """What Kueue would never admit under ``config`` on ``inventory``, one line each: HAMi
    shares whose count is ``nvidia.com/gpu`` (Kueue charges them a whole GPU, and the chart's
    ClusterQueues cover HAMi's memory only with ``kueue.hami``); such shares are refused
    (:func:`kueue_hami_refusal`, :func:`gpupool.kube.hami.unpriced_shares`)."""
    if not kueue_cohort(config) or not any(g.share_resource == HAMI for g in inventory.gpus):
        return []
    hami = notebook_settings(config)
    if hami.hami_resources.get("count") != GPU_RESOURCE:
        return []
    key = hami.setting_key("hami_resources").replace(type(hami).__name__, "KubeGPUSpawner")
    return [
        f"{key}: HAMi's count is {GPU_RESOURCE}, which Kueue "
        "charges as a whole GPU, so Kueue will not admit shares on HAMi nodes as the hub "
        "grants them; give HAMi's resourceCountName a name of its own (the chart's kueue.hami); "
        "until then no share is handed out on HAMi nodes"
    ]
