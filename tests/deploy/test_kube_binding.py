"""Pods go where the ledger counted them (issue 15): node binding of notebook and job pods, the
stand-in's scheduler and volume attachment that check it, ReadWriteOnce claims of multi-node
jobs, the shared ReadWriteMany volume, and exit codes per rank.

The stand-in (:mod:`tests.deploy.kube_api`) schedules as kube-scheduler does for what gpupool
relies on (taints, node affinity, free allocatable, topology spread; the roomiest node wins), and
attaches a ReadWriteOnce claim to one node at a time, so these tests show both the failure the
binding prevents (a pod the ledger sent to one node lands on another, and a later one waits on
``Insufficient nvidia.com/gpu``) and that bound pods land where the ledger said.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import (
    ApiClient,
    Configuration,
    V1Affinity,
    V1NodeAffinity,
    V1NodeSelector,
    V1NodeSelectorRequirement,
    V1NodeSelectorTerm,
)
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Team
from gpupool.core.errors import NoCapacity
from gpupool.core.jobs import Job, JobSpec
from gpupool.core.ledger import Allocation, Request
from gpupool.declarations import ConfigError
from gpupool.jobs.manager import JobManager
from gpupool.kube.job_status import observe_objects, rank_exit_codes
from gpupool.kube.manifests import (
    JOB_LABEL,
    NODES_ANNOTATION,
    configmap_name,
    exact_binding,
    job_name,
    make_job,
)
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.pods import HOSTNAME_LABEL, apply_allocation
from gpupool.pool import Pool, with_node_pools
from gpupool.store import Store
from tests.conftest import a100_mixed_node, h100_node
from tests.deploy.kube_api import StandIn, served
from tests.deploy.kube_fixtures import (
    IMAGE,
    NS,
    hostnames,
    node_terms,
    notebook_pod,
    run_job_pods,
    spawner_pod,
    validate,
)
from tests.deploy.kube_fixtures import (
    serialise_now as serialise,
)

OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=8),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", model="A100-80GB", profile="3g.40gb"),
}
NODES = (h100_node("dgx-h100-1"), h100_node("dgx-h100-2"), a100_mixed_node("dgx-a100-1"))


# -- builders -------------------------------------------------------------------------------------
def ledger(*nodes: dict[str, Any]) -> Ledger:
    inventory = inventory_from_nodes(list(nodes or NODES))
    everyone = Team("everyone", offers=frozenset({"cpu"}))
    return Ledger(inventory, OFFERS, {"vision": Team("vision", 64000)}, everyone)


def cluster(*nodes: dict[str, Any]) -> StandIn:
    """The stand-in with these nodes (default :data:`NODES`), labelled as z2jh user nodes (the
    notebook pod's ``nodeSelector``)."""
    api = StandIn()
    for node in nodes or NODES:
        node = copy.deepcopy(node)
        node["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
        api.add_node(node)
    return api


def notebook(allocation: Allocation | None, offer: str, *, bind: bool = True) -> dict[str, Any]:
    user = allocation.user if allocation else "cpu-user"
    pod = apply_allocation(spawner_pod(user), allocation, OFFERS[offer], bind_to_node=bind)
    body = serialise(pod)
    validate(body)
    return body


def a_job(offer: str = "h100", gpus: int = 2, nodes: int = 2) -> Job:
    spec = JobSpec(offer=offer, gpus=gpus, nodes=nodes, script="print(1)\n", filename="t.py")
    return Job("0f3a9c2b7d41", "alice", "vision", spec, state="starting")


def job_allocations(pool: Ledger, offer: str, gpus: int, nodes: list[str]) -> list[Allocation]:
    """One allocation per job node, on the nodes given (the ledger's choice, made explicit)."""
    out = []
    for node in nodes:
        alloc_id = f"job-{len(pool.allocations)}"
        a = pool.allocate(Request("alice", "vision", offer, gpus, "job", "j1"), alloc_id)
        out.append(replace(a, node=node))
    return out


def run_job(api: StandIn, body: dict[str, Any]) -> dict[int, dict[str, Any]]:
    code, created = api.create("jobs", NS, body)
    assert code == 201, created
    name = created["metadata"]["name"]
    api.create_pods(name, NS)
    api.run_pods(name, NS)
    return api.pods_of(name, NS)


def build(job: Job, allocations: list[Allocation], **kwargs: Any) -> dict[str, Any]:
    options: dict[str, Any] = {
        "pod_template": notebook_pod(),
        "namespace": NS,
        "script_configmap": configmap_name(job),
        "offer": OFFERS[job.spec.offer],
    }
    obj = make_job(job, allocations, **(options | kwargs))
    validate(obj)
    template = obj["spec"]["template"]
    meta = {"name": f"{obj['metadata']['name']}-0-abcde", **template["metadata"]}
    validate({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]})
    return obj


# -- item 1: the manifests carry the binding -----------------------------------------------------
def test_gpu_and_mig_notebook_pods_are_bound_to_the_ledgers_node_cpu_pods_are_not() -> None:
    pool = ledger()
    gpu = pool.allocate(Request("alice", "vision", "h100", 2, "notebook", "a"), "a1")
    mig = pool.allocate(Request("bob", "vision", "mig-3g.40gb", 1, "notebook", "b"), "b1")
    assert (gpu.node, mig.node) == ("dgx-h100-1", "dgx-a100-1")
    assert hostnames(notebook(gpu, "h100")["spec"]) == [["dgx-h100-1"]]
    assert hostnames(notebook(mig, "mig-3g.40gb")["spec"]) == [["dgx-a100-1"]]
    cpu = notebook(None, "cpu")["spec"]
    assert hostnames(cpu) == [] and "affinity" not in cpu
    assert hostnames(notebook(gpu, "h100", bind=False)["spec"]) == []  # bind_to_node off


def test_an_earlier_binding_is_replaced_and_other_terms_kept_for_every_node() -> None:
    pool = ledger()
    gpu = pool.allocate(Request("alice", "vision", "h100", 1, "notebook", "a"), "a1")
    stale = V1NodeSelectorRequirement(key="metadata.name", operator="In", values=["old-node"])
    zone = V1NodeSelectorRequirement(key="zone", operator="In", values=["a"])
    rack = V1NodeSelectorRequirement(key="rack", operator="Exists")
    terms = [
        V1NodeSelectorTerm(match_expressions=[zone], match_fields=[stale]),
        V1NodeSelectorTerm(match_expressions=[rack]),
    ]
    affinity = V1Affinity(
        node_affinity=V1NodeAffinity(
            required_during_scheduling_ignored_during_execution=V1NodeSelector(
                node_selector_terms=terms
            )
        )
    )
    base = spawner_pod("alice", affinity)
    base.spec.node_selector = {"nvidia.com/gpu.product": "old", "pool": "gpu"}
    out = serialise(apply_allocation(base, gpu, OFFERS["h100"]))
    validate(out)
    zone_term, rack_term = node_terms(out["spec"])
    assert [e["key"] for e in zone_term["matchExpressions"]] == ["zone", "nvidia.com/gpu.product"]
    assert [e["key"] for e in rack_term["matchExpressions"]] == ["rack", "nvidia.com/gpu.product"]
    assert hostnames(out["spec"]) == [["dgx-h100-1"], ["dgx-h100-1"]]  # each term bound
    assert out["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert base.spec.node_selector["nvidia.com/gpu.product"] == "old"  # the input is untouched
    # several nodes (a job's): one term per node and per admin term, all valid
    two = apply_allocation(base, gpu, OFFERS["h100"], nodes=["dgx-h100-1", "dgx-h100-2"])
    out = serialise(two)
    validate(out)
    assert hostnames(out["spec"]) == [["dgx-h100-1"], ["dgx-h100-2"]] * 2
    # applied again (a job made from this notebook pod): the same terms, not more
    again = serialise(apply_allocation(two, gpu, OFFERS["h100"]))
    assert node_terms(again["spec"]) == node_terms(
        serialise(apply_allocation(base, gpu, OFFERS["h100"]))["spec"]
    )


def test_job_manifests_bind_every_node_and_spread_over_distinct_ones() -> None:
    pool = ledger()
    job = a_job("h100", gpus=2, nodes=2)
    spread = build(job, job_allocations(pool, "h100", 2, ["dgx-h100-1", "dgx-h100-2"]))
    spec = spread["spec"]["template"]["spec"]
    assert hostnames(spec) == [["dgx-h100-1"], ["dgx-h100-2"]]
    assert spec["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": HOSTNAME_LABEL,
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {JOB_LABEL: job.id}},
        }
    ]
    assert spread["metadata"]["annotations"][NODES_ANNOTATION] == "dgx-h100-1,dgx-h100-2"
    # the notebook's own node binding (dgx-a100-1, its MIG node) is not the job's
    assert "dgx-a100-1" not in str(spec.get("affinity"))
    together = build(job, job_allocations(pool, "h100", 2, ["dgx-h100-1", "dgx-h100-1"]))
    spec = together["spec"]["template"]["spec"]
    assert hostnames(spec) == [["dgx-h100-1"]] and "topologySpreadConstraints" not in spec
    unbound = build(
        job, job_allocations(pool, "h100", 1, ["dgx-h100-1", "dgx-h100-2"]), bind_to_node=False
    )
    assert hostnames(unbound["spec"]["template"]["spec"]) == []
    assert NODES_ANNOTATION not in unbound["metadata"]["annotations"]
    cpu = build(a_job("cpu", gpus=1, nodes=2), job_allocations(pool, "cpu", 1, ["", ""]))
    spec = cpu["spec"]["template"]["spec"]
    assert hostnames(spec) == [] and "topologySpreadConstraints" not in spec


