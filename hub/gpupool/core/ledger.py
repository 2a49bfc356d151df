"""The ledger: who holds which devices, and the one place that grants or refuses them.

Vocabulary
- *allocation*: a granted request: id, owner, team, offer, what it is for (``kind``/``ref``), the
  devices it holds and what it costs in GPU-equivalents (thousandths).
- *device*: one held GPU (``profile is None`` and ``share_milli is None``; ``instance``: the
  GPU's UUID as its node reported it, where the GPU's id is bookkeeping, on Kubernetes), MIG
  instance (profile, start slot, and the ``MIG-…`` UUID once the instance exists), or share of
  a GPU with MIG off (``share_milli``: thousandths of its memory; ``visible_id`` is the GPU's UUID).
- *cost* of a share: its milli (its memory fraction); a share offer by size costs what it takes
  on the GPU it lands on, so the quota is checked with the least it may cost on this inventory
  (:meth:`Ledger.unit_cost_milli`) before placing and with the real cost after.
- *restore*: rebuilding the ledger from persisted allocations after a restart, against the
  inventory found now. Allocations whose devices are gone (or now conflict) come back as *lost*.
- *blocked slots*: a MIG placement taken by no allocation and charged to nobody: an instance
  the pool must not place over (one of the pool's own that is still draining, an instance an
  admin made while the hub runs, free slots while MIG on demand is off). See :meth:`Ledger.block`.
  An admin's instance known at start on a GPU whose instances the pool creates is not blocked:
  it is a fixed instance there (*reserved slots* in :mod:`gpupool.core.occupancy`), handed out
  as it is, and nothing, a blocked slot neither, is ever placed over it.
- *outside use*: devices a process uses without holding them (:mod:`gpupool.core.holders`),
  with why (:meth:`Ledger.set_outside_use`): nothing new is placed on such a GPU (*closed* in
  :mod:`gpupool.core.occupancy`), and such a fixed MIG instance is blocked (``outside``) while
  free, or as soon as its holder releases it. Capacity still counts them (a request waits for
  them); refusals and verdicts name them. *Outside shares* (:meth:`Ledger.set_outside_shares`):
  memory of a share-taking GPU a process uses without holding it (another tenant's HAMi pod,
  whose GPU and memory its scheduler wrote down): taken from that GPU's shares, with why, so
  only what is left is handed out there.
- *cohort*: with Kueue admitting GPU pods (``cohort``: its cohort's name), a grant must also fit
  Kueue's cohort rule over the same teams (:mod:`gpupool.core.cohort`), so the hub never grants
  a pod Kueue would leave unadmitted.

Invariants, checked by :meth:`Ledger.check_invariants` and kept by every operation:
no slot has two owners; a whole GPU is never handed out while MIG instances or shares are on it
(nor MIG or shares on a whole-held GPU, nor a whole GPU on one the platform shares out);
shares sit only on GPUs with MIG off that take them and add up to at most
the GPU (1000 milli); multi-device allocations (GPUs, MIG instances) sit on one node; no team
holds more than guarantee plus borrowing limit; the usage counters equal the sum of the
allocations.

Contract: pure and synchronous. Every operation either completes or leaves the ledger unchanged.
Clocks and ids come from the caller.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from gpupool.core.admission import Admission, Usage, admit
from gpupool.core.cohort import Cohort, check_cohort
from gpupool.core.errors import InvalidRequest, NoCapacity, QuotaExceeded, UnknownAllocation
from gpupool.core.inventory import Inventory, Node, NodePool
from gpupool.core.mig import GEOMETRIES, Profile
from gpupool.core.occupancy import SHARE_MILLI, Occupancy
from gpupool.core.offers import Offer, Request, fmt_mib, share_cost_milli
from gpupool.core.parse import quoted
from gpupool.core.placement import Demand, Pick, PlacementPolicy, make_policy
from gpupool.core.quota import EVERYONE, Team, check_offer, check_quota
from gpupool.core.units import fmt


@dataclass(frozen=True)
class Device:
    gpu: str
    profile: str | None = None
    start: int | None = None
    instance: str | None = None
    share_milli: int | None = None
    """For a share of a GPU without MIG: the thousandths of the GPU's memory it holds."""

    @property
    def visible_id(self) -> str:
        """What goes into ``CUDA_VISIBLE_DEVICES``: the MIG UUID if known, else the GPU UUID."""
        return self.instance or self.gpu


LASTING_BLOCKS = frozenset({"admin", "gone", "off"})
"""Blocked slots that stay taken until the next start (an admin's instances learnt while the hub
runs, or destroyed by an admin while it runs: ``gone``; free slots while MIG on demand is off),
which :meth:`Ledger.capacity` counts; ``draining`` slots come back. An admin's instances known at
start are no blocked slots but fixed instances, which capacity counts as allocatable."""


