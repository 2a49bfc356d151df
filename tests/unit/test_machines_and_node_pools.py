"""A multi-node job's nodes on different machines, and autoscaled node pools at zero.

- A job whose nodes must be different machines (the Kubernetes backend binds one pod template to
  its nodes, exact only when each node is a machine) is granted node by node away from the
  machines it already holds, for whole GPUs, dynamic and fixed MIG alike; asking for more nodes
  than the pool has machines that can hold one is *never*, not a wait that never ends.
- A declared node pool (``c.GPUPool.node_pools``) turns "this pool holds none" into a *wait*
  with the reason, only for what one of its nodes could hold.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from gpupool.core import Ledger, Offer, Request, Team
from gpupool.core.errors import NoCapacity
from gpupool.core.inventory import Inventory, Node
from gpupool.core.queue import Queued, schedule, try_gang
from gpupool.declarations import ConfigError
from gpupool.discovery.node_pools import parse_node_pools
from tests.factories import gpu

GPU = Offer("gpu", "gpu", max_count=8)
A100 = Offer("a100", "gpu", model="A100-80GB", max_count=8)
MIG = Offer("mig-1g.10gb", "mig", profile="1g.10gb")
OFFERS = {o.name: o for o in (GPU, A100, MIG)}
TEAM = Team("vision", 64000, 0, None, None)


def machines(*nodes: tuple[str, int, str]) -> Inventory:
    """Nodes of ``count`` GPUs each, in MIG ``mode`` (``off``, ``dynamic`` or ``fixed``)."""
    fixed = tuple(("1g.10gb", s) for s in range(7))
    return Inventory(
        tuple(
            Node(
                name,
                tuple(
                    gpu(name, i, mode=mode, instances=fixed if mode == "fixed" else ())
                    for i in range(count)
                ),
            )
            for name, count, mode in nodes
        ),
        source="test",
    )


def grant_job(ledger: Ledger, offer: str, count: int, nodes: int, distinct: bool) -> list[str]:
    """What the job manager does: one allocation per job node, away from its other machines."""
    held: list[str] = []
    for i in range(nodes):
        avoid = frozenset(held) if distinct else frozenset()
        request = Request("ada", "vision", offer, count, "job", "j1", avoid)
        a = ledger.allocate(request, f"j1-{i}")
        assert a.node is not None
        held.append(a.node)
    ledger.check_invariants()
    return held


@pytest.mark.parametrize("mode", ["off", "dynamic", "fixed"])
def test_a_jobs_nodes_go_to_different_machines(mode: str) -> None:
    ledger = Ledger(
        machines(("m1", 4, mode), ("m2", 4, mode), ("m3", 4, mode)), OFFERS, {"vision": TEAM}
    )
    offer = "gpu" if mode == "off" else "mig-1g.10gb"
    # packing puts all three on m1 when nothing asks otherwise
    assert len(set(grant_job(ledger.clone(), offer, 1, 3, distinct=False))) < 3
    assert sorted(grant_job(ledger, offer, 1, 3, distinct=True)) == ["m1", "m2", "m3"]


def test_the_uneven_split_that_binding_could_not_make_exact_is_not_granted() -> None:
    """m1 has 2 free GPUs, m2 and m3 four: three 1-GPU nodes used to be m1, m1, m2."""
    ledger = Ledger(
        machines(("m1", 4, "off"), ("m2", 4, "off"), ("m3", 4, "off")), OFFERS, {"vision": TEAM}
    )
    ledger.allocate(Request("bob", "vision", "gpu", 2), "nb")
    assert sorted(grant_job(ledger, "gpu", 1, 3, distinct=True)) == ["m1", "m2", "m3"]


def test_no_other_machine_is_no_capacity_naming_the_machines() -> None:
    ledger = Ledger(machines(("m1", 4, "off")), OFFERS, {"vision": TEAM})
    ledger.allocate(Request("ada", "vision", "gpu", 1, "job", "j1"), "j1-0")
    with pytest.raises(NoCapacity, match="on a machine other than m1"):
        ledger.allocate(Request("ada", "vision", "gpu", 1, "job", "j1", frozenset({"m1"})), "x")


def test_more_nodes_than_machines_is_never_when_they_must_differ() -> None:
    ledger = Ledger(machines(("m1", 8, "off"), ("m2", 2, "off")), OFFERS, {"vision": TEAM})
    a = ledger.admit(TEAM, "ada", GPU, 4, nodes=2, distinct=True)
    assert (a.verdict, a.cause) == ("never", "capacity")
    assert (
        a.reason
        == "its 2 nodes must be different machines, and this pool has 1 that can hold 4 of gpu"
    )
    assert ledger.admit(TEAM, "ada", GPU, 2, nodes=2, distinct=True).verdict == "now"
    assert ledger.admit(TEAM, "ada", GPU, 4, nodes=2, distinct=False).verdict == "now"


A100_POOL = {"a100": {"node": "8x A100-80GB", "max_nodes": 3}}


def test_a_request_only_a_node_pool_at_zero_could_hold_waits() -> None:
    at_zero = machines(("h1", 2, "off"))
    refused = Ledger(at_zero, OFFERS, {"vision": TEAM}).admit(TEAM, "ada", A100, 4)
    assert refused.verdict == "never"

    scaling = Inventory(at_zero.nodes, "test", node_pools=parse_node_pools(A100_POOL))
    ledger = Ledger(scaling, OFFERS, {"vision": TEAM})
    a = ledger.admit(TEAM, "ada", A100, 4)
    assert (a.verdict, a.cause) == ("wait", "scale-up")
    assert a.reason == "node pool a100 has to add a node first (it is autoscaled)"
    # what its node could not hold stays impossible
    assert (
        Ledger(scaling, {"gpu16": Offer("gpu16", "gpu", max_count=16)}, {"vision": TEAM})
        .admit(TEAM, "ada", Offer("gpu16", "gpu", max_count=16), 16)
        .verdict
        == "never"
    )
    # and nothing is ever placed on the template
    with pytest.raises(NoCapacity):
        ledger.allocate(Request("ada", "vision", "a100", 4), "x")


def test_a_share_never_waits_for_a_node_pool_whose_nodes_give_whole_gpus_only() -> None:
    """A node pool's node is a Kubernetes node: its GPUs are handed out whole by the device
    plugin (shares need a shared node), so a share offer is never, not a scale-up."""
    l40s = {"l40s": {"node": "4x L40S-48GB", "max_nodes": 2}}
    share = Offer("share-q", "share", share_milli=250)
    scaling = Inventory((), "test", node_pools=parse_node_pools(l40s))
    (template,) = (p.node for p in scaling.node_pools)
    assert {g.share_resource for g in template.gpus} == {""}
    ledger = Ledger(scaling, {"share-q": share}, {"vision": TEAM})
    assert ledger.admit(TEAM, "ada", share, 1).verdict == "never"


def test_a_multi_node_job_waits_for_machines_the_node_pool_can_add() -> None:
    scaling = Inventory((), "test", node_pools=parse_node_pools(A100_POOL))
    ledger = Ledger(scaling, OFFERS, {"vision": TEAM})
    assert ledger.admit(TEAM, "ada", A100, 8, nodes=3, distinct=True).verdict == "wait"
    assert ledger.admit(TEAM, "ada", A100, 8, nodes=4, distinct=True).verdict == "never"


KEY = "GPUPool.node_pools"
A100_NODE = "8x A100-80GB"


@pytest.mark.parametrize(
    ("value", "key", "says"),
    [
        ({"A100": {"node": A100_NODE, "max_nodes": 1}}, f"{KEY}.A100", "lowercase"),
        ({"a": {"node": A100_NODE}}, f"{KEY}.a", "must have the keys"),
        ({"a": {"node": A100_NODE, "max_nodes": 0}}, f"{KEY}.a.max_nodes", "1 or more"),
        ({"a": {"node": f"n1: {A100_NODE}", "max_nodes": 2}}, f"{KEY}.a.node", "without its name"),
        ({"a": {"node": "8x banana", "max_nodes": 2}}, f"{KEY}.a.node", "banana"),
        (["a100"], KEY, "dict of node pools"),
    ],
)
def test_a_bad_node_pool_names_its_key(value: object, key: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_node_pools(value)
    assert str(e.value).startswith(key) and says in str(e.value)


def test_the_queues_plan_grants_as_the_job_manager_does() -> None:
    """The plan's what-if uses the same per-node request as the grant, so it never plans a start
    the grant refuses: a 3-node job on two machines waits, on three it starts spread out."""
    two = Ledger(machines(("m1", 4, "off"), ("m2", 4, "off")), OFFERS, {"vision": TEAM})
    job = Queued("j1", "ada", "vision", "gpu", 1, 3, 0, 0.0, 3600.0, distinct=True)
    plan = schedule(two, [job], [], 0.0)
    assert plan.start == [] and "on a machine other than m1, m2" in plan.waiting["j1"]
    assert schedule(two, [replace(job, distinct=False)], [], 0.0).start == ["j1"]
    three = Ledger(
        machines(("m1", 4, "off"), ("m2", 4, "off"), ("m3", 4, "off")), OFFERS, {"vision": TEAM}
    )
    assert schedule(three, [job], [], 0.0).start == ["j1"]
    assert try_gang(three, job) == ""
    assert sorted(a.node or "" for a in three.allocations.values()) == ["m1", "m2", "m3"]
