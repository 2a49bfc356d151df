"""What this single-user server holds, for the lab's status bar (``GET gpupool/allocation``).

Vocabulary and contract:

- The server's own environment says what it was given: ``GPUPOOL_OFFER``, ``GPUPOOL_TEAM``,
  ``GPUPOOL_ALLOCATION`` (the allocation's id), ``GPUPOOL_SIMULATED`` and the visible devices
  (``CUDA_VISIBLE_DEVICES``, or ``NVIDIA_VISIBLE_DEVICES`` where only the container runtime
  names them, as on Kubernetes).
- The **label** says it in words: ``"H100-80GB ×1 · vision"`` (whole GPUs: the hub's label for
  the number of visible devices), ``"MIG 3g.40gb · nlp"``, ``"CPU only"``. The hub's offers
  document gives the words; without it (the hub did not answer) they come from the offer name's
  conventions (``cpu``, ``mig-<profile>``), so the label always shows.
- The **idle state** comes from the hub's list of the user's allocations: the idle reclaimer's
  ``idle_since`` and its warning ``{"reclaim_at", "action", "reason", "message"}`` for this server's
  allocation, both None when the hub did not answer or says nothing of the kind.
- Pure functions of their arguments: the handler fetches, these decide.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

__all__ = [
    "AllocationInfo",
    "IdleState",
    "IdleWarning",
    "allocation_info",
    "idle_state",
    "offer_label",
    "visible_devices",
]

#: the fields of the hub's idle warning passed on to the lab
WARNING_FIELDS = ("reclaim_at", "action", "message")
WARNING_REASONS = ("idle", "memory", "device")
"""Why the hub warns: the GPUs are idle, a share's processes use more memory than the share, or a
process of this server uses a device it does not hold (a hub that does not say is warning about
idleness)."""
#: ``NVIDIA_VISIBLE_DEVICES`` values that name no device list
NO_DEVICE_LIST = frozenset({"", "all", "none", "void"})

#: one line of the hub's offers document, as the hub sent it
OfferLine = Mapping[str, Any]


class IdleWarning(TypedDict):
    """The idle reclaimer's warning: when and what it will do, in words for the user."""

    reclaim_at: str
    action: str
    reason: str
    message: str


class IdleState(TypedDict):
    idle_since: str | None
    warning: IdleWarning | None


class AllocationInfo(IdleState):
    """The reply of ``GET gpupool/allocation``."""

    label: str
    offer: str
    team: str
    simulated: bool
    allocation: str


def visible_devices(env: Mapping[str, str]) -> list[str]:
    """The device entries this server sees: ``CUDA_VISIBLE_DEVICES`` (``NVIDIA_VISIBLE_DEVICES``
    where only the container runtime names them, as on Kubernetes)."""
    for key in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
        value = env.get(key, "")
        if value.strip().lower() not in NO_DEVICE_LIST:
            return [d.strip() for d in value.split(",") if d.strip()]
    return []


def _hub_choices(offers: Mapping[str, Any] | None, offer: str, team: str) -> list[OfferLine]:
    """The hub's choices for ``offer``: the team's first, else any team's."""
    if not offers or not offer:
        return []
    teams = [t for t in offers.get("teams", []) if isinstance(t, dict)]
    teams.sort(key=lambda t: t.get("team") != team)  # stable: the server's team first
    return [o for t in teams for o in t.get("offers", []) if o.get("name") == offer]


def _strip_count(label: str) -> str:
    """``"H100-80GB ×2"`` → ``"H100-80GB"`` (the hub's labels of counted offers end in ``×N``)."""
    base, sep, count = label.rpartition(" ×")
    return base if sep and count.isdigit() else label


