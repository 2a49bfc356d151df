"""The chart's schema of offers and teams is gpupool's own, and the chart accepts what the hub does.

- One source: the committed ``values.schema.json`` is what ``scripts/helm-values-schema`` makes of
  :mod:`gpupool.declarations_schema` (built from the parser's definitions).
- Offers: each form (a name implying each kind, each kind given or left out, each key with a good
  or a bad value) that :func:`gpupool.declarations.parse_offer` accepts renders through the chart
  and reaches the hub as the same offer; each form it refuses the chart refuses, naming the offer.
  The schema itself refuses it (checked here with ``jsonschema``, as Helm checks it at render)
  unless only the chart's own checks can see why (a profile implied by the offer's name, a
  share's size against 1 MiB and its model: see :mod:`gpupool.declarations_schema`).
- Teams and ``everyone`` likewise, against :func:`gpupool.declarations.parse_settings` (a team
  naming an undefined offer: the chart's check).
- Share offers declared in values render with Kueue on, and teams may list them.
"""

from __future__ import annotations

import itertools
import json
import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.core.offers import Offer
from gpupool.core.quota import Team
from gpupool.declarations import (
    MEMORY_SIZE,
    OFFER_KINDS,
    ConfigError,
    default_kind,
    parse_offer,
    parse_settings,
)
from gpupool.hub.fileconfig import load_config_file
from tests.deploy.chart_fixtures import CHART, RELEASE, ROOT, by_kind, merge, render

NO_DEPENDENCY = {"jupyterhub": {"enabled": False}}
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)

OFFER_NAMES = ("cpu", "h100", "mig-3g.40gb", "mig-1g.10gb", "share-small")
"""Names implying each kind; ``mig-1g.10gb`` a profile of different shares on different models."""
OFFER_VARIANTS: list[dict[str, Any]] = [
    {},
    {"description": "Half an H100"},
    {"description": 5},
    {"model": "H100-80GB"},
    {"model": "T4-16GB"},
    {"model": "h100"},
    {"model": 80},
    {"max_count": 2},
    {"max_count": 0},
    {"max_count": True},
    {"max_count": "2"},
    {"nvlink": True},
    {"nvlink": "yes"},
    {"profile": "3g.40gb"},
    {"profile": "1g.10gb"},
    {"profile": "1g.10gb", "model": "H100-80GB"},
    {"profile": "3g.45gb"},
    {"profile": "7g.141gb", "model": "H100-80GB"},
    {"memory": "6GB"},
    {"memory": "512 mib"},
    {"memory": "0.0001GB"},
    {"memory": "0GB"},
    {"memory": "6TB"},
    {"memory": 6},
    {"memory": "80GB", "model": "H100-80GB"},
    {"memory": "81GB", "model": "H100-80GB"},
    {"fraction": 0.25},
    {"fraction": 1},
    {"fraction": 0},
    {"fraction": 1.5},
    {"fraction": 0.0004},
    {"fraction": "0.5"},
    {"fraction": True},
    {"memory": "6GB", "fraction": 0.25},
    {"gpus": 1},
]
KINDS: list[str | None] = [None, *OFFER_KINDS, "tpu"]
"""``None``: the kind left out (set to null, which drops a default's kind in Helm)."""

TEAM_VARIANTS: list[dict[str, Any]] = [
    {},
    {"guarantee": 2},
    {"guarantee": 0.5},
    {"guarantee": -1},
    {"guarantee": True},
    {"guarantee": "2"},
    {"borrow_limit": 1.5},
    {"borrow_limit": -0.5},
    {"user_cap": 1},
    {"user_cap": 0},
    {"offers": ["cpu"]},
    {"offers": ["cpu", "cpu"]},
    {"offers": []},
    {"offers": ["cpu", "share-small"]},
    {"offers": "cpu"},
    {"offers": [1]},
    {"offers": ["h200"]},
    {"min_priority": -100},
    {"min_priority": -101},
    {"min_priority": 1},
    {"min_priority": -5.5},
    {"max_priority": 100},
    {"max_priority": 101},
    {"max_priority": -1},
    {"max_priority": "1"},
    {"user_limits": {"jobs": 3, "spawns": 0}},
    {"user_limits": {"job": 3}},
    {"user_limits": {"jobs": -1}},
    {"user_limits": {"jobs": 1.5}},
    {"user_limits": "x"},
    {"quota": 1},
]
TEAM_OFFERS = {"cpu": {"kind": "cpu"}, "share-small": {"memory": "6GB"}}


