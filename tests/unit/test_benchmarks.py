"""The trace replay's pure pod mapping, tiny replays whose outcome is worked out by hand, and
where the trace comes from: the public trace's folder when there is one, else the synthetic trace
(both paths run here whether or not ``../shared/traces`` exists)."""

from __future__ import annotations

import csv
import json
import random
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import trace as traces
from benchmarks.replay import (
    Shape,
    TracePod,
    fill_length,
    gpu_shapes,
    main,
    mig_profile_for,
    order_pods,
    read_nodes,
    read_pods,
    run_policy,
    shape_of,
)
from benchmarks.stats import percentile

POD_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time\n"


def write_pods(path: Path, rows: list[tuple[str, int, int, int | str]]) -> Path:
    body = "".join(f"{n},1000,1024,{g},{m},,LS,Running,{t}\n" for n, g, m, t in rows)
    path.write_text(POD_HEADER + body)
    return path


def write_nodes(path: Path, nodes: list[tuple[str, int]]) -> Path:
    body = "".join(f"{n},64000,262144,{g},G2\n" for n, g in nodes)
    path.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + body)
    return path


# -- mapping --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("gpu_milli", "profile"),
    [
        (1, "1g.10gb"),
        (142, "1g.10gb"),  # 142/1000 <= 1/7 = 0.142857
        (143, "2g.20gb"),
        (285, "2g.20gb"),  # <= 2/7 = 0.285714
        (286, "3g.40gb"),
        (428, "3g.40gb"),  # <= 3/7 = 0.428571
        (429, "4g.40gb"),
        (571, "4g.40gb"),  # <= 4/7 = 0.571428
        (572, "7g.80gb"),  # no 5g or 6g profile
        (999, "7g.80gb"),
        (1000, "7g.80gb"),
    ],
)
def test_smallest_profile_whose_compute_covers_the_share(gpu_milli: int, profile: str) -> None:
    assert mig_profile_for(gpu_milli) == profile


@pytest.mark.parametrize("gpu_milli", [0, -5, 1001])
def test_a_share_outside_one_gpu_has_no_profile(gpu_milli: int) -> None:
    with pytest.raises(ValueError):
        mig_profile_for(gpu_milli)


def test_shapes_of_whole_fractional_and_gpu_less_pods() -> None:
    assert shape_of(TracePod("w", 4, 1000)) == Shape("w", "gpu", 4, 4000)
    assert shape_of(TracePod("one", 1, 1000)) == Shape("one", "gpu", 1, 1000)
    assert shape_of(TracePod("f", 1, 460)) == Shape("f", "mig-4g.40gb", 1, 460)
    assert shape_of(TracePod("f", 1, 810)) == Shape("f", "mig-7g.80gb", 1, 810)
    assert shape_of(TracePod("cpu", 0, 0)) is None


@pytest.mark.parametrize(("num_gpu", "gpu_milli"), [(2, 500), (9, 1000), (1, 1500)])
def test_pods_outside_the_model_are_rejected(num_gpu: int, gpu_milli: int) -> None:
    with pytest.raises(ValueError):
        shape_of(TracePod("x", num_gpu, gpu_milli))


def test_order_is_by_creation_time_with_ties_in_file_order() -> None:
    pods = [
        TracePod("c", 1, 1000, 5),
        TracePod("a", 1, 1000, 1),
        TracePod("z", 1, 1000, 3),
        TracePod("b", 1, 1000, 1),
        TracePod("y", 1, 1000, 3),
    ]
    assert [p.name for p in order_pods(pods)] == ["a", "b", "z", "y", "c"]


def test_order_is_file_order_without_times() -> None:
    pods = [TracePod("c", 1, 1000), TracePod("a", 1, 1000, 1), TracePod("b", 1, 1000)]
    assert [p.name for p in order_pods(pods)] == ["c", "a", "b"]


def test_read_pods_without_a_time_column_keeps_file_order(tmp_path: Path) -> None:
    path = tmp_path / "pods.csv"
    path.write_text("name,num_gpu,gpu_milli\np1,1,1000\np0,0,0\np2,1,300\n")
    pods = read_pods(path)
    assert [p.creation_time for p in pods] == [None, None, None]
    assert gpu_shapes(pods) == [Shape("p1", "gpu", 1, 1000), Shape("p2", "mig-3g.40gb", 1, 300)]


