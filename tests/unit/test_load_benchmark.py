"""The load benchmark's pure helpers: who asks for what, device overlap within and across views,
quotas, job histories, leaks, the hub's decision counts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.load_plan import (
    FINAL,
    ROLES,
    SPEC,
    TEAMS,
    final_changes,
    groups,
    plan_jobs,
    plan_users,
    route,
    status_class,
    team_limits,
)
from benchmarks.load_views import (
    Held,
    Persistence,
    Proc,
    ScanCost,
    Snapshot,
    classify,
    conflicts,
    cross_view,
    device_slots,
    gone_holders,
    homed,
    intervals,
    live_processes,
    over_limit,
    team_use,
    views_of,
)
from gpupool.procfs import parse_environ


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


def test_parse_environ() -> None:  # the process view reads environments with gpupool.procfs
    raw = b"HOME=/tmp/h/u1\0CUDA_VISIBLE_DEVICES=\0A=b=c\0junk\0"
    env = parse_environ(raw.split(b"\0"))
    assert env == {"HOME": "/tmp/h/u1", "CUDA_VISIBLE_DEVICES": "", "A": "b=c"}


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


# -- the three views compared (benchmarks.load_views) --------------------------------------------
def server(pid: int, user: str, alloc: str, *devices: str) -> Proc:
    return Proc(pid, "server", user, f"alloc:{alloc}", "vision", devices)


def job_proc(pid: int, user: str, job: str, *devices: str) -> Proc:
    return Proc(pid, "job", user, f"job:{job}", "vision", devices)


def nb(alloc: str, user: str, *devices: str) -> Held:
    return Held(alloc, user, "notebook", f"{user}/", devices)


def kinds(found: dict[tuple[str, ...], object]) -> list[tuple[str, ...]]:
    return sorted(found)


def test_views_that_agree_report_nothing() -> None:
    allocs = (nb("a1", "u1", "GPU-a"), Held("a2", "u2", "job", "j2", ("GPU-b",)))
    procs = (server(1, "u1", "a1", "GPU-a"), job_proc(2, "u2", "j2", "GPU-b"))
    assert cross_view(Snapshot(allocs, allocs, procs), SLOTS) == {}
    halves = (nb("a1", "u1", "MIG-a0"), nb("a3", "u3", "MIG-a4"))  # two halves of one GPU
    procs = (server(1, "u1", "a1", "MIG-a0"), server(3, "u3", "a3", "MIG-a4"))
    assert cross_view(Snapshot(halves, halves, procs), SLOTS) == {}


def test_a_process_on_a_device_the_views_gave_to_another_holder_is_a_double_owner() -> None:
    # u1's server still runs on GPU-b; the pool (db and rest) gave GPU-b to u2's job
    allocs = (nb("a1", "u1", "GPU-a"), Held("a2", "u2", "job", "j2", ("GPU-b",)))
    procs = (server(1, "u1", "a1", "GPU-a", "GPU-b"),)
    found = cross_view(Snapshot(allocs, allocs, procs), SLOTS)
    assert kinds(found) == [
        ("other_holder", "proc~db", "job:j2", "alloc:a1", "GPU-b"),
        ("other_holder", "proc~rest", "job:j2", "alloc:a1", "GPU-b"),
        ("uncovered", "proc~db", "alloc:a1", "GPU-b"),
        ("uncovered", "proc~rest", "alloc:a1", "GPU-b"),
    ]
    assert found[("other_holder", "proc~db", "job:j2", "alloc:a1", "GPU-b")]["process_user"] == "u1"


def test_a_process_without_an_allocation_or_with_anothers_is_found_in_each_view() -> None:
    db = (nb("a1", "u2", "GPU-a"),)  # a1 is u2's in the db
    rest: tuple[Held, ...] = ()  # and gone from the pool's memory
    procs = (
        server(1, "u1", "a1", "GPU-a"),
        job_proc(2, "u3", "j9", "MIG-a4"),
        server(3, "u4", "c"),
    )
    found = cross_view(Snapshot(db, rest, procs), SLOTS)
    assert ("wrong_holder", "proc~db", "alloc:a1") in found
    assert ("unallocated", "proc~rest", "alloc:a1") in found
    assert ("unallocated", "proc~db", "job:j9") in found
    assert ("unallocated", "proc~rest", "job:j9") in found
    assert not [k for k in found if "alloc:c" in k]  # a CPU-only server holds nothing


def test_a_mig_instance_is_covered_by_its_allocation_and_a_whole_gpu_is_not() -> None:
    allocs = (nb("a1", "u1", "MIG-a0"),)
    ok = cross_view(Snapshot(allocs, None, (server(1, "u1", "a1", "MIG-a0"),)), SLOTS)
    assert ok == {}
    wide = cross_view(Snapshot(allocs, None, (server(1, "u1", "a1", "GPU-a"),)), SLOTS)
    assert list(wide) == [("uncovered", "proc~db", "alloc:a1", "GPU-a")]


def test_the_db_and_rest_views_giving_one_device_to_two_holders_disagree() -> None:
    db = (nb("a1", "u1", "GPU-a"),)
    rest = (nb("a2", "u2", "MIG-a4"),)
    found = cross_view(Snapshot(db, rest, ()), SLOTS)
    assert list(found) == [("views_disagree", "db~rest", "alloc:a1", "alloc:a2", "GPU-a")]
    assert cross_view(Snapshot(db, None, ()), SLOTS) == {}  # one view read: nothing to compare


def test_a_view_not_read_is_left_out() -> None:
    snap = Snapshot(None, (nb("a1", "u1", "GPU-a"),), (server(1, "u1", "a2", "GPU-a"),))
    assert snap.read() == {"proc", "rest"}
    assert {k[1] for k in cross_view(snap, SLOTS)} == {"proc~rest"}
    assert views_of(("unallocated", "proc~db", "alloc:x")) == {"proc", "db"}


def test_a_finding_counts_only_once_it_lasted_the_grace_in_every_look() -> None:
    p = Persistence(grace=12)
    key = ("other_holder", "proc~db", "alloc:a", "alloc:b", "GPU-a")
    assert p.update(0.0, {key: "x"}) == []
    assert p.update(6.0, {key: "x"}) == []
    assert p.update(12.0, {key: "x"}) == [key]  # seen for 12 s: a double owner
    assert p.update(13.0, {key: "x"}) == []  # counted once
    assert p.confirmed == {key: "x"}


def test_a_finding_gone_at_a_recheck_was_timing_and_starts_again() -> None:
    p = Persistence(grace=12)
    key = ("unallocated", "proc~rest", "alloc:a")
    p.update(0.0, {key: 1})
    p.update(5.0, {})  # the allocation was recorded meanwhile (or the process ended)
    assert p.update(12.5, {key: 1}) == []  # seen again: its time starts anew
    assert p.update(24.5, {key: 1}) == [key]


def test_a_look_that_could_not_read_a_view_neither_confirms_nor_clears() -> None:
    p = Persistence(grace=10)
    key = ("unallocated", "proc~rest", "alloc:a")

    def rest_read(k: tuple[str, ...]) -> bool:
        return False  # the hub was down: no rest view

    p.update(0.0, {key: 1})
    p.update(5.0, {}, rest_read)
    assert p.update(10.0, {key: 1}) == [key]
    p2 = Persistence(grace=10)
    p2.update(0.0, {key: 1})
    p2.reset()
    assert p2.update(10.0, {key: 1}) == []


def test_an_allocation_is_leaked_once_no_process_and_no_server_record_hold_it() -> None:
    allocs = [
        nb("a1", "u1", "GPU-a"),  # a live server
        nb("a2", "u2", "GPU-b"),  # JupyterHub still has a record of it (starting)
        nb("a3", "u3", "MIG-a0"),  # gone
        Held("a4", "u4", "job", "j4", ("MIG-a4",)),  # a live job
        Held("a5", "u5", "job", "j5", ()),  # a job without processes: gone
    ]
    procs = [server(1, "u1", "a1", "GPU-a"), job_proc(2, "u4", "j4", "MIG-a4")]
    gone = gone_holders(allocs, procs, {"u2/", "u5/"})
    assert sorted(gone) == [("leak", "a3"), ("leak", "a5")]


def test_processes_are_told_apart_by_their_environment() -> None:
    base = {"HOME": "/h/u1", "JUPYTERHUB_USER": "u1", "CUDA_VISIBLE_DEVICES": "GPU-a,MIG-a4"}
    s = classify(10, {**base, "GPUPOOL_ALLOCATION": "a1"}, "python jupyterhub-singleuser")
    assert s is not None and (s.kind, s.holder, s.devices) == (
        "server",
        "alloc:a1",
        ("GPU-a", "MIG-a4"),
    )
    j = classify(11, {"USER": "u2", "GPUPOOL_JOB": "j1", "CUDA_VISIBLE_DEVICES": ""}, "torchrun")
    assert j is not None and (j.kind, j.user, j.holder, j.devices) == ("job", "u2", "job:j1", ())
    assert classify(12, base, "python -m ipykernel_launcher") is None  # a kernel: its server counts
    bare = classify(13, base, "jupyterhub-singleuser")
    assert bare is not None and bare.holder == "pid:13"


def test_the_process_view_finds_this_runs_processes_by_their_home(tmp_path: Path) -> None:
    env = {"PATH": os.environ.get("PATH", ""), "GPUPOOL_JOB": "j1", "USER": "u1"}
    mine = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env={**env, "HOME": f"{tmp_path}/u1", "CUDA_VISIBLE_DEVICES": "GPU-a"},
    )
    other = subprocess.Popen(  # another run's home, under a name that starts the same
        [sys.executable, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env={**env, "HOME": f"{tmp_path}-other/u1"},
    )
    try:
        cost = ScanCost()
        found = {p.pid: p for p in live_processes(tmp_path, cost)}
        assert set(found) == {mine.pid}
        assert (found[mine.pid].holder, found[mine.pid].devices) == ("job:j1", ("GPU-a",))
        assert cost.pids[0] >= 3 and len(cost.seconds) == 1  # every process was looked at
        assert [pid for pid, _ in homed(tmp_path, [other.pid, mine.pid])] == [mine.pid]
    finally:
        for proc in (mine, other):
            proc.kill()
            proc.wait()
    assert live_processes(tmp_path) == []


def test_look_intervals() -> None:
    assert intervals([0.0, 0.5, 1.25]) == [0.5, 0.75]
    assert intervals([1.0]) == []


# -- the contested phase's counts (benchmarks.load_contested) -------------------------------------
METRICS_BEFORE = """# HELP gpupool_allocation_duration_seconds x
# TYPE gpupool_allocation_duration_seconds histogram
gpupool_allocation_duration_seconds_bucket{kind="notebook",le="+Inf"} 3.0
gpupool_allocation_duration_seconds_count{kind="notebook"} 3.0
gpupool_allocation_duration_seconds_sum{kind="notebook"} 0.01
# HELP gpupool_refusals_total x
# TYPE gpupool_refusals_total counter
gpupool_refusals_total{kind="notebook",reason="quota_exceeded"} 1.0
# HELP gpupool_allocations x
# TYPE gpupool_allocations gauge
gpupool_allocations{kind="notebook",offer="h100",team="vision"} 2.0
gpupool_allocations{kind="notebook",offer="cpu",team="everyone"} 1.0
# HELP gpupool_store_healthy x
# TYPE gpupool_store_healthy gauge
gpupool_store_healthy 1.0
"""
METRICS_AFTER = """# TYPE gpupool_allocation_duration_seconds histogram
gpupool_allocation_duration_seconds_count{kind="notebook"} 13.0
gpupool_allocation_duration_seconds_count{kind="job"} 4.0
# TYPE gpupool_refusals_total counter
gpupool_refusals_total{kind="notebook",reason="quota_exceeded"} 6.0
gpupool_refusals_total{kind="notebook",reason="no_capacity"} 2.0
gpupool_refusals_total{kind="job",reason="store_unavailable"} 1.0
# TYPE gpupool_allocations gauge
gpupool_allocations{kind="notebook",offer="h100",team="vision"} 4.0
"""


def test_decisions_are_the_hubs_grants_releases_and_refusals() -> None:
    from benchmarks.load_contested import decisions, pool_counts

    before, after = pool_counts(METRICS_BEFORE), pool_counts(METRICS_AFTER)
    assert before == {
        "allocations": 3.0,
        "grants:notebook": 3.0,
        "refusals:notebook:quota_exceeded": 1.0,
        "store_healthy": 1.0,
    }
    d = decisions(before, after)
    # 14 grants; the pool grew by 1 (3 -> 4 allocations): 13 releases; 8 refusals
    assert d == {
        "decisions": 14 + 13 + 8,
        "grants": 14,
        "releases": 13,
        "refusals": 8,
        "grants_by_kind": {"job": 4, "notebook": 10},
        "refusals_by_kind_reason": {
            "job:store_unavailable": 1,
            "notebook:no_capacity": 2,
            "notebook:quota_exceeded": 5,
        },
    }


def test_contested_spawns_ask_for_what_the_team_allows() -> None:
    import random

    from benchmarks.load_contested import spawn_options

    rng = random.Random(0)
    seen = {tuple(sorted(spawn_options("vision", rng).items())) for _ in range(200)}
    assert seen == {
        (("count", 1), ("offer", "h100")),
        (("count", 2), ("offer", "h100")),
        (("count", 1), ("offer", "mig-3g.40gb")),
    }
    assert {spawn_options("nlp", rng)["offer"] for _ in range(20)} == {"mig-3g.40gb"}
    assert spawn_options(None, rng) == {}


# -- the store fault (benchmarks.load_faults) -----------------------------------------------------
def test_filling_a_folder_stops_at_the_first_refused_write(tmp_path: object) -> None:
    import errno
    from pathlib import Path
    from unittest import mock

    from benchmarks import load_faults

    folder = Path(str(tmp_path))
    writes = iter(
        [
            1 << 20,
            1 << 20,
            OSError(errno.ENOSPC, "full"),
            4096,
            OSError(errno.ENOSPC, "full"),
            OSError(errno.ENOSPC, "full"),
        ]
    )

    class Full:
        def __enter__(self) -> Full:
            return self

        def __exit__(self, *_: object) -> None:
            return None

        def write(self, block: bytes) -> int:
            n = next(writes)
            if isinstance(n, OSError):
                raise n
            return n

    with mock.patch.object(Path, "open", lambda *_a, **_k: Full()):
        assert load_faults.fill(folder) == 2 * (1 << 20) + 4096
