"""gpupool's teams and quotas as Slurm accounts, QOS and billing weights (pure; no I/O).

Vocabulary
- *gres costs*: what one unit of each GPU gres costs in milli GPU-equivalents
  (:mod:`gpupool.core.units`): ``{"gpu:h100": 1000, "gpu:1g.10gb": 125, "shard": 250}``. Keys are
  ``NAME:TYPE`` or a bare ``NAME`` (a gres without types, or the price of an untyped request).
- *billing weights*: the partition's ``TRESBillingWeights`` that make Slurm's ``billing`` TRES of a
  job equal its cost in milli GPU-equivalents, so one number (``billing``) carries gpupool's quota
  unit into ``GrpTRES`` and ``MaxTRESPerUser``.
- *plan*: per team (``everyone``, the users in no team, included), one Slurm account under a
  parent account (``Fairshare`` = the guarantee,
  ``GrpTRES=billing=`` the limit, guarantee plus borrowing) and one QOS
  (``gpupool-<account>``, ``MaxTRESPerUser=billing=`` the per-user cap or ``-1`` for none), the
  account's default QOS; plus the slurm.conf lines the admin must add.

How Slurm 22.05 computes ``billing`` (what the weights rely on):
- slurm.conf(5), TRESBillingWeights: "the sum of all TRES types multiplied by their corresponding
  billing weight"; TRES not listed weigh 0 (only without TRESBillingWeights is a job billed its
  CPUs); "Negative values are allowed"; with ``PriorityFlags=MAX_TRES`` the per-node TRES are
  *maxed*, not summed, which would break the sum: :func:`conf_problems` refuses it.
- src/slurmctld/node_scheduler.c computes ``tres_req_cnt[TRES_ARRAY_BILLING]`` with
  ``assoc_mgr_tres_weighted()`` (src/common/assoc_mgr.c), a double cast to ``uint64_t``
  (truncated): integer weights in milli keep it exact.
- A request for ``gpu:h100:2`` counts as ``gres/gpu=2`` *and* ``gres/gpu:h100=2`` (typed gres are
  TRES of their own when ``AccountingStorageTRES`` lists them; ``scontrol show job`` prints
  ``TRES=...,gres/gpu=2,gres/gpu:h100=2``). An untyped ``--gres=gpu:1`` counts only as
  ``gres/gpu=1`` until it is placed. So the untyped name carries the base price (a whole GPU) and
  each type the *difference* to its own cost (``GRES/gpu:1g.10gb=-875``): a typed request is billed
  exactly its cost, an untyped one a whole GPU per unit (the most any unit costs), never 0. Checked
  against the real daemons in tests/slurm/test_slurm_accounts.py.

Per-user caps go on a QOS, not on per-user associations: ``MaxTRESPerUser`` exists only on a QOS
(sacctmgr(8)); a per-user association ``GrpTRES`` would need one write per member on every change
and would miss members added by hand. A per-team QOS is one object, the team account's default,
inherited by every user association under it.

Contract: :func:`plan` validates names and costs (``ValueError`` with a sentence);
:func:`commands` returns ``sacctmgr`` argument lists (never shell strings) that turn the current
state (:func:`parse_assocs`, :func:`parse_qos`) into the plan and are empty when nothing differs;
they add and modify, never delete.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpupool.core.offers import mig_costs
from gpupool.core.quota import Team
from gpupool.core.units import GPU_MILLI
from gpupool.slurm.settings import mig_profile_of

ORGANIZATION = "gpupool"
"""The ``Organization`` of the accounts gpupool creates (how it recognises its own)."""
QOS_PREFIX = "gpupool-"
NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
"""What a Slurm account or QOS name may be here: sacctmgr lowercases names, so only lowercase."""
GRES_KEY = re.compile(r"^[a-z][a-z0-9_]*(:[A-Za-z0-9_.-]+)?$")
NO_LIMIT = -1
"""sacctmgr's value that clears a limit."""


@dataclass(frozen=True)
class AccountPlan:
    team: str
    account: str
    fairshare: int
    """The guarantee in milli (at least 1: a share of 0 would starve the team's jobs)."""
    grp_billing: int
    """The team's limit, guarantee plus borrowing, in milli (``GrpTRES=billing=``)."""
    qos: str
    user_cap: int
    """``MaxTRESPerUser=billing=`` on the team's QOS; :data:`NO_LIMIT` when the team has none."""


