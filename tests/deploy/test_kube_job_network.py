"""Each job's network is its own on Kubernetes: the hub creates one NetworkPolicy per job.

The policy is built by :func:`gpupool.kube.manifests.make_network_policy` (pure) and created
by :class:`KubeJobBackend` through ``kubernetes_asyncio`` against the stand-in API server of
:mod:`tests.deploy.kube_api`, which stores NetworkPolicies as the real one does (strict schema
validation, its defaults, garbage collection by ``ownerReferences``) and answers ``403
Forbidden`` for what the hub's Role does not grant. What the policies let through, together with
the Helm chart's, is checked by network-config-analyzer in ``test_chart_full.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gpupool.core.jobs import Job, JobSpec
from gpupool.kube import manifests as kube_manifests
from gpupool.kube.job_status import KubeError
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import NS, a_job, allocate, backend, started, validate

JOB_LABEL = "gpupool.io/job"
DNS_53 = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]


def two_jobs() -> tuple[Job, Job]:
    """Two-node jobs of two users in two teams."""
    return (
        a_job("h100", gpus=1, nodes=2),
        Job("7c1d2e9a0b33", "bob", "nlp", JobSpec("print(1)\n", offer="h100", nodes=2)),
    )


def policies(api: Any) -> dict[str, dict[str, Any]]:
    return {name: obj for (_, name), obj in api.objects["networkpolicies"].items()}


def selects(policy: dict[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = policy["spec"]["podSelector"]["matchLabels"]
    return labels


# -- the manifest ---------------------------------------------------------------------------------
def test_a_jobs_policy_admits_its_own_pods_and_dns_only() -> None:
    job = a_job("h100", gpus=1, nodes=2)
    owner = {"metadata": {"name": "gpupool-0f3a9c2b7d41", "uid": "u-1"}}
    policy = kube_manifests.make_network_policy(job, NS, owner)
    validate(policy)
    own = {"podSelector": {"matchLabels": {JOB_LABEL: job.id}}}
    assert policy["metadata"]["name"] == kube_manifests.job_name(job)
    assert policy["metadata"]["labels"][JOB_LABEL] == job.id
    (ref,) = policy["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"]) == ("Job", "gpupool-0f3a9c2b7d41", "u-1")
    spec = policy["spec"]
    assert spec["podSelector"] == own["podSelector"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    assert spec["ingress"] == [{"from": [own]}]  # every port: the rendezvous, NCCL, gloo
    kube_dns = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
        "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
    }
    assert spec["egress"] == [{"to": [own]}, {"to": [kube_dns], "ports": DNS_53}]


def test_the_dns_peers_are_a_setting_and_odd_ids_become_label_values() -> None:
    job = Job("Run/1 of ada", "ada", "vision", JobSpec("x"))
    node_local = {"ipBlock": {"cidr": "169.254.20.10/32"}}
    policy = kube_manifests.make_network_policy(job, NS, dns=[node_local])
    validate(policy)
    pods = kube_manifests.job_labels(job)  # what the job's pods carry
    assert selects(policy) == {JOB_LABEL: pods[JOB_LABEL]} and pods[JOB_LABEL] != job.id
    assert policy["spec"]["egress"][1] == {"to": [node_local], "ports": DNS_53}
    assert "ownerReferences" not in policy["metadata"]
    bare = kube_manifests.make_network_policy(job, NS, dns=[])
    assert bare["spec"]["egress"] == [{"to": [{"podSelector": {"matchLabels": selects(bare)}}]}]


# -- the backend ----------------------------------------------------------------------------------
def test_each_job_gets_its_own_policy_owned_by_its_job(kube: Served) -> None:
    api, b = kube.api, backend(kube)
    first, second = two_jobs()
    handles = []

    async def go() -> None:
        for job in (first, second):
            handles.append(await b.start(job, allocate("h100", 1, 2)))

    asyncio.run(go())
    found = policies(api)
    assert len(found) == 2  # one per job, none shared
    for job in (first, second):
        name = f"gpupool-{job.id}"
        policy, owner = found[name], api.job(name, NS)
        assert selects(policy) == {JOB_LABEL: job.id}
        assert policy["spec"]["ingress"] == [
            {"from": [{"podSelector": policy["spec"]["podSelector"]}]}
        ]
        (ref,) = policy["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"]) == ("Job", name, owner["metadata"]["uid"])
        # the Job was resumed (its last change) only once its policy existed: no pod without it
        assert owner["spec"]["suspend"] is False
        assert int(policy["metadata"]["resourceVersion"]) < int(
            owner["metadata"]["resourceVersion"]
        )
    # the garbage collector takes a policy with its Job, and only that one
    api.delete("jobs", NS, f"gpupool-{first.id}", "Background")
    assert set(policies(api)) == {f"gpupool-{second.id}"}
    asyncio.run(b.cancel(started(second, handles[1])))
    assert not policies(api)


def test_a_role_without_network_policies_fails_the_start_and_leaves_nothing(
    kube: Served,
) -> None:
    api = kube.api
    api.forbid("create", "networkpolicies")
    job = a_job("h100", gpus=1, nodes=2)
    with pytest.raises(KubeError) as refused:
        asyncio.run(backend(kube).start(job, allocate("h100", 1, 2)))
    assert str(refused.value) == (
        "Kubernetes refused to create NetworkPolicy gpupool/gpupool-0f3a9c2b7d41: "
        'networkpolicies.networking.k8s.io is forbidden: User "system:serviceaccount:jhub:hub" '
        'cannot create resource "networkpolicies" in API group "networking.k8s.io" in the '
        "namespace \"gpupool\" (the hub's Role must grant it: the Helm chart's does)"
    )
    assert not any(api.objects.values())  # the Job deleted, and what it owned with it
    assert ("jobs", "gpupool-0f3a9c2b7d41", "Background") in api.deletions


def test_without_network_policies_the_hub_touches_none(kube: Served) -> None:
    api = kube.api
    for verb in ("create", "delete"):
        api.forbid(verb, "networkpolicies")
    b = backend(kube, network_policy=False)
    job = a_job("h100", gpus=1, nodes=2)
    handle = asyncio.run(b.start(job, allocate("h100", 1, 2)))
    asyncio.run(b.cancel(started(job, handle)))
    assert not any("networkpolicies" in r[1] for r in api.requests)


def test_a_left_over_policy_of_an_earlier_run_is_replaced(kube: Served) -> None:
    api = kube.api
    job = a_job("h100", gpus=1, nodes=2)
    stale = kube_manifests.make_network_policy(job, NS, dns=[])
    with api.lock:
        api.create("networkpolicies", NS, stale)
    asyncio.run(backend(kube).start(job, allocate("h100", 1, 2)))
    (policy,) = policies(api).values()
    assert len(policy["spec"]["egress"]) == 2 and policy["metadata"]["ownerReferences"]


# -- the stand-in, as the API server ----------------------------------------------------------
def test_the_stand_in_defaults_network_policies_as_the_api_server_does(kube: Served) -> None:
    api = kube.api
    body = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "p"},
        "spec": {
            "podSelector": {},
            "egress": [{"ports": [{"port": 53}]}],
            "ingress": [{"ports": [{"port": 80, "protocol": "UDP"}]}],
        },
    }
    with api.lock:
        code, made = api.create("networkpolicies", NS, body)
        assert code == 201
        assert made["spec"]["policyTypes"] == ["Ingress", "Egress"]
        assert made["spec"]["egress"][0]["ports"] == [{"port": 53, "protocol": "TCP"}]
        assert made["spec"]["ingress"][0]["ports"] == [{"port": 80, "protocol": "UDP"}]
        ingress_only = {**body, "metadata": {"name": "q"}, "spec": {"podSelector": {}}}
        assert api.create("networkpolicies", NS, ingress_only)[1]["spec"]["policyTypes"] == [
            "Ingress"
        ]
        bad = {**body, "metadata": {"name": "r"}, "spec": {"podSelector": {}, "policyTypes": 1}}
        assert api.create("networkpolicies", NS, bad)[0] == 422
        code, status = api.delete("networkpolicies", NS, "p")
        assert (code, status["kind"], status["details"]["group"]) == (
            200,
            "Status",
            "networking.k8s.io",
        )


def test_the_admin_page_sentence_says_whether_jobs_have_a_network_of_their_own(
    kube: Served,
) -> None:
    on, off = backend(kube), backend(kube, network_policy=False)
    assert on.private_network and on.network_note.startswith("private: each job has a Network")
    assert not off.private_network and "network_policy is off" in off.network_note
