"""A job on several MIG instances per node under CDI (issue 26, section 4).

gpupool runs such a job as one rank per instance, each rank taking its own instance's UUID from
``NVIDIA_VISIBLE_DEVICES`` (``gpupool_lab.rank_log``). That holds only under the NVIDIA device
plugin's ``envvar`` strategy. Under CDI (``cdi-cri``, the GPU Operator's default since v25.10) the
plugin sets no variable and the CDI spec sets ``NVIDIA_VISIBLE_DEVICES=void``
(:mod:`tests.deploy.kube_devices`): every rank finds no device of its own, and CUDA shows a
process only the first MIG instance, so all ranks run on one instance. The job backend refuses
such a job at submit (400, with the reason), unless ``KubeJobBackend.device_list_strategy`` says
``envvar``; a bad value stops the hub at start, naming the key."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, Configuration
from traitlets.config import Config

from gpupool.core import InvalidRequest, Ledger, Offer, Request, Team
from gpupool.declarations import ConfigError
from gpupool.hub.errors import status_of
from gpupool.jobs.manager import JobManager
from gpupool.kube.jobs import check_kube_settings
from gpupool.kube.manifests import job_name
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.pool import Pool
from gpupool.store import Store
from gpupool_lab.rank_log import rank_device
from tests.conftest import a100_mixed_node
from tests.deploy.kube_api import Served
from tests.deploy.kube_devices import DevicePlugin
from tests.deploy.kube_fixtures import IMAGE, NS, a_job, build_job, container

OFFERS = {
    "cpu": Offer("cpu", "cpu"),
    "mig-3g.40gb": Offer("mig-3g.40gb", "mig", model="A100-80GB", profile="3g.40gb", max_count=2),
}


def ledger() -> Ledger:
    inventory = inventory_from_nodes([a100_mixed_node()])
    return Ledger(inventory, OFFERS, {"vision": Team("vision", 8000)})


def ranks_devices(kube: Served, strategy: str) -> list[str | None]:
    """The instance each of a 2-rank job pod's local ranks runs on, on a node whose device plugin
    hands devices out under ``strategy``."""
    api = kube.api
    node = a100_mixed_node()
    node["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"  # z2jh's, as templated
    with api.lock:
        api.add_node(node)
        api.device_plugin = DevicePlugin(strategy)
    pool = ledger()
    job = a_job("mig-3g.40gb", gpus=2)
    allocation = pool.allocate(Request("alice", "vision", "mig-3g.40gb", 2, "job", job.id), "a0")
    obj = build_job(job, [allocation], offer=OFFERS["mig-3g.40gb"])
    obj["spec"]["suspend"] = False
    name = job_name(job)
    with api.lock:
        code, reply = api.create("jobs", NS, obj)
        assert code == 201, reply
        api.create_pods(name, NS)
        api.run_pods(name, NS)
        (pod,) = api.pods_of(name, NS).values()
    assert pod["status"]["phase"] == "Running"
    box = container(obj)["name"]
    given = api.device_plugin.devices_of(NS, pod["metadata"]["name"])
    assert len(given) == 2 and all(d.id.startswith("MIG-") for d in given)
    env: dict[str, Any] = {
        e["name"]: e["value"] for e in pod["spec"]["containers"][0].get("env", []) if "value" in e
    }
    env |= api.device_plugin.container_env(NS, pod["metadata"]["name"], box)
    return [rank_device({**env, "LOCAL_RANK": str(r)})[0] for r in range(2)]


def test_under_envvar_each_rank_has_its_own_instance(kube: Served) -> None:
    first, second = ranks_devices(kube, "envvar")
    assert first and second and first != second


def test_under_cdi_no_rank_can_tell_its_instance(kube: Served) -> None:
    """What a real cluster under the GPU Operator's CDI default does to today's job pod: every
    rank falls back to the first instance CUDA shows (none has one of its own)."""
    assert ranks_devices(kube, "cdi-cri") == [None, None]


def manager(tmp_path: Path, kube: Served, **settings: Any) -> JobManager:
    c = Config()
    c.JobManager.backend_class = "gpupool.kube.jobs.KubeJobBackend"
    c.KubeJobBackend.namespace = NS
    c.KubeJobBackend.image = IMAGE
    c.KubeJobBackend.api_client_factory = lambda: ApiClient(Configuration(host=kube.url))
    for key, value in settings.items():
        setattr(c.KubeJobBackend, key, value)
    return JobManager(Pool(ledger(), Store(f"sqlite:///{tmp_path / 'pool.sqlite'}")), config=c)


def submit(m: JobManager, gpus: int) -> Any:
    spec = {"script": "print(1)\n", "offer": "mig-3g.40gb", "gpus": gpus, "nodes": 1}

    async def go() -> Any:
        return m.submit("alice", ["vision"], spec)

    return asyncio.run(go())


def test_a_job_on_two_instances_is_refused_at_submit_under_cdi(
    tmp_path: Path, kube: Served
) -> None:
    m = manager(tmp_path, kube)
    with pytest.raises(InvalidRequest) as e:
        submit(m, 2)
    assert status_of(e.value) == 400
    message = e.value.message
    assert "2× MIG 3g.40gb per node cannot run on this cluster" in message
    assert "NVIDIA_VISIBLE_DEVICES is 'void'" in message
    assert "KubeJobBackend.device_list_strategy" in message
    assert "Ask for 1 instance per node" in message
    assert not m.jobs
    assert submit(m, 1).state == "queued"  # one instance per node: one rank, its own


def test_under_envvar_a_job_on_two_instances_is_taken(tmp_path: Path, kube: Served) -> None:
    m = manager(tmp_path, kube, device_list_strategy="envvar")
    assert submit(m, 2).state == "queued"


def test_an_unknown_strategy_stops_the_hub_naming_the_key() -> None:
    c = Config()
    c.KubeJobBackend.device_list_strategy = "cdi"
    with pytest.raises(ConfigError) as e:
        check_kube_settings(c)
    assert "KubeJobBackend.device_list_strategy" in str(e.value)
    assert "cdi-cri" in str(e.value)