@dataclass(frozen=True)
class Plan:
    parent: str
    accounts: tuple[AccountPlan, ...]
    weights: Mapping[str, int]
    """TRES name (``GRES/gpu:1g.10gb``) to billing weight."""

    def account(self, team: str) -> str:
        for a in self.accounts:
            if a.team == team:
                return a.account
        raise KeyError(team)


def gres_costs_of(gres_models: Mapping[str, str], shards_per_gpu: int = 0) -> dict[str, int]:
    """The cost of each gres of ``SlurmSettings.gres_models`` (``{"h100": "H100-80GB",
    "1g.10gb": "H100-80GB"}`` → ``{"gpu:h100": 1000, "gpu:1g.10gb": 125}``), and of a shard
    when the partition's GPUs have ``shards_per_gpu`` each (one weight for ``gres/shard``, so
    every node must split its GPUs alike; a cost that does not divide 1000 is rounded up, so
    Slurm never bills less than gpupool charges).

    >>> gres_costs_of({"h100": "H100-80GB", "1g.10gb": "H100-80GB"}, shards_per_gpu=4)
    {'gpu:h100': 1000, 'gpu:1g.10gb': 125, 'shard': 250}
    """
    costs: dict[str, int] = {}
    for gres_type, model in gres_models.items():
        profile = mig_profile_of(gres_type, model)
        costs[f"gpu:{gres_type}"] = mig_costs(profile, model)[model] if profile else GPU_MILLI
    if shards_per_gpu:
        costs["shard"] = -(-GPU_MILLI // shards_per_gpu)
    return costs


def billing_weights(gres_costs: Mapping[str, int]) -> dict[str, int]:
    """The ``TRESBillingWeights`` pairs that bill each gres its cost (module docstring).

    >>> billing_weights({"gpu:h100": 1000, "gpu:1g.10gb": 125, "shard": 250})
    {'GRES/gpu': 1000, 'GRES/gpu:1g.10gb': -875, 'GRES/shard': 250}
    """
    for key, cost in gres_costs.items():
        if not GRES_KEY.match(key):
            raise ValueError(f"gres {key!r} is not NAME or NAME:TYPE (e.g. 'gpu:h100')")
        if not isinstance(cost, int) or isinstance(cost, bool) or cost < 0:
            raise ValueError(f"gres {key!r}: cost must be whole milli GPU-eq >= 0, got {cost!r}")
    names = sorted({key.split(":")[0] for key in gres_costs})
    weights: dict[str, int] = {}
    for name in names:
        typed = {k: c for k, c in gres_costs.items() if k.startswith(f"{name}:")}
        default = GPU_MILLI if name == "gpu" else max(typed.values(), default=0)
        base = gres_costs.get(name, max([default, *typed.values()]))
        if base:
            weights[f"GRES/{name}"] = base
        for key, cost in sorted(typed.items()):
            if cost != base:
                weights[f"GRES/{key}"] = cost - base
    return weights


def weights_text(weights: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in weights.items())


def parse_weights(text: str) -> dict[str, float]:
    """``TRESBillingWeights`` as Slurm prints it (``GRES/gpu=1000,GRES/gpu:1g.10gb=-875``), keys
    lowercased, weights of 0 left out (a TRES not listed weighs 0)."""
    out: dict[str, float] = {}
    for pair in filter(None, text.split(",")):
        key, _, value = pair.partition("=")
        if float(value):
            out[key.strip().lower()] = float(value)
    return out


def request_tres(gres: Mapping[str, int]) -> dict[str, int]:
    """The gres TRES Slurm counts for a request of ``{"gpu:h100": 2, "shard": 3}`` (typed gres
    count under their name too; see the module docstring)."""
    tres: dict[str, int] = {}
    for key, count in gres.items():
        name = key.split(":")[0]
        tres[f"gres/{name}"] = tres.get(f"gres/{name}", 0) + count
        if ":" in key:
            tres[f"gres/{key}"] = tres.get(f"gres/{key}", 0) + count
    return tres


def billing(weights: Mapping[str, int], tres: Mapping[str, int]) -> int:
    """Slurm's ``billing`` of ``tres`` under ``weights``: the weighted sum, truncated
    (assoc_mgr_tres_weighted, node_scheduler.c)."""
    lower = {k.lower(): v for k, v in weights.items()}
    return int(sum(lower.get(k.lower(), 0) * n for k, n in tres.items()))


def accounting_tres(gres_costs: Mapping[str, int]) -> list[str]:
    """What ``AccountingStorageTRES`` must list: each gres name and each typed gres."""
    names = sorted({k.split(":")[0] for k in gres_costs})
    return [f"gres/{n}" for n in names] + [f"gres/{k}" for k in sorted(gres_costs) if ":" in k]


def plan(
    teams: Iterable[Team],
    gres_costs: Mapping[str, int],
    parent: str = "gpupool",
    names: Mapping[str, str] | None = None,
) -> Plan:
    """One account (and QOS) per team, ``everyone`` included (gpupool's limits hold for the users
    in no team too), named as the team unless ``names`` maps it; a team ``names`` maps to ``""``
    gets none (its users submit without ``--account``: Slurm charges their default account)."""
    names = dict(names or {})
    if not NAME.match(parent):
        raise ValueError(f"parent account {parent!r} is not a Slurm account name ({NAME.pattern})")
    accounts = []
    for team in sorted(teams, key=lambda t: t.name):
        account = names.get(team.name, team.name)
        if not account:
            continue
        if not NAME.match(account):
            raise ValueError(
                f"team {team.name!r}: {account!r} is not a Slurm account name (lowercase letters,"
                f" digits, '_', '.', '-'); map it to one, e.g. {{{team.name!r}: 'team1'}}"
            )
        accounts.append(
            AccountPlan(
                team=team.name,
                account=account,
                fairshare=max(team.guarantee_milli, 1),
                grp_billing=team.limit_milli,
                qos=f"{QOS_PREFIX}{account}",
                user_cap=NO_LIMIT if team.user_cap_milli is None else team.user_cap_milli,
            )
        )
    seen: dict[str, str] = {}
    for a in accounts:
        if a.account in seen or a.account == parent:
            raise ValueError(
                f"teams {seen.get(a.account, parent)!r} and {a.team!r} map to one account "
                f"{a.account!r}"
            )
        seen[a.account] = a.team
    return Plan(parent=parent, accounts=tuple(accounts), weights=billing_weights(gres_costs))


def slurm_conf_lines(p: Plan, partition: str, gres_costs: Mapping[str, int]) -> list[str]:
    """What the admin adds to slurm.conf (the partition line gets the weights)."""
    return [
        "AccountingStorageType=accounting_storage/slurmdbd",
        f"AccountingStorageTRES={','.join(accounting_tres(gres_costs))}",
        "AccountingStorageEnforce=associations,limits,qos,safe",
        f"PartitionName={partition} ... TRESBillingWeights={weights_text(p.weights)}",
    ]


# -- reading Slurm's state ------------------------------------------------------------------------
ASSOC_FORMAT = "account,user,parentname,fairshare,grptres,qos,defaultqos,organization"
"""``sacctmgr --parsable2 --noheader show assoc format=...`` columns :func:`parse_assocs` reads.
(``organization`` is an account field; show assoc leaves it empty, see :data:`ACCOUNT_FORMAT`.)"""
ACCOUNT_FORMAT = "account,organization"
QOS_FORMAT = "name,maxtrespu"


@dataclass(frozen=True)
class Assoc:
    account: str
    user: str
    parent: str
    fairshare: str
    grp_tres: str
    qos: str
    default_qos: str


def parse_assocs(text: str) -> list[Assoc]:
    rows = []
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) < 7:
            continue
        rows.append(Assoc(*cols[:7]))
    return rows


