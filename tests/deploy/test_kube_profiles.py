"""KubeSpawner's profiles under KubeGPUSpawner (issue 15): an admin's ``profile_list`` (z2jh's
``singleuser.profileList``) keeps its images, CPU and memory, and gpupool's GPU choice applies on
top of it.

Each start here is a real one: the real :class:`KubeGPUSpawner` (profile list set on
``c.KubeSpawner``, as z2jh's ``jupyterhub_config.py`` sets it), a real pool over the nodes of the
API stand-in (:mod:`tests.deploy.kube_api`, served over HTTP), KubeSpawner's own start (its pod
reflector, its ``load_user_options``, its pod request); the pod checked is the one the stand-in
stored, scheduled by the stand-in's scheduler.

- ``profile`` (and a profile's ``profile_options``) in ``user_options`` are KubeSpawner's: its
  ``kubespawner_override`` (image, CPU, memory) reach the pod; gpupool's offer, count and team
  give its GPUs, its node binding and its tolerations, whatever the profile's override says about
  ``nvidia.com/*`` resources or the GPU product label.
- ``gpupool_offers`` in a profile entry restricts the offers that profile may take; the hub
  enforces it whatever the browser sends (4xx with the reason, nothing held).
- An unknown profile, or a choice a profile option does not have, is a 400 with the reason.
- The spawn form shows KubeSpawner's profile choice and gpupool's GPU choice; what it posts
  reaches KubeSpawner's options parsing and gpupool's.
"""

from __future__ import annotations

import asyncio
import base64
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from kubespawner import KubeSpawner
from tornado import web
from traitlets.config import Config

from gpupool.core import Offer, Team
from gpupool.declarations import ConfigError
from gpupool.hub import setup
from gpupool.hub.form import check_profile_offers
from gpupool.pool import Pool
from gpupool_spawner.kube import KubeGPUSpawner
from tests.conftest import a100_mixed_node, h100_node, node
from tests.deploy.chart_fixtures import CHART, render_all, z2jh_archive
from tests.deploy.kube_api import Served
from tests.deploy.kube_fixtures import (
    bound_to,
    pooled_cluster,
    profile_spawner,
    start,
    stop,
)
from tests.deploy.kube_fixtures import (
    gpu_quantities as nvidia,
)

