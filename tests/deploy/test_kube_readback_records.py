"""What the hub records once it has read back the GPUs the node gave (issue 26, section 4): the
device plugin of the stand-in (:mod:`tests.deploy.kube_devices`, choosing other GPUs than the
ledger, as NVIDIA's ``GetPreferredAllocation`` does) gives a job's pod GPUs 6 and 7 where the
ledger granted 0 and 1; once dcgm-exporter's pod mapping is read back
(:mod:`gpupool.kube.readback`), the job's own record (the jobs API, the pages, the saved row)
names the GPUs the node gave, not the ledger's names at grant."""

from __future__ import annotations

import asyncio
import copy
import logging
from pathlib import Path

from kubernetes_asyncio.client import ApiClient, Configuration
from traitlets.config import Config

from gpupool.core import Ledger, Offer, Team
from gpupool.core.jobs import Job
from gpupool.hub.models import job_model
from gpupool.hub.pages_view import admin_view
from gpupool.hub.reclaim import IdleReclaimer
from gpupool.jobs.manager import JobManager
from gpupool.kube.jobs import KubeJobBackend
from gpupool.kube.manifests import job_name
from gpupool.kube.nodes import inventory_from_nodes
from gpupool.kube.readback import MigKey, read_back
from gpupool.monitors.dcgm import DCGMSource
from gpupool.pool import Pool
from gpupool.readback import Seen
from gpupool.store import Store
from tests.conftest import a100_mixed_node, h100_node
from tests.deploy.kube_api import Served, served
from tests.deploy.kube_devices import DevicePlugin, node_devices
from tests.deploy.kube_fixtures import IMAGE, NS
from tests.prometheus import Prometheus

NODE = "dgx-h100-1"
SPEC = {"script": "print(1)\n", "offer": "h100", "gpus": 2, "nodes": 1}


class SteppedBackend(KubeJobBackend):
    """The Kubernetes backend whose watch never looks again on its own (the test drives it)."""

    async def wait(self, job: Job, timeout: float) -> None:
        await asyncio.Event().wait()


