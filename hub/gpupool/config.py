"""``GPUPool``: the admin-facing configurable, set in ``jupyterhub_config.py`` as ``c.GPUPool.*``.

Every setting is a traitlet with ``config=True`` and an example in its help. Each part is checked
when it is set (``@validate``), and :meth:`GPUPool.settings` adds the checks across parts; a bad
value raises :class:`gpupool.declarations.ConfigError`, whose message starts with the key path,
so the hub stops at start naming the key to fix. Settings that are valid but odd for the pool
found at start (an offer it can never grant, a user cap above the team's limit, a guarantee
larger than the pool) are logged as warnings when the pool is built
(:func:`gpupool.declarations.config_warnings`).
"""

from __future__ import annotations

from typing import Any

from traitlets import Any as AnyTrait
from traitlets import Dict, Float, Unicode, validate
from traitlets.config import LoggingConfigurable

from gpupool.core.placement import POLICIES
from gpupool.declarations import (
    ConfigError,
    Settings,
    parse_offers,
    parse_settings,
    parse_team,
    parse_teams,
    parse_user_limits,
)

INVENTORY_SOURCES = (
    "nvml",
    "simulated:<spec>",
    "kubernetes",
    "kubernetes:<label selector>",
    "slurm",
)


class GPUPool(LoggingConfigurable):
    offers = Dict(
        {
            "cpu": {"kind": "cpu", "description": "No GPU"},
        },
        config=True,
        help="""What users may pick, by name. Kinds: ``cpu``, ``gpu`` (whole GPUs; ``max_count``,
        optional ``model`` and ``nvlink``), ``mig`` (instances of ``profile``, one per request
        unless ``max_count`` allows more, all on one node; a process sees only the first, a job
        runs a rank on each; the kind and the profile follow from a name like ``mig-3g.40gb``).
        Example::

            c.GPUPool.offers = {
                "cpu": {"description": "CPU only"},
                "h100": {"kind": "gpu", "model": "H100-80GB", "max_count": 4, "nvlink": True},
                "mig-3g.40gb": {},
                "mig-1g.10gb": {"model": "H100-80GB", "max_count": 2},
            }
        """,
    )

    teams = Dict(
        {},
        config=True,
        help="""Teams by JupyterHub group name, with quotas in GPU-equivalents (a whole GPU is 1, a
        3g.40gb MIG instance 0.5). ``guarantee``: always available while the pool has it;
        ``borrow_limit``: how much more the team may use while others leave theirs idle;
        ``user_cap``: the most one member may hold; ``offers``: which offers it may request
        (default: all); ``min_priority`` (-100..0, default -100) and ``max_priority`` (0..100,
        default 0): the priorities its members may give their jobs, which order only the team's
        own queued jobs (across teams the queue goes by fair share, then submission time); by
        default members may lower a job, not raise it; admins may set any from -100 to 100;
        ``user_limits``: keys of ``GPUPool.user_limits`` that differ for the team.
        Example::

            c.GPUPool.teams = {
                "vision": {"guarantee": 2, "borrow_limit": 1, "user_cap": 1,
                           "offers": ["cpu", "h100", "mig-3g.40gb"], "max_priority": 10,
                           "user_limits": {"jobs": 100}},
                "nlp": {"guarantee": 1, "offers": ["cpu", "mig-1g.10gb"]},
            }
        """,
    )

    everyone = Dict(
        {"offers": ["cpu"]},
        config=True,
        help="""What users in no team get, as a team spec (the keys of ``teams``). Default: CPU
        only. Example::

            c.GPUPool.everyone = {"guarantee": 0.25, "offers": ["cpu", "mig-1g.10gb"],
                                  "max_priority": 0}
        """,
    )

    user_limits = Dict(
        {"jobs": 32, "log_followers": 8, "spawns": 2},
        config=True,
        help="""What one user may have in flight at once, whatever their quota, so one user
        cannot starve the others: ``jobs`` queued or running, ``log_followers`` (job logs
        followed live, ``?follow=1``, open at once) and ``spawns`` (notebook servers starting at
        once; matters with named servers). Beyond one, the hub answers 429 naming the limit and
        what is in use, before anything is stored. 0: no limit. A team's ``user_limits``
        overrides keys for requests charged to it; keys left out here keep their defaults.
        Example::

            c.GPUPool.user_limits = {"jobs": 50, "log_followers": 4, "spawns": 1}
        """,
    )

    inventory = Unicode(
        "nvml",
        config=True,
        help="""Where the GPUs come from: ``nvml`` (this machine, through the NVIDIA driver),
        ``kubernetes`` (the cluster's nodes' allocatable ``nvidia.com/*`` resources, read once at
        start; ``kubernetes:<label selector>`` for some nodes only), ``slurm`` (the GPU gres of
        a Slurm cluster's nodes, from ``sinfo``, followed while the hub runs; see
        ``c.SlurmSettings`` and docs/slurm.md) or ``simulated:<spec>`` for a machine without
        GPUs, always labelled as simulated. Examples::

            c.GPUPool.inventory = "simulated:node1: 4x H100-80GB, mig=2"
            c.GPUPool.inventory = "kubernetes:nvidia.com/gpu.present=true"
            c.GPUPool.inventory = "slurm"
        """,
    )

    node_pools = Dict(
        {},
        config=True,
        help="""Autoscaled GPU node pools of a Kubernetes inventory, which may have no nodes now
        (scaled to zero): what one node of each holds (the simulated-spec grammar without a
        name) and the most nodes it grows to. A request only such a node could hold then waits,
        with the reason shown, instead of being refused as impossible. Example::

            c.GPUPool.node_pools = {"a100": {"node": "8x A100-80GB", "max_nodes": 4}}
        """,
    )

    simulated_fallback = Unicode(
        "",
        config=True,
        help="""A simulated spec to use when ``inventory`` is ``nvml`` and NVML finds no GPU (no
        driver, or no GPU): for demos and laptops; the pool then says "simulated" everywhere.
        Empty (the default) means no fallback. Example::

            c.GPUPool.simulated_fallback = "local: 4x H100-80GB, mig=2"
        """,
    )

    simulated_activity_file = Unicode(
        "",
        config=True,
        help="""For a simulated inventory only: a JSON file the simulated NVML reads device
        activity from at each reading, ``{uuid: {"gpu": 37, "pids": [4242], "used_mib": 2048}}``,
        so a demo or a test can make a simulated GPU look busy or idle (the admin page shows the
        UUIDs). Empty (the default): simulated GPUs are idle. Example:
        ``c.GPUPool.simulated_activity_file = ".run/activity.json"``""",
    )

    policy = Unicode(
        "gpupool",
        config=True,
        help="""Placement policy: ``gpupool`` (fragmentation-aware, keeps large shapes
        placeable), ``best-fit`` or ``first-fit``. Example: ``c.GPUPool.policy = "best-fit"``""",
    )

    db_url = Unicode(
        "sqlite:///gpupool.sqlite",
        config=True,
        help="""SQLAlchemy URL of the allocation store. Checked at start: it must open, be
        empty, gpupool's, or another application's without gpupool tables (gpupool's own tables
        and migration record are kept apart, so it may share JupyterHub's database), be at a
        migration this gpupool knows (older ones are upgraded), and be writable (for SQLite, the
        file and its directory); otherwise the hub stops with one line saying what to do.
        Example: ``c.GPUPool.db_url = "postgresql+psycopg://gpupool@db/gpupool"``""",
    )

    store_retry_max_s = Float(
        30.0,
        config=True,
        help="""The longest wait, in seconds, between retries of writes the database refused
        (a release, a job's new state: kept in memory and retried, from 1 s doubling up to
        this, until written; meanwhile the store is reported unhealthy and new allocations and
        jobs are refused with 503). Example: ``c.GPUPool.store_retry_max_s = 10``""",
    )

    managed_mig = AnyTrait(
        False,
        config=True,
        help="""GPUs in MIG mode on which gpupool creates MIG instances itself, where the
        placement policy puts them, and destroys them on release: by GPU UUID (``nvidia-smi -L``)
        or model key; a dict may also turn one GPU off (a UUID's entry wins over its model's);
        ``True`` means every MIG GPU. Local (NVML) inventories only; the hub needs root (or the
        MIG config capability), else these GPUs hand out only the instances they have, and the
        admin page says why. Instances an admin made stay as they are and are never destroyed.
        gpupool never switches MIG mode (``nvidia-smi -i 0 -mig 1`` and a GPU reset do).
        Default: ``False`` (only instances an admin made are handed out). Examples::

            c.GPUPool.managed_mig = ["H100-80GB"]
            c.GPUPool.managed_mig = {"GPU-5a1f0c2e-…": True, "A100-80GB": True}
        """,
    )

    @validate("managed_mig")
    def _valid_managed_mig(self, proposal: dict[str, Any]) -> Any:
        from gpupool.mig.manager import parse_managed

        parse_managed(proposal["value"])
        return proposal["value"]

    @validate("offers")
    def _valid_offers(self, proposal: dict[str, Any]) -> Any:
        parse_offers(proposal["value"])
        return proposal["value"]

    @validate("teams")
    def _valid_teams(self, proposal: dict[str, Any]) -> Any:
        parse_teams(proposal["value"])
        return proposal["value"]

    @validate("everyone")
    def _valid_everyone(self, proposal: dict[str, Any]) -> Any:
        parse_team("everyone", proposal["value"], "GPUPool.everyone")
        return proposal["value"]

    @validate("user_limits")
    def _valid_user_limits(self, proposal: dict[str, Any]) -> Any:
        parse_user_limits("GPUPool.user_limits", proposal["value"])
        return proposal["value"]

    @validate("store_retry_max_s")
    def _valid_store_retry(self, proposal: dict[str, Any]) -> float:
        value = float(proposal["value"])
        if not 1.0 <= value <= 3600.0:
            raise ConfigError(
                "GPUPool.store_retry_max_s", f"must be 1 to 3600 seconds, got {value}"
            )
        return value

    @validate("policy")
    def _valid_policy(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"]).strip()
        if value not in POLICIES:
            raise ConfigError(
                "GPUPool.policy", f"must be one of {', '.join(POLICIES)}, got {value!r}"
            )
        return value

    @validate("inventory")
    def _valid_inventory(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"]).strip()
        if value in ("nvml", "kubernetes", "slurm") or value.startswith("kubernetes:"):
            return value
        if value.startswith("simulated:"):
            from gpupool.discovery import parse_spec

            try:
                parse_spec(value.removeprefix("simulated:"))
            except ValueError as e:
                raise ConfigError("GPUPool.inventory", str(e)) from None
            return value
        raise ConfigError(
            "GPUPool.inventory",
            f"must be one of {', '.join(INVENTORY_SOURCES)}, got {value!r}; "
            "example: 'simulated:node1: 4x H100-80GB, mig=2'",
        )

    @validate("node_pools")
    def _valid_node_pools(self, proposal: dict[str, Any]) -> Any:
        from gpupool.discovery.node_pools import parse_node_pools

        parse_node_pools(proposal["value"])
        return proposal["value"]

    @validate("simulated_fallback")
    def _valid_fallback(self, proposal: dict[str, Any]) -> str:
        value = str(proposal["value"]).strip()
        if value:
            from gpupool.discovery import parse_spec

            try:
                parse_spec(value)
            except ValueError as e:
                raise ConfigError("GPUPool.simulated_fallback", str(e)) from None
        return value

    @validate("db_url")
    def _valid_db_url(self, proposal: dict[str, Any]) -> str:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        value = str(proposal["value"]).strip()
        try:
            make_url(value)
        except ArgumentError:
            raise ConfigError(
                "GPUPool.db_url",
                "is not an SQLAlchemy URL (value not shown: it may hold a password); "
                "example: 'sqlite:///gpupool.sqlite'",
            ) from None
        return value

    def settings(self) -> Settings:
        """The validated offers, teams and ``everyone``, checked across parts; every team with
        the per-user limits (the keys of ``user_limits`` given, the others' defaults).

        The default ``everyone`` (CPU only) follows the offers: where no ``cpu`` offer is
        defined, users in no team get nothing rather than an error.
        """
        everyone = self.everyone
        if "everyone" not in self.config.get("GPUPool", {}):
            everyone = {**everyone, "offers": [o for o in everyone["offers"] if o in self.offers]}
        defaults = self.trait_defaults("user_limits")
        assert isinstance(defaults, dict)
        limits = {**defaults, **self.user_limits}
        return parse_settings(self.offers, self.teams, everyone, limits)
