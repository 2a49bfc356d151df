"""Per-user limits (``gpupool.core.limits``) and how the config sets them: the hub's default
(``GPUPool.user_limits``) with a team's own keys over it; a bad key stops the hub naming it."""

from __future__ import annotations

from typing import Any

import pytest
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.core.errors import LimitReached
from gpupool.core.limits import UserLimits
from gpupool.core.quota import EVERYONE, Team, check_limit_in_every, member_teams
from gpupool.declarations import ConfigError


def test_a_limit_refuses_one_more_naming_the_limit_what_is_in_use_and_what_to_do() -> None:
    team = Team("vision", user_limits=UserLimits(jobs=2, log_followers=1, spawns=1))
    team.check_limit("jobs", 1)  # room for one more
    with pytest.raises(LimitReached) as e:
        team.check_limit("jobs", 2)
    assert e.value.message == (
        "You have 2 jobs queued or running; the limit is 2 per user in team vision. "
        "Wait until one ends, or cancel one."
    )
    with pytest.raises(LimitReached, match="You have 1 followed log open; the limit is 1"):
        team.check_limit("log_followers", 1)
    with pytest.raises(LimitReached, match=r"You have 3 servers starting; .* until one has"):
        team.check_limit("spawns", 3)
    everyone = Team("everyone", user_limits=UserLimits(jobs=1))
    with pytest.raises(LimitReached, match="the limit is 1 per user in no team"):
        everyone.check_limit("jobs", 1)


def test_zero_is_no_limit() -> None:
    Team("vision").check_limit("jobs", 10**6)
    Team("vision", user_limits=UserLimits(jobs=0, spawns=1)).check_limit("jobs", 10**6)


def settings(**gpupool: Any) -> Any:
    c = Config()
    for key, value in gpupool.items():
        setattr(c.GPUPool, key, value)
    return GPUPool(config=c).settings()


def test_teams_get_the_hubs_defaults_with_their_own_keys_over_them() -> None:
    s = settings(
        user_limits={"jobs": 5},
        teams={"vision": {"user_limits": {"spawns": 0}}, "nlp": {}},
        everyone={"offers": ["cpu"], "user_limits": {"log_followers": 1}},
    )
    assert s.teams["vision"].user_limits == UserLimits(jobs=5, log_followers=8, spawns=0)
    assert s.teams["nlp"].user_limits == UserLimits(jobs=5, log_followers=8, spawns=2)
    assert s.everyone.user_limits == UserLimits(jobs=5, log_followers=1, spawns=2)
    assert settings().everyone.user_limits == UserLimits(jobs=32, log_followers=8, spawns=2)


@pytest.mark.parametrize(
    ("gpupool", "key"),
    [
        ({"user_limits": {"job": 3}}, "GPUPool.user_limits.job: unknown key"),
        ({"user_limits": {"jobs": -1}}, "GPUPool.user_limits.jobs: must be a whole number >= 0"),
        ({"user_limits": {"jobs": True}}, "GPUPool.user_limits.jobs: must be a whole number"),
        (
            {"teams": {"vision": {"user_limits": {"spawns": 1.5}}}},
            "GPUPool.teams['vision'].user_limits.spawns: must be a whole number >= 0",
        ),
        (
            {"everyone": {"user_limits": {"followers": 1}}},
            "GPUPool.everyone.user_limits.followers: unknown key",
        ),
    ],
)
def test_a_bad_limit_stops_the_hub_naming_the_key(gpupool: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        settings(**gpupool)
    assert str(e.value).startswith(key), e.value


def test_a_user_in_several_teams_is_refused_only_when_every_team_would() -> None:
    tight = Team("vision", user_limits=UserLimits(spawns=1))
    loose = Team("nlp", user_limits=UserLimits(spawns=3))
    free = Team("robots")  # no limit
    check_limit_in_every([tight, loose], "spawns", 2)  # nlp still has room
    with pytest.raises(LimitReached, match="the limit is 3 per user in team nlp"):
        check_limit_in_every([tight, loose], "spawns", 3)  # the loosest limit's sentence
    check_limit_in_every([tight, free], "spawns", 100)
    check_limit_in_every([], "spawns", 100)


def test_the_teams_a_user_may_charge() -> None:
    teams = {"vision": Team("vision"), "nlp": Team("nlp")}
    everyone = Team(EVERYONE)
    assert member_teams(teams, everyone, ["nlp", "staff", "vision"]) == [
        teams["nlp"],
        teams["vision"],
    ]
    assert member_teams(teams, everyone, ["staff"]) == [everyone]