def test_exact_binding_needs_an_even_split() -> None:
    def at(*nodes: str) -> list[Allocation]:
        a = Allocation("x", "u", "t", "h100", "job", "j", 1, 1000, None, ())
        return [replace(a, node=n) for n in nodes]

    assert exact_binding(at("n1"))
    assert exact_binding(at("n1", "n2", "n3"))
    assert exact_binding(at("n1", "n1", "n2", "n2"))
    assert not exact_binding(at("n1", "n1", "n2"))


# -- item 2: the stand-in schedules; unbound pods go astray, bound ones do not --------------------
@pytest.mark.parametrize("bind", [True, False])
def test_notebooks_land_where_the_ledger_counted_them_only_when_bound(bind: bool) -> None:
    pool, api = ledger(), cluster()
    carol = pool.allocate(Request("carol", "vision", "h100", 2, "notebook", "c"), "c1")
    dave = pool.allocate(Request("dave", "vision", "h100", 6, "notebook", "d"), "d1")
    eve = pool.allocate(Request("eve", "vision", "h100", 8, "notebook", "e"), "e1")
    # the ledger packs dave next to carol, so that eve gets a whole node
    assert (carol.node, dave.node, eve.node) == ("dgx-h100-1", "dgx-h100-1", "dgx-h100-2")
    states = {}
    for allocation in (carol, dave, eve):
        code, pod = api.create("pods", NS, notebook(allocation, "h100", bind=bind))
        assert code == 201, pod
        states[allocation.user] = api.schedule(NS, pod["metadata"]["name"])
    placed = {u: api.objects["pods"][NS, f"jupyter-{u}"]["spec"].get("nodeName") for u in states}
    if bind:
        assert states == dict.fromkeys(states, "Running")
        assert placed == {"carol": "dgx-h100-1", "dave": "dgx-h100-1", "eve": "dgx-h100-2"}
        return
    # kube-scheduler spreads dave onto the emptier node, and eve, who fits by the ledger, waits
    assert placed["dave"] == "dgx-h100-2" != dave.node
    assert states["eve"] == "Unschedulable"
    (condition,) = api.objects["pods"][NS, "jupyter-eve"]["status"]["conditions"]
    assert condition["message"] == (
        "0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
        "2 Insufficient nvidia.com/gpu."
    )


