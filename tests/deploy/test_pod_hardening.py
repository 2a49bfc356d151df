"""Pods the hub builds at run time are hardened: job pods always, notebook pods by default.

checkov sees only what the chart renders, not the pods the hub makes, so these tests check the
built pod specs themselves, validated strictly against the Kubernetes schemas:

- Job pods (:func:`gpupool.kube.manifests.make_job`, and through
  :class:`~gpupool.kube.jobs.KubeJobBackend` against the API stand-in) run with
  ``runAsNonRoot``, ``allowPrivilegeEscalation: false``, every capability dropped and the
  ``RuntimeDefault`` seccomp profile, whatever the notebook pod they are made from says (the
  user and groups it names are kept), also when the owner has no notebook pod at all; on no host
  namespace, with no init container of the notebook's; a notebook pod running as root cannot
  make a job pod (refused with the reason, rather than a pod the kubelet never starts).
- Notebook pods (:class:`~gpupool_spawner.kube.KubeGPUSpawner`, configured as z2jh's
  ``jupyterhub_config.py`` configures KubeSpawner) get the same four fields on the notebook
  container where the admin's settings leave them unset (``KubeGPUSpawner.pod_hardening``);
  what the admin sets (KubeSpawner's ``uid``, ``allow_privilege_escalation``,
  ``container_security_context``, ``pod_security_context``, a profile's
  ``kubespawner_override``) wins, and ``pod_hardening = {}`` turns it off.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import pytest
from kubernetes_asyncio.client import V1Capabilities, V1Container, V1SecurityContext
from traitlets.config import Config

from gpupool.hub import objects as hub_objects
from gpupool.pool import Pool
from gpupool_spawner.kube import KubeGPUSpawner
from tests.accounts import shared_mode
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import (
    IMAGE,
    NS,
    Group,
    User,
    a_job,
    allocate,
    backend,
    build_job,
    manifest,
    pod_of,
    validate,
)
from tests.deploy.kube_fixtures import notebook_pod as running_notebook_pod

RUNTIME_DEFAULT = {"type": "RuntimeDefault"}
HARDENED = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": RUNTIME_DEFAULT,
}


def job_pod(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = obj["spec"]["template"]["spec"]
    return spec


def hardened(context: dict[str, Any]) -> bool:
    """The four fields, as the restricted Pod Security Standard asks for them."""
    return all(context.get(k) == v for k, v in HARDENED.items())


# -- job pods -------------------------------------------------------------------------------------
def test_a_job_whose_owner_has_no_notebook_runs_hardened() -> None:
    job = a_job("h100", gpus=1)
    obj = build_job(job, allocate("h100", 1, 1), pod_template={}, image=IMAGE)
    validate(pod_of(obj))
    pod = job_pod(obj)
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": RUNTIME_DEFAULT}
    (container,) = pod["containers"]
    assert container["securityContext"] == HARDENED


def test_the_backend_hardens_a_job_of_an_owner_without_a_notebook(kube: Served) -> None:
    job = a_job("h100", gpus=1, nodes=2)
    asyncio.run(backend(kube).start(job, allocate("h100", 1, 2)))  # no notebook pod stored
    stored = kube.api.job(f"gpupool-{job.id}", NS)
    (container,) = job_pod(stored)["containers"]
    assert hardened(container["securityContext"]) and job_pod(stored)["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": RUNTIME_DEFAULT,
    }
    kube.api.create_pods(f"gpupool-{job.id}", NS)  # the pods the Job controller makes
    for made in kube.api.pods_of(f"gpupool-{job.id}", NS).values():
        assert hardened(made["spec"]["containers"][0]["securityContext"])


def test_a_job_keeps_the_notebooks_user_but_the_hardening_always_wins() -> None:
    template = running_notebook_pod()
    notebook = template["spec"]["containers"][0]
    notebook["securityContext"] = {
        "runAsUser": 1000,
        "runAsGroup": 100,
        "allowPrivilegeEscalation": True,
        "privileged": True,
        "capabilities": {"add": ["SYS_ADMIN", "NET_RAW"], "drop": ["MKNOD"]},
        "seccompProfile": {"type": "Unconfined"},
        "runAsNonRoot": False,
        "readOnlyRootFilesystem": True,
    }
    template["spec"]["securityContext"] = {
        "fsGroup": 100,
        "runAsNonRoot": False,
        "seccompProfile": {"type": "Unconfined"},
    }
    template["spec"] |= {"hostNetwork": True, "hostPID": True, "hostIPC": True}
    obj = build_job(a_job("h100", gpus=1), allocate("h100", 1, 1), pod_template=template)
    validate(pod_of(obj))
    pod = job_pod(obj)
    (container,) = pod["containers"]
    assert container["securityContext"] == {
        **HARDENED,
        "runAsUser": 1000,
        "runAsGroup": 100,
        "readOnlyRootFilesystem": True,
    }
    assert pod["securityContext"] == {
        "fsGroup": 100,
        "runAsNonRoot": True,
        "seccompProfile": RUNTIME_DEFAULT,
    }
    assert not {"hostNetwork", "hostPID", "hostIPC"} & pod.keys()  # policies see the pod
    # z2jh's block-cloud-metadata (privileged, root, NET_ADMIN) belongs to the notebook server
    assert "initContainers" not in pod


@pytest.mark.parametrize("level", ["container", "pod"])
def test_a_job_from_a_notebook_running_as_root_is_refused_with_the_reason(level: str) -> None:
    template = running_notebook_pod()
    if level == "pod":
        template["spec"]["securityContext"]["runAsUser"] = 0
        del template["spec"]["containers"][0]["securityContext"]["runAsUser"]
    else:
        template["spec"]["containers"][0]["securityContext"]["runAsUser"] = 0
    with pytest.raises(ValueError, match=r"runs as root \(runAsUser 0\).*job pods never do"):
        build_job(a_job("h100", gpus=1), allocate("h100", 1, 1), pod_template=template)


# -- notebook pods --------------------------------------------------------------------------------
def z2jh_config(**kubespawner: Any) -> Config:
    """What z2jh's ``jupyterhub_config.py`` (chart 4.4.0, ``files/hub/jupyterhub_config.py``)
    sets on KubeSpawner for security with its default values: ``singleuser.uid`` 1000,
    ``singleuser.fsGid`` 100, ``singleuser.allowPrivilegeEscalation`` false, and the
    ``block-cloud-metadata`` init container of ``singleuser.cloudMetadata.blockWithIptables``
    (privileged, user 0, ``NET_ADMIN``), as it builds it."""
    config = Config()
    config.KubeSpawner.uid = 1000
    config.KubeSpawner.fs_gid = 100
    config.KubeSpawner.allow_privilege_escalation = False
    config.KubeSpawner.init_containers = [
        V1Container(
            name="block-cloud-metadata",
            image="quay.io/jupyterhub/k8s-network-tools:4.4.0",
            command=["iptables", "--append", "OUTPUT", "--protocol", "tcp", "--destination",
                     "169.254.169.254", "--destination-port", "80", "--jump", "DROP"],
            security_context=V1SecurityContext(
                privileged=True, run_as_user=0, capabilities=V1Capabilities(add=["NET_ADMIN"])
            ),
        )
    ]  # fmt: skip
    for key, value in kubespawner.items():
        config.KubeSpawner[key] = value
    return config


def notebook_spawner(pool: Pool, config: Config, **traits: Any) -> KubeGPUSpawner:
    """A real KubeGPUSpawner for alice of team vision under ``config`` (z2jh's) plus
    ``c.KubeGPUSpawner`` ``traits`` (as ``test_kube_manifests.spawner``); call inside a running
    event loop."""
    config = copy.deepcopy(config)
    for key, value in traits.items():
        config.KubeGPUSpawner[key] = value
    shared_mode(config)
    hub = hub_objects.build(pool, config, logging.getLogger("test"))
    settings = {hub_objects.SETTINGS_KEY: hub}
    user = User("alice", [Group("vision")], settings=settings)
    return KubeGPUSpawner(_mock=True, user=user, config=config)


def notebook_pod(pool: Pool, config: Config, offer: str = "h100", **traits: Any) -> dict[str, Any]:
    """The pod KubeGPUSpawner builds for alice under ``config`` (z2jh's) and ``traits``."""

    async def go() -> dict[str, Any]:
        s = notebook_spawner(pool, config, **traits)
        pod = await manifest(s, pool, offer)
        pool.release(s.gpupool_allocation_id)
        return pod

    pod = asyncio.run(go())
    validate(pod)
    return pod


def notebook_context(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "notebook"]
    context: dict[str, Any] = container.get("securityContext") or {}
    return context


def test_notebook_pods_are_hardened_by_default_under_z2jhs_settings(pool: Pool) -> None:
    pod = notebook_pod(pool, z2jh_config())
    assert notebook_context(pod) == {**HARDENED, "runAsUser": 1000}
    assert pod["spec"]["securityContext"] == {"fsGroup": 100}
    # z2jh's own init container is the admin's: left as z2jh made it (and it still runs)
    (init,) = pod["spec"]["initContainers"]
    assert init["securityContext"] == {
        "privileged": True,
        "runAsUser": 0,
        "capabilities": {"add": ["NET_ADMIN"]},
    }
    cpu = notebook_pod(pool, z2jh_config(), offer="cpu")
    assert notebook_context(cpu) == {**HARDENED, "runAsUser": 1000}


def test_what_the_admin_sets_wins_field_by_field(pool: Pool) -> None:
    config = z2jh_config(
        allow_privilege_escalation=True,  # singleuser.allowPrivilegeEscalation: true
        container_security_context={"capabilities": {"add": ["SYS_PTRACE"]}},
        pod_security_context={
            "seccompProfile": {"type": "Localhost", "localhostProfile": "j.json"}
        },
    )
    context = notebook_context(notebook_pod(pool, config))
    assert context == {
        "runAsUser": 1000,
        "runAsNonRoot": True,  # the one field the admin left to gpupool
        "allowPrivilegeEscalation": True,
        "capabilities": {"add": ["SYS_PTRACE"]},
    }  # no container seccompProfile: it would override the pod's Localhost one
    # singleuser.uid: 0 says "root": runAsNonRoot would keep the container from starting
    root = notebook_context(notebook_pod(pool, z2jh_config(uid=0)))
    assert root == {**{k: v for k, v in HARDENED.items() if k != "runAsNonRoot"}, "runAsUser": 0}


def test_hardening_notebooks_is_a_setting(pool: Pool) -> None:
    off = notebook_pod(pool, z2jh_config(), pod_hardening={})
    assert notebook_context(off) == {"runAsUser": 1000, "allowPrivilegeEscalation": False}
    seccomp_only = {"seccompProfile": RUNTIME_DEFAULT}
    some = notebook_pod(pool, z2jh_config(), pod_hardening=seccomp_only)
    assert notebook_context(some) == {
        "runAsUser": 1000,
        "allowPrivilegeEscalation": False,
        "seccompProfile": RUNTIME_DEFAULT,
    }
    # a null field (Helm keeps `runAsNonRoot: null` of gpupool.notebookHardening) is none
    nulls = notebook_pod(pool, z2jh_config(), pod_hardening={"runAsNonRoot": None, **seccomp_only})
    assert notebook_context(nulls) == notebook_context(some)
    bare = notebook_pod(pool, Config(), pod_hardening=seccomp_only)  # no z2jh, KubeSpawner's own
    assert notebook_context(bare) == {"allowPrivilegeEscalation": False, **seccomp_only}


def test_a_profile_relaxes_the_hardening_for_its_image(pool: Pool) -> None:
    """z2jh's ``singleuser.profileList``: a profile's ``kubespawner_override`` merges into a
    dict setting, a key set to None drops it (KubeSpawner's ``_apply_overrides``)."""
    profiles = [
        {"display_name": "Default", "slug": "default", "default": True},
        {
            "display_name": "Root image",
            "slug": "root",
            "kubespawner_override": {
                "image": "registry.example.org/needs-root:1",
                "uid": 0,
                "pod_hardening": {"runAsNonRoot": None, "capabilities": None},
            },
        },
    ]
    config = z2jh_config(profile_list=profiles)

    async def go(profile: str) -> dict[str, Any]:
        s = notebook_spawner(pool, config)
        s.user_options = {"profile": profile}
        await s.load_user_options()
        pod = await manifest(s, pool, "cpu")
        pool.release(s.gpupool_allocation_id)
        return pod

    assert notebook_context(asyncio.run(go("default"))) == {**HARDENED, "runAsUser": 1000}
    relaxed = asyncio.run(go("root"))
    assert notebook_context(relaxed) == {
        "runAsUser": 0,
        "allowPrivilegeEscalation": False,
        "seccompProfile": RUNTIME_DEFAULT,
    }
    assert notebook_context(asyncio.run(go("default"))) == {**HARDENED, "runAsUser": 1000}