def test_gpu_less_pods_are_skipped_and_the_rest_ordered(tmp_path: Path) -> None:
    path = write_pods(
        tmp_path / "pods.csv",
        [("late", 1, 1000, 9), ("cpu", 0, 0, 0), ("early", 1, 110, 2), ("tie", 2, 1000, 2)],
    )
    assert [(s.name, s.offer, s.count) for s in gpu_shapes(read_pods(path))] == [
        ("early", "mig-1g.10gb", 1),
        ("tie", "gpu", 2),
        ("late", "gpu", 1),
    ]


def test_fill_stops_with_the_pod_whose_demand_reaches_capacity() -> None:
    shapes = [Shape(f"p{i}", "gpu", 1, d) for i, d in enumerate([400, 500, 100, 700])]
    assert fill_length(shapes, 900) == 2  # 400 + 500 reaches 900 exactly
    assert fill_length(shapes, 901) == 3  # 1000 after the third pod
    assert fill_length(shapes, 1700) == 4
    assert fill_length(shapes, 1701) == 4  # the trace ends first
    assert fill_length(shapes, 0) == 0
    assert fill_length([], 1000) == 0


def test_fill_ends_with_a_trace_shorter_than_the_capacity() -> None:
    shapes = [Shape("a", "gpu", 1, 1000), Shape("b", "mig-1g.10gb", 1, 100)]
    assert fill_length(shapes, 2200) == 2  # only the churn wraps around


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 0.99) == 99
    assert percentile(values, 0.5) == 50
    assert percentile([7], 0.99) == 7
    assert percentile([], 0.99) == 0.0


# -- tiny replays ---------------------------------------------------------------------------
def test_first_fit_replay_by_hand(tmp_path: Path) -> None:
    pods = write_pods(
        tmp_path / "pods.csv",
        [
            ("cpu", 0, 0, 0),  # skipped
            ("w2", 2, 1000, 5),
            ("m4", 1, 470, 1),  # 4g.40gb
            ("m3", 1, 320, 1),  # 3g.40gb; same time as m4, so after it
            ("w1", 1, 1000, 7),
            ("late", 1, 1000, 9),  # never offered: demand reached capacity before
        ],
    )
    nodes = write_nodes(tmp_path / "nodes.csv", [("a", 1), ("b", 2)])
    result = run_policy("first-fit", gpu_shapes(read_pods(pods)), read_nodes(nodes))
    # m4 -> a/0 slots 0-3; m3 -> a/0 slots 4-7; w2 -> node b (a has no whole-free GPU);
    # w1 -> refused (a/0 carries MIG, b is full); demand 470+320+2000+1000 >= 3000: stop.
    assert (result.offered, result.placed, result.refused) == (4, 3, 1)
    assert result.placed_demand_ratio == pytest.approx(2790 / 3000)
    assert result.blocked_ratio == pytest.approx(1.0)
    assert result.offered_demand_ratio == pytest.approx(3790 / 3000)


def test_best_fit_takes_the_fullest_node_where_first_fit_takes_the_first(tmp_path: Path) -> None:
    pods = write_pods(
        tmp_path / "pods.csv", [("one", 1, 1000, 0), ("four", 4, 1000, 1), ("two", 1, 1000, 2)]
    )
    nodes = write_nodes(tmp_path / "nodes.csv", [("big", 4), ("small", 2)])
    shapes, pool = gpu_shapes(read_pods(pods)), read_nodes(nodes)
    first = run_policy("first-fit", shapes, pool)
    best = run_policy("best-fit", shapes, pool)
    # first-fit puts "one" on big, so "four" no longer fits anywhere, and "two" on big;
    # best-fit puts "one" and "two" on small (fewest free slots left) and "four" on big
    assert (first.offered, first.placed, first.refused) == (3, 2, 1)
    assert (best.offered, best.placed, best.refused) == (3, 3, 0)


