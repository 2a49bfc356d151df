"""Stand-ins and builders the Kubernetes tests share (test modules never import each other).

- jobs (:mod:`gpupool.kube.manifests`, ``KubeJobBackend``): a ledger over an H100 node and a MIG
  A100 node, allocations as the job manager asks for them, a job, the notebook pod a job is made
  from as the API server returns it, and readers of a Job object's pod template;
- notebooks (``KubeGPUSpawner``): JupyterHub's ``User`` as the spawners read it, a real spawner
  over the hub's objects, its pod as the API would receive it;
- node binding and profiles: a bare spawner pod, the nodes a pod is bound to, KubeSpawner's real
  start and stop against the stand-in API server (:mod:`tests.deploy.kube_api`);
- :func:`validate`: strict validation against the Kubernetes schemas (1.33 and the newest);
- :func:`api_cluster`: the stand-in served, gpupool's client pointed at it; :func:`until`;
- :func:`pooled_cluster`: the stand-in served over given nodes, KubeSpawner's and gpupool's
  clients pointed at it, and the hub's pool over the same nodes.

The fixtures (``kube``, ``pool``) are in ``tests/deploy/conftest.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes_asyncio.config.kube_config as kube_config
import kubernetes_validate
import pytest
from kubernetes_asyncio.client import (
    ApiClient,
    Configuration,
    V1Affinity,
    V1Container,
    V1ObjectMeta,
    V1Pod,
    V1PodSpec,
    V1ResourceRequirements,
)
from kubernetes_validate.utils import major_minor
from kubespawner import KubeSpawner
from kubespawner.clients import load_config
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Request, Team
from gpupool.core.jobs import Job, JobSpec
from gpupool.core.ledger import Allocation
from gpupool.hub.objects import SETTINGS_KEY, build
from gpupool.jobs.manager import JobManager
from gpupool.kube.jobs import KubeJobBackend
from gpupool.kube.manifests import configmap_name, make_job
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.pool import Pool
from gpupool.store import Store
from gpupool_spawner.kube import KubeGPUSpawner
from tests.accounts import shared_mode
from tests.conftest import a100_mixed_node, h100_node, kubeconfig
from tests.deploy.kube_api import Served, StandIn, served

# -- jobs ----------------------------------------------------------------------------------------
K8S_VERSIONS = ("1.33", major_minor(kubernetes_validate.latest_version()))


NS = "gpupool"


IMAGE = "quay.io/jupyter/pytorch-notebook:cuda12-2025-06-02"


OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=4),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", model="A100-80GB", profile="3g.40gb"),
}


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


TOKEN_VOLUME = "kube-api-access-x7k2p"


def ledger() -> Ledger:
    inventory = inventory_from_nodes([h100_node(), a100_mixed_node()])
    everyone = Team("everyone", offers=frozenset({"cpu"}))
    return Ledger(inventory, OFFERS, {"vision": Team("vision", 16000)}, everyone)


def allocate(offer: str, count: int, nodes: int, pool: Ledger | None = None) -> list[Allocation]:
    """One allocation per node, as the job manager asks for them."""
    pool = pool or ledger()
    n = len(pool.allocations)
    return [
        pool.allocate(Request("alice", "vision", offer, count, "job", "j1"), f"alloc-{n + i}")
        for i in range(nodes)
    ]


def a_job(offer: str = "h100", gpus: int = 2, nodes: int = 1, **spec: Any) -> Job:
    fields: dict[str, Any] = {"script": "import torch\nprint('hello')\n", "filename": "train.py"}
    fields |= spec
    return Job(
        "0f3a9c2b7d41",
        "alice",
        "vision",
        JobSpec(offer=offer, gpus=gpus, nodes=nodes, **fields),
        state="starting",
    )


def notebook_pod(user: str = "alice", image: str = IMAGE) -> dict[str, Any]:
    """alice's MIG notebook pod as ``GET pods/jupyter-alice`` returns it: KubeSpawner's pod with
    gpupool's allocation, plus what admission (token volume, default tolerations, priority), the
    scheduler (``nodeName``) and the kubelet (``status``) added."""
    mount = {"name": TOKEN_VOLUME, "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"}
    mount["readOnly"] = True  # type: ignore[assignment]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"jupyter-{user}",
            "namespace": NS,
            "uid": "5b1d7f0e-1111-4222-8333-444455556666",
            "resourceVersion": "88123",
            "creationTimestamp": "2025-01-01T00:00:00Z",
            "labels": {
                "app": "jupyterhub",
                "app.kubernetes.io/component": "singleuser-server",
                "component": "singleuser-server",
                "heritage": "jupyterhub",
                "hub.jupyter.org/servername": "",
                "hub.jupyter.org/username": user,
                "gpupool.io/team": "vision",
                "gpupool.io/offer": "mig-3g.40gb",
                "gpupool.io/allocation": "notebook-alloc",
                "kueue.x-k8s.io/queue-name": "vision-gpu",
                "kueue.x-k8s.io/priority-class": "gp-notebook",
            },
            "annotations": {"hub.jupyter.org/username": user},
        },
        "spec": {
            "automountServiceAccountToken": True,
            "serviceAccount": "default",
            "serviceAccountName": "default",
            "containers": [
                {
                    "name": "notebook",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "args": ["jupyterhub-singleuser"],
                    "env": [
                        {"name": "JUPYTERHUB_API_TOKEN", "value": "secret-token"},
                        {"name": "JPY_API_TOKEN", "value": "secret-token"},
                        {"name": "JUPYTERHUB_USER", "value": user},
                        {"name": "GPUPOOL_ALLOCATION", "value": "notebook-alloc"},
                        {"name": "MEM_LIMIT", "value": "17179869184"},
                        {"name": "HF_HOME", "value": "/home/jovyan/.cache/hf"},
                    ],
                    "ports": [{"containerPort": 8888, "name": "notebook-port", "protocol": "TCP"}],
                    "lifecycle": {"postStart": {"exec": {"command": ["sh", "-c", "true"]}}},
                    "resources": {
                        "limits": {"cpu": "4", "memory": "16G", "nvidia.com/mig-3g.40gb": "1"},
                        "requests": {"cpu": "1", "memory": "8G", "nvidia.com/mig-3g.40gb": "1"},
                    },
                    "securityContext": {"allowPrivilegeEscalation": False, "runAsUser": 1000},
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File",
                    "volumeMounts": [{"name": "home", "mountPath": "/home/jovyan"}, mount],
                    "workingDir": "/home/jovyan",
                },
                {"name": "sidecar", "image": "busybox:1.36", "args": ["sleep", "infinity"]},
            ],
            "initContainers": [
                {
                    "name": "block-cloud-metadata",
                    "image": "quay.io/jupyterhub/k8s-network-tools:4.1.0",
                    "command": ["iptables", "-A", "OUTPUT", "-d", "169.254.169.254", "-j", "DROP"],
                    "securityContext": {
                        "capabilities": {"add": ["NET_ADMIN"]},
                        "privileged": True,
                        "runAsUser": 0,
                    },
                    "volumeMounts": [mount],
                }
            ],
            "volumes": [
                {"name": "home", "persistentVolumeClaim": {"claimName": f"claim-{user}"}},
                {
                    "name": TOKEN_VOLUME,
                    "projected": {
                        "defaultMode": 420,
                        "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {
                                "configMap": {
                                    "name": "kube-root-ca.crt",
                                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                }
                            },
                        ],
                    },
                },
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "nvidia.com/gpu.product",
                                        "operator": "In",
                                        "values": ["NVIDIA-A100-SXM4-80GB"],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "tolerations": [
                GPU_TOLERATION,
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
            ],
            "nodeSelector": {"hub.jupyter.org/node-purpose": "user"},
            "nodeName": "dgx-a100-1",
            "priority": 0,
            "preemptionPolicy": "PreemptLowerPriority",
            "enableServiceLinks": True,
            "dnsPolicy": "ClusterFirst",
            "restartPolicy": "OnFailure",
            "schedulerName": "default-scheduler",
            "securityContext": {"fsGroup": 100},
            "terminationGracePeriodSeconds": 1,
        },
        "status": {"phase": "Running", "podIP": "10.244.3.4", "qosClass": "Burstable"},
    }


def validate(obj: dict[str, Any]) -> None:
    for version in K8S_VERSIONS:
        assert kubernetes_validate.validate(obj, version, strict=True) == version


def pod_of(job_object: dict[str, Any]) -> dict[str, Any]:
    """A pod as the Job's template makes it (to validate the template as a Pod)."""
    template = job_object["spec"]["template"]
    meta = {"name": f"{job_object['metadata']['name']}-0-abcde", **template["metadata"]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}


