"""Nodes whose GPUs the NVIDIA device plugin shares (time-slicing or MPS) or HAMi shares out, as
share capacity of the pool (issue 16, section 2).

The node objects follow NVIDIA's GPU operator documentation ("Time-Slicing GPUs in Kubernetes",
"Multi-Process Service in Kubernetes"): with ``renameByDefault: false`` (the default) the node's
``nvidia.com/gpu`` counts ``gpu.count × replicas`` replicas and the product label gets
``-SHARED``; with ``renameByDefault: true`` ``nvidia.com/gpu`` is 0 and the replicas are
``nvidia.com/gpu.shared``, the product label unchanged. Both carry ``nvidia.com/gpu.replicas`` and
``nvidia.com/gpu.sharing-strategy``. A HAMi node carries HAMi's ``hami.io/node-nvidia-register``
annotation and ``deviceSplitCount`` (10) virtual ``nvidia.com/gpu`` per GPU.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from gpupool.core import Ledger, NoCapacity, Offer, Request, Team
from gpupool.core.ledger import Device
from gpupool.kube.nodes import hami_devices, inventory_from_nodes
from tests.conftest import T4_MIB, h100_node, hami_node, shared_node

OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "gpu": Offer("gpu", "gpu", max_count=8),
    "t4-quarter": Offer("t4-quarter", "share", share_milli=250),
    "share-3gb": Offer("share-3gb", "share", share_mib=3072),
    "share-4gb": Offer("share-4gb", "share", share_mib=4096),
    "share-8gb": Offer("share-8gb", "share", share_mib=8192),
}


def ledger(*nodes: dict[str, Any], limit: int = 64000) -> Ledger:
    return Ledger(inventory_from_nodes(list(nodes)), OFFERS, {"vision": Team("vision", limit)})


# -- discovery ------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["time-slicing", "mps"])
@pytest.mark.parametrize(
    ("renamed", "resource"), [(False, "nvidia.com/gpu"), (True, "nvidia.com/gpu.shared")]
)
def test_a_shared_node_gives_gpus_that_take_shares_of_one_replica(
    strategy: str, renamed: bool, resource: str
) -> None:
    inv = inventory_from_nodes([shared_node(strategy=strategy, renamed=renamed), h100_node()])
    shared = [g for g in inv.gpus if g.uuid.startswith("k8s-t4-shared-")]
    assert [g.uuid for g in shared] == [f"k8s-t4-shared-gpu{i}" for i in range(4)]
    assert {
        (g.model, g.memory_mib, g.mig_mode, g.share_resource, g.share_replicas) for g in shared
    } == {("T4-16GB", T4_MIB, "off", resource, 4)}
    # the product label as GFD wrote it, for the offer's product affinity
    assert {g.product_name for g in shared} == {"Tesla-T4" if renamed else "Tesla-T4-SHARED"}
    # whole GPUs of an unshared node are handed out only whole
    assert {g.share_resource for g in inv.gpus if g.uuid.startswith("k8s-dgx")} == {""}
    (note,) = [n for n in inv.notes if "t4-shared" in n]
    assert f"{strategy}) into 4 replicas of 3840 MiB ({resource})" in note


@pytest.mark.parametrize(
    "labels",
    [
        {"nvidia.com/gpu.sharing-strategy": "none"},  # only the replicas label
        {"nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.sharing-strategy": "mps"},  # strategy
        {"nvidia.com/gpu.replicas": "1", "nvidia.com/gpu.sharing-strategy": "none"},  # -SHARED
    ],
)
def test_each_sign_of_sharing_alone_is_enough_and_the_replicas_come_from_the_count(
    labels: dict[str, str],
) -> None:
    obj = shared_node()
    obj["metadata"]["labels"] |= labels
    inv = inventory_from_nodes([obj])
    assert len(inv.gpus) == 4 and {g.share_replicas for g in inv.gpus} == {4}


def test_one_replica_unshared_stays_whole() -> None:
    obj = h100_node()
    obj["metadata"]["labels"] |= {
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
    }
    inv = inventory_from_nodes([obj])
    assert len(inv.gpus) == 8 and {g.share_resource for g in inv.gpus} == {""}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (
            lambda n: n["status"]["allocatable"].update({"nvidia.com/gpu": "14"}),
            "are not whole GPUs times a replica count",
        ),
        (
            lambda n: n["metadata"]["labels"].pop("nvidia.com/gpu.product"),
            "no nvidia.com/gpu.product label",
        ),
        (
            lambda n: n["status"]["allocatable"].update({"nvidia.com/mig-1g.10gb": "8"}),
            "MIG instances are shared too",
        ),
    ],
)
def test_a_shared_node_that_makes_no_sense_is_left_out_saying_why(change: Any, why: str) -> None:
    obj = shared_node()
    change(obj)
    inv = inventory_from_nodes([obj, h100_node()])
    assert [n.name for n in inv.nodes] == ["dgx-h100-1"]
    (note,) = [n for n in inv.notes if "t4-shared" in n]
    assert why in note and note.endswith("left out")


def test_a_hami_node_takes_shares_by_memory() -> None:
    inv = inventory_from_nodes([hami_node()])
    assert [g.uuid for g in inv.gpus] == [  # HAMi's own (issue 26: pods name them to HAMi)
        f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(2)
    ]
    assert {
        (g.model, g.memory_mib, g.share_resource, g.share_replicas, g.share_slots) for g in inv.gpus
    } == {("L40S-48GB", 46068, "hami", 0, 10)}
    assert any("shared by HAMi (20× nvidia.com/gpu virtual)" in n for n in inv.notes)
    # no GFD product label: the model comes from HAMi's annotation, and the note says what an
    # offer's product affinity then cannot do
    assert {g.product_name for g in inv.gpus} == {""}
    assert any("share offers with a model cannot be scheduled there" in n for n in inv.notes)
    labelled = hami_node()
    labelled["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA-L40S"
    inv = inventory_from_nodes([labelled])
    assert {(g.model, g.product_name) for g in inv.gpus} == {("L40S-48GB", "NVIDIA-L40S")}
    assert not any("cannot be scheduled" in n for n in inv.notes)


def test_hamis_older_annotation_format_is_read() -> None:
    old = (
        "GPU-a,10,46068,100,NVIDIA-NVIDIA L40S,0,true:GPU-b,10,46068,100,NVIDIA-NVIDIA L40S,0,true:"
    )
    assert hami_devices(old) == [(46068, "NVIDIA-NVIDIA L40S", 10)] * 2
    assert hami_devices("garbage") == []


# -- the ledger on shared GPUs --------------------------------------------------------------------
def test_a_share_on_a_shared_gpu_costs_one_replica() -> None:
    led = ledger(shared_node(gpus=1))
    # 3 GB of a 15 GB T4 would be 200 milli by memory; there it takes one replica of four
    a = led.allocate(Request("ada", "vision", "share-3gb"), "a1")
    assert a.cost_milli == 250 and [d.share_milli for d in a.devices] == [250]
    assert a.devices[0].gpu == "k8s-t4-shared-gpu0" and a.node == "t4-shared"
    led.allocate(Request("bob", "vision", "t4-quarter"), "a2")
    led.allocate(Request("cy", "vision", "share-3gb"), "a3")
    led.allocate(Request("di", "vision", "share-3gb"), "a4")
    led.check_invariants()
    # four replicas, four shares: the fifth finds none
    with pytest.raises(NoCapacity):
        led.allocate(Request("ed", "vision", "share-3gb"), "a5")
    led.release("a2")
    assert led.allocate(Request("ed", "vision", "share-3gb"), "a5").cost_milli == 250


def test_replicas_that_do_not_divide_a_thousand_fit_exactly() -> None:
    led = ledger(shared_node(gpus=1, replicas=3))
    costs = [led.allocate(Request(u, "vision", "share-3gb"), u).cost_milli for u in "abc"]
    assert costs == [333] * 3
    assert led.placeable(OFFERS["share-3gb"]) == 0
    led.check_invariants()


def test_a_share_larger_than_a_replica_is_refused_with_the_reason() -> None:
    led = ledger(shared_node())  # replicas of 3840 MiB
    assert led.placeable(OFFERS["share-3gb"]) == 16
    assert led.placeable(OFFERS["share-4gb"]) == 0 and led.capacity(OFFERS["share-4gb"]) == 0
    with pytest.raises(NoCapacity) as e:
        led.allocate(Request("ada", "vision", "share-4gb"), "a1")
    assert (
        "A 4 GB share of a GPU is larger than one replica of the shared T4-16GB GPUs (3.75 GB "
        "each), and a share there gets one replica, never more." in e.value.message
    )
    assert led.allocations == {}


def test_whole_gpu_requests_never_land_on_shared_gpus() -> None:
    led = ledger(shared_node(), hami_node())
    assert led.placeable(OFFERS["gpu"]) == 0 and led.capacity(OFFERS["gpu"]) == 0
    with pytest.raises(NoCapacity):
        led.allocate(Request("ada", "vision", "gpu"), "a1")
    # and with an unshared node beside them, whole GPUs go there, shares never do
    led = ledger(shared_node(), h100_node())
    whole = led.allocate(Request("ada", "vision", "gpu", 8), "a1")
    assert whole.node == "dgx-h100-1"
    share = led.allocate(Request("bob", "vision", "t4-quarter"), "a2")
    assert share.node == "t4-shared"
    led.release("a1")  # eight free H100s, and still no share lands on them
    for i in range(15):
        assert led.allocate(Request("cy", "vision", "t4-quarter"), f"s{i}").node == "t4-shared"
    with pytest.raises(NoCapacity):
        led.allocate(Request("cy", "vision", "t4-quarter"), "s15")
    led.check_invariants()


def test_a_share_on_a_hami_gpu_costs_its_memory() -> None:
    led = ledger(hami_node(gpus=1))
    a = led.allocate(Request("ada", "vision", "share-8gb"), "a1")
    assert a.cost_milli == -(-8192 * 1000 // 46068)  # 178: its memory fraction, rounded up
    led.check_invariants()


def test_a_hami_gpu_holds_no_more_shares_than_its_split_count() -> None:
    """HAMi puts at most ``deviceSplitCount`` pods on a GPU, however small: a share there takes
    at least one split's worth of it (so a fifth 1 GB share of a GPU split in 4 is refused, not
    sent to a pod that would stay Pending), and is charged that (what it takes from others)."""
    led = Ledger(
        inventory_from_nodes([hami_node(gpus=1, split=4)]),
        {"share-1gb": Offer("share-1gb", "share", share_mib=1024)},
        {"vision": Team("vision", 64000)},
    )
    held = [led.allocate(Request("ada", "vision", "share-1gb"), f"s{i}") for i in range(4)]
    assert {a.cost_milli for a in held} == {250}  # not 23: a quarter of the pods it may hold
    assert led.placeable(led.offers["share-1gb"]) == 0
    with pytest.raises(NoCapacity):
        led.allocate(Request("ada", "vision", "share-1gb"), "s4")
    led.check_invariants()
    a = ledger(hami_node(gpus=1)).allocate(Request("ada", "vision", "share-8gb"), "a1")
    assert a.cost_milli == 178  # above a split's worth (100): its memory fraction


def test_restore_keeps_shares_of_shared_gpus_and_loses_whole_ones() -> None:
    led = ledger(shared_node(gpus=1))
    a = led.allocate(Request("ada", "vision", "share-3gb"), "a1")
    twin = ledger(shared_node(gpus=1))
    restored, lost = twin.restore([a])
    assert restored == [a] and lost == []
    whole = replace(a, id="a2", devices=(Device("k8s-t4-shared-gpu0"),))
    assert ledger(shared_node(gpus=1)).restore([whole]) == ([], [whole])


def test_the_config_warnings_say_why_an_offer_never_fits_shared_gpus() -> None:
    from gpupool.declarations import Settings, config_warnings

    everyone = Team("everyone", offers=frozenset({"cpu"}))
    settings = Settings(OFFERS, {"vision": Team("vision", 64000)}, everyone)
    shared = config_warnings(settings, inventory_from_nodes([shared_node()]))
    assert (
        "GPUPool.offers['gpu']: every GPU in the pool has MIG on or is shared out by the device "
        "plugin (time-slicing, MPS or HAMi), so none can be granted whole; the offer can never "
        "be granted"
    ) in shared
    assert (
        "GPUPool.offers['share-4gb'].memory: 4 GB share of a GPU is larger than every GPU with "
        "MIG off it could land on, or than one replica where the device plugin shares a GPU; "
        "the offer can never be granted"
    ) in shared
    whole = config_warnings(settings, inventory_from_nodes([h100_node()]))
    assert (
        "GPUPool.offers['share-3gb']: the device plugin hands every GPU with MIG off out whole "
        "(no time-slicing, MPS or HAMi on its nodes), so no share can be placed; the offer can "
        "never be granted"
    ) in whole


def test_the_spawn_page_says_the_cluster_enforces_such_shares() -> None:
    from gpupool.shares import ShareEnforcement, offer_enforcement

    rules = ShareEnforcement()
    shared = inventory_from_nodes([shared_node(strategy="mps"), h100_node()]).gpus
    note = offer_enforcement(OFFERS["t4-quarter"], shared, rules)
    assert note == "one replica of a GPU the device plugin shares (MPS: its memory limit)"
    hami = inventory_from_nodes([hami_node()]).gpus
    assert offer_enforcement(OFFERS["share-8gb"], hami, rules) == "HAMi: hard memory limit"