def test_churn_offers_pods_again_after_the_end_of_the_trace(tmp_path: Path) -> None:
    pods = write_pods(tmp_path / "pods.csv", [("only", 1, 1000, 0)])
    nodes = write_nodes(tmp_path / "nodes.csv", [("a", 1)])
    result = run_policy("first-fit", gpu_shapes(read_pods(pods)), read_nodes(nodes), 3, seed=7)
    assert (result.placed, result.refused) == (1, 0)
    assert result.churn_refused_share == 0.0
    assert result.churn_mean_placed_demand == pytest.approx(1.0)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_churn_releases_the_pod_the_seeded_rng_picks(tmp_path: Path, seed: int) -> None:
    pods = write_pods(
        tmp_path / "pods.csv", [("m4", 1, 470, 0), ("m1", 1, 110, 1), ("w", 1, 1000, 2)]
    )
    nodes = write_nodes(tmp_path / "nodes.csv", [("a", 1)])
    result = run_policy("first-fit", gpu_shapes(read_pods(pods)), read_nodes(nodes), 1, seed)
    # fill: m4 -> slots 0-3, m1 -> slot 4, w refused (the GPU carries MIG)
    assert (result.placed, result.refused) == (2, 1)
    assert result.blocked_ratio == pytest.approx(0.625)
    # churn: release placed[randrange(2)], then offer m4 again (the trace wrapped around);
    # it fits only where m4 was (4g.40gb starts at slot 0 alone)
    released_m4 = random.Random(seed).randrange(2) == 0
    assert result.churn_refused_share == (0.0 if released_m4 else 1.0)
    assert result.churn_mean_placed_demand == pytest.approx(0.58 if released_m4 else 0.47)


# -- where the trace comes from -------------------------------------------------------------
def csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or ()), rows


def test_the_synthetic_trace_has_the_real_files_names_and_columns(tmp_path: Path) -> None:
    folder = traces.write_synthetic_trace(tmp_path, seed=1)
    assert folder == tmp_path / "alibaba-gpu-v2023"
    pod_columns, pods = csv_rows(folder / "openb_pod_list_default.csv")
    node_columns, nodes = csv_rows(folder / "openb_node_list_gpu_node.csv")
    assert pod_columns == [
        "name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos",
        "pod_phase", "creation_time", "deletion_time", "scheduled_time",
    ]  # fmt: skip
    assert node_columns == ["sn", "cpu_milli", "memory_mib", "gpu", "model"]
    assert len(pods) == traces.SYNTHETIC_PODS
    assert (pods, nodes) == traces.synthetic_trace(seed=1)