def container(job_object: dict[str, Any]) -> dict[str, Any]:
    (c,) = job_object["spec"]["template"]["spec"]["containers"]
    return c


def job_env(job_object: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(job_object).get("env", [])}


def job_nvidia(job_object: dict[str, Any]) -> dict[str, dict[str, str]]:
    resources = container(job_object).get("resources", {})
    return {
        kind: {k: v for k, v in resources.get(kind, {}).items() if k.startswith("nvidia.com/")}
        for kind in ("limits", "requests")
    }


def build_job(job: Job, allocations: list[Allocation], **kwargs: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "pod_template": notebook_pod(),
        "namespace": NS,
        "script_configmap": configmap_name(job),
        "offer": OFFERS[job.spec.offer],
    }
    return make_job(job, allocations, **(options | kwargs))


def backend(server: Served, **traits: Any) -> KubeJobBackend:
    options: dict[str, Any] = {
        "namespace": NS,
        "offers": OFFERS,
        "image": IMAGE,
        "api_client_factory": lambda: ApiClient(Configuration(host=server.url)),
    }
    return KubeJobBackend(**(options | traits))


def started(job: Job, handle: str) -> Job:
    return Job(job.id, job.owner, job.team, job.spec, state=job.state, handle=handle)


# -- notebooks -----------------------------------------------------------------------------------
@dataclass
class Group:
    name: str