def parse_qos(text: str) -> dict[str, str]:
    """QOS name to its ``MaxTRESPerUser`` (``billing=500`` or empty)."""
    out = {}
    for line in text.splitlines():
        cols = line.split("|")
        if len(cols) >= 2:
            out[cols[0]] = cols[1]
    return out


def tres_value(tres: str, name: str) -> int:
    """``billing`` of ``"cpu=4,billing=500"`` (:data:`NO_LIMIT` when absent)."""
    for pair in tres.split(","):
        key, _, value = pair.partition("=")
        if key == name and value:
            return int(value)
    return NO_LIMIT


# -- what to change -------------------------------------------------------------------------------
def commands(
    p: Plan, cluster: str, assocs: Iterable[Assoc], qos: Mapping[str, str]
) -> list[list[str]]:
    """``sacctmgr -i`` argument lists turning the current state of ``cluster`` (its
    associations, and the QOS, which are global) into ``p``: empty when nothing differs; adds and
    modifies, never deletes."""
    accounts = {a.account: a for a in assocs if not a.user}
    out: list[list[str]] = []
    sacctmgr = ["sacctmgr", "-i"]
    if p.parent not in accounts:
        out.append(
            [
                *sacctmgr,
                "add",
                "account",
                p.parent,
                f"Cluster={cluster}",
                "Description=gpupool teams",
                f"Organization={ORGANIZATION}",
            ]
        )
    for a in p.accounts:
        cap = f"MaxTRESPerUser=billing={a.user_cap}"
        if a.qos not in qos:
            out.append([*sacctmgr, "add", "qos", a.qos, cap])
        elif tres_value(qos[a.qos], "billing") != a.user_cap:
            out.append([*sacctmgr, "modify", "qos", "where", f"name={a.qos}", "set", cap])
        limits = {
            "Fairshare": str(a.fairshare),
            "GrpTRES": f"billing={a.grp_billing}",
            "QOS": a.qos,
            "DefaultQOS": a.qos,
        }
        now = accounts.get(a.account)
        if now is None:
            out.append(
                [
                    *sacctmgr,
                    "add",
                    "account",
                    a.account,
                    f"Cluster={cluster}",
                    f"Parent={p.parent}",
                    f"Description=gpupool team {a.team}",
                    f"Organization={ORGANIZATION}",
                    *(f"{k}={v}" for k, v in limits.items()),
                ]
            )
            continue
        current = {
            "Fairshare": now.fairshare,
            "GrpTRES": f"billing={tres_value(now.grp_tres, 'billing')}",
            "QOS": now.qos,
            "DefaultQOS": now.default_qos,
        }
        differ = [f"{k}={v}" for k, v in limits.items() if current[k] != v]
        if differ:
            # "modify account" changes the account's own association; its users inherit.
            out.append(
                [
                    *sacctmgr,
                    "modify",
                    "account",
                    "where",
                    f"name={a.account}",
                    f"cluster={cluster}",
                    "set",
                    *differ,
                ]
            )
    return out


