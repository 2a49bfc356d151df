"""gpupool's server options (``gpupool_spawner.options``) and how the spawner composes with
JupyterHub's ``options_from_form``: its keys strictly checked, everyone else's left alone."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from tornado import web
from traitlets.config import Config

from gpupool.core.errors import InvalidRequest
from gpupool_spawner.local import LocalGPUSpawner
from gpupool_spawner.options import from_form, others, parse_user_options


def spawner(**traits: Any) -> LocalGPUSpawner:
    user = SimpleNamespace(name="ada", groups=[], url="/user/ada/", escaped_name="ada")
    return LocalGPUSpawner(config=Config(), user=user, **traits)


def test_only_gpupools_keys_are_read_and_checked() -> None:
    options = {"offer": "h100", "count": 2, "image": ["x"], "anything": {"deep": 1}}
    assert parse_user_options(options) == ("h100", 2, None)
    for bad, why in [
        ({"offer": 5}, "user_options.offer must be an offer name, got 5."),
        ({"offer": "h100", "count": "2x"}, "user_options.count must be a whole number"),
        ({"offer": "h100", "team": ["a"]}, "user_options.team must be a team name"),
        ({"image": "x"}, "user_options.offer must be an offer name, got None."),
    ]:
        with pytest.raises(InvalidRequest, match=why.replace(".", r"\.")):
            parse_user_options(bad)


def test_a_form_or_a_spawn_link_names_gpupools_keys() -> None:
    assert from_form({"gpupool_choice": ["vision|h100|2"], "x": ["1"]}) == {
        "team": "vision", "offer": "h100", "count": 2
    }  # fmt: skip
    assert from_form({"gpupool_choice": ["|cpu|1"]}) == {"team": None, "offer": "cpu", "count": 1}
    assert from_form({"offer": ["h100"], "count": ["2"]}) == {"offer": "h100", "count": 2}
    assert from_form({"image": ["x"]}) == {}
    assert others({"gpupool_choice": ["|cpu|1"], "offer": ["x"], "image": ["y"]}) == {
        "image": ["y"]
    }
    for bad in ({"gpupool_choice": ["h100"]}, {"gpupool_choice": ["v||1"]}, {"offer": ["a", "b"]}):
        with pytest.raises(InvalidRequest):
            from_form(bad)


def test_options_from_form_is_a_trait_with_gpupools_parser_as_default() -> None:
    s = spawner()
    form = {"gpupool_choice": ["vision|h100|1"], "image": ["mine"]}
    assert s.run_options_from_form(form) == {
        "image": ["mine"], "team": "vision", "offer": "h100", "count": 1
    }  # fmt: skip
    assert s.options_from_query({"offer": ["cpu"]}) == {"offer": "cpu"}


def test_an_admins_callable_composes_with_gpupools_keys() -> None:
    seen: list[dict[str, Any]] = []

    def theirs(form_data: dict[str, list[str]], spawner: Any) -> dict[str, Any]:
        seen.append(form_data)
        return {"image": form_data["image"][0].upper(), "offer": "not theirs to set"}

    s = spawner(options_from_form=theirs)  # the constructor argument, as JupyterHub's tests pass
    form = {"gpupool_choice": ["vision|h100|2"], "image": ["mine"]}
    assert s.run_options_from_form(form) == {
        "image": "MINE", "team": "vision", "offer": "h100", "count": 2
    }  # fmt: skip
    assert seen == [{"image": ["mine"]}]  # it never sees gpupool's field
    assert s.options_from_query({"image": ["q"]}) == {"image": "Q", "offer": "not theirs to set"}

    simple = spawner(options_from_form="simple")  # JupyterHub's named behaviours still work
    assert simple.run_options_from_form({"image": ["x"], "offer": ["cpu"]}) == {
        "image": "x", "offer": "cpu"
    }  # fmt: skip


def test_a_bad_choice_on_the_form_is_a_400_and_a_huge_form_a_413() -> None:
    s = spawner()
    with pytest.raises(web.HTTPError) as e:
        s.run_options_from_form({"gpupool_choice": ["vision|h100|²"]})
    assert e.value.status_code == 400 and "Choose one of the offers" in e.value.log_message
    with pytest.raises(web.HTTPError) as e:
        s.run_options_from_form({"x": ["y" * 10_000]})
    assert e.value.status_code == 413