@dataclass
class User:
    """The parts of JupyterHub's ``User`` the spawners read (as KubeSpawner's tests mock it)."""

    name: str
    groups: list[Group] = field(default_factory=list)
    id: int = 1
    url: str = "/user/alice/"
    settings: dict[str, Any] = field(default_factory=dict)


def spawner(
    pool: Pool, kubespawner: Mapping[str, Any] | None = None, **traits: Any
) -> KubeGPUSpawner:
    """A real KubeGPUSpawner for alice of team vision, handed the hub objects over ``pool`` as
    JupyterHub hands them (the user's settings), with ``kubespawner`` on ``c.KubeSpawner`` and
    ``traits`` on ``c.KubeGPUSpawner``; call inside a running event loop."""
    config = Config()
    for key, value in (kubespawner or {}).items():
        config.KubeSpawner[key] = value
    for key, value in traits.items():
        config.KubeGPUSpawner[key] = value
    shared_mode(config)  # the job manager's local backend never runs user code as root
    settings = {SETTINGS_KEY: build(pool, config, logging.getLogger("test"))}
    user = User("alice", [Group("vision")], settings=settings)
    return KubeGPUSpawner(_mock=True, user=user, config=config)


def profile_spawner(pool: Pool, profiles: Any = None, **traits: Any) -> KubeGPUSpawner:
    """:func:`spawner` with the admin's profile list on ``c.KubeSpawner`` as z2jh sets it, in
    :data:`PROFILE_NS`, against the stand-in API server."""
    kubespawner = {
        "profile_list": copy.deepcopy(profiles) if profiles is not None else [],
        "namespace": PROFILE_NS,
        "events_enabled": False,
        "start_timeout": 30,
    }
    return spawner(pool, kubespawner, **traits)


async def manifest(s: KubeGPUSpawner, pool: Pool, offer: str, count: int = 1) -> dict[str, Any]:
    """Allocate as the mixin's ``start`` does, then the pod as the API would receive it."""
    allocation = pool.allocate("alice", ["vision"], offer, count, ref=s.gpupool_ref)
    s.gpupool_allocation_id = allocation.id
    return await serialise(await s.get_pod_manifest())


