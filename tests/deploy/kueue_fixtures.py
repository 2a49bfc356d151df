"""Shared set-up of the Kueue tests (issue 26): the hub's config as the rendered chart gives it,
and a notebook start that Kueue (:class:`tests.deploy.kube_kueue.Kueue`) admits or leaves gated,
run to its end."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.hub.fileconfig import load_config_file
from gpupool.kube.settings import kueue_cohort
from gpupool.pool import Pool
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import PROFILE_NS, pooled_cluster, profile_spawner, stop
from tests.deploy.kube_kueue import Kueue


def hub_config(objects: list[dict[str, Any]], tmp_path: Path) -> Config:
    """The hub's config from the rendered ``gpupool-config`` ConfigMap."""
    data = next(o for o in objects if o["metadata"]["name"] == "gpupool-config")
    path = tmp_path / "gpupool.json"
    path.write_text(data["data"]["gpupool.json"])
    c = Config()
    load_config_file(c, path)
    return c


@contextlib.contextmanager
def kueue_cluster(
    c: Config, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nodes: list[dict[str, Any]]
) -> Iterator[tuple[Served, Pool]]:
    """:func:`tests.deploy.kube_fixtures.pooled_cluster` over ``nodes`` with the offers, teams
    and Kueue cohort of the hub's config ``c``."""
    settings = GPUPool(config=c).settings()
    with pooled_cluster(
        tmp_path,
        monkeypatch,
        nodes,
        settings.offers,
        settings.teams,
        settings.everyone,
        cohort=kueue_cohort(c),
    ) as cluster:
        yield cluster


async def refused_start(
    server: Served, pool: Pool, kueue: Kueue, template: str, offer: str
) -> tuple[BaseException, tuple[str, str], bool]:
    """Start a notebook of ``offer`` under ``kueue_queue_template``; once its pod is made, Kueue
    admits it (and it is scheduled) or leaves it gated. The start must fail: its error, the
    pod's key and whether the pod was there when the start had failed (before its stop)."""
    s = profile_spawner(pool, None, kueue_queue_template=template)
    s.start_timeout = 3
    s.user_options = {"offer": offer}
    task = asyncio.ensure_future(s.start())
    key = (PROFILE_NS, s.pod_name)
    try:
        while key not in server.api.objects["pods"] and not task.done():
            await asyncio.sleep(0.02)  # KubeSpawner's own start, awaited by the test
        if key in server.api.objects["pods"] and not kueue.admit_pod(server.api, *key):
            server.api.schedule(*key)  # admitted: Kueue ungates it
        with pytest.raises(Exception) as refused:
            await asyncio.wait_for(task, 30)
        return refused.value, key, key in server.api.objects["pods"]
    finally:
        await stop(s)
