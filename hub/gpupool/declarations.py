"""Turn the admin's plain config (dicts from ``jupyterhub_config.py``, Helm values) into core types.

Vocabulary
- *key path*: where a value sits in the config, e.g. ``GPUPool.teams['vision'].guarantee``; every
  :class:`ConfigError` starts with it, so a bad config names the key to fix.
- *settings*: the validated result: offers, teams and the ``everyone`` pseudo-team.

- *odd setting*: valid on its own, but pointless for the pool it runs on (an offer no GPU of the
  pool can serve, a user cap above its team's limit, a guarantee larger than the pool):
  :func:`config_warnings` finds them, one sentence each starting with the key path; the pool logs
  them at start as warnings and starts anyway.

Contract: pure (no I/O). Each ``parse_*`` function validates one part on its own;
:func:`parse_settings` adds the checks across parts (a team allowed an offer that is not defined).
The Helm chart's schema of offers and teams is built from the definitions here
(:mod:`gpupool.declarations_schema`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from traitlets import TraitError

from gpupool.core.inventory import GPU, Inventory
from gpupool.core.ledger import Ledger
from gpupool.core.limits import LIMIT_KEYS, NO_LIMITS, UserLimits
from gpupool.core.mig import GEOMETRIES
from gpupool.core.offers import Offer, fmt_mib, mig_costs, model_memory_mib
from gpupool.core.quota import EVERYONE, Team
from gpupool.core.units import GPU_MILLI, fmt, to_milli

MODEL_KEY = re.compile(r"^[A-Z][A-Z0-9]*-\d+GB$")
"""A GPU model key, e.g. ``H100-80GB``."""
OFFER_KINDS = ("cpu", "gpu", "mig", "share")
OFFER_KEYS = {
    "kind",
    "description",
    "model",
    "max_count",
    "nvlink",
    "profile",
    "memory",
    "fraction",
}
MEMORY_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(GB|GiB|MB|MiB)\s*$", re.I)
"""A share's size, e.g. ``6GB`` (case does not matter)."""
TEAM_KEYS = {
    "guarantee",
    "borrow_limit",
    "user_cap",
    "offers",
    "min_priority",
    "max_priority",
    "user_limits",
}
PRIORITY_RANGES = {"min_priority": (-100, 0), "max_priority": (0, 100)}
"""The bounds of a team's ``min_priority`` and ``max_priority``."""


class ConfigError(TraitError):
    """A bad gpupool setting; the message starts with the key path."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class Settings:
    offers: dict[str, Offer]
    teams: dict[str, Team]
    everyone: Team


def _unknown_keys(path: str, spec: Mapping[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(spec) - allowed)
    if extra:
        raise ConfigError(
            f"{path}.{extra[0]}", f"unknown key; allowed keys are {', '.join(sorted(allowed))}"
        )


def _mapping(path: str, value: Any, example: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(path, f"must be a dict, got {value!r}; example: {example}")
    return value


def _gpu_eq(path: str, value: Any, *, positive: bool = False) -> int:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(path, f"must be a number {bound} (GPU-equivalents), got {value!r}")
    return to_milli(value)


def _priority(path: str, value: Any, low: int, high: int) -> int:
    """A bound of a team's priority range; the range always holds 0, a job's default."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(path, f"must be a whole number from {low} to {high}, got {value!r}")
    return value


def parse_user_limits(path: str, value: Any) -> dict[str, int]:
    """Per-user limits given as ``{"jobs": 20, "log_followers": 4, "spawns": 2}`` (any of the
    keys; each a whole number, 0 for no limit): the keys given, checked."""
    value = _mapping(path, value, '{"jobs": 20, "log_followers": 4, "spawns": 2}')
    _unknown_keys(path, value, set(LIMIT_KEYS))
    for key, limit in value.items():
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ConfigError(
                f"{path}.{key}", f"must be a whole number >= 0 (0: no limit), got {limit!r}"
            )
    return dict(value)