def offer_label(offer: str, devices: int, choices: Sequence[OfferLine]) -> tuple[str, str]:
    """``(label, kind)`` of what the server holds, from the hub's choices or, without them, by
    the offer name's conventions (``cpu``, ``mig-<profile>``)."""
    if choices:
        kind = str(choices[0].get("kind", "gpu"))
        if kind not in ("gpu", "mig"):  # counted offers have a line per count
            return str(choices[0].get("label") or offer), kind
        same = [c for c in choices if c.get("count") == devices]
        if same:
            return str(same[0].get("label")), kind
        base = _strip_count(str(choices[0].get("label") or offer))
        return (f"{base} ×{devices}" if devices else base), kind
    if not offer or offer == "cpu" or (not devices and offer.startswith("cpu")):
        return "CPU only", "cpu"
    if offer.startswith("mig-"):
        return f"MIG {offer.removeprefix('mig-')}", "mig"
    return (f"{offer} ×{devices}" if devices else offer), "gpu"


def idle_state(allocations: Sequence[object] | None, allocation_id: str) -> IdleState:
    """``{"idle_since", "warning"}`` of this server's allocation (``id == allocation_id``) among
    the hub's ``allocations``: the idle reclaimer's ``idle_since`` (ISO time or None) and its
    warning, ``{"reclaim_at", "action", "reason", "message"}`` or None. None for both when the
    hub did not answer (``allocations`` None), the allocation is not listed or has no ``idle``
    (a CPU one)."""
    found: Mapping[str, Any] = {}
    if allocation_id:
        for allocation in allocations or ():
            if isinstance(allocation, Mapping) and str(allocation.get("id")) == allocation_id:
                idle = allocation.get("idle")
                found = idle if isinstance(idle, Mapping) else {}
                break
    warning = found.get("warning")
    idle_since = found.get("idle_since")
    return {
        "idle_since": idle_since if isinstance(idle_since, str) else None,
        "warning": _warning(warning) if isinstance(warning, Mapping) else None,
    }


def _warning(warning: Mapping[str, object]) -> IdleWarning | None:
    """The warning's contract fields, or None when one is missing or not text."""
    reclaim_at, action, message = (warning.get(key) for key in WARNING_FIELDS)
    if not (isinstance(reclaim_at, str) and isinstance(action, str) and isinstance(message, str)):
        return None
    reason = warning.get("reason", "idle")
    if reason not in WARNING_REASONS:
        return None
    return {"reclaim_at": reclaim_at, "action": action, "reason": str(reason), "message": message}


def allocation_info(
    env: Mapping[str, str],
    offers: Mapping[str, Any] | None,
    allocations: Sequence[object] | None = None,
) -> AllocationInfo:
    """What this server holds, for the lab's status: ``{"label", "offer", "team", "simulated",
    "allocation", "idle_since", "warning"}``. ``offers`` is the hub's offers document, or None
    when the hub did not answer; the label then comes from the environment alone.
    ``allocations`` is the hub's list of the user's allocations, or None when the hub did not
    answer; ``idle_since`` and ``warning`` come from it (see :func:`idle_state`).

    Labels: ``"H100-80GB ×1 · vision"`` (whole GPUs: the hub's label for the number of visible
    devices), ``"MIG 3g.40gb · nlp"``, ``"CPU only"``.
    """
    offer, team = env.get("GPUPOOL_OFFER", ""), env.get("GPUPOOL_TEAM", "")
    allocation_id = env.get("GPUPOOL_ALLOCATION", "")
    devices = len(visible_devices(env))
    label, kind = offer_label(offer, devices, _hub_choices(offers, offer, team))
    if kind != "cpu" and team:
        label += f" · {team}"
    simulated_env = env.get("GPUPOOL_SIMULATED")
    if simulated_env is not None and simulated_env != "":
        simulated = simulated_env.strip().lower() in ("1", "true", "yes")
    else:
        simulated = bool(offers and offers.get("simulated"))
    idle = idle_state(allocations, allocation_id)
    return {
        "label": label,
        "offer": offer,
        "team": team,
        "simulated": simulated,
        "allocation": allocation_id,
        "idle_since": idle["idle_since"],
        "warning": idle["warning"],
    }
