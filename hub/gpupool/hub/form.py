"""The spawn page's HTML: a plain form (radio buttons, no JavaScript needed), escaped throughout.

Contract: ``render(menus, inventory_label, simulated)`` returns the HTML JupyterHub puts inside its
spawn form; the chosen radio button posts ``gpupool_choice=team|offer|count``. Whether the page
shows it at all is ``GPUSpawnerMixin.spawn_form`` (:data:`SPAWN_FORMS`, checked at start by
:func:`check_spawn_form`).
"""

from __future__ import annotations

from html import escape
from typing import Any

from ..core.quota import EVERYONE
from ..core.units import fmt
from ..settings import ConfigError
from .menu import TeamMenu

FIELD = "gpupool_choice"
SPAWN_FORMS = ("choices", "always", "never")
"""The values of ``GPUSpawnerMixin.spawn_form``: when the spawn page shows this form."""
SPAWNER_SECTIONS = ("GPUSpawnerMixin", "LocalGPUSpawner", "KubeGPUSpawner")


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


def render(menus: list[TeamMenu], inventory_label: str, simulated: bool) -> str:
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
