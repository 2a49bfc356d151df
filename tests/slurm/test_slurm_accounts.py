"""Quota mapping on real Slurm with accounting: slurmdbd on MariaDB, slurmctld and slurmd
(:class:`gpupool.slurm.devcluster.DevCluster` with ``accounting=True``), the teams' plan applied by
:class:`gpupool.slurm.accounts_sync.SlurmAccounts` through sacctmgr, and jobs held back by
Slurm itself with the reasons 22.05 gives (``AssocGrpBilling``, ``QOSMaxBillingPerUser``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from traitlets.config import Config

from gpupool.core.quota import EVERYONE, Team
from gpupool.declarations import ConfigError
from gpupool.slurm import accounts
from gpupool.slurm.accounts_sync import SlurmAccounts
from gpupool.slurm.commands import SlurmCommands
from gpupool.slurm.devcluster import DevCluster, NodeLayout
from gpupool.slurm.settings import SlurmSettings
from tests.accounts import IS_ROOT, NOT_ROOT, unix_user
from tests.slurm_cluster import MakeCluster, with_accounting

LAYOUT = (
    NodeLayout("gpu1", {"h100": 2, "1g.10gb": 8}),
    NodeLayout("gpu2", {"a100": 2}, shards=8),
)
"""Eight 1g.10gb instances (1 GPU-eq at 125 each), so a team's limit of 1 fills exactly."""
COSTS = {"gpu:h100": 1000, "gpu:a100": 1000, "gpu:1g.10gb": 125, "shard": 250}
TEAMS = [
    Team("vision", guarantee_milli=1000),
    Team("nlp", guarantee_milli=2000, borrow_limit_milli=1000, user_cap_milli=1000),
]
ANN, BOB = "gpslurm-ann", "gpslurm-bob"


def accounting_cluster(make: MakeCluster, weights: bool = True) -> DevCluster:
    return make(
        nodes=LAYOUT, **{**with_accounting(COSTS), **({} if weights else {"billing_weights": ""})}
    )


def manager(cluster: DevCluster, **kwargs: Any) -> SlurmAccounts:
    return SlurmAccounts(
        commands=SlurmCommands(str(cluster.conf)),
        partition="gpu",
        gres_costs=COSTS,
        manage=True,
        **kwargs,
    )


def assocs(cluster: DevCluster) -> dict[tuple[str, str], accounts.Assoc]:
    out = cluster.run(
        "sacctmgr", "--parsable2", "--noheader", "show", "assoc", f"format={accounts.ASSOC_FORMAT}"
    ).stdout
    return {(a.account, a.user): a for a in accounts.parse_assocs(out)}


def submit(cluster: DevCluster, account: str, gres: str, user: str = "root") -> int:
    args = ["sbatch", "--parsable", "-A", account, *([f"--gres={gres}"] if gres else [])]
    args += ["-o", "/dev/null"]
    args += ["--chdir=/tmp", "--wrap", "sleep 300"]
    if user != "root":
        args = ["runuser", "-u", user, "--", *args]
    return int(cluster.run(*args).stdout.strip().split(";")[0])


def jobs(cluster: DevCluster) -> dict[int, dict[str, Any]]:
    return {j["job_id"]: j for j in json.loads(cluster.run("squeue", "--json").stdout)["jobs"]}


