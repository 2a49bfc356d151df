"""A node watch event rebuilds only the changed node and restores only its allocations
(:func:`gpupool.kube.reconcile.plan_swap` with the node's name, :meth:`Ledger.replace_nodes`),
and that can never drift from the full rebuild (every node, every allocation restored,
:meth:`Ledger.rebuilt`).

A Hypothesis state machine keeps two ledgers over the same few Kubernetes nodes: one follows
each node event with the full rebuild (what the reconciler did for every event before), the
other with the one-node rebuild. Between events both get the same requests, releases (a release
on a draining node rebuilds it, as ``KubeReconciler._released`` does) and outside use. After
every step both are the same ledger: inventory (nodes and notes), allocations, slot state,
blocked slots, outside use, usage counters, the draining nodes; a request gets the same devices
from both; and the one-node ledger is what a full rebuild from the final nodes gives.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from gpupool.core import Inventory, Ledger, Offer, PoolError, Request, Team
from gpupool.kube.nodes import NodePart, node_part
from gpupool.kube.reconcile import Swap, effective_parts, plan_swap

NAMES = ("n0", "n1", "n2", "n3")
OFFERS = {
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=4),
    "mig-1g": Offer("mig-1g", "mig", model="A100-80GB", profile="1g.10gb", max_count=2),
    "mig-3g": Offer("mig-3g", "mig", model="A100-80GB", profile="3g.40gb"),
    "quarter": Offer("quarter", "share", share_milli=250),
}
TEAMS = {"all": Team("all", 10**6, offers=frozenset(OFFERS))}
FORMS = ("h100", "a100-mig", "shared", "cordoned", "not-ready", "gone")


def node_object(name: str, form: str, size: int) -> dict[str, Any] | None:
    """A GPU node as the API server sends it: ``size`` (1-4) scales its GPUs."""
    if form == "gone":
        return None
    labels = {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
        "nvidia.com/gpu.memory": "81559",
        "nvidia.com/gpu.count": str(size),
        "nvidia.com/mig.strategy": "mixed",
    }
    resources = {"nvidia.com/gpu": str(size)}
    if form == "a100-mig":  # one whole GPU and `size` GPUs of 2×1g.10gb, 1×2g.20gb, 1×3g.40gb
        labels["nvidia.com/gpu.product"] = "NVIDIA-A100-SXM4-80GB"
        labels["nvidia.com/gpu.memory"] = "81920"
        labels["nvidia.com/gpu.count"] = str(size + 1)
        resources = {
            "nvidia.com/gpu": "1",
            "nvidia.com/mig-1g.10gb": str(2 * size),
            "nvidia.com/mig-2g.20gb": str(size),
            "nvidia.com/mig-3g.40gb": str(size),
        }
    if form == "shared":  # time-slicing, 4 replicas per GPU
        labels["nvidia.com/gpu.replicas"] = "4"
        labels["nvidia.com/gpu.sharing-strategy"] = "time-slicing"
        resources = {"nvidia.com/gpu": str(4 * size)}
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady"}
    if form == "not-ready":
        ready = {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}
    return {
        "metadata": {"name": name, "labels": labels},
        "spec": {"unschedulable": form == "cordoned"},
        "status": {"allocatable": resources, "conditions": [ready]},
    }


def state(ledger: Ledger) -> dict[str, Any]:
    """Everything a ledger decides from, as plain values."""
    occ = ledger.occ
    return {
        "nodes": ledger.inventory.nodes,
        "notes": ledger.inventory.notes,
        "allocations": dict(ledger.allocations),
        "gpus": occ.gpus,
        "mask": occ.mask,
        "whole": occ.whole,
        "shares": occ.share_used,
        "closed": occ.closed,
        "blocked": dict(ledger.blocked),
        "outside": dict(ledger.outside),
        "team_used": +ledger.team_used,
        "user_used": +ledger.user_used,
    }


class NodeEvents(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, dict[str, Any]] = {}
        self.parts: dict[str, NodePart] = {}
        self.full = self.incr = _empty()
        self.draining: dict[str, dict[str, str]] = {"full": {}, "incr": {}}
        self.ids = 0

    @initialize(forms=st.lists(st.sampled_from(FORMS[:3]), min_size=4, max_size=4))
    def start(self, forms: list[str]) -> None:
        for name, form in zip(NAMES, forms, strict=True):
            obj = node_object(name, form, 2)
            assert obj is not None
            self.objects[name] = obj
        self.parts = {n: node_part(o) for n, o in self.objects.items()}
        inventory = effective_parts(self.parts, _empty(), None)[0]
        self.full = Ledger(inventory, OFFERS, TEAMS)
        self.incr = Ledger(inventory, OFFERS, TEAMS)

    def _swap(self, names: list[str] | None) -> None:
        """Both ledgers follow the nodes: ``full`` by the full rebuild, ``incr`` by ``names``."""
        every = {n: node_part(o) for n, o in self.objects.items()}
        full = plan_swap(self.full, every, None)
        incr = plan_swap(self.incr, self.parts, names)
        assert [a.id for a in full.lost] == [a.id for a in incr.lost]
        assert [a.id for a in full.changed] == [a.id for a in incr.changed]
        self.full = _apply(self.full, full, self.draining, "full")
        self.incr = _apply(self.incr, incr, self.draining, "incr")

    @rule(name=st.sampled_from(NAMES), form=st.sampled_from(FORMS), size=st.integers(1, 4))
    def node_event(self, name: str, form: str, size: int) -> None:
        obj = node_object(name, form, size)
        if obj is None:
            self.objects.pop(name, None)
            self.parts.pop(name, None)
        else:
            self.objects[name] = obj
            self.parts[name] = node_part(obj)
        self._swap([name])

    @rule(offer=st.sampled_from(sorted(OFFERS)), count=st.integers(1, 2))
    def allocate(self, offer: str, count: int) -> None:
        count = count if OFFERS[offer].counted else 1
        self.ids += 1
        request = Request(f"u{self.ids % 3}", "all", offer, count)
        results = []
        for ledger in (self.full, self.incr):
            try:
                results.append(ledger.allocate(request, alloc_id=f"a{self.ids}"))
            except PoolError as e:
                results.append(type(e).__name__)  # type: ignore[arg-type]
        assert results[0] == results[1]

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        if not self.full.allocations:
            return
        alloc_id = data.draw(st.sampled_from(sorted(self.full.allocations)))
        node = self.full.allocations[alloc_id].node
        self.full.release(alloc_id)
        self.incr.release(alloc_id)
        if node in self.draining["full"] or node in self.draining["incr"]:
            self._swap([node] if node else [])  # KubeReconciler._released

    @rule(data=st.data())
    def outside_use(self, data: st.DataObject) -> None:
        devices = sorted(
            {g.uuid for g in self.full.inventory.gpus}
            | {i.uuid for g in self.full.inventory.gpus for i in g.instances if i.uuid}
        )
        chosen = data.draw(st.lists(st.sampled_from(devices), max_size=4)) if devices else []
        reasons = {d: "used by pod other/p" for d in chosen}
        self.full.set_outside_use(reasons)
        self.incr.set_outside_use(reasons)

    @invariant()
    def the_same_ledger(self) -> None:
        self.full.check_invariants()
        self.incr.check_invariants()
        assert state(self.incr) == state(self.full)
        assert self.draining["incr"] == self.draining["full"]

    @invariant()
    def a_full_rebuild_of_the_final_nodes_changes_nothing(self) -> None:
        inventory, _ = effective_parts(self.parts, self.incr, None)
        now = (self.incr.inventory.nodes, self.incr.inventory.notes)
        if (inventory.nodes, inventory.notes) != now:
            # only where a swap was refused (an allocation that fits nowhere): both kept theirs
            assert plan_swap(self.incr, self.parts, None).lost


def _empty() -> Ledger:
    return Ledger(Inventory(()), OFFERS, TEAMS)


def _apply(ledger: Ledger, swap: Swap, draining: dict[str, dict[str, str]], key: str) -> Ledger:
    if swap.ledger is None:
        return ledger
    draining[key] = swap.draining
    return swap.ledger


NodeEvents.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestNodeEvents = NodeEvents.TestCase


def test_a_held_instance_in_outside_use_survives_a_rebuild() -> None:
    """A fixed MIG instance an allocation holds while another tenant's pod is counted on it
    (outside use) is not blocked while held, and a rebuild keeps it so: outside use is applied
    after the allocations are restored (before, the rebuild blocked it first, lost the
    allocation and refused the new inventory)."""
    obj = node_object("n0", "a100-mig", 1)
    assert obj is not None
    parts = {"n0": node_part(obj)}
    ledger = Ledger(effective_parts(parts, _empty(), None)[0], OFFERS, TEAMS)
    held = ledger.allocate(Request("ana", "all", "mig-3g", 1), alloc_id="a1")
    instance = held.devices[0].instance
    assert instance is not None
    ledger.set_outside_use({instance: "used by pod other/p"})
    assert not ledger.blocked
    grown = node_object("n0", "a100-mig", 2)
    assert grown is not None
    parts["n0"] = node_part(grown)
    for names in (None, ["n0"]):
        swap = plan_swap(ledger, parts, names)
        assert swap.lost == [] and swap.ledger is not None
        assert swap.ledger.allocations["a1"] == held and not swap.ledger.blocked
        swap.ledger.release("a1")  # then blocked, as the live ledger does
        assert [b.instance for b in swap.ledger.blocked.values()] == [instance]
