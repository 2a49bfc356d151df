"""``python -m gpupool.describe [jupyterhub_config.py]``: show the pool a config describes.

Loads ``c.GPUPool`` from the config file (bad config stops here, naming the key), discovers the
inventory, restores the ledger from the database and prints GPUs, MIG layouts, offers with what is
free now, and team quotas. A simulated pool says so on its first line.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from traitlets.config import PyFileConfigLoader

from gpupool.config import GPUPool
from gpupool.core.units import fmt
from gpupool.declarations import ConfigError
from gpupool.hub.objects import SETTINGS_KEY, HubObjects
from gpupool.pool import Pool


def render(pool: Pool) -> str:
    ledger, inv = pool.ledger, pool.inventory
    lines = [f"gpupool: {inv.label}" + ("  [SIMULATED: no real GPUs]" if inv.simulated else "")]
    lines.extend(f"  note: {n}" for n in inv.notes)
    for node in inv.nodes:
        lines.append(f"node {node.name}")
        for g in node.gpus:
            mig = f"MIG {g.mig_mode}" if g.mig_enabled else "whole"
            inst = ", ".join(f"{i.profile}@{i.start}" for i in g.instances)
            lines.append(
                f"  [{g.index}] {g.model:<11} {g.uuid}  {mig}{'  ' + inst if inst else ''}"
            )
    lines.append("offers (free now, ignoring quotas):")
    for name, offer in sorted(ledger.offers.items()):
        cost = fmt(ledger.unit_cost_milli(offer))
        lines.append(
            f"  {name:<14} {offer.label:<16} {cost:>6} GPU-eq  free {ledger.placeable(offer)}"
        )
    lines.append("teams (used / guarantee + borrow limit, GPU-eq):")
    for team in [*ledger.teams.values(), ledger.everyone]:
        used = ledger.team_used[team.name]
        offers = ", ".join(sorted(team.offers or ledger.offers))
        lines.append(
            f"  {team.name:<10} {fmt(used)} / {fmt(team.guarantee_milli)} + "
            f"{fmt(team.borrow_limit_milli)}  offers: {offers}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    path = Path(argv[0] if argv else "jupyterhub_config.py").resolve()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        config = PyFileConfigLoader(path.name, str(path.parent)).load_config()
        hub = config.JupyterHub.get("tornado_settings", {}).get(SETTINGS_KEY)
        pool = hub.pool if isinstance(hub, HubObjects) else Pool.from_config(GPUPool(config=config))
    except ConfigError as e:
        print(f"{path.name}: {e}", file=sys.stderr)
        return 2
    print(render(pool))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
