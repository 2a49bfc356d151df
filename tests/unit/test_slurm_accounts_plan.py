"""The Slurm accounts plan (pure): billing weights that bill gpupool's cost, the accounts and QOS of
the teams, the sacctmgr commands (idempotent, never deleting) and the slurm.conf checks."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpupool.core.quota import EVERYONE, Team
from gpupool.slurm import accounts
from gpupool.slurm.accounts import Assoc

COSTS = {"gpu:h100": 1000, "gpu:a100": 1000, "gpu:1g.10gb": 125, "gpu:3g.40gb": 500, "shard": 250}
TEAMS = [
    Team("vision", guarantee_milli=2000, borrow_limit_milli=1000, user_cap_milli=1000),
    Team("nlp", guarantee_milli=1000),
    Team(EVERYONE),
]


def test_weights_bill_typed_gres_their_cost_and_untyped_a_whole_gpu() -> None:
    w = accounts.billing_weights(COSTS)
    assert w == {
        "GRES/gpu": 1000,
        "GRES/gpu:1g.10gb": -875,
        "GRES/gpu:3g.40gb": -500,
        "GRES/shard": 250,
    }
    assert accounts.billing(w, accounts.request_tres({"gpu:1g.10gb": 8})) == 1000
    assert accounts.billing(w, accounts.request_tres({"gpu": 1})) == 1000
    assert accounts.weights_text(w) == (
        "GRES/gpu=1000,GRES/gpu:1g.10gb=-875,GRES/gpu:3g.40gb=-500,GRES/shard=250"
    )


gres_tables = st.dictionaries(
    st.sampled_from(["gpu:h100", "gpu:a100", "gpu:1g.10gb", "gpu:2g.20gb", "gpu:3g.40gb"]),
    st.integers(min_value=0, max_value=1000),
    min_size=1,
).flatmap(
    lambda gpus: st.one_of(
        st.just(gpus), st.integers(1, 1000).map(lambda shard: {**gpus, "shard": shard})
    )
)


@given(
    gres_tables.flatmap(
        lambda costs: st.tuples(
            st.just(costs), st.dictionaries(st.sampled_from(sorted(costs)), st.integers(0, 64))
        )
    )
)
def test_billing_of_any_request_is_its_cost_in_milli(
    case: tuple[dict[str, int], dict[str, int]],
) -> None:
    costs, request = case
    w = accounts.billing_weights(costs)
    cost = sum(costs[k] * n for k, n in request.items())
    assert accounts.billing(w, accounts.request_tres(request)) == cost


@given(gres_tables, st.integers(1, 16))
def test_an_untyped_gpu_is_billed_no_less_than_any_typed_one(
    costs: dict[str, int], count: int
) -> None:
    w = accounts.billing_weights(costs)
    most = max(c for k, c in costs.items() if k.startswith("gpu:"))
    assert accounts.billing(w, accounts.request_tres({"gpu": count})) >= most * count


def test_gres_costs_from_the_shared_settings() -> None:
    models = {"h100": "H100-80GB", "1g.10gb": "H100-80GB", "a100_3g.20gb": "A100-40GB"}
    assert accounts.gres_costs_of(models, shards_per_gpu=3) == {
        "gpu:h100": 1000,
        "gpu:1g.10gb": 125,
        "gpu:a100_3g.20gb": 500,
        "shard": 334,
    }


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match="NAME:TYPE"):
        accounts.billing_weights({"gpu h100": 1000})
    with pytest.raises(ValueError, match="whole milli"):
        accounts.billing_weights({"gpu:h100": 0.5})  # type: ignore[dict-item]


def test_plan_one_account_and_qos_per_team_everyone_included() -> None:
    p = accounts.plan(TEAMS, COSTS, parent="gpupool", names={"vision": "cv-lab"})
    assert [(a.team, a.account, a.qos) for a in p.accounts] == [
        ("everyone", "everyone", "gpupool-everyone"),  # gpupool's limits hold for them too
        ("nlp", "nlp", "gpupool-nlp"),
        ("vision", "cv-lab", "gpupool-cv-lab"),
    ]
    everyone, nlp, vision = p.accounts
    assert (vision.fairshare, vision.grp_billing, vision.user_cap) == (2000, 3000, 1000)
    assert nlp.user_cap == accounts.NO_LIMIT
    assert (everyone.fairshare, everyone.grp_billing) == (1, 0)  # CPU only: no GPU billing
    assert p.account("vision") == "cv-lab"


def test_a_team_mapped_to_no_account_gets_none() -> None:
    """``SlurmSettings.accounts = {"everyone": ""}``: users in no team submit without
    ``--account`` (Slurm charges their own default account)."""
    p = accounts.plan(TEAMS, COSTS, names={EVERYONE: ""})
    assert [a.team for a in p.accounts] == ["nlp", "vision"]
    with pytest.raises(KeyError):
        p.account(EVERYONE)


def test_plan_refuses_names_slurm_cannot_take() -> None:
    with pytest.raises(ValueError, match="'Vision Lab' is not a Slurm account name"):
        accounts.plan([Team("Vision Lab")], COSTS)
    with pytest.raises(ValueError, match="map to one account 'x'"):
        accounts.plan([Team("a"), Team("b")], COSTS, names={"a": "x", "b": "x"})


def test_commands_from_nothing_add_parent_qos_and_accounts() -> None:
    p = accounts.plan(TEAMS[:1], COSTS)
    cmds = accounts.commands(p, "c1", [], {})
    assert cmds == [
        ["sacctmgr", "-i", "add", "account", "gpupool", "Cluster=c1",
         "Description=gpupool teams", "Organization=gpupool"],
        ["sacctmgr", "-i", "add", "qos", "gpupool-vision", "MaxTRESPerUser=billing=1000"],
        ["sacctmgr", "-i", "add", "account", "vision", "Cluster=c1", "Parent=gpupool",
         "Description=gpupool team vision", "Organization=gpupool", "Fairshare=2000",
         "GrpTRES=billing=3000", "QOS=gpupool-vision", "DefaultQOS=gpupool-vision"],
    ]  # fmt: skip


def _state(
    grp: str = "billing=3000", cap: str = "billing=1000"
) -> tuple[list[Assoc], dict[str, str]]:
    assocs = [
        Assoc("root", "", "", "1", "", "normal", ""),
        Assoc("gpupool", "", "root", "1", "", "normal", ""),
        Assoc("vision", "", "gpupool", "2000", grp, "gpupool-vision", "gpupool-vision"),
        Assoc("vision", "ann", "", "1", "", "gpupool-vision", ""),
        Assoc("physics", "", "root", "5", "cpu=10", "normal", ""),
    ]
    return assocs, {"normal": "", "gpupool-vision": cap}


def test_commands_when_slurm_holds_the_plan_are_none() -> None:
    p = accounts.plan(TEAMS[:1], COSTS)
    assert accounts.commands(p, "c1", *_state()) == []


def test_commands_change_only_what_differs_and_never_delete() -> None:
    p = accounts.plan(TEAMS[:1], COSTS)
    cmds = accounts.commands(p, "c1", *_state(grp="cpu=4,billing=5000", cap=""))
    assert cmds == [
        ["sacctmgr", "-i", "modify", "qos", "where", "name=gpupool-vision", "set",
         "MaxTRESPerUser=billing=1000"],
        ["sacctmgr", "-i", "modify", "account", "where", "name=vision", "cluster=c1", "set",
         "GrpTRES=billing=3000"],
    ]  # fmt: skip
    assert not any({"delete", "remove"} & set(c) for c in cmds)


def test_parse_sacctmgr_output() -> None:
    text = (
        "gpupool||root|1||normal||\n"
        "vision||gpupool|2000|billing=3000|gpupool-vision|gpupool-vision|\n"
    )
    rows = accounts.parse_assocs(text)
    assert rows[1] == Assoc(
        "vision", "", "gpupool", "2000", "billing=3000", "gpupool-vision", "gpupool-vision"
    )
    assert accounts.parse_qos("normal|\ngpupool-nlp|billing=500\n") == {
        "normal": "",
        "gpupool-nlp": "billing=500",
    }
    assert accounts.tres_value("cpu=4,billing=500", "billing") == 500
    assert accounts.tres_value("", "billing") == accounts.NO_LIMIT


CONFIG = """Configuration data as of 2026-12-03T00:00:00
AccountingStorageType   = accounting_storage/slurmdbd
AccountingStorageEnforce = associations,limits,qos,safe
AccountingStorageTRES   = cpu,mem,energy,node,billing,fs/disk,vmem,pages,gres/gpu,gres/shard,gres/gpu:h100,gres/gpu:a100,gres/gpu:1g.10gb,gres/gpu:3g.40gb
ClusterName             = gpupooldev
PriorityFlags           =
"""  # noqa: E501


def test_conf_problems_name_the_key_and_the_line_to_add() -> None:
    p = accounts.plan(TEAMS, COSTS)
    weights = accounts.weights_text(p.weights)
    good = f"PartitionName=gpu Nodes=gpu[1-2] TRESBillingWeights={weights} State=UP"
    assert accounts.conf_problems(p, "gpu", COSTS, good, CONFIG) == []
    problems = accounts.conf_problems(
        p, "gpu", COSTS, "PartitionName=gpu State=UP", CONFIG.replace(",gres/gpu:h100", "")
    )
    assert problems == [
        "slurm.conf TRESBillingWeights of partition gpu is not set; add to its PartitionName "
        f"line: TRESBillingWeights={weights}",
        "slurm.conf AccountingStorageTRES lacks gres/gpu:h100; set AccountingStorageTRES="
        "gres/gpu,gres/shard,gres/gpu:1g.10gb,gres/gpu:3g.40gb,gres/gpu:a100,gres/gpu:h100",
    ]
    zeros = good.replace("TRESBillingWeights=", "TRESBillingWeights=GRES/gpu:h100=0,")
    assert accounts.conf_problems(p, "gpu", COSTS, zeros, CONFIG) == []
    no_dbd = CONFIG.replace("accounting_storage/slurmdbd", "accounting_storage/none")
    assert accounts.conf_problems(p, "gpu", COSTS, good, no_dbd) == [
        "slurm.conf AccountingStorageType is accounting_storage/none: Slurm enforces quotas only"
        " with slurmdbd (set AccountingStorageType=accounting_storage/slurmdbd and run slurmdbd,"
        " or set c.SlurmAccounts.manage = False: gpupool's admission enforces them)"
    ]
    max_tres = CONFIG.replace("PriorityFlags           =", "PriorityFlags = MAX_TRES")
    assert "MAX_TRES" in accounts.conf_problems(p, "gpu", COSTS, good, max_tres)[0]


def test_slurm_conf_lines() -> None:
    p = accounts.plan(TEAMS, {"gpu:h100": 1000, "gpu:1g.10gb": 125})
    assert accounts.slurm_conf_lines(p, "gpu", {"gpu:h100": 1000, "gpu:1g.10gb": 125}) == [
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageTRES=gres/gpu,gres/gpu:1g.10gb,gres/gpu:h100",
        "AccountingStorageEnforce=associations,limits,qos,safe",
        "PartitionName=gpu ... TRESBillingWeights=GRES/gpu=1000,GRES/gpu:1g.10gb=-875",
    ]
