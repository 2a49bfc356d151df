"""Reading what Slurm prints (:mod:`gpupool.slurm.parse`): gres strings, index and host lists, as
Slurm 22.05's ``squeue --json`` and ``sinfo --json`` write them (samples taken from the dev
cluster's daemons)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool.slurm.parse import (
    Gres,
    SlurmOutputError,
    gres_list,
    host_list,
    index_list,
    sinfo_nodes,
    squeue_jobs,
)


def test_gres_strings_as_slurm_prints_them() -> None:
    used = "gpu:h100:2(IDX:0-1),gpu:1g.10gb:0(IDX:N/A),shard:0"
    assert gres_list(used) == (
        Gres("gpu", "h100", 2, (0, 1)),
        Gres("gpu", "1g.10gb", 0, ()),
        Gres("shard", "", 0, ()),
    )
    assert gres_list("gpu:a100:2,shard:a100:8") == (
        Gres("gpu", "a100", 2),
        Gres("shard", "a100", 8),
    )
    assert gres_list("gpu:h100:4(S:0-1)") == (Gres("gpu", "h100", 4),)
    assert gres_list("gpu:2(IDX:0,3)") == (Gres("gpu", "", 2, (0, 3)),)
    assert gres_list("shard:3(IDX:0)") == (Gres("shard", "", 3, (0,)),)
    assert gres_list("") == gres_list("(null)") == ()


def test_text_that_is_not_slurms_is_refused() -> None:
    with pytest.raises(SlurmOutputError):
        gres_list("gpu:h100:two")
    with pytest.raises(SlurmOutputError):
        index_list("0-x")


@given(st.lists(st.integers(0, 300), unique=True, min_size=1))
def test_index_lists_round_trip(indices: list[int]) -> None:
    indices.sort()
    runs: list[str] = []
    start = prev = indices[0]
    for i in [*indices[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    assert index_list(",".join(runs)) == tuple(indices)


def test_host_lists() -> None:
    assert host_list("gpu[1-3,5],cpu1") == ("gpu1", "gpu2", "gpu3", "gpu5", "cpu1")
    assert host_list("n[08-10]") == ("n08", "n09", "n10")
    assert host_list("gpu1") == ("gpu1",)
    assert host_list("") == ()


def test_squeue_and_sinfo_documents() -> None:
    jobs = squeue_jobs(
        {
            "jobs": [
                {
                    "job_id": 7,
                    "name": "jupyter-ada",
                    "user_name": "ada",
                    "job_state": "RUNNING",
                    "state_reason": "None",
                    "nodes": "gpu[1-2]",
                    "gres_detail": ["gpu:h100:1(IDX:1)", "gpu:a100:1(IDX:0)"],
                    "comment": "gpupool:m:server:a1",
                    "start_time": 1796255371,
                },
                {"job_id": 8, "job_state": "PENDING", "state_reason": "Resources"},
            ]
        }
    )
    running, pending = jobs
    assert running.reason == "" and pending.reason == "Resources" and pending.pending
    assert running.gpu_indices("gpu2") == (Gres("gpu", "a100", 1, (0,)),)
    assert running.gpu_indices("gpu3") == ()
    nodes = sinfo_nodes(
        {
            "nodes": [
                {
                    "name": "gpu1",
                    "state": "mixed",
                    "state_flags": ["DRAIN"],
                    "gres": "gpu:h100:2",
                    "gres_used": "gpu:h100:1(IDX:0)",
                    "partitions": ["gpu"],
                }
            ]
        }
    )
    assert nodes[0].flags == ("drain",) and nodes[0].gres_used[0].indices == (0,)
    with pytest.raises(SlurmOutputError):
        squeue_jobs({"errors": ["no"]})


def test_a_gres_model_that_names_no_memory_stops_the_hub_naming_the_key() -> None:
    from gpupool.declarations import ConfigError
    from gpupool.slurm.settings import SlurmSettings, mig_profile_of

    with pytest.raises(ConfigError, match=r"SlurmSettings\.gres_models"):
        SlurmSettings(gres_models={"h100": "H100"})
    assert mig_profile_of("h100_1g.10gb", "H100-80GB") == "1g.10gb"
    assert mig_profile_of("1g.10gb", "H100-80GB") == "1g.10gb"
    assert mig_profile_of("h100", "H100-80GB") is None