def manager(server: Served, tmp_path: Path) -> JobManager:
    node = copy.deepcopy(h100_node(NODE))
    node["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
    with server.api.lock:
        server.api.add_node(node)
        server.api.device_plugin = DevicePlugin()
    c = Config()
    c.JobManager.backend_class = SteppedBackend
    c.KubeJobBackend.namespace = NS
    c.KubeJobBackend.image = IMAGE
    c.KubeJobBackend.api_client_factory = lambda: ApiClient(Configuration(host=server.url))
    offers = {"h100": Offer("h100", "gpu", model="H100-80GB", max_count=8)}
    ledger = Ledger(inventory_from_nodes([node]), offers, {"big": Team("big", 64000)})
    return JobManager(Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}")), config=c)


def test_a_job_records_the_gpus_read_back(tmp_path: Path) -> None:
    """On main the job's devices stayed the ledger's names at grant (``k8s-<node>-gpu0``,
    ``-gpu1``) after the read-back re-keyed its allocation to the node's GPUs 6 and 7."""
    prom = Prometheus()
    with served() as server:
        m = manager(server, tmp_path)
        uuids = {d.index: d.gpu_uuid for d in node_devices(server.api.nodes[NODE])}

        async def go() -> None:
            job = m.submit("alice", ["big"], dict(SPEC))
            await m.schedule_pass()
            job = m.jobs[job.id]
            assert job.state == "starting"
            assert job.devices == (f"k8s-{NODE}-gpu0", f"k8s-{NODE}-gpu1")  # the ledger's
            name = job_name(job)
            with server.api.lock:
                server.api.create_pods(name, NS)
                server.api.run_pods(name, NS)
                (pod,) = server.api.pods_of(name, NS).values()
                plugin = server.api.device_plugin
                assert plugin is not None
                given = sorted(d.index for d in plugin.devices_of(NS, pod["metadata"]["name"]))
                assert given == [6, 7]  # the device plugin's choice
                series = plugin.dcgm_series(server.api.nodes.values(), server.api._bound_pods())
                pods = [p for (ns, _), p in server.api.objects["pods"].items() if ns == NS]
            with prom._lock:
                prom.series = series
            source = DCGMSource(prom.url, 5.0)
            done = await read_back(m.pool, source, pods, logging.getLogger("test"))
            assert done == list(job.allocations)
            real = (uuids[6], uuids[7])
            job = m.jobs[job.id]
            assert sorted(job.devices) == sorted(real)  # the job's record
            assert sorted(job_model(job, None)["devices"]) == sorted(real)  # the jobs API
            (saved,) = [j for j in m.pool.store.load_jobs() if j.id == job.id]
            assert sorted(saved.devices) == sorted(real)  # what a restart finds
            # a restarted hub's manager reads the same
            again = JobManager(m.pool, config=m.config)
            assert sorted(again.jobs[job.id].devices) == sorted(real)

        asyncio.run(go())
    prom.close()


def test_a_mig_instance_shows_the_parent_gpu_and_gpu_instance_the_node_reports(
    tmp_path: Path,
) -> None:
    """A MIG notebook: the ledger's layout of a MIG node is a packing of its counts (not
    re-keyed), but the admin page's cell of the instance shows what the node reports for it
    (dcgm-exporter: the parent GPU's index and ``UUID``, ``GPU_I_ID``). On main nothing of it
    was kept."""
    offers = {"mig-2g": Offer("mig-2g", "mig", model="A100-80GB", profile="2g.20gb")}
    prom = Prometheus()
    with served() as server:
        node = a100_mixed_node("a100")
        node["metadata"]["labels"]["hub.jupyter.org/node-purpose"] = "user"
        with server.api.lock:
            server.api.add_node(node)
            server.api.device_plugin = DevicePlugin()
        ledger = Ledger(inventory_from_nodes([node]), offers, {"big": Team("big", 64000)})
        pool = Pool(ledger, Store(f"sqlite:///{tmp_path / 'pool.sqlite'}"))
        a = pool.allocate("ada", ["big"], "mig-2g", 1, team="big", ref="ada/")
        (d,) = a.devices
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": "jupyter-ada",
                "labels": {"gpupool.io/team": "big", "gpupool.io/allocation": a.id},
            },
            "spec": {
                "nodeName": "a100",
                "containers": [
                    {
                        "name": "notebook",
                        "image": IMAGE,
                        "resources": {"limits": {"nvidia.com/mig-2g.20gb": "1"}},
                    }
                ],
            },
        }
        with server.api.lock:
            code, reply = server.api.create("pods", NS, body)
            assert code == 201, reply
            assert server.api.schedule(NS, "jupyter-ada") == "Running"
            plugin = server.api.device_plugin
            assert plugin is not None
            (given,) = plugin.devices_of(NS, "jupyter-ada")
            series = plugin.dcgm_series(server.api.nodes.values(), server.api._bound_pods())
            pods = [p for (ns, _), p in server.api.objects["pods"].items() if ns == NS]
        assert given.gi is not None and given.profile == "2g.20gb"
        with prom._lock:
            prom.series = series
        reported: dict[MigKey, Seen] = {}
        source = DCGMSource(prom.url, 5.0)
        done = asyncio.run(read_back(pool, source, pods, logging.getLogger("test"), reported))
        assert done == []  # MIG is not re-keyed
        assert pool.ledger.allocations[a.id] == a
        seen = reported[a.id, d.gpu, d.start]
        assert (seen.index, seen.uuid, seen.gi) == (given.index, given.gpu_uuid, given.gi)
        # the admin page's cell of the instance
        c = Config()
        c.JobManager.backend_class = SteppedBackend
        c.KubeJobBackend.namespace = NS
        c.KubeJobBackend.image = IMAGE
        view = admin_view(
            pool, JobManager(pool, config=c), IdleReclaimer(pool, config=c), 0.0, reported
        )
        cells = [
            cell
            for n in view["nodes"]
            for g in n["gpus"]
            for cell in g["cells"]
            if cell["holder"] and cell["holder"]["allocation"] == a.id
        ]
        (cell,) = cells
        text = f"node reports GPU {given.index} ({given.gpu_uuid}), GPU instance {given.gi}"
        assert cell["reported"] == text and text in cell["title"]
    prom.close()