CPU_IMAGE = "quay.io/jupyter/datascience-notebook:2025-06-02"
TORCH_IMAGE = "quay.io/jupyter/pytorch-notebook:cuda12-2025-06-02"
JAX_IMAGE = "registry.example.org/jax-notebook:2025.06"
OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "h100": Offer("h100", "gpu", model="H100-80GB", max_count=4),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", model="A100-80GB", profile="3g.40gb"),
}
PROFILES: list[dict[str, Any]] = [
    {
        "display_name": "Data science (CPU)",
        "slug": "datasci",
        "default": True,
        "gpupool_offers": ["cpu"],
        "kubespawner_override": {"image": CPU_IMAGE, "cpu_limit": 2, "mem_limit": "4G"},
    },
    {
        "display_name": "Deep learning",
        "slug": "dl",
        "description": "PyTorch or JAX with CUDA",
        "gpupool_offers": ["h100", "mig-3g.40gb"],
        "kubespawner_override": {
            "image": TORCH_IMAGE,
            "cpu_limit": 16.0,
            "cpu_guarantee": 8.0,
            "mem_limit": "128G",
            "mem_guarantee": "64G",
            # what an old z2jh profile gave a GPU with: the pool's allocation wins over it
            "extra_resource_limits": {"nvidia.com/gpu": "8"},
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"},
        },
        "profile_options": {
            "image": {
                "display_name": "Image",
                "choices": {
                    "torch": {"display_name": "PyTorch", "kubespawner_override": {}},
                    "jax": {
                        "display_name": "JAX",
                        "kubespawner_override": {"image": JAX_IMAGE},
                    },
                },
            }
        },
    },
    {
        "display_name": "Anything",
        "slug": "any",
        "kubespawner_override": {"image": TORCH_IMAGE},
    },
]


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Served, Pool]]:
    """The stand-in (an H100 node, a MIG A100 node and a CPU node, z2jh user nodes) and the
    hub's pool over the same nodes."""
    nodes = [h100_node(), a100_mixed_node(), node("cpu-1", {}, {}, taints=[])]
    for obj in nodes:
        obj["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
    teams = {"vision": Team("vision", 8000)}
    everyone = Team("everyone", offers=frozenset({"cpu"}))
    with pooled_cluster(tmp_path, monkeypatch, nodes, OFFERS, teams, everyone) as made:
        yield made


def spawner(pool: Pool, profiles: Any = PROFILES, **traits: Any) -> KubeGPUSpawner:
    """alice (team vision) with the admin's profile list; call inside a running event loop."""
    return profile_spawner(pool, profiles, **traits)


def run_start(server: Served, pool: Pool, user_options: dict[str, Any]) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        s = spawner(pool)
        s.user_options = user_options
        try:
            return await start(server, s)
        finally:
            await stop(s)

    return asyncio.run(go())


def refused(
    server: Served, pool: Pool, user_options: dict[str, Any], profiles: Any = PROFILES
) -> str:
    """The HTTP error a start with these options gets; asserts nothing was held or made."""

    async def go() -> web.HTTPError:
        s = spawner(pool, profiles)
        s.user_options = user_options
        try:
            with pytest.raises(web.HTTPError) as e:
                await start(server, s)
            return e.value
        finally:
            await KubeSpawner._stop_all_reflectors()

    error = asyncio.run(go())
    assert 400 <= error.status_code < 500, error
    assert pool.ledger.allocations == {}
    assert server.api.objects["pods"] == {}
    return f"{error.status_code} {error.log_message}"


def notebook(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "notebook"]
    return container


# -- profile and offer together -------------------------------------------------------------------
def test_a_profiles_image_cpu_and_memory_reach_the_pod_with_the_pools_gpus(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster
    pod = run_start(server, pool, {"profile": "dl", "image": "jax", "offer": "h100", "count": 2})
    container = notebook(pod)
    assert container["image"] == JAX_IMAGE  # the profile option's override
    resources = container["resources"]
    assert float(resources["limits"]["cpu"]) == 16 and float(resources["requests"]["cpu"]) == 8
    assert int(resources["limits"]["memory"]) == 128 * 2**30  # KubeSpawner writes bytes
    assert int(resources["requests"]["memory"]) == 64 * 2**30
    # the ledger's GPUs, not the profile's 8; the ledger's node, not the profile's A100 selector
    assert nvidia(pod) == nvidia(pod, "requests") == {"nvidia.com/gpu": "2"}
    assert "nvidia.com/gpu.product" not in (pod["spec"].get("nodeSelector") or {})
    assert bound_to(pod) == {"dgx-h100-1"}
    assert pod["spec"]["nodeName"] == "dgx-h100-1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["spec"][
        "tolerations"
    ]
    assert pod["metadata"]["labels"]["gpupool.io/offer"] == "h100"
    assert pool.ledger.allocations == {}  # released by the stop


def test_a_profile_with_a_mig_offer_and_its_default_option(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster
    pod = run_start(server, pool, {"profile": "dl", "offer": "mig-3g.40gb"})
    assert notebook(pod)["image"] == TORCH_IMAGE
    assert nvidia(pod) == {"nvidia.com/mig-3g.40gb": "1"}  # and no nvidia.com/gpu: 8
    assert bound_to(pod) == {"dgx-a100-1"}


def test_no_profile_named_is_the_default_profile(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster
    pod = run_start(server, pool, {})
    assert notebook(pod)["image"] == CPU_IMAGE
    assert int(notebook(pod)["resources"]["limits"]["memory"]) == 4 * 2**30
    assert nvidia(pod) == {}
    assert pod["metadata"]["labels"]["gpupool.io/offer"] == "cpu"


def test_a_profile_that_names_no_offers_takes_any_offer(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster
    pod = run_start(server, pool, {"profile": "any", "offer": "h100", "count": 1})
    assert notebook(pod)["image"] == TORCH_IMAGE
    assert nvidia(pod) == {"nvidia.com/gpu": "1"}


def test_gpu_overrides_in_the_container_config_do_not_bypass_the_pool(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster
    profiles = [
        {
            "display_name": "Sneaky",
            "kubespawner_override": {
                "extra_resource_guarantees": {"nvidia.com/gpu": "4"},
                "extra_container_config": {
                    "resources": {"limits": {"nvidia.com/mig-1g.10gb": "7"}}
                },
            },
        }
    ]

    async def go() -> dict[str, Any]:
        s = spawner(pool, profiles)
        s.user_options = {"offer": "mig-3g.40gb"}
        try:
            return await start(server, s)
        finally:
            await stop(s)

    pod = asyncio.run(go())
    assert nvidia(pod) == nvidia(pod, "requests") == {"nvidia.com/mig-3g.40gb": "1"}


# -- refusals -------------------------------------------------------------------------------------
def test_an_offer_the_profile_does_not_allow_is_refused(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster
    why = refused(server, pool, {"profile": "datasci", "offer": "h100", "count": 1})
    assert why.startswith("400 ")
    assert "Data science (CPU)" in why and "h100" in why and "cpu" in why


def test_the_default_profiles_offers_apply_to_a_start_naming_no_profile(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster
    why = refused(server, pool, {"offer": "mig-3g.40gb"})
    assert why.startswith("400 ") and "Data science (CPU)" in why


def test_a_restricted_profile_without_an_offer_gets_its_only_offer_or_a_reason(
    cluster: tuple[Served, Pool],
) -> None:
    server, pool = cluster
    why = refused(server, pool, {"profile": "dl"})
    assert why.startswith("400 ") and "h100" in why and "mig-3g.40gb" in why


def test_an_unknown_profile_is_a_400_naming_the_profiles(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster
    why = refused(server, pool, {"profile": "gpu-xl", "offer": "cpu"})
    assert why.startswith("400 ") and "gpu-xl" in why and "datasci" in why and "dl" in why


def test_a_choice_the_profile_option_lacks_is_a_400(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster
    why = refused(server, pool, {"profile": "dl", "image": "tensorflow", "offer": "h100"})
    assert why.startswith("400 ") and "tensorflow" in why and "jax" in why


def test_a_profile_that_is_not_a_name_is_a_400(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster
    why = refused(server, pool, {"profile": ["dl"], "offer": "h100"})
    assert why.startswith("400 ")


@pytest.mark.parametrize(
    "override",
    [
        {"node_selector": {"kubernetes.io/hostname": "dgx-a100-1"}},
        {"extra_pod_config": {"nodeName": "dgx-a100-1"}},
    ],
    ids=["hostname-selector", "node-name"],
)
def test_a_profile_pinned_to_another_node_than_the_ledgers_is_refused(
    cluster: tuple[Served, Pool], override: dict[str, Any]
) -> None:
    """gpupool owns where a GPU pod runs: a profile that pins pods to a node by name cannot
    take GPUs the ledger counted on another node (without the check the pod would sit Pending,
    or, with ``nodeName``, bypass the scheduler onto a node whose GPUs the ledger gave others)."""
    server, pool = cluster
    profiles = [{"display_name": "Pinned", "kubespawner_override": override}]
    why = refused(server, pool, {"offer": "h100"}, profiles)
    assert why.startswith("400 ") and "dgx-a100-1" in why and "dgx-h100-1" in why


# -- the spawn form -------------------------------------------------------------------------------
def test_the_spawn_form_shows_the_profiles_and_the_gpu_choice(
    cluster: tuple[Served, Pool],
) -> None:
    _, pool = cluster

    async def go() -> str:
        s = spawner(pool)
        form = await s.get_options_form()
        await KubeSpawner._stop_all_reflectors()
        return str(form)

    form = asyncio.run(go())
    assert 'name="profile"' in form and 'value="dl"' in form
    assert 'name="profile-option-dl--image"' in form
    assert 'name="gpupool_choice"' in form and 'value="vision|h100|2"' in form


def test_a_form_post_with_profile_and_offer_starts_both(cluster: tuple[Served, Pool]) -> None:
    server, pool = cluster
    form_data = {
        "profile": ["dl"],
        "profile-option-dl--image": ["jax"],
        "gpupool_choice": ["vision|h100|2"],
    }

    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        s = spawner(pool)
        options = s.run_options_from_form(form_data)
        s.user_options = options
        try:
            return options, await start(server, s)
        finally:
            await stop(s)

    options, pod = asyncio.run(go())
    assert options == {
        "profile": "dl",
        "image": "jax",
        "team": "vision",
        "offer": "h100",
        "count": 2,
    }
    assert notebook(pod)["image"] == JAX_IMAGE
    assert nvidia(pod) == {"nvidia.com/gpu": "2"}


def test_a_spawn_link_names_a_profile_and_an_offer(cluster: tuple[Served, Pool]) -> None:
    _, pool = cluster

    async def go() -> dict[str, Any]:
        s = spawner(pool)
        options = s.options_from_query({"profile": ["dl"], "offer": ["h100"], "count": ["1"]})
        await KubeSpawner._stop_all_reflectors()
        return options

    assert asyncio.run(go()) == {"profile": "dl", "offer": "h100", "count": 1}


def test_without_a_profile_list_the_form_is_gpupools_alone(
    cluster: tuple[Served, Pool],
) -> None:
    _, pool = cluster

    async def go() -> str:
        s = spawner(pool, None)
        return str(await s.get_options_form())

    form = asyncio.run(go())
    assert 'name="gpupool_choice"' in form and 'name="profile"' not in form


# -- the hub's start -----------------------------------------------------------------------------
def test_profile_offers_the_pool_lacks_stop_the_hub_naming_the_key() -> None:
    c = Config()
    c.KubeSpawner.profile_list = PROFILES
    check_profile_offers(c, OFFERS)  # fine
    c.KubeSpawner.profile_list = [*PROFILES, {"display_name": "x", "gpupool_offers": ["a100"]}]
    with pytest.raises(ConfigError, match=r"KubeSpawner\.profile_list\[3\]\.gpupool_offers"):
        check_profile_offers(c, OFFERS)
    c = Config()
    c.KubeGPUSpawner.profile_list = {"dl": {"display_name": "x", "gpupool_offers": "h100"}}
    with pytest.raises(ConfigError, match=r"KubeGPUSpawner\.profile_list\['dl'\]"):
        check_profile_offers(c, OFFERS)


# -- the chart ------------------------------------------------------------------------------------
def test_z2jhs_profile_list_passes_through_the_chart_unchanged(tmp_path: Path) -> None:
    """``jupyterhub.singleuser.profileList`` (with ``gpupool_offers``) reaches the hub's values
    as written (z2jh's ``jupyterhub_config.py`` sets ``c.KubeSpawner.profile_list`` from it,
    which KubeGPUSpawner inherits), and gpupool's config sets nothing that would hide it."""
    archive = z2jh_archive()
    if archive is None:
        pytest.skip("the JupyterHub chart archive is neither in helm/gpupool/charts/ nor shared/")
    chart_dir = tmp_path / "gpupool"
    shutil.copytree(CHART, chart_dir, ignore=shutil.ignore_patterns("charts"))
    (chart_dir / "charts").mkdir()
    shutil.copy(archive, chart_dir / "charts")
    values = {"jupyterhub": {"singleuser": {"profileList": PROFILES}}}
    with helm.Chart.load(chart_dir) as chart:
        objects = render_all(chart, values)
    (secret,) = [o for o in objects if o["kind"] == "Secret" and "values.yaml" in o.get("data", {})]
    hub_values = yaml.safe_load(base64.b64decode(secret["data"]["values.yaml"]))
    assert hub_values["singleuser"]["profileList"] == PROFILES
    (config,) = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("gpupool-config")
    ]
    text = str(config["data"])
    assert "profile_list" not in text and "options_form" not in text


def test_setup_checks_the_profiles_offers(tmp_path: Path) -> None:
    """The check runs where a bad key must stop the hub: in ``setup(c)``, before anything runs."""
    c = Config()
    c.GPUPool.inventory = "simulated:n: 2x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp_path / 'pool.sqlite'}"
    c.GPUPool.offers = {"cpu": {"kind": "cpu"}}
    c.JupyterHub.db_url = f"sqlite:///{tmp_path / 'jupyterhub.sqlite'}"
    c.KubeSpawner.profile_list = [{"display_name": "x", "gpupool_offers": ["h100"]}]
    with pytest.raises(ConfigError, match=r"^KubeSpawner\.profile_list\[0\]\.gpupool_offers"):
        setup(c)
