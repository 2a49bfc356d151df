"""The settings every part of gpupool on Slurm shares: where the cluster is and what its gres mean.

Vocabulary
- *Slurm settings*: :class:`SlurmSettings`, a traitlets ``Configurable`` the spawner, the job
  backend and the hub's Slurm services all inherit, so ``c.SlurmSettings.<name>`` applies to all
  of them and ``c.SlurmSpawner.<name>`` or ``c.SlurmJobBackend.<name>`` overrides it for one.
- *gres model*: what a GPU gres type of the cluster is, as gpupool names it: a model key
  (``"h100": "H100-80GB"``); a type whose name ends with a MIG profile of that model
  (``"1g.10gb": "H100-80GB"``, or ``"h100_1g.10gb"``, as Slurm's NVML plugin names MIG types) is
  that MIG profile on that model.
- *account of a team*: the Slurm account a team's jobs are charged to (``--account``): the
  team's name unless ``accounts`` says otherwise.

Contract: no I/O; :func:`check_slurm_settings` raises :class:`ConfigError` naming the key of a
bad value, so the hub stops at start.
"""

from __future__ import annotations

import re
from typing import Any

from traitlets import Bool, Dict, Float, List, Unicode, validate
from traitlets.config import Configurable

from gpupool.core.mig import GEOMETRIES
from gpupool.core.offers import model_memory_mib
from gpupool.declarations import ConfigError

_TIME = re.compile(r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^UNLIMITED$|^infinite$")


class SlurmSettings(Configurable):
    slurm_conf = Unicode(
        "",
        config=True,
        help="""The ``slurm.conf`` Slurm's commands read (``SLURM_CONF``); empty: Slurm's own
        default (``/etc/slurm/slurm.conf``). Example:
        ``c.SlurmSettings.slurm_conf = "/etc/slurm/slurm.conf"``""",
    )
    slurm_bin = Unicode(
        "",
        config=True,
        help="""The folder holding ``sbatch``, ``squeue``, ``sinfo`` and ``scancel``; empty: found
        on ``PATH``. Example: ``c.SlurmSettings.slurm_bin = "/opt/slurm/bin"``""",
    )
    partition = Unicode(
        "",
        config=True,
        help="""The partition gpupool's GPUs are in: its nodes are the pool, and every server and
        job is submitted to it. Empty: the cluster's default partition (and every node).
        Example: ``c.SlurmSettings.partition = "gpu"``""",
    )
    gres_models = Dict(
        key_trait=Unicode(),
        value_trait=Unicode(),
        config=True,
        help="""Each GPU gres type of the cluster as a gpupool model key (see docs/slurm.md):
        whole GPUs, and MIG types (a type named after a MIG profile of its model). A node's GPUs
        of a type not listed are left out of the pool, with a note. Example:
        ``c.SlurmSettings.gres_models = {"h100": "H100-80GB", "1g.10gb": "H100-80GB"}``""",
    )
    simulated = Bool(
        False,
        config=True,
        help="""The cluster's GPUs are not real (the dev cluster of ``make run-slurm``, whose GPUs
        are character devices): the pool says "simulated" wherever it shows, as a simulated
        NVML pool does. Example: ``c.SlurmSettings.simulated = True``""",
    )
    accounts = Dict(
        key_trait=Unicode(),
        value_trait=Unicode(),
        config=True,
        help="""The Slurm account of a team, where it is not the team's name (``everyone``: the
        users in no team; ``""``: submit without ``--account``, so Slurm charges the user's own
        default account). Example:
        ``c.SlurmSettings.accounts = {"vision": "cv-lab", "everyone": ""}``""",
    )
    command_timeout = Float(
        30.0,
        config=True,
        help="""Seconds a Slurm command (``squeue``, ``sbatch``, ``scancel``) may take before the
        hub gives up on it; a controller that does not answer in time is *unknown*, never
        "stopped". Example: ``c.SlurmSettings.command_timeout = 60``""",
    )
    poll_period = Float(
        10.0,
        config=True,
        help="""Seconds between the hub's ``squeue`` calls: ONE call for every server and job
        (the shared poller), jittered by a fifth either way; a start in progress asks for one
        sooner, but never more than one a second. Example: ``c.SlurmSettings.poll_period = 30``""",
    )
    node_period = Float(
        60.0,
        config=True,
        help="""Seconds between the hub's ``sinfo`` calls, which keep the pool's nodes in step
        with Slurm's (a node drained, down, back, or added). Example:
        ``c.SlurmSettings.node_period = 300``""",
    )
    sudo = List(
        Unicode(),
        ["sudo", "-n", "-u", "{user}", "--"],
        config=True,
        help="""How a hub that does not run as root submits as a user (``{user}`` is replaced by
        the account); a root hub becomes the account itself and does not use it. The hub's
        account needs a sudoers rule for ``sbatch`` and ``scancel`` only (docs/slurm.md). Example:
        ``c.SlurmSettings.sudo = ["sudo", "-n", "-u", "{user}", "--"]``""",
    )

    @validate("gres_models")
    def _valid_gres_models(self, proposal: dict[str, Any]) -> dict[str, str]:
        value = dict(proposal["value"])
        for gres_type, model in value.items():
            if not re.fullmatch(r"[A-Za-z0-9_.+-]+", gres_type) or not model_memory_mib(model):
                raise ConfigError(
                    "SlurmSettings.gres_models",
                    f"{gres_type!r}: {model!r} is not a gres type and a model key "
                    '(e.g. {"h100": "H100-80GB"})',
                )
        return value


def mig_profile_of(gres_type: str, model: str) -> str | None:
    """The MIG profile a gres type names on ``model`` (``"1g.10gb"``, ``"h100_1g.10gb"``), or
    ``None`` for a whole-GPU type."""
    geometry = GEOMETRIES.get(model)
    if geometry is None:
        return None
    tail = gres_type.rsplit("_", 1)[-1]
    return tail if tail in geometry.by_name else None


def check_time_limit(value: str, key: str) -> str:
    """A Slurm time limit (``"8:00:00"``, ``"1-00:00:00"``, ``"30"``), or ConfigError."""
    if not _TIME.match(value):
        raise ConfigError(key, f"{value!r} is not a Slurm time limit (e.g. '8:00:00' or '1-0')")
    return value
