"""The load benchmark's pure helpers: who asks for what, device overlap, quotas, job histories."""

from __future__ import annotations

import pytest

from benchmarks.load import (
    ROLES,
    SPEC,
    TEAMS,
    conflicts,
    device_slots,
    final_changes,
    groups,
    over_limit,
    parse_environ,
    plan_jobs,
    plan_users,
    route,
    status_class,
    team_limits,
    team_use,
)

FINAL = ("succeeded", "failed", "cancelled", "lost")


def test_users_play_the_roles_in_turn_and_teams_are_groups() -> None:
    users = plan_users(90)
    assert [u.name for u in users[:2]] == ["u000", "u001"]
    assert len({u.name for u in users}) == 90
    assert all((u.team, u.offer, u.count) == ROLES[i % len(ROLES)] for i, u in enumerate(users))
    members = groups(users)
    assert set(members) == set(TEAMS)
    assert sum(len(m) for m in members.values()) == sum(1 for u in users if u.team)
    assert plan_users(1000)[999].name == "u999"


def test_every_role_asks_for_an_offer_its_team_allows() -> None:
    for team, offer, _ in ROLES:
        allowed = TEAMS[team]["offers"] if team else ["cpu"]
        assert offer in allowed


def test_options_name_the_offer_and_count_except_for_cpu() -> None:
    by_offer = {u.offer: u for u in plan_users(10)}
    assert by_offer["cpu"].options() == {}
    assert by_offer["mig-3g.40gb"].options() == {"offer": "mig-3g.40gb", "count": 1}


def test_limits_are_guarantee_plus_borrowing_and_bind_on_the_pool() -> None:
    limits = team_limits()
    assert limits == {"vision": 6.0, "nlp": 3.0, "speech": 3.0, "robotics": 5.0}
    assert sum(limits.values()) > 16  # quotas and capacity both bind on 16 GPU-eq


def test_a_third_of_the_jobs_use_the_owners_gpu_offer() -> None:
    jobs = plan_jobs(plan_users(90), 48)
    assert len(jobs) == 48
    gpu = [body for p, body in jobs if body["offer"] != "cpu"]
    assert all(body["offer"] == p.offer for p, body in jobs if body["offer"] != "cpu")
    assert 0 < len(gpu) <= 16
    assert {body["gpus"] for _, body in jobs} == {1}


def test_the_simulated_pool_has_12_whole_gpus_and_8_half_instances() -> None:
    slots = device_slots(SPEC)
    gpus = {gpu for gpu, _ in slots.values()}
    assert len(gpus) == 16
    instances = [(vid, mask) for vid, (_, mask) in slots.items() if vid.startswith("MIG-")]
    assert len(instances) == 8
    assert sorted({mask for _, mask in instances}) == [0x0F, 0xF0]
    assert all(mask == 0xFF for vid, (_, mask) in slots.items() if vid.startswith("GPU-"))


SLOTS = {
    "GPU-a": ("GPU-a", 0xFF),
    "MIG-a0": ("GPU-a", 0x0F),
    "MIG-a4": ("GPU-a", 0xF0),
    "GPU-b": ("GPU-b", 0xFF),
}


@pytest.mark.parametrize(
    ("holdings", "expected"),
    [
        ({"x": ["GPU-a"], "y": ["GPU-b"]}, []),
        ({"x": ["MIG-a0"], "y": ["MIG-a4"]}, []),  # two halves of one GPU
        ({"x": ["GPU-a"], "y": ["MIG-a4"]}, [("GPU-a", "x", "y")]),  # whole and a half
        ({"y": ["MIG-a0"], "x": ["MIG-a0"]}, [("GPU-a", "x", "y")]),  # named in order
        ({"x": ["GPU-a", "GPU-a"]}, []),  # one holder never conflicts with itself
        ({"x": [""], "y": [""]}, []),  # CPU only
        ({"x": ["GPU-z"], "y": ["GPU-z"]}, [("GPU-z", "x", "y")]),  # unknown ids: own device
        (
            {"x": ["GPU-a"], "y": ["MIG-a0"], "z": ["MIG-a4"]},
            [("GPU-a", "x", "y"), ("GPU-a", "x", "z")],
        ),
    ],
)
def test_conflicts_are_overlapping_slots_of_different_holders(
    holdings: dict[str, list[str]], expected: list[tuple[str, str, str]]
) -> None:
    assert conflicts(holdings, SLOTS) == expected


def test_team_use_counts_each_device_once_per_team() -> None:
    holdings = {
        "a": ("vision", ["GPU-a"]),
        "b": ("vision", ["MIG-a0"]),  # inside a's GPU: not more
        "c": ("nlp", ["MIG-a4"]),
        "d": ("nlp", ["GPU-b", ""]),
    }
    assert team_use(holdings, SLOTS) == {"vision": 1.0, "nlp": 1.5}