def test_the_synthetic_trace_is_the_same_for_a_seed_and_differs_across_seeds(
    tmp_path: Path,
) -> None:
    a = traces.write_synthetic_trace(tmp_path / "a", seed=7) / "openb_pod_list_default.csv"
    b = traces.write_synthetic_trace(tmp_path / "b", seed=7) / "openb_pod_list_default.csv"
    c = traces.write_synthetic_trace(tmp_path / "c", seed=8) / "openb_pod_list_default.csv"
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_the_synthetic_trace_has_the_published_shape() -> None:
    pods, nodes = traces.synthetic_trace(seed=0, pods=4000)
    requests = Counter((int(p["num_gpu"]), int(p["gpu_milli"])) for p in pods)
    share = {k: n / len(pods) for k, n in requests.items()}
    # the trace: 13% GPU-less, 48% one whole GPU, 1% several whole GPUs, 38% one fraction
    assert 0.10 < share[(0, 0)] < 0.17
    assert 0.43 < share[(1, 1000)] < 0.53
    assert 0.003 < sum(v for (g, _), v in share.items() if g > 1) < 0.02
    assert 0.33 < sum(v for (g, m), v in share.items() if g == 1 and m < 1000) < 0.43
    assert {m for g, m in requests if g == 1 and m < 1000} >= {810, 470, 320, 230, 160}
    created = [int(p["creation_time"]) for p in pods]
    assert created == sorted(created)
    lifetimes = sorted(int(p["deletion_time"]) - c for p, c in zip(pods, created, strict=True))
    assert lifetimes[0] >= 0
    assert 300 < lifetimes[len(lifetimes) // 2] < 1000  # the trace's median: 540 s
    for p in pods:  # pending pods were never scheduled
        assert (p["pod_phase"] == "Pending") == (p["scheduled_time"] == "")
    shapes = gpu_shapes(TracePod(p["name"], int(p["num_gpu"]), int(p["gpu_milli"])) for p in pods)
    demand = sum(s.demand_milli for s in shapes)
    gpus = sum(int(n["gpu"]) for n in nodes)
    assert 0.9 < demand / (gpus * 1000) <= traces.DEMAND_OF_CAPACITY  # the trace: 97.98%
    assert {int(n["gpu"]) for n in nodes} <= {1, 2, 4, 8}


def test_the_trace_folder_is_the_option_then_the_environment_then_the_default(
    tmp_path: Path,
) -> None:
    option = traces.write_synthetic_trace(tmp_path / "option").parent
    env = traces.write_synthetic_trace(tmp_path / "env").parent
    default = traces.write_synthetic_trace(tmp_path / "default").parent
    missing = tmp_path / "missing"
    sub = "alibaba-gpu-v2023"
    assert traces.locate(option, {"GPUPOOL_TRACES": str(env)}, default).folder == option / sub
    assert traces.locate(None, {"GPUPOOL_TRACES": str(env)}, default).folder == env / sub
    assert traces.locate(None, {}, default).folder == default / sub
    # the folder holding the two files works as well as the one holding alibaba-gpu-v2023/
    assert traces.locate(option / sub, {}, missing).folder == option / sub
    # an environment variable naming a folder without the trace means: the synthetic trace
    source = traces.locate(None, {"GPUPOOL_TRACES": str(missing)}, default)
    assert source.folder is None and f"GPUPOOL_TRACES={missing}" in source.why
    source = traces.locate(None, {}, missing)
    assert source.folder is None and "GPUPOOL_TRACES is not set" in source.why
    with pytest.raises(FileNotFoundError, match="--traces"):
        traces.locate(missing, {}, default)


def test_without_a_trace_the_replay_runs_on_the_synthetic_one_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUPOOL_TRACES", str(tmp_path / "missing"))
    assert main(["--policy", "first-fit", "--json"]) == 0
    out, err = capsys.readouterr()
    [result] = json.loads(out)
    assert (result["trace"], result["trace_seed"]) == ("synthetic", 0)
    assert result["offered"] > 0 and result["placed"] > 0
    [line] = err.splitlines()  # one line: why, and where the public trace comes from
    assert line.startswith("trace: synthetic (GPUPOOL_TRACES=")
    assert "https://github.com/alibaba/clusterdata" in line
    assert "cluster-trace-gpu-v2023" in line and "research" in line

    assert main(["--policy", "first-fit", "--trace-seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("trace: synthetic (seed 3): 815 pods")
    assert "github.com/alibaba/clusterdata" in err


def test_with_a_trace_folder_the_replay_reads_it_and_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = traces.write_synthetic_trace(tmp_path / "traces", seed=5, pods=300)
    monkeypatch.setenv("GPUPOOL_TRACES", str(tmp_path / "traces"))
    assert main(["--policy", "best-fit", "--json"]) == 0
    out, err = capsys.readouterr()
    [result] = json.loads(out)
    assert Path(result["trace"]).resolve() == folder / "openb_pod_list_default.csv"
    assert "trace_seed" not in result and err == ""
    expected = run_policy(
        "best-fit",
        gpu_shapes(read_pods(folder / "openb_pod_list_default.csv")),
        read_nodes(folder / "openb_node_list_gpu_node.csv"),
    )
    assert (result["placed"], result["refused"]) == (expected.placed, expected.refused)

    assert main(["--policy", "best-fit"]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("trace: ") and "synthetic" not in out
    assert "300 pods" in out.splitlines()[0]


def test_a_traces_option_without_the_trace_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--traces", str(tmp_path)])
    assert exit_.value.code == 2
    assert "--traces" in capsys.readouterr().err


def test_the_public_trace_when_present_maps_onto_the_model() -> None:
    """Only where the public trace is at hand (``$GPUPOOL_TRACES`` or ``../shared/traces``): every
    pod has a shape, in the counts benchmarks/README.md gives."""
    source = traces.locate(None)
    if source.folder is None:
        pytest.skip(f"no public trace here ({source.why}); the synthetic one is tested above")
    pods = read_pods(source.pods)
    shapes = gpu_shapes(pods)
    if len(pods) != 8152:
        pytest.skip(f"{source.pods} is not the public trace's default pod list")
    kinds = Counter("gpu" if s.offer == "gpu" else s.offer for s in shapes)
    assert kinds == {
        "gpu": 3986,
        "mig-7g.80gb": 1406,
        "mig-4g.40gb": 971,
        "mig-3g.40gb": 389,
        "mig-2g.20gb": 280,
        "mig-1g.10gb": 32,
    }
    assert sum(n for _, n in read_nodes(source.nodes)) == 6212


# -- the sharing model (the FGD paper's) ----------------------------------------------------
def test_sharing_model_shapes_are_shares_of_their_milli() -> None:
    assert shape_of(TracePod("f", 1, 460), "sharing") == Shape("f", "share-460", 1, 460)
    assert shape_of(TracePod("w", 4, 1000), "sharing") == Shape("w", "gpu", 4, 4000)
    assert shape_of(TracePod("cpu", 0, 0), "sharing") is None
    with pytest.raises(ValueError):
        shape_of(TracePod("x", 2, 500), "sharing")


def test_sharing_first_fit_and_best_fit_replays_by_hand(tmp_path: Path) -> None:
    pods = write_pods(
        tmp_path / "pods.csv",
        [("s6", 1, 600, 0), ("s5", 1, 500, 1), ("s4", 1, 400, 2), ("w2", 2, 1000, 3)],
    )
    nodes = write_nodes(tmp_path / "nodes.csv", [("a", 2), ("b", 1)])
    shapes = gpu_shapes(read_pods(pods), "sharing")
    first = run_policy("first-fit", shapes, read_nodes(nodes), model="sharing")
    best = run_policy("best-fit", shapes, read_nodes(nodes), model="sharing")
    # first-fit: s6 -> a/0, s5 -> a/1, s4 -> a/0 (400 free there), w2 refused (no node has
    # two fully free GPUs); the fill stops there: demand 3500 >= 3000
    assert (first.offered, first.placed, first.refused) == (4, 3, 1)
    assert first.blocked_ratio == pytest.approx(1500 / 3000)
    # best-fit: s6 -> a/0; s5 -> a/1 (ties: 500 left on a/1 and on b/0: file order); s4 ->
    # a/0 (0 left); w2 refused too. Same outcome, different reasons.
    assert (best.placed, best.refused) == (3, 1)
    assert best.blocked_ratio == best.placed_demand_ratio == pytest.approx(0.5)


def test_sharing_best_fit_packs_where_first_fit_takes_the_first(tmp_path: Path) -> None:
    pods = write_pods(
        tmp_path / "pods.csv",
        [("a", 1, 400, 0), ("b", 1, 700, 1), ("c", 1, 300, 2), ("d", 1, 600, 3)],
    )
    nodes = write_nodes(tmp_path / "nodes.csv", [("x", 1), ("y", 1)])
    shapes = gpu_shapes(read_pods(pods), "sharing")
    first = run_policy("first-fit", shapes, read_nodes(nodes), model="sharing")
    best = run_policy("best-fit", shapes, read_nodes(nodes), model="sharing")
    # a -> x (400); b -> y (700, x has 600 free). first-fit: c -> x (the first that fits), so
    # d (600) finds 300 free on each: refused. best-fit: c -> y (0 left), d -> x.
    assert (first.placed, first.refused) == (3, 1)
    assert (best.placed, best.refused) == (4, 0)
    assert best.blocked_ratio == pytest.approx(1.0)


def test_the_sharing_model_runs_every_policy_and_reports_the_same_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPUPOOL_TRACES", str(tmp_path / "missing"))
    assert main(["--json", "--churn", "50", "--model", "sharing"]) == 0
    sharing = json.loads(capsys.readouterr().out)
    assert main(["--json", "--churn", "50"]) == 0
    mig = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in sharing] == ["first-fit", "best-fit", "gpupool"]
    assert [set(r) for r in sharing] == [set(r) for r in mig]
    assert {r["model"] for r in sharing} == {"sharing"} and {r["model"] for r in mig} == {"mig"}
    for r in sharing:  # a share costs exactly its milli
        assert r["blocked_ratio"] == pytest.approx(r["placed_demand_ratio"])
    assert main(["--policy", "best-fit", "--model", "sharing"]) == 0
    assert "MIG off, shares of 1000 milli" in capsys.readouterr().out.splitlines()[0]


def test_the_allocator_benchmark_runs_with_shares_in_the_mix() -> None:
    from benchmarks.allocator import run_one

    for policy in ("first-fit", "best-fit", "gpupool"):
        result = run_one(64, policy, steps=200, shares=True)  # ends with check_invariants
        assert result.alloc_share is not None and result.alloc_share.count > 0
        assert result.granted > 0


# -- refusals breakdown ---------------------------------------------------------------------
def test_the_refusal_breakdown_adds_up_to_the_replays_own_refusals(tmp_path: Path) -> None:
    from benchmarks.refusals import breakdown

    folder = traces.write_synthetic_trace(tmp_path, seed=0)
    pods = read_pods(folder / traces.POD_FILE)
    nodes = read_nodes(folder / traces.NODE_FILE)
    parts_seen: Counter[str] = Counter()
    for model in ("mig", "sharing"):
        shapes = gpu_shapes(pods, model)
        for policy in ("first-fit", "best-fit", "gpupool"):
            for seed in (1, 2):
                c = breakdown(policy, shapes, nodes, 400, seed, model)
                plain = run_policy(policy, shapes, nodes, 400, seed, model)  # not watched
                refused = round((plain.churn_refused_share or 0) * 400)
                parts = {
                    "A": c.none_whole_free,
                    "B": c.beyond_supply,
                    "C": c.node_taken,
                    "rest": c.rest,
                }
                assert sum(parts.values()) == c.refused == c.replay_refused == refused
                assert c.offers == 400 and c.x8_offers >= c.beyond_supply + c.node_taken
                assert c.bound == c.none_whole_free + c.beyond_supply + c.beyond_placed
                parts_seen.update(k for k, v in parts.items() if v)
    assert set(parts_seen) == {"A", "B", "C", "rest"}  # this trace makes every kind


def test_the_refusals_command_writes_its_json_and_names_the_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.refusals import main as refusals_main

    monkeypatch.setenv("GPUPOOL_TRACES", str(tmp_path / "missing"))
    out = tmp_path / "refusals.json"
    assert (
        refusals_main(["--model", "sharing", "--seeds", "1,2", "--churn", "60", "--out", str(out)])
        == 0
    )
    table = capsys.readouterr().out
    assert table.startswith("trace: synthetic (seed 0)") and "bound A+B" in table
    rows = json.loads(out.read_text())
    assert [(r["model"], r["policy"]) for r in rows] == [
        ("sharing", "first-fit"),
        ("sharing", "best-fit"),
        ("sharing", "gpupool"),
    ]
    for r in rows:
        assert r["trace"] == "synthetic" and r["seeds"] == [1, 2] and r["offers"] == 120
        assert [s["seed"] for s in r["per_seed"]] == [1, 2]
        assert r["refused"] == sum(s["refused"] for s in r["per_seed"])


def test_each_refusal_goes_to_its_part_by_hand() -> None:
    from benchmarks.refusals import WatchedRun
    from benchmarks.replay import build_inventory

    # node a: 8 GPUs, node b: 1; the fill (9 GPUs of demand) places p0 (8 GPUs) on a and p1 on b
    sizes = [8, 1, 4, 1, 1, 8, 8]
    shapes = [Shape(f"p{i}", "gpu", k, k * 1000) for i, k in enumerate(sizes)]
    run = WatchedRun("first-fit", shapes, build_inventory([("a", 8), ("b", 1)]))
    t: list[int] = []
    assert run.fill_offers == 2 and run.offer_next(t) and run.offer_next(t)
    assert not run.offer_next(t)  # step 0: p2 (4 GPUs) fits nowhere: rest
    assert not run.offer_next(t)  # step 1: p3 (1 GPU), not one GPU whole-free: A
    run.release(0)  # p0 leaves: a is fully free (supply 1, by an 8-GPU pod)
    assert run.offer_next(t)  # step 2: p4 (1 GPU) can only take a: forced
    assert not run.offer_next(t)  # step 3: p5 (8 GPUs) was matched to a, which p4 took: C
    assert not run.offer_next(t)  # step 4: p6 (8 GPUs), the supply is used up: B
    run.release(1)  # p4 leaves a: fully free again (supply 2, by a 1-GPU pod)
    assert run.offer_next(t)  # step 5: p0 again (8 GPUs), matched, placed
    assert not run.offer_next(t)  # step 6: p1 (1 GPU), a and b held: A
    run.release(1)  # p0 leaves a (supply 3, by an 8-GPU pod)
    run.release(0)  # p1 leaves b
    assert run.offer_next(t)  # step 7: p2 (4 GPUs) can only take a: forced
    run.release(0)  # p2 leaves a (supply 4, by a 4-GPU pod)
    assert run.offer_next(t)  # step 8: p3 (1 GPU) takes a although b is free: by choice
    c = run.counts
    assert (c.offers, c.refused, c.x8_offers) == (9, 5, 3)
    assert (c.none_whole_free, c.beyond_supply, c.node_taken, c.rest) == (2, 1, 1, 1)
    assert c.none_whole_free_steps == [1, 6] and c.rest_by_shape == {"4×GPU": 1}
    assert c.supply_by == {"8×GPU": 2, "1×GPU": 1, "4×GPU": 1}
    assert c.took_forced == {"1×GPU": 1, "4×GPU": 1} and c.took_choice == {"1×GPU": 1}
    assert c.bound == 3 and c.beyond_placed == 0