def test_a_bound_pod_waits_with_the_schedulers_words_when_its_node_is_full() -> None:
    pool, api = ledger(), cluster()
    eve = pool.allocate(Request("eve", "vision", "h100", 8, "notebook", "e"), "e1")
    # something the ledger did not count holds 4 GPUs of eve's node
    squatter = notebook(replace(eve, user="squatter", devices=eve.devices[:4]), "h100")
    squatter["spec"]["nodeName"] = eve.node
    api.create("pods", NS, squatter)
    assert api.schedule(NS, "jupyter-squatter") == "Running"
    api.create("pods", NS, notebook(eve, "h100"))
    assert api.schedule(NS, "jupyter-eve") == "Unschedulable"
    pod = api.objects["pods"][NS, "jupyter-eve"]
    assert pod["status"]["conditions"][0]["message"] == (
        "0/3 nodes are available: 1 Insufficient nvidia.com/gpu, "
        "2 node(s) didn't match Pod's node affinity/selector."
    )
    assert ("FailedScheduling", "jupyter-eve") in [
        (e["reason"], e["involvedObject"]["name"]) for e in api.events
    ]


def test_the_stand_in_enforces_gpu_taints_and_mig_resources() -> None:
    api = cluster()
    pool = ledger()
    mig = pool.allocate(Request("bob", "vision", "mig-3g.40gb", 1, "notebook", "b"), "b1")
    body = notebook(mig, "mig-3g.40gb", bind=False)
    untolerated = copy.deepcopy(body)
    untolerated["metadata"]["name"] = "jupyter-untolerated"
    del untolerated["spec"]["tolerations"]
    api.create("pods", NS, untolerated)
    assert api.schedule(NS, "jupyter-untolerated") == "Unschedulable"
    message = api.objects["pods"][NS, "jupyter-untolerated"]["status"]["conditions"][0]["message"]
    assert message == (
        "0/3 nodes are available: 3 node(s) had untolerated taint {nvidia.com/gpu: present}."
    )
    api.create("pods", NS, body)
    assert api.schedule(NS, "jupyter-bob") == "Running"
    assert api.objects["pods"][NS, "jupyter-bob"]["spec"]["nodeName"] == "dgx-a100-1"