async def serialise(pod: V1Pod) -> dict[str, Any]:
    """The pod's JSON, as ``kubernetes_asyncio`` sends it to the API server."""
    async with ApiClient() as api:
        data: dict[str, Any] = api.sanitize_for_serialization(pod)
        return data


def notebook_container(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "notebook"]
    return container


def notebook_nvidia(pod: dict[str, Any]) -> dict[str, dict[str, str]]:
    resources = notebook_container(pod).get("resources", {})
    return {
        kind: {k: v for k, v in resources.get(kind, {}).items() if k.startswith("nvidia.com/")}
        for kind in ("limits", "requests")
    }


def notebook_env(pod: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in notebook_container(pod).get("env", [])}


# -- node binding -------------------------------------------------------------------------------
def serialise_now(pod: V1Pod) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with ApiClient() as api:
            return dict(api.sanitize_for_serialization(pod))

    return asyncio.run(go())


def spawner_pod(user: str, affinity: V1Affinity | None = None) -> V1Pod:
    """A notebook pod as KubeSpawner builds it (the parts that matter here)."""
    return V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=V1ObjectMeta(name=f"jupyter-{user}", labels={"component": "singleuser-server"}),
        spec=V1PodSpec(
            containers=[
                V1Container(
                    name="notebook",
                    image=IMAGE,
                    resources=V1ResourceRequirements(requests={"cpu": "1", "memory": "8G"}),
                )
            ],
            affinity=affinity,
        ),
    )


def node_terms(spec: dict[str, Any]) -> list[dict[str, Any]]:
    node = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    terms = node.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return list(terms.get("nodeSelectorTerms", []))


def hostnames(spec: dict[str, Any]) -> list[list[str]]:
    """The nodes each required term binds to (``metadata.name`` field requirements)."""
    return [
        f["values"]
        for t in node_terms(spec)
        for f in t.get("matchFields", [])
        if f["key"] == "metadata.name"
    ]


def run_job_pods(api: StandIn, name: str) -> dict[int, dict[str, Any]]:
    api.create_pods(name, NS)
    api.run_pods(name, NS)
    return api.pods_of(name, NS)


# -- profiles: KubeSpawner's start and stop ------------------------------------------------------
PROFILE_NS = "jhub"


async def start(server: Served, s: KubeGPUSpawner) -> dict[str, Any]:
    """KubeSpawner's real start against the stand-in; the stand-in's scheduler places the pod.
    Returns the pod as the API server stored it (a refusal is raised as the start raised it)."""
    task = asyncio.ensure_future(s.start())
    key = (PROFILE_NS, s.pod_name)
    try:
        while key not in server.api.objects["pods"]:
            if task.done():
                await task  # the start was refused before any pod was made
                raise AssertionError("the start ended without making a pod")
            await asyncio.sleep(0.02)
        assert server.api.schedule(*key) == "Running", server.api.objects["pods"][key]["status"]
        await asyncio.wait_for(task, 30)
        return copy.deepcopy(server.api.objects["pods"][key])
    finally:
        if not task.done():
            task.cancel()


async def stop(s: KubeGPUSpawner) -> None:
    await s.stop(now=True)
    await KubeSpawner._stop_all_reflectors()


def bound_to(pod: dict[str, Any]) -> set[str]:
    node = pod["spec"].get("affinity", {}).get("nodeAffinity", {})
    terms = node.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return {
        v
        for t in terms.get("nodeSelectorTerms", [])
        for f in t.get("matchFields", [])
        if f["key"] == "metadata.name"
        for v in f["values"]
    }


def gpu_quantities(pod: dict[str, Any], kind: str = "limits") -> dict[str, str]:
    quantities = notebook_container(pod).get("resources", {}).get(kind, {})
    return {k: v for k, v in quantities.items() if k.startswith("nvidia.com/")}