def parse_memory(path: str, value: Any) -> int:
    """A share's size in MiB from ``"6GB"``, ``"6 GiB"``, ``"512MB"`` or ``"6144MiB"`` (GB and GiB
    are both 1024 MiB, as in model keys like ``RTX3090-24GB``; MB and MiB are MiB)."""
    m = MEMORY_SIZE.match(value) if isinstance(value, str) else None
    mib = 0
    if m:
        number, unit = float(m.group(1)), m.group(2).lower()
        mib = round(number * 1024) if unit in ("gb", "gib") else round(number)
    if mib < 1:
        raise ConfigError(
            path, f"must be a size like '6GB' or '512MB' (GB = 1024 MiB), got {value!r}"
        )
    return mib


def _share(path: str, spec: Mapping[str, Any], model: str | None) -> tuple[int | None, int | None]:
    """``(share_milli, share_mib)`` of a share offer: exactly one of ``fraction`` or ``memory``."""
    if ("memory" in spec) == ("fraction" in spec):
        raise ConfigError(
            path,
            "a 'share' offer takes exactly one of 'memory' (a size, e.g. '6GB') or 'fraction' "
            "(of the GPU's memory, e.g. 0.25)",
        )
    if "fraction" in spec:
        fraction = spec["fraction"]
        ok = isinstance(fraction, int | float) and not isinstance(fraction, bool)
        milli = round(fraction * GPU_MILLI) if ok else 0
        if not ok or not 0 < fraction <= 1 or milli < 1:
            raise ConfigError(
                f"{path}.fraction",
                f"must be a number above 0 and at most 1 (at least 0.001), got {fraction!r}",
            )
        return milli, None
    mib = parse_memory(f"{path}.memory", spec["memory"])
    memory = model_memory_mib(model) if model else None
    if memory is not None and mib > memory:
        raise ConfigError(
            f"{path}.memory", f"{fmt_mib(mib)} is more than a {model} has ({fmt_mib(memory)})"
        )
    return None, mib


def default_kind(name: str) -> str:
    """The kind of an offer that names none: ``cpu``, ``mig-…``, ``share-…``, else ``gpu``."""
    if name == "cpu":
        return "cpu"
    return "mig" if name.startswith("mig-") else "share" if name.startswith("share-") else "gpu"