def until(check: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Poll ``check`` until it holds (the pause only spaces the polls)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        time.sleep(0.2)


def settle(cluster: DevCluster, expected: dict[int, tuple[str, str]]) -> None:
    """Wait until each job is in its (state, reason), e.g. ``(PENDING, AssocGrpBilling)``."""

    def now() -> dict[int, tuple[str, str]]:
        js = jobs(cluster)
        return {i: (js[i]["job_state"], js[i]["state_reason"]) for i in expected if i in js}

    until(lambda: now() == expected, f"jobs {expected}; last seen {now()}")


def billing_of(cluster: DevCluster, job_id: int) -> int:
    line = cluster.run("scontrol", "show", "job", str(job_id), "-o").stdout
    tres = accounts.parse_scontrol(line)["TRES"]
    return accounts.tres_value(tres, "billing")


def test_the_plan_is_applied_once_and_leaves_other_accounts_alone(
    make_slurm_cluster: MakeCluster,
) -> None:
    cluster = accounting_cluster(make_slurm_cluster)
    cluster.run("sacctmgr", "-i", "add", "account", "physics", "GrpTRES=cpu=10", "Fairshare=5")

    ran = asyncio.run(manager(cluster).apply(TEAMS))
    assert [c[2:4] for c in ran] == [
        ["add", "account"],
        ["add", "qos"],
        ["add", "account"],
        ["add", "qos"],
        ["add", "account"],
    ]
    now = assocs(cluster)
    assert (now["nlp", ""].parent, now["nlp", ""].fairshare) == ("gpupool", "2000")
    assert (now["nlp", ""].grp_tres, now["nlp", ""].default_qos) == ("billing=3000", "gpupool-nlp")
    assert now["vision", ""].grp_tres == "billing=1000"
    qos = accounts.parse_qos(
        cluster.run("sacctmgr", "--parsable2", "--noheader", "show", "qos", "format=name,maxtrespu")
        .stdout
    )  # fmt: skip
    assert (qos["gpupool-nlp"], qos["gpupool-vision"]) == ("billing=1000", "")

    # a fresh hub (a restart) finds nothing to change
    assert asyncio.run(manager(cluster).apply(TEAMS)) == []
    assert assocs(cluster) == now

    # a changed borrowing limit is one modify, of that limit only
    bigger = [TEAMS[0], Team("nlp", 2000, 2000, 1000)]
    assert asyncio.run(manager(cluster).apply(bigger)) == [
        ["sacctmgr", "-i", "modify", "account", "where", "name=nlp", "cluster=gpupooldev",
         "set", "GrpTRES=billing=4000"],
    ]  # fmt: skip
    after = assocs(cluster)
    assert after["nlp", ""].grp_tres == "billing=4000"
    assert (after["physics", ""].grp_tres, after["physics", ""].fairshare) == ("cpu=10", "5")


def test_a_team_limit_of_one_gpu_holds_in_slurm_with_mig_priced_by_memory(
    make_slurm_cluster: MakeCluster,
) -> None:
    cluster = accounting_cluster(make_slurm_cluster)
    sync = manager(cluster)
    asyncio.run(sync.apply(TEAMS))
    assert asyncio.run(sync.ensure_user("root", "vision")) == "vision"

    first = submit(cluster, "vision", "gpu:h100:1")
    second = submit(cluster, "vision", "gpu:h100:1")
    settle(cluster, {first: ("RUNNING", "None"), second: ("PENDING", "AssocGrpBilling")})
    assert billing_of(cluster, first) == 1000
    cluster.run("scancel", str(first), str(second))
    until(lambda: not {first, second} & {i for i, j in jobs(cluster).items()
                                         if j["job_state"] in ("RUNNING", "PENDING")},
          "both cancelled")  # fmt: skip

    # eight 1g.10gb instances cost 8 x 125 = 1000: all run within the limit of 1 GPU-eq
    migs = [submit(cluster, "vision", "gpu:1g.10gb:1") for _ in range(8)]
    settle(cluster, {i: ("RUNNING", "None") for i in migs})
    assert {billing_of(cluster, i) for i in migs} == {125}
    # ... and then neither a whole GPU nor an untyped one (billed a whole GPU) fits
    h100 = submit(cluster, "vision", "gpu:h100:1")
    untyped = submit(cluster, "vision", "gpu:1")
    settle(cluster, {h100: ("PENDING", "AssocGrpBilling"), untyped: ("PENDING", "AssocGrpBilling")})
    assert billing_of(cluster, untyped) == 1000


@pytest.mark.skipif(not IS_ROOT, reason=NOT_ROOT)
def test_the_per_user_cap_holds_for_one_user_not_for_their_teammate(
    make_slurm_cluster: MakeCluster,
) -> None:
    cluster = accounting_cluster(make_slurm_cluster)
    unix_user(ANN)
    unix_user(BOB)
    sync = manager(cluster)
    asyncio.run(sync.apply(TEAMS))
    for user in (ANN, BOB):
        assert asyncio.run(sync.ensure_user(user, "nlp")) == "nlp"
    assert asyncio.run(manager(cluster).apply(TEAMS)) == []  # users' associations change nothing
    users = {u for (a, u) in assocs(cluster) if a == "nlp" and u}
    assert users == {ANN, BOB}

    # nlp's cap is 1 GPU-eq per user (its limit 3): ann's second GPU waits, bob's first runs
    ann1 = submit(cluster, "nlp", "gpu:h100:1", user=ANN)
    ann2 = submit(cluster, "nlp", "gpu:a100:1", user=ANN)
    bob1 = submit(cluster, "nlp", "gpu:h100:1", user=BOB)
    settle(
        cluster,
        {
            ann1: ("RUNNING", "None"),
            ann2: ("PENDING", "QOSMaxBillingPerUser"),
            bob1: ("RUNNING", "None"),
        },
    )
    # shards at 250 each: bob's 3 more shards would reach 1.75 > 1, 0 more fit; ann's none
    bob_shards = submit(cluster, "nlp", "shard:3", user=BOB)
    settle(cluster, {bob_shards: ("PENDING", "QOSMaxBillingPerUser")})
    assert billing_of(cluster, bob_shards) == 750


def test_ensure_user_adds_the_association_once(make_slurm_cluster: MakeCluster) -> None:
    cluster = accounting_cluster(make_slurm_cluster)
    sync = manager(cluster)
    asyncio.run(sync.apply([*TEAMS, Team(EVERYONE)]))
    # not known to Slurm yet: a job on the team's account is refused at submit
    refused = cluster.run("sbatch", "-A", "vision", "--wrap", "true", check=False)
    assert refused.returncode and "Invalid account" in refused.stderr

    async def twice() -> list[str]:
        return list(await asyncio.gather(*(sync.ensure_user("root", "vision") for _ in range(2))))

    assert asyncio.run(twice()) == ["vision", "vision"]
    assert ("vision", "root") in assocs(cluster)
    assert submit(cluster, "vision", "gpu:1g.10gb:1")
    # users in no team: an account of their own team, everyone, whose limit (0: CPU only)
    # refuses a GPU and lets a CPU job run (billing 0 under GrpTRES=billing=0)
    assert asyncio.run(sync.ensure_user("root", EVERYONE)) == "everyone"
    gpu, cpu = submit(cluster, "everyone", "gpu:1g.10gb:1"), submit(cluster, "everyone", "")
    settle(cluster, {gpu: ("PENDING", "AssocGrpBilling"), cpu: ("RUNNING", "None")})
    # a server without an allocation names no account
    assert asyncio.run(sync.ensure_user("root", "")) == ""


def test_missing_billing_weights_stop_the_hub_naming_the_line(
    make_slurm_cluster: MakeCluster,
) -> None:
    cluster = accounting_cluster(make_slurm_cluster, weights=False)
    settings = SlurmSettings(slurm_conf=str(cluster.conf))  # the default partition: gpu
    sync = SlurmAccounts.from_settings(
        settings, COSTS, config=Config(SlurmAccounts={"manage": True})
    )
    with pytest.raises(ConfigError) as e:
        asyncio.run(sync.apply(TEAMS))
    assert e.value.path == "SlurmAccounts.manage"
    assert (
        "TRESBillingWeights of partition gpu is not set; add to its PartitionName line: "
        "TRESBillingWeights=GRES/gpu=1000,GRES/gpu:1g.10gb=-875,GRES/shard=250"
    ) in str(e.value)
    assert ("gpupool", "") not in assocs(cluster)  # nothing was created


def test_manage_on_a_cluster_without_slurmdbd_stops_the_hub(
    make_slurm_cluster: MakeCluster,
) -> None:
    cluster = make_slurm_cluster(nodes=LAYOUT)
    with pytest.raises(ConfigError, match="AccountingStorageType is accounting_storage/none"):
        asyncio.run(manager(cluster).apply(TEAMS))


def test_manage_off_names_the_account_and_changes_nothing(
    make_slurm_cluster: MakeCluster,
) -> None:
    cluster = accounting_cluster(make_slurm_cluster)
    sync = SlurmAccounts(
        commands=SlurmCommands(str(cluster.conf)),
        partition="gpu",
        gres_costs=COSTS,
        accounts={"vision": "cv-lab"},
    )
    assert asyncio.run(sync.apply(TEAMS)) == []
    assert asyncio.run(sync.ensure_user("root", "vision")) == "cv-lab"
    assert set(assocs(cluster)) == {("root", ""), ("root", "root")}