@dataclass(frozen=True)
class Blocked:
    """A MIG placement taken without an allocation, and why (``admin``, ``draining``, ``off``,
    ``gone``: an admin's instance of the inventory that NVML no longer shows)."""

    gpu: str
    profile: str
    start: int
    reason: str
    instance: str | None = None


@dataclass(frozen=True)
class Allocation:
    id: str
    user: str
    team: str
    offer: str
    kind: str
    ref: str
    count: int
    cost_milli: int
    node: str | None
    devices: tuple[Device, ...]
    created: float = 0.0

    @property
    def visible_devices(self) -> str:
        return ",".join(d.visible_id for d in self.devices)


class Ledger:
    def __init__(
        self,
        inventory: Inventory,
        offers: Mapping[str, Offer],
        teams: Mapping[str, Team],
        everyone: Team | None = None,
        policy: PlacementPolicy | str = "gpupool",
        cohort: str = "",
        *,
        occupancy: Occupancy | None = None,
    ) -> None:
        self.inventory = inventory
        self.offers = dict(offers)
        self.teams = dict(teams)
        self.everyone = everyone or Team(EVERYONE, offers=frozenset({"cpu"}))
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.cohort_name = cohort
        """The Kueue cohort of the teams' ClusterQueues when Kueue admits GPU pods ('': no
        Kueue); then nothing is granted that Kueue's cohort rule would not admit."""
        self.cohort = (
            Cohort.of_teams(cohort, self.teams.values(), self.everyone) if cohort else None
        )
        self.occ = occupancy or Occupancy(inventory)
        self.allocations: dict[str, Allocation] = {}
        self.blocked: dict[tuple[str, int], Blocked] = {}
        self.outside: dict[str, str] = {}
        """Devices in outside use (GPU or MIG UUID -> why; see *outside use*)."""
        self.outside_shares: dict[str, tuple[int, str]] = {}
        """GPU UUID -> (MiB asked, why) of the *outside shares* (see *outside use*)."""
        self._outside_milli: dict[int, int] = {}
        self.team_used: Counter[str] = Counter()
        self.user_used: Counter[tuple[str, str]] = Counter()
        self._capacity: dict[Offer, int] = {}
        self._mig_capacities: dict[Offer, int] = {}
        self._node_capacities: dict[Offer, tuple[int, ...]] = {}
        self._pool_capacities: dict[Offer, tuple[tuple[NodePool, int], ...]] = {}
        self._unit_costs: dict[Offer, int] = {}

    def clone(self) -> Ledger:
        """An independent copy with the same allocations and the placement policy in the same
        state (for what-if planning: the copy places a request where this ledger then would)."""
        twin = Ledger(
            self.inventory, self.offers, self.teams, self.everyone, self.policy.copy(),
            self.cohort_name, occupancy=self.occ.copy(),
        )  # fmt: skip
        twin.allocations = dict(self.allocations)  # an Allocation is frozen: shared
        twin.blocked = dict(self.blocked)
        twin.outside = dict(self.outside)
        twin.outside_shares = dict(self.outside_shares)
        twin._outside_milli = dict(self._outside_milli)
        twin.team_used = Counter(self.team_used)
        twin.user_used = Counter(self.user_used)
        return twin

    # -- questions -------------------------------------------------------------------------
    def team(self, name: str) -> Team:
        if name == self.everyone.name:
            return self.everyone
        try:
            return self.teams[name]
        except KeyError:
            raise InvalidRequest(f"Unknown team {quoted(name)}.") from None

    def placeable(self, offer: Offer) -> int:
        """How many of ``offer`` could be granted right now, ignoring quotas.

        For whole GPUs: the most free GPUs on one node. For MIG and shares: instances or shares
        that fit, summed over GPUs (each GPU counted on its own, so this is exact for one request
        of one instance or share at a time; :meth:`usage` counts several instances of one request
        on one node).
        """
        occ = self.occ
        if offer.kind == "cpu":
            return 1
        if offer.kind == "share":
            total = 0
            for group, need in occ.share_needs(offer.model, offer.share_cost_on, offer.share_mib):
                for u in group.used_values:
                    if u + need > SHARE_MILLI:
                        break
                    total += len(group.by_used[u]) * ((SHARE_MILLI - u) // need)
            return total
        if offer.kind == "gpu":
            return max(
                (
                    f
                    for (model, f), b in occ.node_buckets.items()
                    if b and (offer.model is None or model == offer.model)
                ),
                default=0,
            )
        total = 0
        resolved: dict[str, Profile | None] = {}

        def profile_of(model: str) -> Profile | None:
            if model not in resolved:
                geo = GEOMETRIES.get(model)
                resolved[model] = geo.resolve(offer.profile) if geo and offer.profile else None
            return resolved[model]

        for (model, _mode, mask), bucket in occ.mig_buckets.items():
            if offer.model not in (None, model) or not bucket:
                continue
            p = profile_of(model)
            if p is not None:
                total += len(bucket) * GEOMETRIES[model].max_fit[p][mask]
        for (model, name, _mask), bucket in occ.fixed_buckets.items():
            if offer.model not in (None, model) or not bucket:
                continue
            p = profile_of(model)
            if p is not None and p.name == name:
                total += len(bucket)
        return total

    def capacity(self, offer: Offer) -> int:
        """What :meth:`placeable` answers for ``offer`` on this inventory with nothing held but
        the lasting blocked slots (an admin's instances learnt while the hub runs, MIG on demand
        off): the most one request could ever get, fixed instances (an admin's on a managed GPU
        too) included (cached until a lasting block comes or goes)."""
        if offer not in self._capacity:
            empty = Ledger(self.inventory, self.offers, self.teams)
            for b in self.blocked.values():
                if b.reason in LASTING_BLOCKS:  # what stays taken; draining slots come back
                    empty.block(b)
            self._capacity[offer] = empty.placeable(offer)
        return self._capacity[offer]

    def _mig_per_node(self, offer: Offer) -> list[int]:
        """:meth:`placeable` of a MIG offer on each node (by ordinal): free fixed instances of
        the profile plus what fits on each GPU that takes instances (GPUs are independent)."""
        occ = self.occ
        out = [0] * len(occ.node_gpus)
        for g, gpu in enumerate(occ.gpus):
            geo = occ.geometry[g]
            p = geo.resolve(offer.profile) if geo and offer.profile else None
            skip = occ.whole[g] or occ.closed[g]
            if p is None or geo is None or offer.model not in (None, gpu.model) or skip:
                continue
            if g in occ.fixed_instances:
                out[occ.node_of[g]] += sum(
                    q.name == p.name and not occ.mask[g] & q.mask_at(i.start)
                    for q, i in occ.fixed_instances[g]
                )
            if gpu.mig_mode in ("dynamic", "flex"):  # an admin's instances are reserved there
                out[occ.node_of[g]] += geo.max_fit[p][occ.placement_mask(g)]
        return out

    def _mig_capacity(self, offer: Offer) -> int:
        """The most instances of a MIG offer one node holds with only the lasting blocked slots
        taken (cached as :meth:`capacity` is)."""
        if offer not in self._mig_capacities:
            empty = Ledger(self.inventory, self.offers, self.teams)
            for b in self.blocked.values():
                if b.reason in LASTING_BLOCKS:
                    empty.block(b)
            self._mig_capacities[offer] = max(empty._mig_per_node(offer), default=0)
        return self._mig_capacities[offer]

    def node_capacities(self, offer: Offer) -> tuple[int, ...]:
        """:meth:`capacity` of each node on its own, in inventory order (cached)."""
        if offer not in self._node_capacities:
            self._node_capacities[offer] = tuple(
                self._alone(n).placeable(offer) for n in self.inventory.nodes
            )
        return self._node_capacities[offer]

    def pool_capacities(self, offer: Offer) -> tuple[tuple[NodePool, int], ...]:
        """Each declared node pool with what one of its nodes could hold of ``offer`` (cached)."""
        if offer not in self._pool_capacities:
            self._pool_capacities[offer] = tuple(
                (p, self._alone(p.node).placeable(offer)) for p in self.inventory.node_pools
            )
        return self._pool_capacities[offer]

    def _alone(self, node: Node) -> Ledger:
        return Ledger(Inventory((node,)), self.offers, self.teams, self.everyone)

    def unit_cost_milli(self, offer: Offer) -> int:
        """The least one unit of ``offer`` costs on this inventory: the offer's own cost, but for
        a share by size without a model the least over the GPUs it may land on (cached)."""
        if offer.kind != "share" or offer.share_mib is None:
            return offer.unit_cost_milli()
        if offer not in self._unit_costs:
            costs = [
                need
                for _, need in self.occ.share_needs(
                    offer.model, offer.share_cost_on, offer.share_mib, fitting=False
                )
            ]
            fits = [c for c in costs if c <= SHARE_MILLI]
            self._unit_costs[offer] = min(fits or costs or [offer.unit_cost_milli()])
        return self._unit_costs[offer]

    def usage(
        self, team: Team, user: str, offer: Offer, count: int = 1, distinct: bool = False
    ) -> Usage:
        """The snapshot :func:`gpupool.core.admission.admit` decides on (machines counted only
        when a multi-node request's nodes must be ``distinct`` machines)."""
        growing = [(p, n) for p, n in self.pool_capacities(offer) if n >= count]
        machines = None
        if distinct:
            machines = sum(n >= count for n in self.node_capacities(offer))
        free, capacity = self.placeable(offer), self.capacity(offer)
        if offer.kind == "mig" and count > 1:  # a request's instances are all on one node
            free, capacity = max(self._mig_per_node(offer), default=0), self._mig_capacity(offer)
        return Usage(
            self.team_used[team.name],
            self.user_used[team.name, user],
            free,
            capacity,
            machines,
            growing[0][0].name if growing else "",
            (machines or 0) + sum(p.max_nodes for p, _ in growing),
            self.unit_cost_milli(offer),
            tuple(self.outside_for(offer)),
            self.cohort,
            dict(self.team_used) if self.cohort is not None else {},
        )

    def admit(
        self,
        team: Team,
        user: str,
        offer: Offer,
        count: int,
        nodes: int = 1,
        distinct: bool = False,
    ) -> Admission:
        """Could ``count`` of ``offer`` per node on ``nodes`` nodes (``distinct`` machines, or
        not) never start, start now, or would it wait? (:mod:`gpupool.core.admission`)."""
        usage = self.usage(team, user, offer, count, distinct and nodes > 1)
        return admit(team, offer, count, nodes, usage)

    def outside_for(self, offer: Offer) -> list[str]:
        """Why devices that could serve ``offer`` are not handed out now (in outside use)."""
        if not (self.outside or self.outside_shares) or offer.kind == "cpu":
            return []
        gpus = {g.uuid: g for g in self.inventory.gpus}
        instances = {i.uuid: (g, i) for g in self.inventory.gpus for i in g.instances if i.uuid}
        reasons = []
        for device, reason in sorted(self.outside.items()):
            gpu, inst = gpus.get(device), None
            if gpu is None and device in instances:
                gpu, inst = instances[device]
            if gpu is None or offer.model not in (None, gpu.model):
                continue
            if offer.kind != "mig":
                serves = inst is None and not gpu.mig_enabled
            else:
                geo = gpu.geometry
                wanted = geo.resolve(offer.profile) if geo and offer.profile else None
                serves = wanted is not None and gpu.mig_enabled
                if inst is not None and geo is not None:
                    serves = serves and geo.resolve(inst.profile) == wanted
            if serves and reason not in reasons:  # one line for GPUs closed for one reason
                reasons.append(reason)
        if offer.kind == "share":
            for device, (_mib, reason) in sorted(self.outside_shares.items()):
                gpu = gpus.get(device)
                if gpu is not None and offer.model in (None, gpu.model):
                    reasons.append(reason)
        return reasons

    def free_now(self, team: Team, user: str) -> str:
        """``"2× 1g.10gb, 1× h100"``: what ``user`` could still get in ``team`` right now, within
        the team's quota and the user's cap; for refusal messages."""
        left = team.limit_milli - self.team_used[team.name]
        if self.cohort is not None:
            left = min(left, self.cohort.room(team.name, self.team_used))
        if team.user_cap_milli is not None:
            left = min(left, team.user_cap_milli - self.user_used[team.name, user])
        fits: list[str] = []
        free: list[str] = []
        for name, offer in sorted(self.offers.items()):
            n = self.placeable(offer) if offer.kind != "cpu" and team.allows(name) else 0
            if n:
                what = f"{n}× {offer.profile if offer.kind == 'mig' else name}"
                (fits if self.unit_cost_milli(offer) <= left else free).append(what)
        if fits:
            return ", ".join(fits)
        if free:
            return f"nothing within your quota (free in the pool: {', '.join(free)})"
        return "nothing"

    # -- operations ------------------------------------------------------------------------
    def allocate(
        self, request: Request, alloc_id: str, created: float = 0.0, explain: bool = True
    ) -> Allocation:
        """Grant ``request`` or raise; the ledger is unchanged when it raises. ``explain=False``:
        a refusal does not say what is free now (the queue's trials only ask whether it fits,
        and that sentence was most of a scheduling pass's time)."""
        if alloc_id in self.allocations:
            raise InvalidRequest(f"Allocation {alloc_id} exists already.")
        team = self.team(request.team)
        offer = check_offer(team, self.offers, request.offer, request.count)
        several = offer.kind == "gpu" or (offer.counted and request.count > 1)
        what = f"{request.count}× {offer.label}" if several else offer.label
        used = (self.team_used[team.name], self.user_used[team.name, request.user])
        try:
            check_quota(team, *used, self.unit_cost_milli(offer) * request.count, what)
            cost = self.unit_cost_milli(offer) * request.count
            check_cohort(self.cohort, team.name, self.team_used, cost, what)
        except QuotaExceeded as e:
            if not explain:
                raise
            free = self.free_now(team, request.user)
            raise QuotaExceeded(f"{e.message} Free now: {free}.") from None
        picks: list[Pick] = []
        if offer.kind != "cpu":
            ordinal = self.occ.node_ordinal
            avoid = frozenset(ordinal[n] for n in request.avoid_nodes if n in ordinal)
            demand = Demand.of(offer, request.count, avoid)
            self.policy.observe(demand)
            found = self.policy.place(self.occ, demand)
            if found is None:
                raise NoCapacity(
                    self._no_capacity(team, request.user, offer, request.count, avoid)
                    if explain
                    else f"No {what} free."
                )
            picks = found
            # what the placement really blocks (a profile name may mean other sizes on other
            # models, a share by size other fractions of other GPUs; the settings forbid the
            # first, a hand-built offer might not)
            cost = sum(self._pick_cost(p) for p in picks)
            check_quota(team, *used, cost, what)
            check_cohort(self.cohort, team.name, self.team_used, cost, what)
        template = Allocation(
            alloc_id,
            request.user,
            team.name,
            request.offer,
            request.kind,
            request.ref,
            request.count,
            0,
            None,
            (),
            created,
        )
        return self._apply(template, picks)

    def release(self, alloc_id: str) -> Allocation:
        try:
            allocation = self.allocations.pop(alloc_id)
        except KeyError:
            raise UnknownAllocation(f"No allocation {alloc_id}.") from None
        occ = self.occ
        for d in allocation.devices:
            g = occ.ordinal[d.gpu]
            if d.share_milli is not None:
                occ.free_share(g, d.share_milli)
            elif d.profile is None:
                occ.free_whole(g)
            else:
                geo = occ.geometry[g]
                p = geo.resolve(d.profile) if geo else None
                assert p is not None and d.start is not None
                occ.free_slots(g, p, d.start)
        self.team_used[allocation.team] -= allocation.cost_milli
        self.user_used[allocation.team, allocation.user] -= allocation.cost_milli
        for d in allocation.devices:  # a fixed instance in outside use: blocked once let go
            if d.instance in self.outside:
                self._close(d.instance)
        return allocation

    def set_outside_use(self, reasons: Mapping[str, str]) -> tuple[set[str], set[str]]:
        """The devices in outside use from now on (device UUID -> why), in place of the last
        ones (see *outside use*); returns the devices newly in it and those free of it again."""
        before, now = set(self.outside), set(reasons)
        for device in before - now:
            self._open(device)
        self.outside = dict(reasons)
        for device in now:
            self._close(device)
        return now - before, before - now

    def set_outside_shares(self, shares: Mapping[str, tuple[int, str]]) -> None:
        """The *outside shares* from now on (GPU UUID -> (MiB, why)), in place of the last ones:
        each takes its memory's thousandths (at least one share slot's worth, at most what the
        ledger's shares leave free) of a share-taking GPU; other devices are ignored."""
        occ = self.occ
        for g, milli in self._outside_milli.items():
            occ.free_share(g, milli)
        self._outside_milli = {}
        self.outside_shares = dict(shares)
        for uuid, (mib, _why) in sorted(shares.items()):
            index = occ.ordinal.get(uuid)
            group = occ.share_group_of.get(index) if index is not None else None
            if index is None or group is None or occ.whole[index] or mib <= 0:
                continue
            g = index
            need = group.need(share_cost_milli(mib, group.memory_mib), mib)
            milli = min(need, SHARE_MILLI - occ.share_used[g])
            if milli > 0:
                occ.take_share(g, milli)
                self._outside_milli[g] = milli

    def _close(self, device: str, among: Iterable[int] | None = None) -> None:
        """Close a GPU, or block a free fixed MIG instance (one held now waits for its
        release; any other device, an instance made for an allocation, has nothing to block);
        ``among``: the GPUs (ordinals) whose instances it may be, else any."""
        occ = self.occ
        g = occ.ordinal.get(device)
        if g is not None:
            if not occ.closed[g]:
                occ.close(g)
            return
        for g in occ.fixed_instances if among is None else among:
            for p, inst in occ.fixed_instances.get(g, ()):
                free = not occ.whole[g] and not occ.mask[g] & p.mask_at(inst.start)
                if inst.uuid == device and free:
                    gpu = occ.gpus[g].uuid
                    self.block(Blocked(gpu, inst.profile, inst.start, "outside", inst.uuid))
                    return

    def _open(self, device: str) -> None:
        g = self.occ.ordinal.get(device)
        if g is not None:
            self.occ.reopen(g)
            return
        for (gpu, start), b in list(self.blocked.items()):
            if b.reason == "outside" and b.instance == device:
                self.unblock(gpu, start)

    def block(self, blocked: Blocked) -> None:
        """Take a MIG placement's slots for no allocation (see *blocked slots*); ``ValueError``
        when the GPU has no such placement or its slots are not free."""
        occ = self.occ
        g = occ.ordinal.get(blocked.gpu)
        geo = occ.geometry[g] if g is not None else None
        p = geo.resolve(blocked.profile) if geo else None
        if g is None or p is None or blocked.start not in p.starts:
            raise ValueError(f"no {blocked.profile} at slot {blocked.start} on {blocked.gpu}")
        if occ.reserved[g] & p.mask_at(blocked.start) and not occ.is_fixed_instance(
            g, p, blocked.start
        ):
            raise ValueError(
                f"{blocked.profile} at slot {blocked.start} on {blocked.gpu} overlaps an admin's "
                "instance (only that instance itself may be blocked)"
            )
        occ.take_slots(g, p, blocked.start)
        self.blocked[blocked.gpu, blocked.start] = blocked
        if blocked.reason in LASTING_BLOCKS:
            self._capacity.clear()
            self._mig_capacities.clear()

    def unblock(self, gpu: str, start: int) -> Blocked:
        """Give blocked slots back; ``KeyError`` when none are blocked there."""
        blocked = self.blocked.pop((gpu, start))
        if blocked.reason in LASTING_BLOCKS:
            self._capacity.clear()
            self._mig_capacities.clear()
        g = self.occ.ordinal[gpu]
        geo = self.occ.geometry[g]
        p = geo.resolve(blocked.profile) if geo else None
        assert p is not None
        self.occ.free_slots(g, p, start)
        return blocked

    def restore(
        self, allocations: Iterable[Allocation]
    ) -> tuple[list[Allocation], list[Allocation]]:
        """Re-apply persisted allocations after a restart; returns ``(restored, lost)``.

        Quotas are not re-checked (running work is never taken away because a quota shrank);
        devices are: an allocation whose GPU is gone, changed mode, or whose fixed instance no
        longer exists is lost. Fixed instances get their current MIG UUIDs.
        """
        restored: list[Allocation] = []
        lost: list[Allocation] = []
        for a in sorted(allocations, key=lambda a: (a.created, a.id)):
            picks = self._picks_for(a)
            if picks is None or a.id in self.allocations:
                lost.append(a)
                continue
            restored.append(self._apply(a, picks, keep_cost=True))
        return restored, lost

    # -- a new inventory -------------------------------------------------------------------
    def rebuilt(self, inventory: Inventory) -> tuple[Ledger, list[Allocation], list[Allocation]]:
        """A new ledger over ``inventory`` with every allocation restored onto it (quotas not
        re-checked, as at start), then this one's outside use; returns it with ``(restored,
        lost)``. Blocked slots are not carried over (outside use blocks its instances anew)."""
        fresh = Ledger(
            inventory, self.offers, self.teams, self.everyone, self.policy, self.cohort_name
        )
        restored, lost = fresh.restore(self.allocations.values())
        fresh.set_outside_use(self.outside)
        fresh.set_outside_shares(self.outside_shares)  # after the ledger's own shares
        return fresh, restored, lost

    def replace_nodes(
        self, inventory: Inventory, names: Iterable[str] = ()
    ) -> tuple[Ledger, list[Allocation], list[Allocation]]:
        """What :meth:`rebuilt` gives for ``inventory``, at the cost of the nodes that differ
        from this ledger's inventory (``names``, and any other node not equal to this one's):
        every other node's GPUs keep their slot state, blocked slots in outside use and
        allocations as they are; only the allocations on the differing nodes are restored
        (``restored``/``lost`` name only those), and only their GPUs' outside use is applied."""
        before = {n.name: n for n in self.inventory.nodes}
        now = {n.name for n in inventory.nodes}
        changed = set(names) | {n for n in before if n not in now}
        changed |= {n.name for n in inventory.nodes if before.get(n.name) != n}
        occ = Occupancy(inventory, carry=(self.occ, changed))
        fresh = Ledger(
            inventory,
            self.offers,
            self.teams,
            self.everyone,
            self.policy,
            self.cohort_name,
            occupancy=occ,
        )
        fresh.outside = dict(self.outside)
        for g_old, milli in self._outside_milli.items():  # taken again below, with the rest
            g = occ.ordinal.get(self.occ.gpus[g_old].uuid)
            if g is not None and occ.node_names[occ.node_of[g]] not in changed:
                occ.free_share(g, milli)
        for b in self.blocked.values():
            g = occ.ordinal.get(b.gpu)
            if g is None or occ.node_names[occ.node_of[g]] in changed:
                continue
            if b.reason == "outside":
                fresh.blocked[b.gpu, b.start] = b
                continue
            geo = occ.geometry[g]  # any other block is not carried over, as in rebuilt()
            p = geo.resolve(b.profile) if geo else None
            assert p is not None
            occ.free_slots(g, p, b.start)
        moving = []
        for a in self.allocations.values():
            if a.node in changed:
                moving.append(a)
                continue
            fresh.allocations[a.id] = a
            fresh.team_used[a.team] += a.cost_milli
            fresh.user_used[a.team, a.user] += a.cost_milli
        restored, lost = fresh.restore(moving)
        for node in inventory.nodes:
            if node.name not in changed:
                continue
            gpus = [occ.ordinal[gpu.uuid] for gpu in node.gpus]
            for gpu in node.gpus:
                for device in (gpu.uuid, *(i.uuid for i in gpu.instances if i.uuid)):
                    if device in fresh.outside:
                        fresh._close(device, gpus)
        fresh.set_outside_shares(self.outside_shares)  # after the ledger's own shares
        return fresh, restored, lost

    # -- internals -------------------------------------------------------------------------
    def _apply(
        self, template: Allocation, picks: list[Pick], keep_cost: bool = False
    ) -> Allocation:
        """Take the picked devices and record ``template`` with them (its id, owner and time)."""
        occ = self.occ
        devices = []
        for pick in picks:
            gpu = occ.gpus[pick.gpu]
            if pick.share is not None:
                occ.take_share(pick.gpu, pick.share)
                devices.append(Device(gpu.uuid, share_milli=pick.share))
            elif pick.profile is None:
                occ.take_whole(pick.gpu)
                devices.append(Device(gpu.uuid, instance=pick.instance))
            else:
                assert pick.start is not None
                occ.take_slots(pick.gpu, pick.profile, pick.start)
                devices.append(Device(gpu.uuid, pick.profile.name, pick.start, pick.instance))
        nodes = {occ.node_names[occ.node_of[p.gpu]] for p in picks}
        allocation = replace(
            template,
            devices=tuple(devices),
            node=nodes.pop() if nodes else None,
            cost_milli=template.cost_milli if keep_cost else sum(map(self._pick_cost, picks)),
        )
        self.allocations[allocation.id] = allocation
        self.team_used[allocation.team] += allocation.cost_milli
        self.user_used[allocation.team, allocation.user] += allocation.cost_milli
        return allocation

    def _pick_cost(self, pick: Pick) -> int:
        if pick.share is not None:
            return pick.share
        geo = self.occ.geometry[pick.gpu]
        return geo.cost_milli(pick.profile) if geo and pick.profile else 1000

    def _picks_for(self, a: Allocation) -> list[Pick] | None:
        """The picks that re-create ``a`` on today's inventory, or ``None`` if it cannot be."""
        occ = self.occ
        picks: list[Pick] = []
        taken: dict[int, int] = {}
        shared: dict[int, int] = {}
        for d in a.devices:
            g = occ.ordinal.get(d.gpu)
            if g is None:
                return None
            gpu = occ.gpus[g]
            if d.share_milli is not None:
                # a share: on a GPU taking shares that nothing holds whole, room left for it
                used = occ.share_used[g] + shared.get(g, 0) + d.share_milli
                if g not in occ.share_group_of or occ.whole[g] or g in taken or used > SHARE_MILLI:
                    return None
                if d.share_milli <= 0:
                    return None
                shared[g] = shared.get(g, 0) + d.share_milli
                picks.append(Pick(g, share=d.share_milli))
                continue
            if d.profile is None:
                if not occ.whole_empty(g) or g in taken or g in shared:
                    return None
                taken[g] = occ.full(g)
                picks.append(Pick(g, instance=d.instance))  # a read-back UUID stays
                continue
            geo = occ.geometry[g]
            p = geo.resolve(d.profile) if geo else None
            if geo is None or p is None or d.start is None or d.start not in p.starts:
                return None
            bits = p.mask_at(d.start)
            if gpu.mig_mode == "off" or occ.whole[g] or (occ.mask[g] | taken.get(g, 0)) & bits:
                return None
            instance = d.instance
            if gpu.mig_mode == "fixed" or occ.reserved[g] & bits:  # must be a pre-made instance
                match = [
                    i for i in gpu.instances if geo.resolve(i.profile) == p and i.start == d.start
                ]
                if not match:
                    return None
                instance = match[0].uuid
            taken[g] = taken.get(g, 0) | bits
            picks.append(Pick(g, p, d.start, instance))
        return picks

    def _no_capacity(
        self, team: Team, user: str, offer: Offer, count: int, avoid: frozenset[int] = frozenset()
    ) -> str:
        what = (
            f"{count}× {offer.model or 'GPU'} on one node"
            if offer.kind == "gpu"
            else offer.label
            if offer.kind == "share"
            else f"{count}× {offer.profile} on one node"
            if count > 1
            else offer.profile
        )
        if avoid:
            others = ", ".join(sorted(self.occ.node_names[n] for n in avoid))
            what = f"{what} on a machine other than {others}"
        outside = self.outside_for(offer)
        return (
            f"No {what} free (team {team.name} uses {fmt(self.team_used[team.name])} of "
            f"{fmt(team.limit_milli)} GPU-eq). Free now: {self.free_now(team, user)}."
            + (self._larger_than_replicas(offer) if offer.kind == "share" else "")
            + (f" Not handed out until nothing else uses it: {'; '.join(outside)}." * bool(outside))
        )

    def _larger_than_replicas(self, offer: Offer) -> str:
        """Why a share offer never fits GPUs split into replicas, where it is too large."""
        needs = self.occ.share_needs(
            offer.model, offer.share_cost_on, offer.share_mib, fitting=False
        )
        for group, need in needs:
            if group.replicas and need > SHARE_MILLI:
                replica = fmt_mib(group.memory_mib // group.replicas)
                return (
                    f" A {offer.label} is larger than one replica of the shared {group.model} "
                    f"GPUs ({replica} each), and a share there gets one replica, never more."
                )
        return ""

    # -- invariants ------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (tests call this)."""
        occ = self.occ
        masks = [0] * len(occ.gpus)
        whole = [False] * len(occ.gpus)
        shared = [0] * len(occ.gpus)
        for b in self.blocked.values():
            g = occ.ordinal[b.gpu]
            geo = occ.geometry[g]
            p = geo.resolve(b.profile) if geo else None
            assert p is not None and b.start in p.starts, f"bad blocked placement {b}"
            assert not masks[g] & p.mask_at(b.start), f"blocked {b} overlaps another"
            assert not occ.reserved[g] & p.mask_at(b.start) or occ.is_fixed_instance(
                g, p, b.start
            ), f"blocked {b} overlaps an admin's instance"
            masks[g] |= p.mask_at(b.start)
        team_used: Counter[str] = Counter()
        user_used: Counter[tuple[str, str]] = Counter()
        for a in self.allocations.values():
            team_used[a.team] += a.cost_milli
            user_used[a.team, a.user] += a.cost_milli
            nodes = {occ.node_of[occ.ordinal[d.gpu]] for d in a.devices}
            assert len(nodes) <= 1, f"{a.id} spans nodes {nodes}"
            for d in a.devices:
                g = occ.ordinal[d.gpu]
                if d.share_milli is not None:
                    assert g in occ.share_group_of, f"{a.id}: share on {d.gpu}, which takes none"
                    assert not whole[g], f"{a.id}: share on whole-held GPU {d.gpu}"
                    assert d.share_milli > 0, f"{a.id}: empty share {d}"
                    shared[g] += d.share_milli
                    assert shared[g] <= SHARE_MILLI, f"{a.id}: shares of {d.gpu} exceed it"
                elif d.profile is None:
                    assert masks[g] == 0 and not shared[g], (
                        f"{a.id}: whole GPU {d.gpu} already has slots or shares taken"
                    )
                    assert occ.gpus[g].mig_mode in ("off", "flex"), f"{a.id}: whole on MIG GPU"
                    assert not occ.share_only[g], f"{a.id}: whole on shares-only GPU {d.gpu}"
                    masks[g], whole[g] = occ.full(g), True
                else:
                    geo = occ.geometry[g]
                    p = geo.resolve(d.profile) if geo else None
                    assert p is not None and d.start in p.starts, f"{a.id}: bad placement {d}"
                    bits = p.mask_at(d.start)
                    assert not whole[g] and not masks[g] & bits, f"{a.id}: {d} has two owners"
                    assert not occ.reserved[g] & bits or occ.is_fixed_instance(g, p, d.start), (
                        f"{a.id}: {d} overlaps an admin's instance"
                    )
                    masks[g] |= bits
        for g, milli in self._outside_milli.items():
            assert not whole[g], f"outside share on whole-held GPU {occ.gpus[g].uuid}"
            shared[g] += milli
            assert shared[g] <= SHARE_MILLI, f"shares of {occ.gpus[g].uuid} exceed it"
        assert masks == occ.mask, "occupancy differs from the allocations"
        closed = [g.uuid in self.outside for g in occ.gpus]
        assert closed == occ.closed, "closed GPUs differ from the devices in outside use"
        assert whole == occ.whole, "whole-GPU flags differ from the allocations"
        assert shared == occ.share_used, "shares differ from the allocations"
        for name, used in team_used.items():
            assert used == self.team_used[name], f"usage counter of team {name} is off"
        assert +self.team_used == +team_used and +self.user_used == +user_used, "counters are off"
        for name, used in team_used.items():
            limit = self.team(name).limit_milli
            assert used <= limit, f"team {name} holds {fmt(used)} > limit {fmt(limit)}"
