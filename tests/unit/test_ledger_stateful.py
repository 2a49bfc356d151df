"""Hypothesis stateful tests: random allocate / release / restart across teams, offers, policies.

``LedgerMachine`` drives the pure ledger hard (many steps, a roomy team so placement, not quota,
is what gets exercised); ``PoolMachine`` drives the real Pool (ledger + SQLite store) with fewer
steps. After every step the ledger's invariants hold; a refused request changes nothing; a
restart rebuilds exactly the same ledger (from the database, for the pool).
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from pathlib import Path
from typing import ClassVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from gpupool.core import GPU, Inventory, Ledger, Node, Offer, PoolError, Request, Team
from gpupool.core.placement import POLICIES
from gpupool.pool import Pool
from gpupool.store import Store
from tests.factories import OFFERS, TEAMS, gpu, mixed_inventory

USERS = ["ana", "bob", "cy", "dee", "eve"]
GROUPS = [[], ["vision"], ["nlp"], ["ops"], ["vision", "ops"]]


class PoolMachine(RuleBasedStateMachine):
    allocations = Bundle("allocations")

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.url = f"sqlite:///{Path(self.tmp.name) / 'pool.sqlite'}"
        self.ids = (f"a{i}" for i in itertools.count())

    def teardown(self) -> None:
        self.pool.store.close()
        self.tmp.cleanup()

    def _new_pool(self) -> Pool:
        ledger = Ledger(mixed_inventory(), OFFERS, TEAMS, policy=self.policy)
        return Pool(ledger, Store(self.url), new_id=lambda: next(self.ids))

    @initialize(policy=st.sampled_from(sorted(POLICIES)))
    def start(self, policy: str) -> None:
        self.policy = policy
        self.pool = self._new_pool()

    def _state(self) -> tuple[object, ...]:
        ledger = self.pool.ledger
        return (dict(ledger.allocations), list(ledger.occ.mask), +ledger.team_used)

    @rule(
        target=allocations,
        user=st.sampled_from(USERS),
        groups=st.sampled_from(GROUPS),
        team=st.sampled_from([None, "vision", "nlp", "ops", "everyone"]),
        offer=st.sampled_from(sorted(OFFERS)),
        count=st.integers(1, 4),
    )
    def allocate(
        self, user: str, groups: list[str], team: str | None, offer: str, count: int
    ) -> str:
        before = self._state()
        try:
            a = self.pool.allocate(user, groups, offer, count, team=team)
        except PoolError as e:
            assert e.message and e.message.endswith(".")
            assert self._state() == before, "a refused request changed the ledger"
            return ""
        assert a.team in groups or (a.team == "everyone" and not set(groups) & set(TEAMS))
        return a.id

    @rule(alloc_id=consumes(allocations))
    def release(self, alloc_id: str) -> None:
        if alloc_id:
            self.pool.release(alloc_id)

    @rule()
    def restart(self) -> None:
        before = self.pool.ledger.allocations
        self.pool.store.close()
        self.pool = self._new_pool()
        lost = self.pool.restore()
        assert lost == []
        assert self.pool.ledger.allocations == before

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "pool"):
            self.pool.ledger.check_invariants()
            persisted = {a.id: a for a in self.pool.store.load()}
            assert persisted == self.pool.ledger.allocations


SHARE_OFFERS = {
    **OFFERS,
    "share-quarter": Offer("share-quarter", "share", share_milli=250),
    "share-0.6": Offer("share-0.6", "share", share_milli=600),
    "share-6gb": Offer("share-6gb", "share", model="RTX3090-24GB", share_mib=6144),
    "share-10gb": Offer("share-10gb", "share", share_mib=10240),
    "mig-2g-x3": Offer("mig-2g-x3", "mig", model="H100-80GB", profile="2g.20gb", max_count=3),
}
"""The shared offers plus shares (by fraction, by size of one model and by size on any GPU) and
up to three MIG instances in one request."""


def small_inventory() -> Inventory:
    """Few devices, so that requests collide often: an NVLink pair, one dynamic and one fixed
    MIG H100, a managed (dynamic) H100 with an admin's 2g.20gb at slot 2 (a fixed instance
    there), a whole and a flex A100-40GB, and two RTX 3090s (MIG off, so shares or whole; the
    H100s with MIG off take shares too)."""
    return Inventory(
        (
            Node(
                "a",
                (
                    gpu("a", 0, peers=(1,)),
                    gpu("a", 1, peers=(0,)),
                    gpu("a", 2, mode="dynamic"),
                    gpu("a", 3, mode="fixed", instances=(("3g.40gb", 0), ("2g.20gb", 4))),
                    gpu("a", 4, mode="dynamic", instances=(("2g.20gb", 2),)),
                ),
            ),
            Node("b", (gpu("b", 0, "A100-40GB"), gpu("b", 1, "A100-40GB", "flex"))),
            Node(
                "c",
                (
                    GPU("GPU-c-0", 0, "RTX3090-24GB", 24576),
                    GPU("GPU-c-1", 1, "RTX3090-24GB", 24268),
                ),
            ),
        ),
        source="test",
    )


OUTSIDE_DEVICES = ["GPU-a-0", "GPU-a-2", "MIG-a-3-0", "MIG-a-4-2", "GPU-b-1", "GPU-c-0"]
"""Devices a process that holds nothing may use: whole, dynamic MIG, flex and share GPUs, a
fixed instance and an admin's instance on a managed GPU."""