def parse_offer(name: str, spec: Any) -> Offer:
    """One offer from ``{"kind": "mig", "profile": "3g.40gb"}`` (kind inferred from the name:
    ``cpu``, ``mig-…``, ``share-…``, else ``gpu``). A share offer: ``{"kind": "share", "memory":
    "6GB", "model": "RTX3090-24GB"}`` or ``{"kind": "share", "fraction": 0.25}``; by memory without
    a model it may cost different fractions on different GPUs (the ledger checks the quota again
    with the cost of the GPU it lands on)."""
    path = f"GPUPool.offers[{name!r}]"
    spec = _mapping(path, spec, '{"kind": "gpu", "model": "H100-80GB", "max_count": 4}')
    _unknown_keys(path, spec, OFFER_KEYS)
    kind = spec.get("kind", default_kind(name))
    if kind not in OFFER_KINDS:
        raise ConfigError(
            f"{path}.kind",
            f"must be 'cpu', 'gpu' or 'mig', or 'share' (a share of a GPU without MIG), "
            f"got {kind!r}",
        )
    model = spec.get("model")
    if model is not None and (not isinstance(model, str) or not MODEL_KEY.match(model)):
        raise ConfigError(
            f"{path}.model", f"must be a model key like 'H100-80GB' or 'A100-40GB', got {model!r}"
        )
    max_count = spec.get("max_count", 1)
    if kind not in ("gpu", "mig") and "max_count" in spec:
        raise ConfigError(
            f"{path}.max_count", "only 'gpu' and 'mig' offers take a count (GPUs, instances)"
        )
    if not isinstance(max_count, int) or isinstance(max_count, bool) or max_count < 1:
        raise ConfigError(f"{path}.max_count", f"must be an integer >= 1, got {max_count!r}")
    nvlink = spec.get("nvlink", False)
    if not isinstance(nvlink, bool):
        raise ConfigError(f"{path}.nvlink", f"must be true or false, got {nvlink!r}")
    profile = spec.get("profile")
    if kind == "mig":
        profile = profile or name.removeprefix("mig-")
        costs = mig_costs(profile, model)
        if not costs:
            where = f"model {model}" if model else "any MIG-capable model"
            have = sorted(p.name for p in GEOMETRIES[model].profiles) if model in GEOMETRIES else []
            hint = f" ({model} has {', '.join(have)})" if have else ""
            raise ConfigError(
                f"{path}.profile", f"{profile!r} is not a MIG profile of {where}{hint}"
            )
        if len(set(costs.values())) > 1:
            raise ConfigError(
                f"{path}.model",
                f"{profile!r} takes a different share of the GPU on {', '.join(sorted(costs))}; "
                "set 'model' to one of them",
            )
        profile = next(GEOMETRIES[m].resolve(profile) for m in costs).name  # type: ignore[union-attr]
    elif profile is not None:
        raise ConfigError(f"{path}.profile", "only 'mig' offers take a profile")
    description = spec.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"{path}.description", f"must be text, got {description!r}")
    share_milli = share_mib = None
    if kind == "share":
        if "nvlink" in spec:
            raise ConfigError(f"{path}.nvlink", "only 'gpu' offers take nvlink")
        share_milli, share_mib = _share(path, spec, model)
    else:
        for key in ("memory", "fraction"):
            if key in spec:
                raise ConfigError(f"{path}.{key}", "only 'share' offers take a memory or fraction")
    return Offer(
        name,
        kind,
        description,
        model,
        max_count,
        nvlink,
        profile,
        share_milli,
        share_mib,
    )


def parse_offers(offers: Any) -> dict[str, Offer]:
    offers = _mapping("GPUPool.offers", offers, '{"cpu": {}, "mig-3g.40gb": {}}')
    return {name: parse_offer(name, spec) for name, spec in offers.items()}


def parse_team(
    name: str, spec: Any, path: str | None = None, user_limits: UserLimits = NO_LIMITS
) -> Team:
    """One team from ``{"guarantee": 2, "borrow_limit": 1, "user_cap": 1, "offers": [...],
    "min_priority": -100, "max_priority": 0, "user_limits": {"jobs": 50}}`` (the priorities its
    users may give their jobs; its ``user_limits`` keys over the hub's, ``user_limits``)."""
    path = path or f"GPUPool.teams[{name!r}]"
    spec = _mapping(path, spec, '{"guarantee": 2, "borrow_limit": 1, "offers": ["mig-3g.40gb"]}')
    _unknown_keys(path, spec, TEAM_KEYS)
    offers = spec.get("offers")
    if offers is not None and (
        not isinstance(offers, list | tuple | set) or not all(isinstance(o, str) for o in offers)
    ):
        raise ConfigError(f"{path}.offers", f"must be a list of offer names, got {offers!r}")
    cap = spec.get("user_cap")
    limits = parse_user_limits(f"{path}.user_limits", spec.get("user_limits", {}))
    return Team(
        name,
        _gpu_eq(f"{path}.guarantee", spec.get("guarantee", 0)),
        _gpu_eq(f"{path}.borrow_limit", spec.get("borrow_limit", 0)),
        None if cap is None else _gpu_eq(f"{path}.user_cap", cap, positive=True),
        None if offers is None else frozenset(offers),
        _priority(
            f"{path}.min_priority", spec.get("min_priority", -100), *PRIORITY_RANGES["min_priority"]
        ),
        _priority(
            f"{path}.max_priority", spec.get("max_priority", 0), *PRIORITY_RANGES["max_priority"]
        ),
        user_limits.overridden(limits),
    )


