"""Apply gpupool's team plan (:mod:`gpupool.slurm.accounts`) to Slurm's database, through
``sacctmgr``.

Vocabulary
- *managed*: ``SlurmAccounts.manage`` is on, so the hub creates and updates the teams' accounts
  and QOS at start and each user's association before their first submit. Off (the default),
  gpupool only names the team's account on submit; quotas then hold through gpupool's own
  admission (the ledger refuses before submitting), which is the only enforcement on a cluster
  without slurmdbd anyway.

Contract: :meth:`SlurmAccounts.apply` reads the current associations and QOS and runs only the
``sacctmgr`` commands that change what differs (nothing on a second run); it never deletes. A
cluster whose slurm.conf lacks what the plan needs (billing weights, tracked gres, enforcement)
stops the hub with a :class:`~gpupool.declarations.ConfigError` naming the key and the line to
add. :meth:`ensure_user` returns the account to submit with, adding the user's association once.
The hub's unix account needs Slurm's Operator (or Admin) level for sacctmgr
(``sacctmgr add user hub AdminLevel=Operator``), or root.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from traitlets import Bool, Unicode
from traitlets.config import LoggingConfigurable

from gpupool.core.quota import Team
from gpupool.declarations import ConfigError
from gpupool.slurm import accounts
from gpupool.slurm.accounts import Plan
from gpupool.slurm.commands import SlurmCommands, SlurmUnavailable


class SlurmCommandFailed(RuntimeError):
    pass


class SlurmAccounts(LoggingConfigurable):
    """Teams as Slurm accounts; see the module docstring."""

    manage = Bool(
        False,
        config=True,
        help="""Whether the hub creates and updates one Slurm account (and QOS) per team in
        slurmdbd, with the team's quotas as Slurm limits, and adds each user's association before
        their first submit. Needs slurmdbd and Slurm Operator level for the hub's account.
        Example: c.SlurmAccounts.manage = True""",
    )
    parent_account = Unicode(
        "gpupool",
        config=True,
        help="""The Slurm account the teams' accounts are created under.
        Example: c.SlurmAccounts.parent_account = "gpupool" """,
    )

    def __init__(
        self,
        *,
        commands: SlurmCommands,
        partition: str,
        gres_costs: Mapping[str, int],
        accounts: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> None:
        """``commands``: the seam to Slurm's commands (its ``SLURM_CONF``, folder and timeout);
        from the shared Slurm settings, ``partition`` (empty: the default one) and ``accounts``
        (team to account where not the team's name); ``gres_costs``: milli per gres unit
        (``{"gpu:h100": 1000, "gpu:1g.10gb": 125}``, :func:`accounts.gres_costs_of`)."""
        super().__init__(**kwargs)
        self.commands = commands
        self.partition = partition
        self.gres_costs = dict(gres_costs)
        self.account_names = dict(accounts or {})
        self.plan: Plan | None = None
        self._cluster = ""
        self._known: set[tuple[str, str]] = set()
        self._lock = asyncio.Lock()

    @classmethod
    def from_settings(
        cls, settings: Any, gres_costs: Mapping[str, int], **kwargs: object
    ) -> SlurmAccounts:
        """Built from the shared ``SlurmSettings``; ``kwargs`` as for any Configurable
        (``config=``, ``parent=``)."""
        return cls(
            commands=SlurmCommands.from_settings(settings),
            partition=settings.partition,
            gres_costs=gres_costs,
            accounts=settings.accounts,
            **kwargs,
        )

    async def _run(self, args: list[str]) -> str:
        result = await self.commands.run(args[0], *args[1:])
        if result.returncode:
            raise SlurmCommandFailed(
                f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}"
            )
        return result.stdout

    def account_of(self, team: str) -> str:
        """The Slurm account of ``team``."""
        return self.account_names.get(team, team)

    # -- at hub start ----------------------------------------------------------------------------
    async def apply(self, teams: Iterable[Team]) -> list[list[str]]:
        """Make slurmdbd hold the teams' plan; returns the commands it ran (none when nothing
        differed or ``manage`` is off)."""
        if not self.manage:
            self.log.info(
                "SlurmAccounts.manage is off: team quotas hold through gpupool's admission"
            )
            return []
        try:
            plan = accounts.plan(teams, self.gres_costs, self.parent_account, self.account_names)
        except ValueError as e:
            raise ConfigError("SlurmSettings.accounts", str(e)) from None
        try:
            return await self._apply(plan)
        except (SlurmUnavailable, SlurmCommandFailed) as e:  # before any change was made
            raise ConfigError(
                "SlurmAccounts.manage",
                f"the teams' accounts could not be read from Slurm ({e}); the hub needs "
                "slurmctld and slurmdbd answering at start, and scontrol and sacctmgr in "
                "SlurmSettings.slurm_bin",
            ) from None

    async def _apply(self, plan: Plan) -> list[list[str]]:
        part = await self._partition_line()
        config = await self._run(["scontrol", "show", "config"])
        name = accounts.parse_scontrol(part).get("PartitionName", self.partition)
        problems = accounts.conf_problems(plan, name, self.gres_costs, part, config)
        if problems:
            raise ConfigError(
                "SlurmAccounts.manage",
                "the cluster's slurm.conf lacks what Slurm needs to enforce the teams' quotas: "
                + "; ".join(problems),
            )
        self._cluster = accounts.parse_scontrol(config).get("ClusterName", "")
        assocs, qos = await self._read()
        todo = accounts.commands(plan, self._cluster, assocs, qos)
        for args in todo:
            self.log.info("Slurm accounts: %s", " ".join(args))
            try:
                await self._run(args)
            except SlurmCommandFailed as e:
                raise ConfigError(
                    "SlurmAccounts.manage",
                    f"{e}. Managing the teams' accounts needs slurmdbd up and Slurm's Operator "
                    "level for the hub's account (as a Slurm admin: sacctmgr add user HUBUSER "
                    "AdminLevel=Operator); or set "
                    "c.SlurmAccounts.manage = False and manage the accounts yourself",
                ) from None
        self.plan = plan
        return todo

    async def _partition_line(self) -> str:
        """``scontrol show partition -o`` of the partition (empty: the default one)."""
        out = await self._run(
            ["scontrol", "show", "partition", *([self.partition] if self.partition else []), "-o"]
        )
        lines = [line for line in out.splitlines() if line.strip()]
        if self.partition:
            return lines[0] if lines else ""
        return next((line for line in lines if " Default=YES " in f" {line} "), "")

    async def _read(self) -> tuple[list[accounts.Assoc], dict[str, str]]:
        base = ["sacctmgr", "--parsable2", "--noheader", "show"]
        assocs = await self._run(
            [*base, "assoc", "where", f"cluster={self._cluster}", f"format={accounts.ASSOC_FORMAT}"]
        )
        qos = await self._run([*base, "qos", f"format={accounts.QOS_FORMAT}"])
        return accounts.parse_assocs(assocs), accounts.parse_qos(qos)

    # -- before a submit -------------------------------------------------------------------------
    async def ensure_user(self, user: str, team: str) -> str:
        """The account ``user`` submits with for ``team`` (``everyone`` for users in no team);
        with ``manage`` on, their association with it exists once this returns (added at most
        once). ``""``, submit without ``--account`` (Slurm charges the user's default account),
        where the team is ``""`` (a server without an allocation) or mapped to ``""``."""
        if not team:
            return ""
        if self.manage and self.plan is None:
            raise RuntimeError("SlurmAccounts.ensure_user before apply (the hub's start)")
        try:
            account = self.plan.account(team) if self.plan else self.account_of(team)
        except KeyError:
            if self.account_of(team) == "":
                return ""
            raise RuntimeError(
                f"team {team!r} has no Slurm account: it was not a team at start"
            ) from None
        if not self.manage or not account or (user, account) in self._known:
            return account
        async with self._lock:
            if (user, account) not in self._known:
                try:
                    await self._add_association(user, account)
                except SlurmCommandFailed as e:
                    raise SlurmUnavailable(
                        f"Slurm's database did not add {user} to account {account} ({e}); "
                        "nothing was submitted: try again, or ask an admin to check slurmdbd"
                    ) from None
                self._known.add((user, account))
        return account

    async def _add_association(self, user: str, account: str) -> None:
        out = await self._run(
            [
                "sacctmgr",
                "--parsable2",
                "--noheader",
                "show",
                "assoc",
                "where",
                f"cluster={self._cluster}",
                f"account={account}",
                f"user={user}",
                "format=account,user",
            ]
        )
        if not out.strip():
            await self._run(accounts.user_command(user, account, self._cluster))
