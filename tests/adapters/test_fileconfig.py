"""``load_config_file``: the Helm chart's JSON settings reach the hub's config, and a broken file
stops the hub naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.declarations import ConfigError
from gpupool.hub.fileconfig import load_config_file


def test_sections_land_in_the_config_and_replace_same_keys(tmp_path: Path) -> None:
    path = tmp_path / "gpupool.json"
    teams = {"lab": {"guarantee": 1.5, "offers": ["cpu"]}}
    path.write_text(json.dumps({"GPUPool": {"teams": teams, "policy": "best-fit"}}))
    c = Config()
    c.GPUPool.policy = "first-fit"
    c.GPUPool.db_url = "sqlite:///kept.sqlite"
    load_config_file(c, path)
    pool = GPUPool(config=c)
    assert (pool.policy, pool.db_url) == ("best-fit", "sqlite:///kept.sqlite")
    assert pool.settings().teams["lab"].guarantee_milli == 1500


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "no such file"),
        ("{not json", "cannot be read as JSON"),
        ("[1, 2]", "must hold a JSON object"),
        ('{"gpupool": {}}', "configurable class name"),
        ('{"GPUPool": 3}', "configurable class name"),
    ],
)
def test_a_broken_file_names_itself(tmp_path: Path, text: str | None, reason: str) -> None:
    path = tmp_path / "gpupool.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as refused:
        load_config_file(Config(), path)
    assert str(refused.value).startswith(str(path)) and reason in str(refused.value)


def test_bad_values_are_refused_by_the_traits_that_receive_them(tmp_path: Path) -> None:
    path = tmp_path / "gpupool.json"
    path.write_text(json.dumps({"GPUPool": {"teams": {"lab": {"guarantee": -1}}}}))
    c = Config()
    load_config_file(c, path)
    with pytest.raises(ConfigError, match=r"GPUPool.teams\['lab'\].guarantee"):
        GPUPool(config=c)