def parse_teams(teams: Any, user_limits: UserLimits = NO_LIMITS) -> dict[str, Team]:
    teams = _mapping("GPUPool.teams", teams, '{"vision": {"guarantee": 2}}')
    if EVERYONE in teams:
        raise ConfigError(
            f"GPUPool.teams[{EVERYONE!r}]", "is reserved; configure it as GPUPool.everyone"
        )
    return {name: parse_team(name, spec, user_limits=user_limits) for name, spec in teams.items()}


def parse_settings(offers: Any, teams: Any, everyone: Any, user_limits: Any = None) -> Settings:
    """All of it, with the cross-checks: every offer a team names must be defined. Every team
    gets the per-user limits ``user_limits`` (the hub's, ``GPUPool.user_limits``; default: none)
    with its own keys over them."""
    limits = UserLimits(**parse_user_limits("GPUPool.user_limits", user_limits or {}))
    parsed_offers = parse_offers(offers)
    parsed_teams = parse_teams(teams, limits)
    parsed_everyone = parse_team(EVERYONE, everyone, "GPUPool.everyone", limits)
    for path, team in [(f"GPUPool.teams[{t.name!r}]", t) for t in parsed_teams.values()] + [
        ("GPUPool.everyone", parsed_everyone)
    ]:
        for offer in sorted(team.offers or ()):
            if offer not in parsed_offers:
                raise ConfigError(
                    f"{path}.offers",
                    f"offer {offer!r} is not defined in GPUPool.offers "
                    f"(defined: {', '.join(sorted(parsed_offers)) or 'none'})",
                )
    return Settings(parsed_offers, parsed_teams, parsed_everyone)


def config_warnings(settings: Settings, inventory: Inventory) -> list[str]:
    """The odd settings for ``inventory``, one sentence each, starting with the key path: an offer
    the pool can never grant (a model it lacks, MIG on or off where the offer needs the other, no
    room in fixed MIG layouts) or a ``max_count`` above what one node can give, a user cap above
    its team's limit, a guarantee larger than the whole pool, and guarantees that add up to more
    than the pool. What "can be granted" is the allocator's own answer on the empty pool
    (:meth:`Ledger.placeable`)."""
    gpus = inventory.gpus
    have = _describe_gpus(gpus)
    empty = Ledger(inventory, settings.offers, settings.teams, settings.everyone)
    out: list[str] = []
    for name, offer in sorted(settings.offers.items()):
        if offer.kind == "cpu":
            continue
        path = f"GPUPool.offers[{name!r}]"
        most = empty.placeable(offer)
        if most == 0:
            key, reason = _never(path, offer, gpus, have)
            out.append(f"{key}: {reason}; the offer can never be granted")
            continue
        if offer.kind == "mig" and offer.max_count > 1:  # all of a request's on one node
            most = max(empty.node_capacities(offer), default=0)
        if offer.kind in ("gpu", "mig") and offer.max_count > most:
            if offer.kind == "mig":
                what = f"{offer.profile} instances"
            else:
                what = f"whole {offer.model} GPUs" if offer.model else "whole GPUs of one model"
            out.append(
                f"{path}.max_count: {offer.max_count} is more than one request can get: at most "
                f"{most} {what} on one node; larger requests can never be granted"
            )
    pool = len(gpus) * GPU_MILLI
    teams = [(f"GPUPool.teams[{n!r}]", t, "the team's") for n, t in sorted(settings.teams.items())]
    teams.append(("GPUPool.everyone", settings.everyone, "everyone's"))
    for path, team, whose in teams:
        guarantee, borrow = team.guarantee_milli, team.borrow_limit_milli
        cap = team.user_cap_milli
        if cap is not None and cap > team.limit_milli:
            out.append(
                f"{path}.user_cap: {fmt(cap)} GPU-eq is above {whose} limit of "
                f"{fmt(team.limit_milli)} (guarantee {fmt(guarantee)} + borrow limit "
                f"{fmt(borrow)}); it can never be reached"
            )
        if guarantee > pool:
            out.append(
                f"{path}.guarantee: {fmt(guarantee)} GPU-eq is more than the whole pool "
                f"({fmt(pool)} GPU-eq: {have}); it can never be met in full"
            )
    guaranteed = [(t.name, t.guarantee_milli) for _, t, _ in teams if t.guarantee_milli]
    total = sum(g for _, g in guaranteed)
    if len(guaranteed) > 1 and total > pool:
        each = ", ".join(f"{name} {fmt(g)}" for name, g in sorted(guaranteed))
        out.append(
            f"GPUPool.teams: the guarantees add up to {fmt(total)} GPU-eq ({each}), more than "
            f"the whole pool ({fmt(pool)} GPU-eq: {have}); they cannot all be met at once"
        )
    return out


