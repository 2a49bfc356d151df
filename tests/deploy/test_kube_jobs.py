"""Jobs on Kubernetes: the Indexed Job, Service and ConfigMap manifests, and KubeJobBackend.

The manifests are built for allocations a real :class:`Ledger` grants over
``inventory_from_nodes`` of realistic node objects, from a notebook pod as the API server returns
it (KubeSpawner's pod plus what admission and the scheduler add), and validated strictly against
the Kubernetes schemas ``kubernetes_validate`` ships (1.33 and the newest). The backend talks
through ``kubernetes_asyncio`` to the stand-in API server of :mod:`tests.deploy.kube_api`, which
stores objects, answers with the real API's status codes and ``Status`` objects, and whose Job
controller the tests move along step by step.
"""

from __future__ import annotations

import asyncio
import copy
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration

from gpupool.core.errors import InvalidRequest
from gpupool.core.jobs import Job, JobSpec
from gpupool.kube.jobs import JobRef, KubeError, KubeJobBackend, observe_objects
from gpupool.kube.manifests import (
    configmap_name,
    job_name,
    make_script_configmap,
    make_service,
    script_key,
    service_name,
)
from gpupool.kube.pods import DEFAULT_PRODUCT_LABELS
from tests.conftest import kubeconfig
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import (
    GPU_TOLERATION,
    IMAGE,
    NS,
    TOKEN_VOLUME,
    a_job,
    allocate,
    backend,
    container,
    ledger,
    notebook_pod,
    pod_of,
    started,
    validate,
)
from tests.deploy.kube_fixtures import (
    build_job as build,
)
from tests.deploy.kube_fixtures import (
    job_env as env,
)
from tests.deploy.kube_fixtures import (
    job_nvidia as nvidia,
)

DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


KUEUE = {"kueue_queue_template": "{team}-gpu", "kueue_priority_class": "gp-job"}
"""The job backend's Kueue settings (a team's queue, the jobs' priority class)."""


# -- builders -------------------------------------------------------------------------------------


def product_values(job_object: dict[str, Any]) -> list[list[str]]:
    spec = job_object["spec"]["template"]["spec"]
    node = spec.get("affinity", {}).get("nodeAffinity", {})
    terms = node.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    return [
        e["values"]
        for t in terms.get("nodeSelectorTerms", [])
        for e in t.get("matchExpressions", [])
        if e["key"] == "nvidia.com/gpu.product"
    ]


# -- manifests: names -----------------------------------------------------------------------------
def test_names_are_stable_dns_labels_from_the_job_id() -> None:
    job = a_job()
    assert job_name(job) == "gpupool-0f3a9c2b7d41" == service_name(job)
    assert configmap_name(job) == "gpupool-0f3a9c2b7d41-script"
    odd = [Job(i, "alice", "vision", JobSpec("x")) for i in ("Run_1/A", "run-1-a", "x" * 90)]
    names = [job_name(j) for j in odd]
    assert len(set(names)) == 3  # a slug alone would make the first two the same
    for j, name in zip(odd, names, strict=True):
        assert DNS_1035.match(name) and len(name) <= 50  # room for "-<index>" in hostnames
        assert job_name(Job(j.id, "bob", "nlp", JobSpec("y"))) == name  # from the id alone


def test_script_keys_are_valid_configmap_keys() -> None:
    assert script_key(a_job(filename="my train (v2).py")) == "my_train_v2_.py"
    assert script_key(a_job(filename="notebooks/Analysis.ipynb")) == "Analysis.ipynb"
    assert script_key(a_job(filename="..")) == "script.py"