def test_job_pods_land_on_the_ledgers_nodes_spread_one_per_node() -> None:
    pool = ledger()
    job = a_job("h100", gpus=2, nodes=2)
    allocations = job_allocations(pool, "h100", 2, ["dgx-h100-1", "dgx-h100-2"])
    body = build(job, allocations)
    for spread in (True, False):
        api = cluster()
        # a notebook the ledger counted holds half of dgx-h100-2
        busy = pool.allocate(Request("carol", "vision", "h100", 4, "notebook", "c"), "c1")
        held = notebook(replace(busy, node="dgx-h100-2"), "h100")
        api.create("pods", NS, held)
        assert api.schedule(NS, "jupyter-carol") == "Running"
        pool.release(busy.id)
        obj = copy.deepcopy(body)
        if not spread:
            del obj["spec"]["template"]["spec"]["topologySpreadConstraints"]
        pods = run_job(api, obj)
        nodes = sorted(p["spec"]["nodeName"] for p in pods.values())
        if spread:  # one pod on each of the ledger's nodes
            assert nodes == ["dgx-h100-1", "dgx-h100-2"]
            assert all(p["status"]["phase"] == "Running" for p in pods.values())
        else:  # the roomier node takes both: not what the ledger counted
            assert nodes == ["dgx-h100-1", "dgx-h100-1"]


def test_a_job_whose_nodes_share_a_machine_lands_there() -> None:
    pool, api = ledger(), cluster()
    job = a_job("h100", gpus=4, nodes=2)
    pods = run_job(api, build(job, job_allocations(pool, "h100", 4, ["dgx-h100-2"] * 2)))
    assert [p["spec"]["nodeName"] for p in pods.values()] == ["dgx-h100-2"] * 2
    assert all(p["status"]["phase"] == "Running" for p in pods.values())


# -- item 3: ReadWriteOnce claims and the shared volume ------------------------------------------
def cluster_with_alices_notebook(*claims: tuple[str, tuple[str, ...]]) -> StandIn:
    """The cluster, alice's notebook running on dgx-a100-1 with her ReadWriteOnce home."""
    api = cluster()
    api.add_claim(NS, "claim-alice", ("ReadWriteOnce",))
    for name, modes in claims:
        api.add_claim(NS, name, modes)
    pod = notebook_pod()
    pod["status"]["phase"] = "Running"
    api.objects["pods"][NS, "jupyter-alice"] = pod
    return api


def volumes(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in obj["spec"]["template"]["spec"]["volumes"]}


def test_a_job_on_another_node_leaves_the_home_claim_out() -> None:
    pool, api = ledger(), cluster_with_alices_notebook()
    job = a_job("h100", gpus=2, nodes=2)
    obj = build(job, job_allocations(pool, "h100", 2, ["dgx-h100-1", "dgx-h100-2"]))
    assert "home" not in volumes(obj)
    pods = run_job(api, obj)
    assert [p["status"]["phase"] for p in pods.values()] == ["Running", "Running"]


