"""The spawn form: a view model printed by a Jinja template (autoescaped) an admin may replace or
extend (``GPUSpawnerMixin.spawn_form_template``, ``spawn_form_template_paths``).

- The default template prints, byte for byte, what the form printed before it was a template
  (``spawn_form_before.html``: three pools' forms, from the f-string code it replaced).
- Hostile text in every field of the view (team and offer names, labels, descriptions, reasons,
  notes, the inventory's label) is printed as text: no element or attribute of its own.
- An admin's template that extends the default changes the blocks it overrides, only those; one
  of the admin's own files (``spawn_form_template_paths``) may extend it too.
- A bad template stops the hub at start naming the key (:func:`check_spawn_form`, which
  ``setup(c)`` runs): a syntax error, a file that is not there, a name the form does not have,
  a folder that is not one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from bs4 import BeautifulSoup
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.declarations import ConfigError
from gpupool.hub import setup
from gpupool.hub.form import (
    FIELD,
    SAMPLES,
    ChoiceView,
    FormView,
    TeamView,
    check_spawn_form,
    form_template,
    render,
)
from gpupool.hub.objects import SETTINGS_KEY, build
from gpupool.pool import Pool
from gpupool_spawner.local import LocalGPUSpawner
from tests.accounts import shared_mode
from tests.hub.hostile import HOSTILE

LOG = logging.getLogger("gpupool.tests.spawn_form")
BEFORE = Path(__file__).with_name("spawn_form_before.html")
EXTENDED = (
    '{% extends "gpupool-spawn-form.html" %}'
    "{% block intro %}\n<p class=site-help>GPUs: ask in #gpu-help</p>{% endblock %}"
    "{% block choice %}{{ super() }}<!-- {{ choice.offer }} -->{% endblock %}"
)


def config(tmp: Path) -> Config:
    """The pool ``spawn_form_before.html`` was printed from (simulated)."""
    c = Config()
    c.GPUPool.inventory = (
        "simulated:n: 2x H100-80GB; m: 1x H100-80GB, mig=1:1g.10gb+1g.10gb+1g.10gb"
    )
    c.GPUPool.db_url = f"sqlite:///{tmp / 'pool.sqlite'}"
    c.GPUPool.offers = {
        "cpu": {},
        "h100": {
            "kind": "gpu", "model": "H100-80GB", "max_count": 2,
            "description": "Hopper & friends <fast>",
        },
        "mig-1g.10gb": {"model": "H100-80GB", "max_count": 2},
    }  # fmt: skip
    c.GPUPool.teams = {
        "vision": {"guarantee": 1, "borrow_limit": 1, "user_cap": 1.5},
        "nlp": {"guarantee": 0, "offers": ["cpu", "mig-1g.10gb"]},
        "audio": {"guarantee": 0, "offers": ["mig-1g.10gb"]},
    }
    c.LocalGPUSpawner.spawn_form = "always"
    shared_mode(c)
    return c


def forms(c: Config) -> dict[str, str]:
    """The spawn form of three users (two teams; no team; nothing they may start now), as their
    spawners print it; bo holds one of vision's GPUs."""
    pool = Pool.from_config(GPUPool(config=c))
    pool.allocate("bo", ["vision"], "h100", 1, team="vision", ref="bo/")
    objects = build(pool, c, LOG)
    printed = {}
    for case, name, groups in [
        ("two teams, simulated, notes", "ada", ["vision", "nlp"]),
        ("no team", "eve", []),
        ("nothing now", "cy", ["audio"]),
    ]:
        user = SimpleNamespace(
            name=name, groups=[SimpleNamespace(name=g) for g in groups], url=f"/user/{name}/",
            escaped_name=name, settings={SETTINGS_KEY: objects},
        )  # fmt: skip
        spawner = LocalGPUSpawner(config=c, user=user, hub=SimpleNamespace(base_url="/hub/"))
        printed[case] = spawner._render_gpupool_form()
    return printed


def before() -> dict[str, str]:
    cases = BEFORE.read_text().split("<!-- case: ")[1:]
    return {c.partition(" -->\n")[0]: c.partition(" -->\n")[2].removesuffix("\n") for c in cases}


def test_the_default_template_prints_the_form_as_before(tmp_path: Path) -> None:
    assert forms(config(tmp_path)) == before()