# -- manifests: the Job ---------------------------------------------------------------------------
def test_one_node_whole_gpu_job_from_the_notebook_pod() -> None:
    job = a_job("h100", gpus=2, args=("--lr", "3e-4", "--tag", "$(HOME)"), env=(("SEED", "$x"),))
    obj = build(job, allocate("h100", 2, 1))
    validate(obj)
    validate(pod_of(obj))
    spec, pod = obj["spec"], obj["spec"]["template"]["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 1, 1)
    assert (spec["backoffLimit"], spec["activeDeadlineSeconds"]) == (0, 3600)
    assert spec["podReplacementPolicy"] == "Failed" and spec["suspend"] is False
    ignore, fail = spec["podFailurePolicy"]["rules"]
    assert ignore == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert fail["action"] == "FailJob"
    assert fail["onExitCodes"] == {"containerName": "job", "operator": "NotIn", "values": [0]}
    assert "ttlSecondsAfterFinished" not in spec
    # the notebook's image and security; nothing of the server itself; not its home claim
    # (ReadWriteOnce, attached to dgx-a100-1, where the notebook runs: the job is on dgx-h100-1)
    c = container(obj)
    assert c["name"] == "job" and c["image"] == IMAGE
    assert "home" not in [m["name"] for m in c["volumeMounts"]]
    assert "persistentVolumeClaim" not in str(pod)
    assert c["securityContext"]["runAsUser"] == 1000  # hardened: test_pod_hardening.py
    assert pod["securityContext"]["fsGroup"] == 100
    assert not {"ports", "lifecycle", "terminationMessagePath"} & c.keys()
    assert c["workingDir"] == "/home/jovyan"
    assert pod["restartPolicy"] == "Never" and pod["subdomain"] == "gpupool-0f3a9c2b7d41"
    assert not {"nodeName", "priority", "preemptionPolicy", "hostname"} & pod.keys()
    assert TOKEN_VOLUME not in str(pod)  # admission adds its own token volume
    assert "initContainers" not in pod  # the server's (block-cloud-metadata runs as root)
    assert pod["nodeSelector"] == {"hub.jupyter.org/node-purpose": "user"}
    assert pod["serviceAccountName"] == "default"
    # the job's GPUs, not the notebook's MIG instance
    assert nvidia(obj) == {"limits": {"nvidia.com/gpu": "2"}, "requests": {"nvidia.com/gpu": "2"}}
    assert c["resources"]["limits"]["memory"] == "16G"
    assert product_values(obj) == [list(DEFAULT_PRODUCT_LABELS["H100-80GB"])]
    assert GPU_TOLERATION in pod["tolerations"]
    # environment: no hub token, gpupool's own, the spec's escaped for Kubernetes
    e = env(obj)
    assert not [n for n in e if n.startswith(("JUPYTERHUB_", "JPY_"))]
    assert e["GPUPOOL_JOB"] == job.id and e["GPUPOOL_TEAM"] == "vision"
    assert e["HF_HOME"] == "/home/jovyan/.cache/hf" and e["SEED"] == "$$x"
    assert "NVIDIA_VISIBLE_DEVICES" not in e  # the device plugin's to set
    assert e["PYTHONUNBUFFERED"] == ""  # ranks share the pod log: whole lines only
    # torchrun: static rendezvous on loopback, node rank from the completion index
    assert c["command"][:2] == ["/bin/sh", "-c"]
    assert c["args"] == [
        "torchrun", "--nnodes", "1", "--nproc-per-node", "2",
        "--node-rank", "$(JOB_COMPLETION_INDEX)",
        "--master-addr", "127.0.0.1", "--master-port", "29500", "--max-restarts", "0",
        "--no-python", "python", "-m", "gpupool_lab.rank_log",
        "/opt/gpupool/logs", "/opt/gpupool/job/train.py",
        "--lr", "3e-4", "--tag", "$$(HOME)",
    ]  # fmt: skip
    assert "rank-$$r.log" in c["command"][2] and "for r in 0 1;" in c["command"][2]
    script = {"name": "gpupool-script", "configMap": {"name": configmap_name(job)}}
    script["configMap"]["defaultMode"] = 0o444  # type: ignore[index]
    assert script in pod["volumes"]
    assert {"name": "gpupool-shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    # labels: the job's, never the notebook server's (KubeSpawner would take it for a server)
    labels = obj["spec"]["template"]["metadata"]["labels"]
    assert labels["gpupool.io/job"] == job.id and labels["gpupool.io/offer"] == "h100"
    assert "component" not in labels and "hub.jupyter.org/username" not in labels
    assert "gpupool.io/allocation" not in labels and "kueue.x-k8s.io/queue-name" not in labels
    assert "kueue.x-k8s.io/priority-class" not in labels  # the notebook's rank is not the job's
    assert obj["metadata"]["labels"]["gpupool.io/owner"] == "alice"
    assert obj["metadata"]["annotations"]["gpupool.io/allocations"] == "alloc-0"


def test_two_node_mig_job_with_restarts_and_a_kueue_queue() -> None:
    job = a_job("mig-3g.40gb", gpus=1, nodes=2, max_restarts=2, time_limit=600)
    obj = build(
        job, allocate("mig-3g.40gb", 1, 2), kueue_queue="vision-gpu", ttl_seconds_after_finished=60
    )
    validate(obj)
    validate(pod_of(obj))
    spec = obj["spec"]
    # max_restarts counts the pool's preemptions (the hub requeues): a failure is never retried
    assert (spec["completions"], spec["parallelism"], spec["backoffLimit"]) == (2, 2, 0)
    assert [r["action"] for r in spec["podFailurePolicy"]["rules"]] == ["Ignore", "FailJob"]
    assert spec["suspend"] is True  # Kueue admits it
    assert (spec["activeDeadlineSeconds"], spec["ttlSecondsAfterFinished"]) == (600, 60)
    assert obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "vision-gpu"
    assert "kueue.x-k8s.io/queue-name" not in spec["template"]["metadata"]["labels"]
    mig = {"nvidia.com/mig-3g.40gb": "1"}
    assert nvidia(obj) == {"limits": mig, "requests": mig}
    assert product_values(obj) == [list(DEFAULT_PRODUCT_LABELS["A100-80GB"])]
    args = container(obj)["args"]
    assert args[args.index("--nnodes") + 1] == "2"
    assert args[args.index("--master-addr") + 1] == "gpupool-0f3a9c2b7d41-0.gpupool-0f3a9c2b7d41"
    assert obj["metadata"]["annotations"]["gpupool.io/allocations"] == "alloc-0,alloc-1"


def test_the_kueue_priority_class_labels_a_queued_job_only() -> None:
    job = a_job("mig-3g.40gb", gpus=1, nodes=2)
    obj = build(
        job, allocate("mig-3g.40gb", 1, 2), kueue_queue="vision-gpu", kueue_priority_class="gp-job"
    )
    validate(obj)
    assert obj["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "gp-job"
    assert "kueue.x-k8s.io/priority-class" not in obj["spec"]["template"]["metadata"]["labels"]
    # without a queue Kueue never sees the Job: no priority label either
    bare = build(job, allocate("mig-3g.40gb", 1, 2), kueue_priority_class="gp-job")
    assert "kueue.x-k8s.io/priority-class" not in bare["metadata"]["labels"]


def test_two_node_cpu_job_has_nothing_gpu_specific() -> None:
    job = a_job("cpu", gpus=2, nodes=2)
    obj = build(job, allocate("cpu", 1, 2), kueue_queue=None)
    validate(obj)
    validate(pod_of(obj))
    pod = obj["spec"]["template"]["spec"]
    assert nvidia(obj) == {"limits": {}, "requests": {}}
    assert product_values(obj) == []  # the notebook's A100 constraint is gone
    assert GPU_TOLERATION not in pod["tolerations"]
    assert pod["tolerations"][0]["key"] == "node.kubernetes.io/not-ready"
    assert env(obj)["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert "for r in 0 1 2 3;" in container(obj)["command"][2]


def test_bare_pod_spec_template_and_image_fallback() -> None:
    job = a_job("h100", gpus=1, workdir="/home/jovyan/project")
    bare = {"containers": [{"name": "main", "volumeMounts": [{"name": "x", "mountPath": "/x"}]}]}
    obj = build(job, allocate("h100", 1, 1), pod_template=bare, image="img:1")
    validate(obj)
    c = container(obj)
    assert c["image"] == "img:1" and c["workingDir"] == "/home/jovyan/project"
    assert all(m["name"].startswith("gpupool-") for m in c["volumeMounts"])  # "x" had no volume
    with pytest.raises(ValueError, match=r"c.KubeJobBackend.image"):
        build(job, allocate("h100", 1, 1), pod_template={})


def test_allocations_must_match_the_nodes_and_each_other() -> None:
    pool = ledger()
    mixed = allocate("h100", 1, 1, pool) + allocate("h100", 2, 1, pool)
    with pytest.raises(ValueError, match="same devices"):
        build(a_job("h100", gpus=1, nodes=2), mixed)
    with pytest.raises(ValueError, match="2 node"):
        build(a_job("h100", gpus=1, nodes=2), mixed[:1])


def test_service_and_configmap() -> None:
    job = a_job(filename="train.py")
    service, cm = make_service(job, NS), make_script_configmap(job, NS)
    validate(service)
    validate(cm)
    assert service["metadata"]["name"] == "gpupool-0f3a9c2b7d41"
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"gpupool.io/job": job.id}
    assert service["spec"]["ports"][0]["port"] == 29500
    assert cm["data"] == {"train.py": job.spec.script}
    owner = {"metadata": {"name": "gpupool-0f3a9c2b7d41", "uid": "u-1"}}
    owned = make_script_configmap(job, NS, owner)
    validate(owned)
    assert owned["metadata"]["ownerReferences"][0]["uid"] == "u-1"


# -- the backend against the stand-in API server ------------------------------------------------
def test_start_creates_owned_objects_then_runs_to_success(kube: Served) -> None:
    api, b = kube.api, backend(kube)
    job = a_job("h100", gpus=2, nodes=2)
    name = job_name(job)

    async def go() -> None:
        handle = await b.start(job, allocate("h100", 2, 2))
        j = started(job, handle)
        obj = api.job(name, NS)
        assert JobRef.of(j, "elsewhere") == JobRef(
            NS, name, name, f"{name}-script", obj["metadata"]["uid"]
        )
        assert obj["spec"]["suspend"] is False  # resumed once its script and service exist
        assert obj["metadata"]["labels"]["gpupool.io/job"] == job.id
        for plural, key in (("configmaps", f"{name}-script"), ("services", name)):
            (owner,) = api.objects[plural][NS, key]["metadata"]["ownerReferences"]
            assert (owner["kind"], owner["uid"]) == ("Job", obj["metadata"]["uid"])
        seen = await b.check(j)
        assert (seen.state, seen.reason) == (
            "starting",
            "0 of 2 node(s) running; node 0: no pod yet",
        )
        api.create_pods(
            name, NS, unschedulable="0/5 nodes are available: 5 Insufficient nvidia.com/gpu."
        )
        seen = await b.check(j)
        assert seen.state == "starting"
        assert "node 0: Unschedulable: 0/5 nodes are available" in seen.reason
        api.run_pods(name, NS, indexes=[0])
        assert (await b.check(j)).reason.startswith("1 of 2 node(s) running; node 1:")
        api.run_pods(name, NS)
        assert await b.check(j) == type(seen)("running", "all 2 node(s) running")
        api.exit_pod(name, NS, 0, 0)
        api.exit_pod(name, NS, 1, 0)
        assert (await b.check(j)).state == "running"  # until the controller says Complete
        api.complete(name, NS)
        seen = await b.check(j)
        # per rank: 2 GPUs per node, each node's torchrun code for both of its ranks
        assert (seen.state, seen.exit_codes) == ("succeeded", ((0, 0), (1, 0), (2, 0), (3, 0)))
        assert seen.ended

    asyncio.run(go())
    pods = api.pods_of(name, NS)
    assert pods[1]["spec"]["hostname"] == f"{name}-1" and pods[1]["spec"]["subdomain"] == name


def test_a_failing_node_fails_the_job_with_its_exit_code(kube: Served) -> None:
    api, b = kube.api, backend(kube)
    job = a_job("h100", gpus=1, nodes=2)
    name = job_name(job)

    async def go() -> Any:
        j = started(job, await b.start(job, allocate("h100", 1, 2)))
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        pod = api.exit_pod(name, NS, 1, 1)
        seen = await b.check(j)
        assert (seen.state, seen.reason) == ("running", "node 0 running, node 1 exited 1")
        message = (
            f"Container job for pod {NS}/{pod} failed with exit code 1 matching FailJob rule "
            "at index 1"
        )
        api.fail(name, NS, "PodFailurePolicy", message)
        return await b.check(j)

    seen = asyncio.run(go())
    assert (seen.state, seen.exit_codes) == ("failed", ((1, 1),))
    assert seen.reason == "node 1 exited 1 (see the node's log)"


@pytest.mark.parametrize(
    ("reason", "message", "expected"),
    [
        (
            "DeadlineExceeded",
            "Job was active longer than specified deadline",
            "time limit of 3600 s",
        ),
        ("BackoffLimitExceeded", "Job has reached the specified backoff limit", "out of restarts"),
    ],
)
def test_controller_failure_reasons_are_said_in_words(
    kube: Served, reason: str, message: str, expected: str
) -> None:
    api, b = kube.api, backend(kube)
    job = a_job("h100", gpus=1, nodes=1)

    async def go() -> Any:
        j = started(job, await b.start(job, allocate("h100", 1, 1)))
        api.create_pods(job_name(job), NS)
        api.run_pods(job_name(job), NS)
        api.fail(job_name(job), NS, reason, message)
        return await b.check(j)

    seen = asyncio.run(go())
    assert seen.state == "failed" and expected in seen.reason


def test_job_deleted_behind_our_back_is_lost(kube: Served) -> None:
    api, b = kube.api, backend(kube)
    job = a_job("h100", gpus=1, nodes=2)
    name = job_name(job)

    async def go() -> None:
        j = started(job, await b.start(job, allocate("h100", 1, 2)))
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        with api.lock:
            api.delete("jobs", NS, name, "Background")  # kubectl delete job
        seen = await b.check(j)
        assert seen.state == "lost" and f"Job {NS}/{name} is gone" in seen.reason
        assert not api.objects["pods"] and not api.objects["services"]  # collected

    asyncio.run(go())


def test_orphaned_pods_keep_the_job_alive_until_cancel_deletes_them(kube: Served) -> None:
    api, b = kube.api, backend(kube)
    job = a_job("h100", gpus=1, nodes=2)
    name = job_name(job)

    async def go() -> None:
        j = started(job, await b.start(job, allocate("h100", 1, 2)))
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        with api.lock:
            api.delete("jobs", NS, name)  # the API's default for Jobs: orphan the pods
        seen = await b.check(j)
        assert (seen.state, seen.ended) == ("running", False)
        assert "waiting for 2 pod(s) to end" in seen.reason
        await b.cancel(j)
        assert (await b.check(j)).state == "lost"

    asyncio.run(go())
    assert ("pods", "DELETE") in {(r[1].split("/")[-1], r[0]) for r in api.requests}


def test_cancel_deletes_job_service_and_configmap(kube: Served) -> None:
    api, b = kube.api, backend(kube)
    job = a_job("h100", gpus=1, nodes=2)
    name = job_name(job)

    async def go() -> None:
        j = started(job, await b.start(job, allocate("h100", 1, 2)))
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        await b.cancel(j)
        assert (await b.check(j)).state == "lost"
        await b.cancel(j)  # twice is fine

    asyncio.run(go())
    assert ("jobs", name, "Background") in api.deletions
    assert not any(api.objects.values())  # Job, pods, Service and ConfigMap all gone


def test_read_log_serves_the_nodes_pod_log_from_an_offset(kube: Served) -> None:
    api, b = kube.api, backend(kube, log_chunk_bytes=8)
    job = a_job("h100", gpus=2, nodes=2)
    name = job_name(job)

    async def go() -> Job:
        return started(job, await b.start(job, allocate("h100", 2, 2)))

    j = asyncio.run(go())

    def read(rank: int, offset: int) -> tuple[bytes, int]:
        return asyncio.run(b.read_log(j, rank, offset))

    assert read(3, 0) == (b"", 0)  # no pods yet
    api.create_pods(name, NS)
    assert read(3, 0) == (b"", 0)  # waiting to start
    api.run_pods(name, NS)
    pods = api.pods_of(name, NS)
    api.logs[pods[0]["metadata"]["name"]] = b"rank 0 and 1\n"
    api.logs[pods[1]["metadata"]["name"]] = b"==== rank 2\n==== rank 3\nloss 0.1\n"
    assert read(3, 0) == (b"==== ran", 8)  # node 1, one chunk
    assert read(2, 8) == (b"k 2\n====", 16)
    assert read(1, 7) == (b"and 1\n", 13)  # node 0, to the end
    assert read(0, 40) == (b"", 13)  # past the end
    assert read(0, 0) == (b"rank 0 a", 8)
    logs = [r for r in api.requests if r[1].endswith("/log")]
    assert logs[-1][2] == {"container": "job", "limitBytes": "8"}


def test_a_restarted_hub_observes_from_the_handle_or_the_names(kube: Served) -> None:
    api = kube.api
    job = a_job("h100", gpus=1, nodes=1)
    name = job_name(job)

    async def go() -> None:
        j = started(job, await backend(kube).start(job, allocate("h100", 1, 1)))
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        fresh = backend(kube, namespace="other")  # a new hub: only the job record is left
        assert (await fresh.check(j)).state == "running"
        unsaved = started(job, "")  # the hub went down before saving the handle
        assert (await backend(kube).check(unsaved)).state == "running"

    asyncio.run(go())


def test_kueue_keeps_the_job_suspended_until_admitted(kube: Served) -> None:
    api, b = kube.api, backend(kube, **KUEUE)
    job = a_job("mig-3g.40gb", gpus=1, nodes=1)
    name = job_name(job)

    async def go() -> None:
        j = started(job, await b.start(job, allocate("mig-3g.40gb", 1, 1)))
        obj = api.job(name, NS)
        assert obj["spec"]["suspend"] is True
        assert obj["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "vision-gpu"
        assert obj["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "gp-job"
        seen = await b.check(j)
        assert seen == type(seen)("starting", "waiting for Kueue to admit it (queue vision-gpu)")
        with api.lock:  # Kueue admits the workload
            api.patch(
                "jobs", NS, name, "application/merge-patch+json", {"spec": {"suspend": False}}
            )
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        assert (await b.check(j)).state == "running"

    asyncio.run(go())
    assert not [r for r in api.requests if r[0] == "PATCH"]  # gpupool never resumed it


def test_cpu_jobs_wait_on_no_kueue_queue(kube: Served) -> None:
    api, b = kube.api, backend(kube, **KUEUE)
    job = a_job("cpu", gpus=2, nodes=1)

    asyncio.run(b.start(job, allocate("cpu", 1, 1)))
    obj = api.job(job_name(job), NS)
    assert obj["spec"]["suspend"] is False
    assert "kueue.x-k8s.io/queue-name" not in obj["metadata"]["labels"]
    assert "kueue.x-k8s.io/priority-class" not in obj["metadata"]["labels"]


def test_job_pods_are_built_from_the_owners_running_notebook(kube: Served) -> None:
    api, b = kube.api, backend(kube)
    with api.lock:
        for user, image in (("alice", "ghcr.io/alice/torch:1"), ("bob", "ghcr.io/bob/jax:1")):
            api.objects["pods"][NS, f"jupyter-{user}"] = notebook_pod(user, image)
    job = a_job("h100", gpus=1)
    asyncio.run(b.start(job, allocate("h100", 1, 1)))
    pod = api.job(job_name(job), NS)["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "ghcr.io/alice/torch:1"
    claims = [
        v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if v["name"] == "home"
    ]
    assert claims == []  # her notebook runs on dgx-a100-1: its ReadWriteOnce home stays there
    selectors = [r[2].get("labelSelector") for r in api.requests if r[1].endswith("/pods")]
    assert "component=singleuser-server,hub.jupyter.org/username=alice" in selectors


def test_the_template_hook_comes_first(kube: Served) -> None:
    api = kube.api
    seen: list[str] = []

    async def hook(b: KubeJobBackend, job: Job) -> dict[str, Any]:
        seen.append(job.id)
        return {"spec": {"containers": [{"name": "notebook", "image": "hooked:1"}]}}

    job = a_job("h100", gpus=1)
    asyncio.run(backend(kube, pod_template_hook=hook).start(job, allocate("h100", 1, 1)))
    assert seen == [job.id]
    assert api.job(job_name(job), NS)["spec"]["template"]["spec"]["containers"][0]["image"] == (
        "hooked:1"
    )


def test_refusals_are_reported_and_leave_nothing_behind(kube: Served) -> None:
    api = kube.api
    job = a_job("h100", gpus=1)
    bad = notebook_pod()
    bad["spec"]["notAField"] = True  # strict schemas: the API server says 422 Invalid
    b = backend(kube, pod_template_hook=lambda _b, _j: bad)
    with pytest.raises(
        KubeError, match=r'refused to create Job .*"gpupool-0f3a9c2b7d41" is invalid'
    ):
        asyncio.run(b.start(job, allocate("h100", 1, 1)))
    assert not any(api.objects.values())
    b = backend(kube)
    asyncio.run(b.start(job, allocate("h100", 1, 1)))
    with pytest.raises(KubeError, match="already exists"):
        asyncio.run(b.start(job, allocate("h100", 1, 1)))


def test_a_left_over_configmap_is_replaced(kube: Served) -> None:
    api = kube.api
    job = a_job("h100", gpus=1)
    stale = make_script_configmap(a_job(script="print('old')"), NS)
    with api.lock:
        api.create("configmaps", NS, stale)
    asyncio.run(backend(kube).start(job, allocate("h100", 1, 1)))
    cm = api.objects["configmaps"][NS, configmap_name(job)]
    assert cm["data"] == {"train.py": job.spec.script} and cm["metadata"]["ownerReferences"]


def test_the_kubeconfig_is_used_without_a_factory(
    kube: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig(tmp_path / "kubeconfig", kube.url)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    b = backend(kube, api_client_factory=None)
    job = a_job("h100", gpus=1)
    j = started(job, asyncio.run(b.start(job, allocate("h100", 1, 1))))
    assert asyncio.run(b.check(j)).state == "starting"


def test_an_unreachable_api_server_leaves_the_job_as_it_is() -> None:
    b = KubeJobBackend(
        namespace=NS,
        api_client_factory=lambda: ApiClient(Configuration(host="http://127.0.0.1:9")),
        request_timeout=5,
    )
    j = Job("0f3a9c2b7d41", "alice", "vision", JobSpec("x"), state="running", handle="{}")
    seen = asyncio.run(b.check(j))
    assert (seen.state, seen.ended) == ("running", False)
    assert "cannot reach the Kubernetes API" in seen.reason


def test_validate_refuses_only_what_the_base_refuses() -> None:
    b = KubeJobBackend(namespace=NS)
    b.validate(JobSpec("x", "h100", gpus=8, nodes=16))
    with pytest.raises(InvalidRequest):
        b.validate(JobSpec("x", "h100", gpus=1, nodes=0))


# -- the GPU pod settings: one definition (KubeGPUSettings), per-class overrides ----------------
SCHEDULER = "gpu_scheduler_name"


@pytest.mark.parametrize(
    ("settings", "job_value", "notebook_value"),
    [
        ({}, "", ""),  # the default
        ({"KubeGPUSettings": "kai"}, "kai", "kai"),  # the shared section sets both
        ({"KubeGPUSpawner": "kai"}, "kai", "kai"),  # as configs said it before: jobs inherit
        ({"KubeGPUSettings": "kai", "KubeGPUSpawner": "volcano"}, "kai", "volcano"),
        ({"KubeGPUSpawner": "kai", "KubeJobBackend": "volcano"}, "volcano", "kai"),
        ({"KubeGPUSettings": "kai", "KubeJobBackend": "volcano"}, "volcano", "kai"),
    ],
)
def test_a_gpu_pod_setting_applies_where_its_section_says(
    settings: dict[str, str], job_value: str, notebook_value: str
) -> None:
    from traitlets.config import Config

    from gpupool.kube.settings import notebook_settings

    config = Config()
    for section, value in settings.items():
        config[section][SCHEDULER] = value
    assert KubeJobBackend(config=config).gpu_scheduler_name == job_value
    assert notebook_settings(config).gpu_scheduler_name == notebook_value


def test_settings_default_to_the_kube_spawners() -> None:
    from traitlets.config import Config

    config = Config()
    config.KubeGPUSpawner.kueue_queue_template = "{team}"
    config.KubeGPUSpawner.bind_to_node = False
    config.KubeGPUSpawner.gpu_product_labels = {"H100-80GB": "my-h100"}
    config.KubeSpawner.namespace = "jhub"
    b = KubeJobBackend(config=config)
    assert (b.namespace, b.kueue_queue_template, b.bind_to_node) == ("jhub", "{team}", False)
    assert b.gpu_product_labels == {"H100-80GB": ["my-h100"]}  # validated as the spawner's
    assert b.gpu_tolerations == [GPU_TOLERATION]


@pytest.mark.parametrize(
    ("section", "expected"),
    [("KubeGPUSpawner", ""), ("KubeGPUSettings", "gp-all"), ("KubeJobBackend", "gp-job")],
)
def test_the_kueue_priority_class_is_not_the_notebooks(section: str, expected: str) -> None:
    from traitlets.config import Config

    config = Config()
    config[section].kueue_priority_class = expected or "gp-notebook"
    assert KubeJobBackend(config=config).kueue_priority_class == expected  # jobs rank below


@pytest.mark.parametrize("section", ["KubeGPUSettings", "KubeGPUSpawner", "KubeJobBackend"])
@pytest.mark.parametrize(
    ("setting", "bad"),
    [
        ("gpu_tolerations", [{"kee": "nvidia.com/gpu"}]),
        ("gpu_product_labels", {"H100-80GB": [""]}),
        ("hami_resources", {"count": "nvidia.com/gpu"}),
        ("kueue_queue_template", "{tema}"),
        ("kueue_priority_class", "Not_A_Name"),
    ],
)
def test_a_bad_gpu_pod_setting_stops_the_hub_naming_its_key(
    section: str, setting: str, bad: Any
) -> None:
    from traitlets.config import Config

    from gpupool.declarations import ConfigError
    from gpupool.kube.jobs import check_kube_settings

    config = Config()
    config[section][setting] = bad
    with pytest.raises(ConfigError, match=rf"^{section}\.{setting}\b"):
        check_kube_settings(config)


def test_observation_of_a_job_object_without_pods() -> None:
    obj: dict[str, Any] = {"metadata": {"name": "j"}, "spec": {}, "status": {}}
    assert observe_objects(obj, [], 1).state == "starting"
    failed = copy.deepcopy(obj)
    failed["status"]["conditions"] = [
        {"type": "Failed", "status": "True", "reason": "Evicted", "message": "node drained"}
    ]
    assert observe_objects(failed, [], 1).reason == "Evicted: node drained"


# -- the container's command, run as Kubernetes would run it ---------------------------------------
def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of ``command``/``args``/``env``: ``$(VAR)`` of a defined variable
    is its value, ``$$`` is ``$``, anything else stays as written."""

    def one(m: re.Match[str]) -> str:
        return "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def test_two_nodes_run_the_containers_command_with_torchrun(tmp_path: Path) -> None:
    """Both pods' command lines, expanded for completion indexes 0 and 1, run on this machine
    (gloo on CPU; node 0's address is loopback here, its pod's DNS name in a cluster): the ranks
    are index × 2 + local rank, and each node's ranks write to its standard output (the pod
    log), with the arguments exactly as the user gave them."""
    pytest.importorskip("torch")
    script = (
        "import sys, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "print('rank', dist.get_rank(), 'of', dist.get_world_size(), sys.argv[1:], flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    job = a_job("cpu", gpus=2, nodes=2, script=script, args=("--tag", "$(HOME)"))
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    obj = build(
        job,
        allocate("cpu", 1, 2),
        log_dir=str(tmp_path / "logs"),
        torchrun=torchrun,
        python=sys.executable,
    )
    (tmp_path / "train.py").write_text(script)
    c = container(obj)
    port = free_port()
    inherited = dict(os.environ)
    runs = []
    for index in (0, 1):
        env = {"JOB_COMPLETION_INDEX": str(index)}
        argv = [expand(a, env) for a in c["command"] + c["args"]]
        argv = [str(tmp_path / "train.py") if a.endswith("/train.py") else a for a in argv]
        argv[argv.index("--master-addr") + 1] = "127.0.0.1"
        argv[argv.index("--master-port") + 1] = str(port)
        variables = {e["name"]: expand(e["value"], env) for e in c["env"]}
        runs.append(
            subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**inherited, **variables},
            )
        )
    outputs = [p.communicate(timeout=180)[0].decode() for p in runs]
    assert [p.returncode for p in runs] == [0, 0], outputs
    for index, out in enumerate(outputs):
        for rank in (2 * index, 2 * index + 1):
            assert f"==== gpupool: rank {rank} starting" in out
            assert f"rank {rank} of 4 ['--tag', '$(HOME)']" in out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