def user_nodes(*nodes: dict[str, Any]) -> list[dict[str, Any]]:
    """Copies of ``nodes`` labelled for z2jh's user pods (``hub.jupyter.org/node-purpose``)."""
    out = copy.deepcopy(list(nodes))
    for obj in out:
        obj["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
    return out


@contextlib.contextmanager
def pooled_cluster(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    nodes: list[dict[str, Any]],
    offers: dict[str, Offer],
    teams: dict[str, Team],
    everyone: Team,
    cohort: str = "",
) -> Iterator[tuple[Served, Pool]]:
    """The stand-in serving ``nodes``, KubeSpawner's and gpupool's clients pointed at it
    (``KUBECONFIG`` and KubeSpawner's cached default), and the hub's pool over the same nodes
    (its ledger in Kueue's ``cohort`` when one is named)."""
    with served() as server:
        for obj in copy.deepcopy(nodes):
            server.api.add_node(obj)
        path = kubeconfig(tmp_path / "kubeconfig", server.url)
        monkeypatch.setenv("KUBECONFIG", str(path))
        monkeypatch.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(path))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        load_config.cache_clear()
        ledger = Ledger(inventory_from_nodes(nodes), offers, teams, everyone, cohort=cohort)
        store = Store(f"sqlite:///{tmp_path / 'gpupool.sqlite'}")
        try:
            yield server, Pool(ledger, store)
        finally:
            store.close()
            load_config.cache_clear()


def kube_hub_config(tmp_path: Path, namespace: str) -> Config:
    """A hub's config on a Kubernetes inventory (the stand-in's nodes), its pods in ``namespace``,
    as ``setup(c)`` reads it."""
    c = Config()
    c.JupyterHub.db_url = f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}"  # no server recorded
    c.JupyterHub.hub_port = 9  # the REST API answers nothing: JupyterHub's records unreadable
    c.JupyterHub.spawner_class = "gpupool-kube"
    c.JobManager.backend_class = "gpupool.kube.jobs.KubeJobBackend"
    c.GPUPool.inventory = "kubernetes"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"h100": {"kind": "gpu", "model": "H100-80GB", "max_count": 8}}
    c.GPUPool.teams = {"big": {"guarantee": 16}}
    c.KubeSpawner.namespace = namespace
    c.Reconciler.period = 0
    c.KubeReconciler.grace = 0.0
    c.KubeReconciler.period = 0.2
    c.KubeReconciler.watch_timeout = 1
    c.KubeReconciler.retry = 0.1
    return c


def job_config(server: Served) -> Config:
    """The job manager's config: :class:`KubeJobBackend` on ``server``, namespace :data:`NS`,
    image :data:`IMAGE`."""
    c = Config()
    c.JobManager.backend_class = "gpupool.kube.jobs.KubeJobBackend"
    c.KubeJobBackend.namespace = NS  # where run_job_pods looks
    c.KubeJobBackend.image = IMAGE
    c.KubeJobBackend.api_client_factory = lambda: ApiClient(Configuration(host=server.url))
    return c


def one_job(pool: Pool, config: Config, spec: dict[str, Any]) -> Job:
    """``alice`` of team ``vision`` submits ``spec`` to the job manager over ``pool``; the job
    after one scheduling pass."""
    m = JobManager(pool, config=config)

    async def scenario() -> Job:
        job = m.submit("alice", ["vision"], spec)
        await m.schedule_pass()
        return m.jobs[job.id]

    return asyncio.run(scenario())


@contextlib.contextmanager
def api_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Served]:
    """The stand-in served, gpupool's own client (``KUBECONFIG``) pointed at it."""
    with served() as server:
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", server.url)))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        yield server


async def until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``what`` on the loop (the watches run meanwhile); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def served_ledger(server: Served, offers: dict[str, Offer]) -> Ledger:
    """A ledger over the nodes ``server`` has now, with one team ``big`` of ample quota."""
    with server.api.lock:
        nodes = list(server.api.nodes.values())
    return Ledger(inventory_from_nodes(nodes), offers, {"big": Team("big", 1_000_000)})