def test_hostile_text_in_every_field_is_printed_as_text() -> None:
    for name, value in HOSTILE.items():
        choice = ChoiceView(
            value=value, team=value, offer=value, count=1, label=value, cost=value, free=value,
            description=value, reason=value, note=value, checked=True, disabled=True,
        )  # fmt: skip
        team = TeamView(value, value, value, (choice,))
        html = render(FormView(FIELD, value, (team,), True))
        soup = BeautifulSoup(html, "html.parser")
        tags = {t.name for t in soup.find_all(True)}
        assert tags == {"div", "strong", "fieldset", "legend", "p", "label", "input", "span"}, name
        assert not [a for t in soup.find_all(True) for a in t.attrs if a.startswith("on")], name
        assert soup.find("fieldset")["data-team"] == value, name
        assert soup.find("input")["value"] == value, name
        texts = [t.get_text() for t in soup.find_all(["legend", "strong", "span"])]
        assert texts.count(value) == 4, name  # legend, label, description, note
        assert f"({value})" in texts, name  # the reason
        assert soup.find("p", class_="gpupool-quota").get_text() == value, name
        assert f"{value} · {value} · {value} " in soup.find("label").get_text(), name
        assert f"no real GPUs ({value})" in soup.div.get_text(), name


def test_an_admins_template_extending_the_default_changes_its_blocks(tmp_path: Path) -> None:
    c = config(tmp_path)
    c.GPUSpawnerMixin.spawn_form_template = EXTENDED
    check_spawn_form(c)
    theirs, ours = forms(c)["two teams, simulated, notes"], before()["two teams, simulated, notes"]
    lines = theirs.splitlines()
    assert lines[1] == "<p class=site-help>GPUs: ask in #gpu-help</p>", theirs
    choices = [line for line in lines if line.startswith('<div class="radio">')]
    assert len(choices) == 8 and choices[0].endswith("</label></div><!-- cpu -->")
    unchanged = [line.removesuffix(line[line.rindex("<!--") :]) if "<!--" in line else line
                 for line in lines[:1] + lines[2:]]  # fmt: skip
    assert "\n".join(unchanged) == ours


def test_an_admins_own_file_may_extend_the_default(tmp_path: Path) -> None:
    folder = tmp_path / "templates"
    folder.mkdir()
    (folder / "site-form.html").write_text(
        '{% extends "gpupool-spawn-form.html" %}'
        '{% block quota %}<p class="site-quota">{{ team.quota | upper }}</p>{% endblock %}'
    )
    c = config(tmp_path)
    c.LocalGPUSpawner.spawn_form_template = '{% extends "site-form.html" %}'
    c.LocalGPUSpawner.spawn_form_template_paths = [str(folder)]
    check_spawn_form(c)
    page = forms(c)["no team"]
    assert '<legend>No team</legend><p class="site-quota">YOU ARE IN NO TEAM: CPU ONLY.</p>' in page


@pytest.mark.parametrize(
    ("settings", "key", "says"),
    [
        ({"spawn_form_template": "{% block intro %}"}, "GPUSpawnerMixin.spawn_form_template",
         "Unexpected end of template"),
        ({"spawn_form_template": '{% extends "site-form.html" %}'},
         "GPUSpawnerMixin.spawn_form_template", "no template 'site-form.html'"),
        ({"spawn_form_template": "{{ form.teams[0].colour }}"},
         "GPUSpawnerMixin.spawn_form_template", "fails on a sample form: UndefinedError"),
        ({"spawn_form_template_paths": ["/nonexistent/templates"]},
         "GPUSpawnerMixin.spawn_form_template_paths", "'/nonexistent/templates' is not a folder"),
    ],
)  # fmt: skip
def test_a_bad_template_stops_the_hub_naming_the_key(
    settings: dict[str, object], key: str, says: str
) -> None:
    c = Config()
    for name, value in settings.items():
        c.GPUSpawnerMixin[name] = value
    with pytest.raises(ConfigError) as refused:
        check_spawn_form(c)
    assert refused.value.path == key and says in refused.value.reason, refused.value


def test_a_file_named_as_the_default_is_refused_rather_than_silently_ignored(
    tmp_path: Path,
) -> None:
    (tmp_path / "gpupool-spawn-form.html").write_text("<p>mine</p>")
    c = Config()
    c.KubeGPUSpawner.spawn_form_template_paths = [str(tmp_path)]
    with pytest.raises(ConfigError, match=r"^KubeGPUSpawner.spawn_form_template_paths: .*rename"):
        check_spawn_form(c)


def test_the_samples_a_template_is_tried_on_reach_every_branch_of_the_default() -> None:
    printed = [render(sample, form_template()) for sample in SAMPLES]
    for piece in ("gpupool-simulated", " checked>", " disabled>", "gpupool-why",
                  "gpupool-enforcement", "text-muted", "gpupool-nothing"):  # fmt: skip
        assert any(piece in html for html in printed), piece


def test_setup_stops_on_a_bad_template_before_building_anything() -> None:
    """``setup(c)`` runs the check first: the hub stops at start, the key named."""
    c = Config()
    c.LocalGPUSpawner.spawn_form_template = "{% if form.nothing_now %}"
    with pytest.raises(ConfigError, match=r"^LocalGPUSpawner\.spawn_form_template: .*line 1"):
        setup(c)