def occupancy_state(ledger: Ledger) -> tuple[object, ...]:
    """Everything a placement reads, as plain values (empty index entries left out: a copy
    keeps them, a rebuild never makes them)."""
    occ = ledger.occ

    def members(index: dict[object, object]) -> dict[object, list[int]]:
        return {k: list(m) for k, m in index.items() if len(m)}

    groups = {
        key: ({u: list(m) for u, m in g.by_used.items() if len(m)}, g.used_values, g.tree)
        for key, g in occ.share_groups.items()
    }
    return (
        occ.mask, occ.whole, occ.share_used, occ.closed, occ._share_index, groups,
        members(occ.mig_buckets), members(occ.node_buckets), members(occ.node_free),
        members(occ.fixed_buckets), occ._gpu_key, occ._node_keys, occ._fixed_keys,
        ledger.allocations, ledger.blocked, ledger.outside, +ledger.team_used, +ledger.user_used,
    )  # fmt: skip


class LedgerMachine(RuleBasedStateMachine):
    teams: ClassVar[dict[str, Team]] = {**TEAMS, "roomy": Team("roomy", guarantee_milli=100_000)}

    @initialize(policy=st.sampled_from(sorted(POLICIES)))
    def start(self, policy: str) -> None:
        self.policy = policy
        self.ledger = Ledger(small_inventory(), SHARE_OFFERS, self.teams, policy=policy)
        self.ids = (f"a{i}" for i in itertools.count())

    @rule(
        user=st.sampled_from(USERS),
        team=st.sampled_from(["roomy", "roomy", "roomy", "vision", "nlp", "ops", "everyone"]),
        offer=st.sampled_from(sorted(SHARE_OFFERS)),
        count=st.integers(1, 3),
    )
    def allocate(self, user: str, team: str, offer: str, count: int) -> None:
        ledger = self.ledger
        occ = ledger.occ
        before = (dict(ledger.allocations), list(occ.mask), list(occ.share_used), +ledger.team_used)
        found = SHARE_OFFERS[offer]
        now = (
            found.kind == "mig"
            and team == "roomy"
            and ledger.admit(ledger.team(team), user, found, count).now
        )
        try:
            a = ledger.allocate(Request(user, team, offer, count), next(self.ids))
            assert len({ledger.occ.node_of[ledger.occ.ordinal[d.gpu]] for d in a.devices}) <= 1
            used = [x for d in a.devices for x in (d.gpu, d.instance) if x in ledger.outside]
            assert not used, f"{a.id} was handed {used}, which something else uses"
        except PoolError as e:
            assert not now, f"admitted now, yet refused: {e.message}"
            after = (
                dict(ledger.allocations),
                list(occ.mask),
                list(occ.share_used),
                +ledger.team_used,
            )
            assert after == before, "a refused request changed the ledger"

    @rule(
        steps=st.lists(
            st.tuples(st.sampled_from(sorted(SHARE_OFFERS)), st.integers(1, 2), st.integers(0, 9)),
            min_size=1,
            max_size=30,
        )
    )
    def burst(self, steps: list[tuple[str, int, int]]) -> None:
        """Many operations in one step (short rule sequences alone rarely reach deep states):
        allocate ``offer`` for the roomy team, then release allocation number ``pick`` if any."""
        for offer, count, pick in steps:
            self.allocate("ana", "roomy", offer, count)
            held = sorted(self.ledger.allocations)
            if held and pick < len(held) and pick % 2:
                self.ledger.release(held[pick])
            self.ledger.check_invariants()

    @rule(offer=st.sampled_from(sorted(SHARE_OFFERS)), count=st.integers(1, 2))
    def allocate_as_a_clone_planned(self, offer: str, count: int) -> None:
        """A clone is what the job queue plans on: it must place a request exactly where the
        ledger it copies then does (devices, or the same refusal), whatever the placement
        policy has learned so far."""
        request = Request("ana", "roomy", offer, count)
        alloc_id = next(self.ids)
        planned: object
        try:
            planned = self.ledger.clone().allocate(request, alloc_id).devices
        except PoolError as e:
            planned = e.message
        try:
            granted: object = self.ledger.allocate(request, alloc_id).devices
        except PoolError as e:
            granted = e.message
        assert granted == planned, f"planned {planned}, granted {granted}"

    @rule(offer=st.sampled_from(sorted(SHARE_OFFERS)), count=st.integers(1, 2))
    def a_clone_is_a_copy_that_stands_alone(self, offer: str, count: int) -> None:
        """A clone copies the slot state and its indexes (it does not rebuild them): they must
        equal what a rebuild from the inventory and the allocations gives, and nothing done on
        the clone may reach the ledger."""
        ledger = self.ledger
        rebuilt = Ledger(small_inventory(), SHARE_OFFERS, self.teams, policy=self.policy)
        for b in ledger.blocked.values():
            rebuilt.block(b)
        rebuilt.restore(ledger.allocations.values())
        rebuilt.set_outside_use(ledger.outside)
        twin = ledger.clone()
        before = occupancy_state(ledger)
        assert occupancy_state(twin) == occupancy_state(rebuilt) == before
        twin.check_invariants()
        with contextlib.suppress(PoolError):
            twin.allocate(Request("ana", "roomy", offer, count), "on-the-clone")
        for alloc_id in sorted(twin.allocations)[:2]:
            twin.release(alloc_id)
        twin.set_outside_use({})
        twin.check_invariants()
        assert occupancy_state(ledger) == before, "a change to the clone reached the ledger"

    @rule(devices=st.sets(st.sampled_from(OUTSIDE_DEVICES), max_size=4))
    def outside_use(self, devices: set[str]) -> None:
        """Processes that hold nothing come to (and leave) GPUs and fixed MIG instances."""
        self.ledger.set_outside_use({d: f"{d} is in use" for d in devices})

    @precondition(lambda self: bool(self.ledger.allocations))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self.ledger.release(data.draw(st.sampled_from(sorted(self.ledger.allocations))))

    @rule()
    def restart(self) -> None:
        fresh = Ledger(small_inventory(), SHARE_OFFERS, self.teams, policy=self.policy)
        _restored, lost = fresh.restore(self.ledger.allocations.values())
        fresh.set_outside_use(self.ledger.outside)
        assert lost == [] and fresh.allocations == self.ledger.allocations
        assert fresh.occ.mask == self.ledger.occ.mask
        assert fresh.occ.share_used == self.ledger.occ.share_used
        self.ledger = fresh

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "ledger"):
            self.ledger.check_invariants()
            # what admission counts per node adds up to what one-instance requests count
            offer = SHARE_OFFERS["mig-2g-x3"]
            assert sum(self.ledger._mig_per_node(offer)) == self.ledger.placeable(offer)


_settings = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
LedgerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=50, **_settings)
PoolMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, **_settings)
TestLedger = LedgerMachine.TestCase
TestPool = PoolMachine.TestCase