def test_a_readwriteonce_claim_on_a_second_node_is_a_multi_attach_error() -> None:
    """What the default avoids: the home claim kept (wrongly declared ReadWriteMany)."""
    pool, api = ledger(), cluster_with_alices_notebook()
    job = a_job("h100", gpus=2, nodes=1)
    obj = build(job, job_allocations(pool, "h100", 2, ["dgx-h100-1"]), keep_claims=["claim-alice"])
    assert volumes(obj)["home"]["persistentVolumeClaim"] == {"claimName": "claim-alice"}
    (pod,) = run_job(api, obj).values()
    assert pod["status"]["phase"] == "Pending" and pod["spec"]["nodeName"] == "dgx-h100-1"
    (status,) = pod["status"]["containerStatuses"]
    assert status["state"] == {"waiting": {"reason": "ContainerCreating"}}
    (event,) = [e for e in api.events if e["reason"] == "FailedAttachVolume"]
    volume = api.claims[NS, "claim-alice"]["volumeName"]
    assert event["message"] == (
        f'Multi-Attach error for volume "{volume}" Volume is already used by pod(s) jupyter-alice'
    )
    seen = observe_objects(
        api.job(job_name(job), NS), list(api.pods_of(job_name(job), NS).values()), 1
    )
    assert (seen.state, seen.reason) == (
        "starting",
        "0 of 1 node(s) running; node 0: ContainerCreating",
    )