def user_command(user: str, account: str, cluster: str) -> list[str]:
    """Add ``user``'s association with ``account`` (QOS and limits inherited from the account)."""
    return ["sacctmgr", "-i", "add", "user", user, f"Account={account}", f"Cluster={cluster}"]


# -- checking slurm.conf --------------------------------------------------------------------------
def parse_scontrol(text: str) -> dict[str, str]:
    """``scontrol show partition NAME -o`` (``Key=Value`` words) or ``scontrol show config``
    (``Key = Value`` lines) as a dict."""
    out: dict[str, str] = {}
    if "\n" in text.strip() or " = " in text:
        for line in text.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                out[key.strip()] = value.strip()
        return out
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep:
            out[key] = value
    return out


def conf_problems(
    p: Plan, partition: str, gres_costs: Mapping[str, int], part: str, config: str
) -> list[str]:
    """What the running cluster lacks for the plan to hold, one sentence each naming the
    slurm.conf key and the line to add; ``part`` is ``scontrol show partition NAME -o``,
    ``config`` is ``scontrol show config``."""
    problems = []
    want = weights_text(p.weights)
    have = parse_scontrol(part).get("TRESBillingWeights", "")
    if parse_weights(have) != parse_weights(want):
        problems.append(
            f"slurm.conf TRESBillingWeights of partition {partition} is {have or 'not set'};"
            f" add to its PartitionName line: TRESBillingWeights={want}"
        )
    conf = parse_scontrol(config)
    storage = conf.get("AccountingStorageType", "")
    if storage != "accounting_storage/slurmdbd":
        return [
            f"slurm.conf AccountingStorageType is {storage or 'not set'}: Slurm enforces quotas"
            " only with slurmdbd (set AccountingStorageType=accounting_storage/slurmdbd and run"
            " slurmdbd, or set c.SlurmAccounts.manage = False: gpupool's admission enforces them)"
        ]
    tracked = {t.strip().lower() for t in conf.get("AccountingStorageTRES", "").split(",")}
    lacking = [t for t in accounting_tres(gres_costs) if t.lower() not in tracked]
    if lacking:
        problems.append(
            f"slurm.conf AccountingStorageTRES lacks {','.join(lacking)}; set "
            f"AccountingStorageTRES={','.join(accounting_tres(gres_costs))}"
        )
    enforce = set(conf.get("AccountingStorageEnforce", "").lower().split(","))
    if not {"associations", "limits", "qos"} <= enforce:
        problems.append(
            f"slurm.conf AccountingStorageEnforce is {conf.get('AccountingStorageEnforce')!r};"
            " set AccountingStorageEnforce=associations,limits,qos,safe"
        )
    if "max_tres" in conf.get("PriorityFlags", "").lower():
        problems.append(
            "slurm.conf PriorityFlags has MAX_TRES, which bills the largest TRES of a node instead"
            " of the sum: remove MAX_TRES from PriorityFlags"
        )
    return problems
