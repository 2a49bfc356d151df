"""The spawn page's HTML: a plain form (radio buttons, no JavaScript needed), escaped throughout.

Contract: ``render(menus, inventory_label, simulated)`` returns the HTML JupyterHub puts inside its
spawn form; the chosen radio button posts ``gpupool_choice=team|offer|count``. Whether the page
shows it at all is ``GPUSpawnerMixin.spawn_form`` (:data:`SPAWN_FORMS`, checked at start by
:func:`check_spawn_form`). With KubeSpawner's ``profile_list``, KubeGPUSpawner puts KubeSpawner's
profile form before this one; a profile's ``gpupool_offers`` (:data:`PROFILE_OFFERS_KEY`) are
checked at start by :func:`check_profile_offers`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from html import escape
from typing import Any

from gpupool.core.quota import EVERYONE
from gpupool.core.units import fmt
from gpupool.declarations import ConfigError
from gpupool.hub.menu import TeamMenu

FIELD = "gpupool_choice"
SPAWN_FORMS = ("choices", "always", "never")
"""The values of ``GPUSpawnerMixin.spawn_form``: when the spawn page shows this form."""
SPAWNER_SECTIONS = ("GPUSpawnerMixin", "LocalGPUSpawner", "KubeGPUSpawner")
PROFILE_OFFERS_KEY = "gpupool_offers"
"""The key of a KubeSpawner ``profile_list`` entry naming the gpupool offers it allows."""


def check_spawn_form(config: Any) -> None:
    """Stop the hub at start, naming the key, if ``spawn_form`` is set to something unknown
    (spawners are built only at the first spawn, too late to say so)."""
    for section in SPAWNER_SECTIONS:
        if section in config and "spawn_form" in config[section]:
            value = config[section]["spawn_form"]
            if value not in SPAWN_FORMS:
                raise ConfigError(
                    f"{section}.spawn_form",
                    f"must be one of {', '.join(SPAWN_FORMS)}, not {value!r}",
                )


def check_profile_offers(config: Any, offers: Collection[str]) -> None:
    """Stop the hub at start, naming the key, if a profile of ``c.KubeSpawner.profile_list`` or
    ``c.KubeGPUSpawner.profile_list`` (a list or a dict; a callable is checked at each spawn)
    has ``gpupool_offers`` that are not a list of the pool's ``offers``."""
    for section in ("KubeSpawner", "KubeGPUSpawner"):
        if section not in config or "profile_list" not in config[section]:
            continue
        profiles = config[section]["profile_list"]
        if isinstance(profiles, dict):
            entries = [(repr(k), v) for k, v in profiles.items()]
        elif isinstance(profiles, list | tuple):
            entries = [(str(i), v) for i, v in enumerate(profiles)]
        else:
            continue
        for where, profile in entries:
            if not isinstance(profile, dict) or PROFILE_OFFERS_KEY not in profile:
                continue
            value = profile[PROFILE_OFFERS_KEY]
            ok = isinstance(value, list | tuple) and all(isinstance(o, str) for o in value)
            unknown = [o for o in value if o not in offers] if ok else []
            if not ok or unknown:
                raise ConfigError(
                    f"{section}.profile_list[{where}].{PROFILE_OFFERS_KEY}",
                    f"must list offers of the pool ({', '.join(sorted(offers))}), not {value!r}",
                )


def render(
    menus: list[TeamMenu],
    inventory_label: str,
    simulated: bool,
    notes: Mapping[str, str] | None = None,
) -> str:
    """The form; ``notes``: a sentence per offer name shown on its lines (how a share of a GPU
    without MIG is enforced, :func:`gpupool.shares.offer_enforcement`)."""
    parts = ['<div class="gpupool-form">']
    if simulated:
        parts.append(
            '<div class="alert alert-warning gpupool-simulated" role="note">'
            f"<strong>Simulated pool</strong>: no real GPUs ({escape(inventory_label)}). "
            "Devices and UUIDs below are simulated.</div>"
        )
    checked = False
    for m in menus:
        t = m.team
        quota = (
            f"uses {fmt(m.used_milli)} of {fmt(t.limit_milli)} GPU-eq "
            f"(guarantee {fmt(t.guarantee_milli)}, borrow limit {fmt(t.borrow_limit_milli)}); "
            f"{fmt(m.left_milli)} left"
        )
        if t.user_cap_milli is not None:
            quota += f"; you hold {fmt(m.user_used_milli)} of your {fmt(t.user_cap_milli)} cap"
        if t.name == EVERYONE:  # the pseudo-team of users in no team: no quota to speak of
            legend = "No team"
            quota = "You are in no team" + (": CPU only." if not t.limit_milli else f"; {quota}.")
        else:
            legend, quota = f"Team {t.name}", f"Team {t.name} {quota}."
        parts.append(
            f'<fieldset class="gpupool-team" data-team="{escape(t.name)}">'
            f"<legend>{escape(legend)}</legend>"
            f'<p class="gpupool-quota">{escape(quota)}</p>'
        )
        for c in m.choices:
            attrs = ""
            if c.enabled and not checked:
                attrs, checked = " checked", True
            if not c.enabled:
                attrs += " disabled"
            free = "" if c.offer == "cpu" or c.cost_milli == 0 else f" · {c.free} free now"
            cost = f" · {fmt(c.cost_milli)} GPU-eq" if c.cost_milli else ""
            why = f' <span class="gpupool-why">({escape(c.reason)})</span>' if c.reason else ""
            why += _note((notes or {}).get(c.offer, ""))
            desc = (
                f' <span class="text-muted">{escape(c.description)}</span>' if c.description else ""
            )
            parts.append(
                '<div class="radio"><label>'
                f'<input type="radio" name="{FIELD}" value="{escape(c.value)}"{attrs}> '
                f"<strong>{escape(c.label)}</strong>{escape(cost)}{escape(free)}{desc}{why}"
                "</label></div>"
            )
        parts.append("</fieldset>")
    if not checked:
        parts.append('<p class="gpupool-nothing">Nothing can be granted right now.</p>')
    parts.append("</div>")
    return "\n".join(parts)


def _note(note: str) -> str:
    """An offer's note (how a share is enforced) as the form prints it, escaped."""
    return f' <span class="gpupool-enforcement">{escape(note)}</span>' if note else ""