def test_a_job_on_the_notebooks_node_keeps_the_home_claim() -> None:
    pool, api = ledger(), cluster_with_alices_notebook()
    job = a_job("mig-3g.40gb", gpus=1, nodes=1)
    obj = build(job, job_allocations(pool, "mig-3g.40gb", 1, ["dgx-a100-1"]))
    assert volumes(obj)["home"]["persistentVolumeClaim"] == {"claimName": "claim-alice"}
    mounts = obj["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "home", "mountPath": "/home/jovyan"} in mounts
    (pod,) = run_job(api, obj).values()
    assert (pod["spec"]["nodeName"], pod["status"]["phase"]) == ("dgx-a100-1", "Running")


def test_the_shared_readwritemany_volume_is_mounted_on_every_node() -> None:
    pool = ledger()
    api = cluster_with_alices_notebook(("gpupool-shared", ("ReadWriteMany",)))
    job = a_job("h100", gpus=2, nodes=2)
    obj = build(
        job,
        job_allocations(pool, "h100", 2, ["dgx-h100-1", "dgx-h100-2"]),
        shared_claim="gpupool-shared",
        shared_mount_path="/mnt/shared/",
    )
    assert volumes(obj)["gpupool-shared"] == {
        "name": "gpupool-shared",
        "persistentVolumeClaim": {"claimName": "gpupool-shared"},
    }
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    assert {"name": "gpupool-shared", "mountPath": "/mnt/shared"} in c["volumeMounts"]
    assert {"name": "GPUPOOL_SHARED_DIR", "value": "/mnt/shared"} in c["env"]
    pods = run_job(api, obj)
    assert sorted(p["spec"]["nodeName"] for p in pods.values()) == ["dgx-h100-1", "dgx-h100-2"]
    assert [p["status"]["phase"] for p in pods.values()] == ["Running", "Running"]
    # the same claim were it ReadWriteOnce: the second node cannot attach it
    api = cluster_with_alices_notebook(("gpupool-shared", ("ReadWriteOnce",)))
    phases = sorted(p["status"]["phase"] for p in run_job(api, obj).values())
    assert phases == ["Pending", "Running"]
    assert any(e["message"].startswith("Multi-Attach error") for e in api.events)


def test_the_backend_passes_the_volume_and_binding_settings() -> None:
    from gpupool.declarations import ConfigError
    from gpupool.kube.jobs import KubeJobBackend

    b = KubeJobBackend(shared_volume_claim="gpupool-shared", keep_claims=["data"])
    assert (b.shared_volume_mount_path, b.bind_to_node) == ("/home/jovyan/shared", True)
    with pytest.raises(ConfigError, match="shared_volume_mount_path"):
        KubeJobBackend(shared_volume_mount_path="shared")


# -- item 4: exit codes per rank -------------------------------------------------------------------
def test_rank_exit_codes_expand_each_nodes_code_to_its_ranks() -> None:
    assert rank_exit_codes(((0, 0), (1, 3)), 2) == ((0, 0), (1, 0), (2, 3), (3, 3))
    assert rank_exit_codes(((1, 1),), 1) == ((1, 1),)
    api = StandIn()
    job = a_job("h100", gpus=4, nodes=2)
    body = build(job, job_allocations(ledger(), "h100", 4, ["dgx-h100-1", "dgx-h100-2"]))
    api.create("jobs", NS, body)
    name = job_name(job)
    api.create_pods(name, NS)
    api.run_pods(name, NS)
    api.exit_pod(name, NS, 1, 1)
    api.fail(name, NS, "PodFailurePolicy", "Container job for pod … failed with exit code 1")
    seen = observe_objects(api.job(name, NS), list(api.objects["pods"].values()), 2, 4)
    assert seen.state == "failed"
    assert seen.exit_codes == ((4, 1), (5, 1), (6, 1), (7, 1))
    assert seen.reason == "node 1 (ranks 4-7) exited 1 (see the node's log)"


# -- the job manager grants a job's nodes on different machines -----------------------------------
def test_the_job_manager_puts_a_jobs_nodes_on_different_machines(tmp_path: Path) -> None:
    """m1 has 2 of its 8 GPUs free: a 3-node job of 1 GPU per node used to get m1, m1, m2, a split
    one pod template cannot bind exactly; now each node is its own machine, and every pod runs
    where the ledger counted it. A 4-node job on 3 machines is refused at once."""
    nodes = (h100_node("m1"), h100_node("m2"), h100_node("m3"))
    with served() as server:
        for node in nodes:
            node = copy.deepcopy(node)
            node["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
            server.api.add_node(node)
        c = Config()
        c.JobManager.backend_class = "gpupool.kube.jobs.KubeJobBackend"
        c.KubeJobBackend.namespace = NS
        c.KubeJobBackend.image = IMAGE
        c.KubeJobBackend.api_client_factory = lambda: ApiClient(Configuration(host=server.url))
        pool = Pool(ledger(*nodes), Store(f"sqlite:///{tmp_path / 'pool.sqlite'}"))
        m = JobManager(pool, config=c)
        assert m.backend.distinct_nodes
        pool.allocate("carol", ["vision"], "h100", 6)  # the policy packs: m1
        spec = {"script": "print(1)\n", "offer": "h100", "gpus": 1, "nodes": 3}

        async def scenario() -> Job:
            job = m.submit("alice", ["vision"], spec)
            await m.schedule_pass()
            return m.jobs[job.id]

        job = asyncio.run(scenario())
        held = [pool.ledger.allocations[a].node for a in job.allocations]
        assert sorted(held) == ["m1", "m2", "m3"], job.reason
        pods = run_job_pods(server.api, f"gpupool-{job.id}")
        assert sorted(p["spec"]["nodeName"] for p in pods.values()) == ["m1", "m2", "m3"]
        assert all(p["status"]["phase"] == "Running" for p in pods.values())
        with pytest.raises(NoCapacity, match="its 4 nodes must be different machines"):
            m.submit("alice", ["vision"], {**spec, "nodes": 4})


def test_a_job_for_a_node_pool_at_zero_queues_with_the_reason(tmp_path: Path) -> None:
    """No A100-80GB whole GPU exists now; the declared node pool could add one: the job queues,
    saying so, where it used to be refused as impossible."""
    c = Config()
    c.JobManager.backend_class = "gpupool.kube.jobs.KubeJobBackend"
    c.KubeJobBackend.namespace = NS
    nodes = (h100_node("m1"),)
    offers = {**OFFERS, "a100": Offer("a100", "gpu", model="A100-80GB", max_count=8)}
    teams = {"vision": Team("vision", 64000)}
    spec = {"script": "print(1)\n", "offer": "a100", "gpus": 8}

    def manager(declared: dict[str, Any]) -> JobManager:
        inventory = inventory_from_nodes(list(nodes))
        if declared:
            inventory = with_node_pools(inventory, declared, "kubernetes")
        store = Store(f"sqlite:///{tmp_path / f'{len(declared)}.sqlite'}")
        return JobManager(Pool(Ledger(inventory, offers, teams), store), config=c)

    with pytest.raises(NoCapacity, match="this pool holds none of a100 on one node"):
        manager({}).submit("alice", ["vision"], spec)
    job = manager({"a100": {"node": "8x A100-80GB", "max_nodes": 2}}).submit(
        "alice", ["vision"], spec
    )
    assert (job.state, job.reason) == (
        "queued",
        "waiting: node pool a100 has to add a node first (it is autoscaled)",
    )
    with pytest.raises(ConfigError, match=r"^GPUPool\.node_pools: is for a Kubernetes inventory"):
        with_node_pools(inventory_from_nodes(list(nodes)), {"a": {}}, "nvml")