def test_over_limit_lists_only_teams_above_their_limit() -> None:
    used = {"vision": 6.0, "nlp": 3.5, "everyone": 0.0, "ghost": 0.5}
    assert over_limit(used, {"vision": 6.0, "nlp": 3.0}) == [
        ("ghost", 0.5, 0.0),
        ("nlp", 3.5, 3.0),
    ]


def test_parse_environ() -> None:
    raw = b"HOME=/tmp/h/u1\0CUDA_VISIBLE_DEVICES=\0A=b=c\0junk\0"
    assert parse_environ(raw) == {"HOME": "/tmp/h/u1", "CUDA_VISIBLE_DEVICES": "", "A": "b=c"}


@pytest.mark.parametrize(
    ("code", "cls"),
    [(None, "error"), (200, "2xx"), (201, "201"), (202, "202"), (409, "4xx"), (503, "5xx")],
)
def test_status_class(code: int | None, cls: str) -> None:
    assert status_class(code) == cls


def test_a_final_state_that_changes_is_reported() -> None:
    history = {
        "ok": ["queued", "starting", "running", "succeeded"],
        "requeued": ["running", "queued", "running", "failed"],  # not final before: fine
        "flipped": ["running", "succeeded", "cancelled"],
        "failed-then-cancelled": ["queued", "failed", "cancelled"],
    }
    assert final_changes(history, FINAL) == {
        "flipped": ["running", "succeeded", "cancelled"],
        "failed-then-cancelled": ["queued", "failed", "cancelled"],
    }


def test_routes_hide_names_ids_and_queries() -> None:
    assert route("/hub/api/users/u001/server") == "/hub/api/users/<name>/server"
    assert route("/hub/api/gpupool/jobs/ab12/logs?rank=1") == "/hub/api/gpupool/jobs/<id>/logs"
    assert route("/hub/api/gpupool/allocations?all=1") == "/hub/api/gpupool/allocations"


# -- the abuse phase's pure helpers (benchmarks.abuse) -------------------------------------------
def test_flood_scripts_are_as_big_as_a_job_may_send_and_valid_python() -> None:
    from benchmarks.abuse import SCRIPT_BYTES, flood_script
    from gpupool.jobs.manager import MAX_SCRIPT_BYTES

    assert SCRIPT_BYTES == MAX_SCRIPT_BYTES
    script = flood_script()
    assert len(script.encode()) == SCRIPT_BYTES
    compile(script, "flood.py", "exec")
    assert len(flood_script(100)) == 100


def test_what_counts_as_accepted_beyond_a_limit() -> None:
    from benchmarks.abuse import beyond

    assert beyond(accepted=32, room=32) == 0
    assert beyond(accepted=35, room=32) == 3
    assert beyond(accepted=34, room=32, freed=2) == 0  # two places came free meanwhile
    assert beyond(accepted=3, room=8) == 0


def test_the_limits_counted_against_are_the_hubs_defaults() -> None:
    from dataclasses import asdict

    from benchmarks.abuse import hub_limits
    from gpupool.config import GPUPool

    assert hub_limits() == asdict(GPUPool().settings().everyone.user_limits)


def test_resident_memory_is_read_from_proc() -> None:
    import os

    from benchmarks.abuse import rss_mib

    mine = rss_mib(os.getpid())
    assert mine is not None and mine > 1
    assert rss_mib(2**22 + 1) is None  # no such process


def test_servers_starting_at_once_are_read_from_the_hubs_log_in_order() -> None:
    from benchmarks.abuse import most_starting

    def granted(server: str) -> str:
        return (
            "[I 2026-12-02 02:08:06.591 JupyterHub.gpupool pool:201] gpupool: allocated 3f2a to "
            f"u000 (team vision, notebook u000/{server}): cpu"
        )

    def up(server: str) -> str:
        return f"[I 02:08:25.943 JupyterHub base:1192] User u000:{server} took 2.1 seconds to start"

    log = [
        granted("a"),
        granted("b"),  # two at once
        "[I ...] gpupool: refused u000/c: You have 2 servers starting; the limit is 2",
        up("a"),
        granted("c"),  # a place came free: still two at once
        granted("x").replace("u000", "u001"),  # another user's
        up("b"),
        up("c"),
    ]
    assert most_starting("\n".join(log), "u000") == 2
    assert most_starting("\n".join([granted("a"), granted("b"), granted("c")]), "u000") == 3
    assert most_starting("", "u000") == 0