@pytest.fixture(scope="module")
def chart() -> Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def hub_config(objects: list[dict[str, Any]], tmp_path: Path) -> Config:
    """The hub's config after ``extraConfig`` loads the rendered ConfigMap's file."""
    path = tmp_path / "gpupool.json"
    path.write_text(by_kind(objects, "ConfigMap")["gpupool-config"]["data"]["gpupool.json"])
    c = Config()
    load_config_file(c, path)
    return c


def refusal(chart: helm.Chart, values: dict[str, Any]) -> str | None:
    """Why the chart refuses ``values`` (Helm's schema check or a template's), or None."""
    try:
        render(chart, values)
    except (helm.HelmValuesError, helm.HelmRenderError) as refused:
        return str(refused)
    return None


def schema_errors(chart: helm.Chart, values: dict[str, Any]) -> list[str]:
    merged = chart.merge_values(values)
    return [e.message for e in VALIDATOR.iter_errors(merged)]


# -- one source ----------------------------------------------------------------------------------
def test_the_schema_is_generated_from_the_parser() -> None:
    script = runpy.run_path(str(ROOT / "scripts" / "helm-values-schema"))
    text = (CHART / "values.schema.json").read_text()
    assert text == script["render"](text), "run scripts/helm-values-schema"


# -- offers --------------------------------------------------------------------------------------
def offer_cases() -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, what the values give the offer) for every form. Kind None: left out (for ``cpu``
    set to null, which drops the chart's default ``kind: cpu``)."""
    for name, kind, variant in itertools.product(OFFER_NAMES, KINDS, OFFER_VARIANTS):
        if kind == "tpu" and variant:
            continue
        if kind is not None or name == "cpu":
            variant = {"kind": kind, **variant}
        yield name, variant


def offer_values(offers: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return merge(NO_DEPENDENCY, {"gpupool": {"offers": offers}})


def verdict(name: str, spec: dict[str, Any]) -> Offer | ConfigError:
    try:
        return parse_offer(name, spec)
    except ConfigError as refused:
        return refused


def only_the_charts_checks_see(name: str, spec: dict[str, Any]) -> bool:
    """Whether a refusal of ``spec`` may be the chart's checks' alone (the schema cannot see it):
    a MIG offer's profile its name implies, a well-spelt share size."""
    kind = spec.get("kind") or default_kind(name)
    if kind == "mig" and "profile" not in spec:
        return True
    memory = spec.get("memory")
    return kind == "share" and isinstance(memory, str) and bool(MEMORY_SIZE.match(memory))


def test_every_offer_the_hub_accepts_renders_and_reaches_it_unchanged(
    chart: helm.Chart, tmp_path: Path
) -> None:
    accepted: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, given in offer_cases():
        spec = chart.merge_values(offer_values({name: given}))["gpupool"]["offers"][name]
        if isinstance(verdict(name, spec), Offer):
            accepted.setdefault(name, []).append((name, given))
    assert set(accepted) == set(OFFER_NAMES)
    assert {default_kind(n) for n in accepted} == set(OFFER_KINDS)
    # each render holds one form of each name; the hub must read each as the parser does
    for batch in itertools.zip_longest(*accepted.values()):
        offers = dict(case for case in batch if case)
        values = offer_values(offers)
        assert not schema_errors(chart, values), offers
        merged = chart.merge_values(values)["gpupool"]["offers"]
        settings = GPUPool(config=hub_config(render(chart, values), tmp_path)).settings()
        for name in offers:
            assert settings.offers[name] == parse_offer(name, merged[name]), (name, offers[name])


def test_every_offer_the_hub_refuses_the_chart_refuses_naming_it(chart: helm.Chart) -> None:
    refused = 0
    for name, given in offer_cases():
        values = offer_values({name: given})
        spec = chart.merge_values(values)["gpupool"]["offers"][name]
        if not isinstance(verdict(name, spec), ConfigError):
            continue
        refused += 1
        if not only_the_charts_checks_see(name, spec):
            assert schema_errors(chart, values), (name, given)
        why = refusal(chart, values)
        assert why is not None, (name, given)
        assert f"/gpupool/offers/{name}" in why or f"gpupool.offers.{name}" in why, why
    assert refused > 100


def test_share_offers_in_values_render_with_kueue_and_reach_the_hub(
    chart: helm.Chart, tmp_path: Path
) -> None:
    # docs/kubernetes.md's share offers, now declared in values (the schema refused kind share)
    offers = {
        "cpu": {"kind": "cpu"},
        "t4-quarter": {"kind": "share", "fraction": 0.25, "model": "T4-16GB"},
        "share-3gb": {"memory": "3GB"},
    }
    teams = {"lab": {"guarantee": 1, "offers": ["cpu", "t4-quarter", "share-3gb"]}}
    values = merge(
        NO_DEPENDENCY,
        {"gpupool": {"offers": offers, "teams": teams}, "kueue": {"enabled": True}},
    )
    objects = render(chart, values)
    settings = GPUPool(config=hub_config(objects, tmp_path)).settings()
    assert settings.offers["t4-quarter"].share_milli == 250
    assert settings.offers["share-3gb"].share_mib == 3072
    assert settings.teams["lab"].offers == {"cpu", "t4-quarter", "share-3gb"}
    assert f"{RELEASE}-lab" in by_kind(objects, "ClusterQueue")


# -- teams ---------------------------------------------------------------------------------------
def team_values(teams: dict[str, Any], everyone: dict[str, Any] | None = None) -> dict[str, Any]:
    pool: dict[str, Any] = {"offers": TEAM_OFFERS, "teams": teams}
    if everyone is not None:
        pool["everyone"] = everyone
    return merge(NO_DEPENDENCY, {"gpupool": pool})


def team_verdict(chart: helm.Chart, values: dict[str, Any]) -> ConfigError | dict[str, Team]:
    g = chart.merge_values(values)["gpupool"]
    try:
        limits = GPUPool().trait_defaults("user_limits")  # the hub's, as GPUPool.settings()
        settings = parse_settings(g["offers"], g["teams"], g.get("everyone") or {}, limits)
    except ConfigError as refused:
        return refused
    return {**settings.teams, "everyone": settings.everyone}


@pytest.mark.parametrize("where", ["team", "everyone"])
def test_every_team_form_the_hub_accepts_renders_and_each_it_refuses_is_refused(
    chart: helm.Chart, tmp_path: Path, where: str
) -> None:
    refused = 0
    for variant in TEAM_VARIANTS:
        values = (
            team_values({"lab": variant})
            if where == "team"
            else team_values({}, {"offers": None, **variant})
        )
        expected = team_verdict(chart, values)
        why = refusal(chart, values)
        if isinstance(expected, ConfigError):
            refused += 1
            assert why is not None, variant
            named = "unknown offer" in why or expected.path.rsplit(".", 1)[-1] in why
            assert named, (variant, why)
            if variant.get("offers") != ["h200"]:  # an undefined offer: the chart's check
                assert schema_errors(chart, values), variant
            continue
        assert why is None and not schema_errors(chart, values), (variant, why)
        settings = GPUPool(config=hub_config(render(chart, values), tmp_path)).settings()
        got = settings.teams["lab"] if where == "team" else settings.everyone
        assert got == expected["lab" if where == "team" else "everyone"], variant
    assert refused >= 15