def _describe_gpus(gpus: tuple[GPU, ...]) -> str:
    """``"2× A100-40GB, 4× H100-80GB (2 with MIG on)"``, or ``"no GPUs"``."""
    parts = []
    for model in sorted({g.model for g in gpus}):
        same = [g for g in gpus if g.model == model]
        on = sum(g.mig_enabled for g in same)
        parts.append(f"{len(same)}× {model}" + (f" ({on} with MIG on)" if on else ""))
    return ", ".join(parts) or "no GPUs"


def _never(path: str, offer: Offer, gpus: tuple[GPU, ...], have: str) -> tuple[str, str]:
    """The key and the reason an offer the empty pool cannot place can never be granted."""
    if not gpus:
        return path, "the pool has no GPUs"
    if offer.model is not None and not any(g.model == offer.model for g in gpus):
        return f"{path}.model", f"the pool has no {offer.model} (it has {have})"
    if offer.kind == "gpu":
        if any(g.share_resource and offer.model in (None, g.model) for g in gpus):
            return path, (
                f"every {offer.model or 'GPU'} in the pool has MIG on or is shared out by the "
                "device plugin (time-slicing, MPS or HAMi), so none can be granted whole"
            )
        return path, (
            f"every {offer.model or 'GPU'} in the pool has MIG on, and gpupool never switches "
            "MIG mode, so none can be granted whole"
        )
    if offer.kind == "share":
        off = [g for g in gpus if g.mig_mode == "off" and offer.model in (None, g.model)]
        if not off:
            return path, (
                f"every {offer.model or 'GPU'} in the pool has MIG on (shares need MIG off), and "
                "gpupool never switches MIG mode"
            )
        if not any(g.share_resource != "" for g in off):
            return path, (
                f"the device plugin hands every {offer.model or 'GPU'} with MIG off out whole "
                "(no time-slicing, MPS or HAMi on its nodes), so no share can be placed"
            )
        key = f"{path}.memory" if offer.share_mib is not None else path
        if any(g.share_replicas for g in off):
            return key, (
                f"{offer.label} is larger than every GPU with MIG off it could land on, or than "
                "one replica where the device plugin shares a GPU"
            )
        return key, f"{offer.label} is larger than every GPU with MIG off it could land on"
    profile = offer.profile or ""
    models = set(mig_costs(profile, offer.model))
    able = [g for g in gpus if g.mig_capable and g.model in models]
    if not able:
        return path, f"no GPU in the pool has the MIG profile {profile} (it has {have})"
    names = ", ".join(sorted({g.model for g in able}))
    if not any(g.mig_enabled for g in able):
        return path, f"every {names} in the pool has MIG off, and gpupool never switches MIG mode"
    return path, (
        f"no {names} in the pool with MIG on has a {profile} instance or room to make one "
        "(their instances are fixed)"
    )
