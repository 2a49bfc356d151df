"""Odd but valid settings are warned about at start, one line each, naming the key: an offer the
pool can never grant (or not in the counts it offers), a user cap above its team's limit, a
guarantee larger than the pool, and guarantees that add up to more than the pool."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.declarations import config_warnings, parse_settings
from gpupool.discovery import simulated_inventory
from gpupool.pool import Pool

NEVER = "the offer can never be granted"


def warnings(spec: str, offers: Any, teams: Any = None, everyone: Any = None) -> list[str]:
    settings = parse_settings(offers, teams or {}, everyone or {})
    return config_warnings(settings, simulated_inventory(spec))


def test_an_offer_for_a_model_the_pool_lacks() -> None:
    offers = {"cpu": {}, "h100": {"model": "H100-80GB", "max_count": 2}}
    assert warnings("n: 2x A100-40GB", offers) == [
        f"GPUPool.offers['h100'].model: the pool has no H100-80GB (it has 2× A100-40GB); {NEVER}"
    ]


def test_a_mig_offer_for_a_model_the_pool_lacks() -> None:
    offers = {"mig-3g.40gb": {"model": "H100-80GB"}}
    assert warnings("n: 2x A100-40GB, mig=2", offers) == [
        "GPUPool.offers['mig-3g.40gb'].model: the pool has no H100-80GB "
        f"(it has 2× A100-40GB (2 with MIG on)); {NEVER}"
    ]


def test_a_mig_offer_without_a_model_no_gpu_of_the_pool_has() -> None:
    offers = {"mig-3g.40gb": {}}  # A100-80GB or H100-80GB; an A100-40GB's 3g is 3g.20gb
    assert warnings("n: 2x A100-40GB, mig=2", offers) == [
        "GPUPool.offers['mig-3g.40gb']: no GPU in the pool has the MIG profile 3g.40gb "
        f"(it has 2× A100-40GB (2 with MIG on)); {NEVER}"
    ]


def test_a_mig_offer_on_gpus_with_mig_off() -> None:
    offers = {"mig-3g.40gb": {"model": "H100-80GB"}}
    assert warnings("n: 2x H100-80GB", offers) == [
        "GPUPool.offers['mig-3g.40gb']: every H100-80GB in the pool has MIG off, and gpupool "
        f"never switches MIG mode; {NEVER}"
    ]


def test_a_mig_offer_fixed_layouts_leave_no_room_for() -> None:
    offers = {"mig-1g.10gb": {"model": "H100-80GB"}}
    assert warnings("n: 1x H100-80GB, mig=1:3g.40gb+4g.40gb", offers) == [
        "GPUPool.offers['mig-1g.10gb']: no H100-80GB in the pool with MIG on has a 1g.10gb "
        f"instance or room to make one (their instances are fixed); {NEVER}"
    ]


def test_a_whole_gpu_offer_when_every_gpu_has_mig_on() -> None:
    offers = {"h100": {"model": "H100-80GB"}, "gpu": {}}
    assert warnings("n: 2x H100-80GB, mig=2", offers) == [
        "GPUPool.offers['gpu']: every GPU in the pool has MIG on, and gpupool never switches "
        f"MIG mode, so none can be granted whole; {NEVER}",
        "GPUPool.offers['h100']: every H100-80GB in the pool has MIG on, and gpupool never "
        f"switches MIG mode, so none can be granted whole; {NEVER}",
    ]


def test_a_count_larger_than_any_node_can_give() -> None:
    offers = {"h100": {"model": "H100-80GB", "max_count": 4}}
    assert warnings("n1: 2x H100-80GB; n2: 3x H100-80GB, mig=1", offers) == [
        "GPUPool.offers['h100'].max_count: 4 is more than one request can get: at most 2 "
        "whole H100-80GB GPUs on one node; larger requests can never be granted"
    ]


def test_gpu_offers_on_a_pool_without_gpus() -> None:
    from gpupool.core.inventory import Inventory

    settings = parse_settings(
        {"cpu": {}, "gpu": {}, "mig-1g.10gb": {"model": "H100-80GB"}},
        {"vision": {"guarantee": 1}},
        {"offers": ["cpu"]},
    )
    assert config_warnings(settings, Inventory((), "nvml")) == [
        f"GPUPool.offers['gpu']: the pool has no GPUs; {NEVER}",
        f"GPUPool.offers['mig-1g.10gb']: the pool has no GPUs; {NEVER}",
        "GPUPool.teams['vision'].guarantee: 1 GPU-eq is more than the whole pool (0 GPU-eq: "
        "no GPUs); it can never be met in full",
    ]


def test_a_user_cap_above_the_teams_limit() -> None:
    teams = {"vision": {"guarantee": 1.5, "borrow_limit": 0.5, "user_cap": 3}}
    assert warnings("n: 4x H100-80GB", {"cpu": {}}, teams) == [
        "GPUPool.teams['vision'].user_cap: 3 GPU-eq is above the team's limit of 2 (guarantee "
        "1.5 + borrow limit 0.5); it can never be reached"
    ]


def test_a_user_cap_of_everyone_above_its_limit() -> None:
    everyone = {"guarantee": 0.25, "user_cap": 0.5, "offers": ["cpu"]}
    assert warnings("n: 4x H100-80GB", {"cpu": {}}, everyone=everyone) == [
        "GPUPool.everyone.user_cap: 0.5 GPU-eq is above everyone's limit of 0.25 (guarantee "
        "0.25 + borrow limit 0); it can never be reached"
    ]


def test_a_guarantee_larger_than_the_pool() -> None:
    teams = {"vision": {"guarantee": 3}}
    assert warnings("n: 2x H100-80GB", {"cpu": {}}, teams) == [
        "GPUPool.teams['vision'].guarantee: 3 GPU-eq is more than the whole pool (2 GPU-eq: "
        "2× H100-80GB); it can never be met in full"
    ]


def test_guarantees_that_add_up_to_more_than_the_pool() -> None:
    teams = {"vision": {"guarantee": 3}, "nlp": {"guarantee": 1.5}}
    assert warnings("n: 4x H100-80GB, mig=2", {"cpu": {}}, teams) == [
        "GPUPool.teams: the guarantees add up to 4.5 GPU-eq (nlp 1.5, vision 3), more than the "
        "whole pool (4 GPU-eq: 4× H100-80GB (2 with MIG on)); they cannot all be met at once"
    ]


def test_a_sensible_config_gives_no_warnings() -> None:
    """The demo's shape: whole GPUs and fixed MIG instances, quotas within the pool."""
    offers = {
        "cpu": {},
        "h100": {"model": "H100-80GB", "max_count": 2},
        "mig-3g.40gb": {"model": "H100-80GB"},
        "mig-2g.20gb": {"model": "H100-80GB"},
        "mig-1g.10gb": {"model": "H100-80GB"},
    }
    teams = {
        "vision": {"guarantee": 1.5, "borrow_limit": 0.5, "user_cap": 2},
        "nlp": {"guarantee": 1, "user_cap": 0.5},
    }
    spec = "local: 4x H100-80GB, mig=2:3g.40gb+2g.20gb+1g.10gb, nvlink=2"
    assert warnings(spec, offers, teams) == []


def test_the_warnings_are_logged_once_when_the_pool_is_built(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = Config()
    c.GPUPool.inventory = "simulated:n: 2x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'gpupool.sqlite'}"
    c.GPUPool.offers = {"cpu": {}, "a100": {"model": "A100-80GB"}}
    c.GPUPool.teams = {"vision": {"guarantee": 3, "user_cap": 4}}
    with caplog.at_level(logging.WARNING, logger="gpupool"):
        Pool.from_config(GPUPool(config=c)).store.close()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = [
        "gpupool: GPUPool.offers['a100'].model: the pool has no A100-80GB (it has "
        f"2× H100-80GB); {NEVER}",
        "gpupool: GPUPool.teams['vision'].user_cap: 4 GPU-eq is above the team's limit of 3 "
        "(guarantee 3 + borrow limit 0); it can never be reached",
        "gpupool: GPUPool.teams['vision'].guarantee: 3 GPU-eq is more than the whole pool "
        "(2 GPU-eq: 2× H100-80GB); it can never be met in full",
    ]
    for line in expected:
        assert said.count(line) == 1, (line, said)
