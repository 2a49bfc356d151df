"""Bad config stops the pool at load, naming the key; good config loads from a real config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config, PyFileConfigLoader

from gpupool.config import GPUPool
from gpupool.declarations import ConfigError

GOOD_OFFERS = {"cpu": {}, "h100": {"model": "H100-80GB", "max_count": 2}, "mig-3g.40gb": {}}


def load(**pool: Any) -> GPUPool:
    config = Config()
    for key, value in pool.items():
        config.GPUPool[key] = value
    gp = GPUPool(config=config)
    gp.settings()
    return gp


@pytest.mark.parametrize(
    ("pool", "path", "reason"),
    [
        (
            {"teams": {"vision": {"guarantee": -1}}},
            "GPUPool.teams['vision'].guarantee",
            "must be a number >= 0",
        ),
        (
            {"teams": {"vision": {"borrow_limit": "lots"}}},
            "GPUPool.teams['vision'].borrow_limit",
            "must be a number >= 0",
        ),
        (
            {"teams": {"vision": {"user_cap": 0}}},
            "GPUPool.teams['vision'].user_cap",
            "must be a number > 0",
        ),
        (
            {"offers": GOOD_OFFERS, "teams": {"vision": {"offers": ["h100", "a100"]}}},
            "GPUPool.teams['vision'].offers",
            "offer 'a100' is not defined in GPUPool.offers",
        ),
        (
            {"everyone": {"offers": ["mig-1g.10gb"]}},
            "GPUPool.everyone.offers",
            "offer 'mig-1g.10gb' is not defined",
        ),
        (
            {"offers": {"mig-3g.20gb": {"model": "H100-80GB"}}},
            "GPUPool.offers['mig-3g.20gb'].profile",
            "'3g.20gb' is not a MIG profile of model H100-80GB (H100-80GB has 1g.10gb,",
        ),
        (
            {"offers": {"mig-5g.50gb": {}}},
            "GPUPool.offers['mig-5g.50gb'].profile",
            "not a MIG profile of any MIG-capable model",
        ),
        (
            {"offers": {"mig-1g.10gb": {}}},
            "GPUPool.offers['mig-1g.10gb'].model",
            "takes a different share of the GPU on A100-40GB, A100-80GB, H100-80GB",
        ),
        (
            {"offers": {"tpu": {"kind": "tpu"}}},
            "GPUPool.offers['tpu'].kind",
            "must be 'cpu', 'gpu' or 'mig'",
        ),
        (
            {"offers": {"h100": {"model": "H100"}}},
            "GPUPool.offers['h100'].model",
            "must be a model key like 'H100-80GB'",
        ),
        (
            {"offers": {"h100": {"max_count": 0}}},
            "GPUPool.offers['h100'].max_count",
            "must be an integer >= 1",
        ),
        (
            {"offers": {"h100": {"maxcount": 2}}},
            "GPUPool.offers['h100'].maxcount",
            "unknown key; allowed keys are",
        ),
        (
            {"teams": {"vision": {"guarantee": 1, "gaurantee": 2}}},
            "GPUPool.teams['vision'].gaurantee",
            "unknown key",
        ),
        ({"teams": {"everyone": {}}}, "GPUPool.teams['everyone']", "is reserved"),
        (
            {"teams": {"vision": {"max_priority": 150}}},
            "GPUPool.teams['vision'].max_priority",
            "must be a whole number from 0 to 100, got 150",
        ),
        (
            {"teams": {"vision": {"max_priority": -10}}},
            "GPUPool.teams['vision'].max_priority",
            "must be a whole number from 0 to 100",
        ),
        (
            {"teams": {"vision": {"min_priority": 5}}},
            "GPUPool.teams['vision'].min_priority",
            "must be a whole number from -100 to 0, got 5",
        ),
        (
            {"everyone": {"max_priority": True}},
            "GPUPool.everyone.max_priority",
            "must be a whole number from 0 to 100",
        ),
        ({"policy": "random"}, "GPUPool.policy", "must be one of first-fit, best-fit, gpupool"),
        ({"inventory": "cuda"}, "GPUPool.inventory", "must be one of nvml, simulated:<spec>"),
        ({"inventory": "simulated:node1 4x H100-80GB"}, "GPUPool.inventory", "expected"),
        ({"db_url": "not a url"}, "GPUPool.db_url", "is not an SQLAlchemy URL"),
    ],
)
def test_bad_config_names_the_key(pool: dict[str, Any], path: str, reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(**pool)
    assert err.value.path == path
    assert reason in err.value.reason
    assert str(err.value).startswith(path + ": ")


def test_a_config_file_loads_into_settings(tmp_path: Path) -> None:
    cfg = tmp_path / "jupyterhub_config.py"
    cfg.write_text(
        "c.GPUPool.offers = {'cpu': {}, 'h100': {'model': 'H100-80GB', 'max_count': 4,"
        " 'nvlink': True}, 'mig-3g.40gb': {}}\n"
        "c.GPUPool.teams = {'vision': {'guarantee': 2.5, 'borrow_limit': 1, 'user_cap': 1,"
        " 'offers': ['cpu', 'mig-3g.40gb']}}\n"
        "c.GPUPool.policy = ' best-fit '\n"
        "c.GPUPool.inventory = 'simulated:node1: 4x H100-80GB, mig=2'\n"
    )
    config = PyFileConfigLoader(cfg.name, str(tmp_path)).load_config()
    pool = GPUPool(config=config)
    s = pool.settings()
    assert pool.policy == "best-fit"
    assert s.offers["mig-3g.40gb"].kind == "mig" and s.offers["mig-3g.40gb"].profile == "3g.40gb"
    assert s.offers["h100"].nvlink and s.offers["h100"].max_count == 4
    vision = s.teams["vision"]
    assert (vision.guarantee_milli, vision.borrow_limit_milli, vision.user_cap_milli) == (
        2500,
        1000,
        1000,
    )
    assert vision.offers == frozenset({"cpu", "mig-3g.40gb"})
    assert s.everyone.offers == frozenset({"cpu"}) and s.everyone.limit_milli == 0


def test_a_drifted_profile_name_in_an_offer_resolves() -> None:
    pool = load(offers={"mig-3g.39gb": {"model": "H100-80GB"}})
    assert pool.settings().offers["mig-3g.39gb"].profile == "3g.40gb"


def test_a_team_priority_range_defaults_to_lowering_only() -> None:
    s = load(teams={"vision": {"max_priority": 10, "min_priority": -5}, "nlp": {}}).settings()
    assert (s.teams["vision"].min_priority, s.teams["vision"].max_priority) == (-5, 10)
    assert (s.teams["nlp"].min_priority, s.teams["nlp"].max_priority) == (-100, 0)
    assert (s.everyone.min_priority, s.everyone.max_priority) == (-100, 0)
