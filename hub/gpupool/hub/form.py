"""The spawn page's form: a pure view model printed by a Jinja template (autoescaped), which an
admin may replace or extend.

Vocabulary
- *view* (:class:`FormView`, :func:`form_view`): what the form shows, worked out from the spawn
  menu in Python: per team its legend and quota sentence, per choice its label, cost, free
  count, why it cannot start now and the offer's note, and which radio button is checked (the
  first that can start). Templates only print it.
- *template*: ``gpupool-spawn-form.html`` in ``gpupool/hub/templates`` (:data:`FORM_TEMPLATE`),
  or an admin's ``GPUSpawnerMixin.spawn_form_template`` (Jinja text, which may
  ``{% extends "gpupool-spawn-form.html" %}`` and override its blocks), with
  ``spawn_form_template_paths`` for the admin's own ``{% extends %}`` and ``{% include %}``
  files (after gpupool's: the default's name always means gpupool's). As KubeSpawner's
  ``profile_form_template`` and ``additional_profile_form_template_paths`` do for its profile
  form (kubespawner/spawner.py, ``_render_options_form``).

Contract: :func:`render` returns the HTML JupyterHub puts inside its spawn form; the chosen radio
button posts ``gpupool_choice=team|offer|count`` (:data:`FIELD`). Every value is escaped by
Jinja's autoescape; undefined names in a template are errors (``StrictUndefined``). Whether the
page shows the form at all is ``GPUSpawnerMixin.spawn_form`` (:data:`SPAWN_FORMS`); both settings
are checked at start by :func:`check_spawn_form` (a bad value, a template that does not compile,
names a file that is not there or fails on a sample view stops the hub, naming the key). With
KubeSpawner's ``profile_list``, KubeGPUSpawner puts KubeSpawner's profile form before this one; a
profile's ``gpupool_offers`` (:data:`PROFILE_OFFERS_KEY`) are checked at start by
:func:`check_profile_offers`.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from jinja2 import (
    ChoiceLoader,
    Environment,
    FileSystemLoader,
    StrictUndefined,
    Template,
    TemplateNotFound,
    TemplateSyntaxError,
)

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
TEMPLATES = Path(__file__).parent / "templates"
FORM_TEMPLATE = "gpupool-spawn-form.html"
"""The default template's name, in :data:`TEMPLATES` (an admin's template may extend it)."""
TEMPLATE_KEY, PATHS_KEY = "spawn_form_template", "spawn_form_template_paths"


def check_spawn_form(config: Any) -> None:
    """Stop the hub at start, naming the key, if ``spawn_form`` is set to something unknown or
    the form's template (``spawn_form_template``, ``spawn_form_template_paths``) cannot print
    a form (spawners are built only at the first spawn, too late to say so)."""
    for section in SPAWNER_SECTIONS:
        if section in config and "spawn_form" in config[section]:
            value = config[section]["spawn_form"]
            if value not in SPAWN_FORMS:
                raise ConfigError(
                    f"{section}.spawn_form",
                    f"must be one of {', '.join(SPAWN_FORMS)}, not {value!r}",
                )
    for spawner in SPAWNER_SECTIONS[1:]:  # each spawner class, with what it inherits
        where = {key: _set_in(config, spawner, key) for key in (TEMPLATE_KEY, PATHS_KEY)}
        if not any(where.values()):
            continue
        text = config[where[TEMPLATE_KEY]][TEMPLATE_KEY] if where[TEMPLATE_KEY] else ""
        paths = config[where[PATHS_KEY]][PATHS_KEY] if where[PATHS_KEY] else []
        at_fault = f"{where[TEMPLATE_KEY] or where[PATHS_KEY]}.{TEMPLATE_KEY}"
        try:
            template = form_template(text, paths)
            for sample in SAMPLES:
                render(sample, template)
        except FormTemplateError as e:
            raise ConfigError(f"{where[e.key] or where[TEMPLATE_KEY]}.{e.key}", e.reason) from None
        except TemplateNotFound as e:  # named by an {% extends %} or {% include %}
            raise ConfigError(at_fault, _not_found(e, paths)) from None
        except Exception as e:  # the template fails on a sample form: it would at every spawn
            raise ConfigError(
                at_fault, f"fails on a sample form: {type(e).__name__}: {e}"
            ) from None


def _set_in(config: Any, spawner: str, key: str) -> str | None:
    """The config section ``spawner`` takes ``key`` from (its own, else the mixin's), if set."""
    for section in (spawner, SPAWNER_SECTIONS[0]):
        if section in config and key in config[section]:
            return section
    return None


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


# -- the view ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ChoiceView:
    """One radio button: ``value`` is what it posts; ``cost`` (``"1 GPU-eq"``), ``free``
    (``"3 free now"``), ``description``, ``reason`` (why it cannot start now) and ``note`` (how
    a share is enforced, what a process of several MIG instances sees) are ``""`` when none."""

    value: str
    team: str
    offer: str
    count: int
    label: str
    cost: str
    free: str
    description: str
    reason: str
    note: str
    checked: bool
    disabled: bool


@dataclass(frozen=True)
class TeamView:
    """One team's fieldset: its name, legend ("Team vision", "No team"), quota sentence."""

    name: str
    legend: str
    quota: str
    choices: tuple[ChoiceView, ...]


@dataclass(frozen=True)
class FormView:
    """The whole form: ``simulated`` is the inventory's label on a simulated pool (else
    ``None``); ``nothing_now`` when no choice can start now (no radio button is checked)."""

    field: str
    simulated: str | None
    teams: tuple[TeamView, ...]
    nothing_now: bool


def form_view(
    menus: Sequence[TeamMenu],
    inventory_label: str,
    simulated: bool,
    notes: Mapping[str, str] | None = None,
) -> FormView:
    """The form for these menus; ``notes``: a sentence per offer name shown on its lines (how a
    share of a GPU without MIG is enforced, :func:`gpupool.shares.offer_enforcement`)."""
    checked = False
    teams = []
    for m in menus:
        choices = []
        for c in m.choices:
            check = c.enabled and not checked
            checked |= check
            choices.append(
                ChoiceView(
                    value=c.value,
                    team=c.team,
                    offer=c.offer,
                    count=c.count,
                    label=c.label,
                    cost=f"{fmt(c.cost_milli)} GPU-eq" if c.cost_milli else "",
                    free="" if c.offer == "cpu" or c.cost_milli == 0 else f"{c.free} free now",
                    description=c.description,
                    reason=c.reason,
                    note=(notes or {}).get(c.offer, ""),
                    checked=check,
                    disabled=not c.enabled,
                )
            )
        legend, quota = _legend_and_quota(m)
        teams.append(TeamView(m.team.name, legend, quota, tuple(choices)))
    return FormView(FIELD, inventory_label if simulated else None, tuple(teams), not checked)


def _legend_and_quota(m: TeamMenu) -> tuple[str, str]:
    t = m.team
    quota = (
        f"uses {fmt(m.used_milli)} of {fmt(t.limit_milli)} GPU-eq "
        f"(guarantee {fmt(t.guarantee_milli)}, borrow limit {fmt(t.borrow_limit_milli)}); "
        f"{fmt(m.left_milli)} left"
    )
    if t.user_cap_milli is not None:
        quota += f"; you hold {fmt(m.user_used_milli)} of your {fmt(t.user_cap_milli)} cap"
    if t.name == EVERYONE:  # the pseudo-team of users in no team: no quota to speak of
        return "No team", "You are in no team" + (
            ": CPU only." if not t.limit_milli else f"; {quota}."
        )
    return f"Team {t.name}", f"Team {t.name} {quota}."


_SAMPLE_CHOICE = ChoiceView(
    value="vision|h100|1", team="vision", offer="h100", count=1, label="H100-80GB ×1",
    cost="1 GPU-eq", free="1 free now", description="Hopper", reason="", note="", checked=True,
    disabled=False,
)  # fmt: skip
SAMPLES = (
    FormView(
        FIELD,
        "2 GPUs (simulated)",
        (
            TeamView(
                "vision",
                "Team vision",
                "Team vision uses 1 of 2 GPU-eq (guarantee 1, borrow limit 1); 1 left.",
                (
                    _SAMPLE_CHOICE,
                    replace(
                        _SAMPLE_CHOICE,
                        value="vision|h100|2",
                        count=2,
                        label="H100-80GB ×2",
                        cost="2 GPU-eq",
                        reason="needs 2 GPU-eq; 1 left",
                        note="A note on the offer.",
                        checked=False,
                        disabled=True,
                    ),
                ),
            ),
        ),
        False,
    ),
    FormView(FIELD, None, (), True),
)
"""What a template is tried on at start: a simulated pool with a choice and a refused one, and a
pool where nothing can start."""


# -- the template ---------------------------------------------------------------------------------
class FormTemplateError(Exception):
    """The form's template cannot be used; ``key`` is the setting at fault."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


def form_template(text: str = "", paths: Sequence[str] = ()) -> Template:
    """The template for ``spawn_form_template`` (``""``: gpupool's) and
    ``spawn_form_template_paths`` (:class:`FormTemplateError` when it cannot be loaded)."""
    return _compiled(text, tuple(str(p) for p in paths))


@functools.lru_cache(maxsize=16)
def _compiled(text: str, paths: tuple[str, ...]) -> Template:
    for folder in paths:
        if not Path(folder).is_dir():
            raise FormTemplateError(PATHS_KEY, f"{folder!r} is not a folder")
        if (Path(folder) / FORM_TEMPLATE).exists():
            raise FormTemplateError(
                PATHS_KEY,
                f"{folder!r} holds a {FORM_TEMPLATE}, which never replaces gpupool's (the name "
                f"{FORM_TEMPLATE!r} means gpupool's, so that yours can extend it): rename it "
                f"and name it in {TEMPLATE_KEY}, e.g. '{{% extends \"site-form.html\" %}}'",
            )
    env = _environment(paths)
    try:
        return env.from_string(text) if text else env.get_template(FORM_TEMPLATE)
    except TemplateSyntaxError as e:
        where = f"{e.name or e.filename or 'the template'}, line {e.lineno}"
        raise FormTemplateError(TEMPLATE_KEY, f"{e.message} ({where})") from None
    except TemplateNotFound as e:
        raise FormTemplateError(TEMPLATE_KEY, _not_found(e, paths)) from None


@functools.lru_cache(maxsize=16)
def _environment(paths: tuple[str, ...]) -> Environment:
    """Jinja with autoescape; gpupool's folder first, then the admin's ``paths``."""
    loader = ChoiceLoader([FileSystemLoader(TEMPLATES), FileSystemLoader(list(paths))])
    return Environment(loader=loader, autoescape=True, undefined=StrictUndefined)


def render(form: FormView, template: Template | None = None) -> str:
    """The form's HTML, printed by ``template`` (default: gpupool's)."""
    return (template or form_template()).render(form=form)


def _not_found(e: TemplateNotFound, paths: Sequence[str]) -> str:
    where = ", ".join(map(repr, paths)) or "none set"
    return f"no template {e.name!r} in gpupool's templates nor in {PATHS_KEY} ({where})"
