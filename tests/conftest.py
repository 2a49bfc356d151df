"""What the whole test suite shares: the ``slow`` marker, given by folder and file, and helpers
used by test modules in more than one folder (test modules never import from each other).

``slow``: the modules that start real hubs, a browser, Helm renders or torchrun. ``make test``
runs everything; ``make test-fast`` (``pytest -m "not slow"``) the rest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.pool import Pool
from tests import skips
from tests.accounts import RUNTIME_PYTHON, as_account, shared_account, shared_mode
from tests.databases import db_url, postgresql_server, postgresql_url  # noqa: F401 (fixtures)
from tests.preflight import first_problem

TESTS = Path(__file__).resolve().parent

# Folders (every module in them) and modules, relative to tests/, whose tests are slow.
SLOW = (
    "hub/",  # a real JupyterHub with real servers and jobs, 1 to 3 minutes a module
    "lab/test_browser.py",  # the whole flow in Chromium, against a real hub
    "lab/test_browser_slices.py",  # a MIG instance and a share spawned in Chromium
    "lab/test_ddp.py",  # real torchrun process groups
    "deploy/test_chart.py",  # Helm renders and `helm lint`
    "deploy/test_kube_jobs.py",  # the containers' command run with real torchrun
    "adapters/test_job_manager.py",  # real jobs (torchrun) through the queue
    "adapters/test_job_lifecycle.py",  # real jobs started, cancelled and lost
    "adapters/test_local_job_privileges.py",  # real jobs as their owners' accounts
    "install/test_fresh_clone.py",  # `make run` from a fresh clone: installs everything
    "slurm/",  # real Slurm daemons (and slurmdbd with MariaDB), jobs and servers on them
)


def pytest_sessionstart(session: pytest.Session) -> None:
    """What the run needs (:mod:`tests.preflight`): a failed check stops it here, once."""
    problem = first_problem()
    if problem:
        pytest.exit(f"gpupool: the tests cannot run here: {problem}", returncode=4)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The run's last lines: how many tests were skipped, by reason (:mod:`tests.skips`)."""
    skips.terminal_summary(terminalreporter)


def unique_node_id(item: pytest.Item) -> None:
    """Give ``item`` the node id its name implies. schemathesis (4.x, on pytest 9) gives every
    operation's item the test function's node id, the same for all; pytest-xdist tells items
    apart by node id, so it ran one of them and dropped the rest."""
    nodeid = f"{item.nodeid.rpartition('::')[0]}::{item.name}"
    try:
        from _pytest.nodeid import coerce_node_id  # pytest 9: a structured node id
    except ImportError:
        item._nodeid = nodeid  # type: ignore[attr-defined]
    else:
        item._id = coerce_node_id(nodeid)  # type: ignore[attr-defined]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if not item.nodeid.endswith(f"::{item.name}"):
            unique_node_id(item)
        try:
            where = item.path.resolve().relative_to(TESTS).as_posix()
        except ValueError:
            continue
        if any(where == s or (s.endswith("/") and where.startswith(s)) for s in SLOW):
            item.add_marker(pytest.mark.slow)


# -- a small DDP training script (the hub's job tests and the browser test) -------------------
TRAIN = """\
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from gpupool_lab import ddp
"""
TRAIN_CELL = """\
ddp.init()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(ddp.rank())
for _ in range(5):
    loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
params = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
print("FINAL", ddp.rank(), ddp.world_size(), params, flush=True)
ddp.cleanup()
"""


# -- a small pool: 3 whole H100s (simulated), team vision guaranteed all three (idle reclaim) --
def small_pool(tmp: Path) -> Pool:
    c = Config()
    c.GPUPool.inventory = "simulated:n: 3x H100-80GB"
    c.GPUPool.db_url = f"sqlite:///{tmp / 'pool.sqlite'}"
    c.GPUPool.offers = {"cpu": {}, "h100": {"model": "H100-80GB", "max_count": 1}}
    c.GPUPool.teams = {"vision": {"guarantee": 3}}
    shared_mode(c)
    return Pool.from_config(GPUPool(config=c))


# -- real processes as the hub starts them for users (reconciliation, adapters and hub) --------
@contextmanager
def holders() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes started with :func:`holder`, killed at the end whatever happened."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        yield started
    finally:
        for p in started:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def holder(
    started: list[subprocess.Popen[bytes]], code: str = "", **env: str
) -> subprocess.Popen[bytes]:
    """A real process as the hub starts them for users (the account that runs user code, a
    session of its own) with ``env``, running ``code`` and then waiting for a signal."""
    p = subprocess.Popen(
        [RUNTIME_PYTHON, "-c", f"import os, signal, sys\n{code}\nsignal.pause()"],
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        cwd="/",
        start_new_session=True,
        stdout=subprocess.PIPE if code else None,
        **as_account(shared_account()),
    )
    started.append(p)
    if code:  # the code says "ready" once it has done its part
        assert p.stdout is not None and p.stdout.readline() == b"ready\n"
    return p


def gone(p: subprocess.Popen[bytes]) -> bool:
    return p.poll() is not None


# -- Kubernetes node objects and a kubeconfig (the node reader, manifests and Kubernetes jobs) --
def gpu_node_labels(product: str, memory: str, count: int, mig_config: str) -> dict[str, str]:
    """The labels GPU feature discovery puts on a GPU node (``mixed`` MIG strategy)."""
    return {
        "beta.kubernetes.io/arch": "amd64",
        "kubernetes.io/os": "linux",
        "feature.node.kubernetes.io/pci-10de.present": "true",
        "nvidia.com/cuda.driver.major": "550",
        "nvidia.com/cuda.driver.minor": "90",
        "nvidia.com/cuda.driver.rev": "07",
        "nvidia.com/cuda.runtime.major": "12",
        "nvidia.com/cuda.runtime.minor": "4",
        "nvidia.com/gfd.timestamp": "1718000000",
        "nvidia.com/gpu.compute.major": "9" if "H100" in product else "8",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.count": str(count),
        "nvidia.com/gpu.deploy.device-plugin": "true",
        "nvidia.com/gpu.family": "hopper" if "H100" in product else "ampere",
        "nvidia.com/gpu.machine": "DGX-H100" if "H100" in product else "DGXA100-920-23687-2530-000",
        "nvidia.com/gpu.memory": memory,
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mig.config": mig_config,
        "nvidia.com/mig.config.state": "success",
        "nvidia.com/mig.strategy": "mixed",
    }


def node(
    name: str,
    labels: dict[str, str],
    nvidia: dict[str, str],
    *,
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    """A node object as the API returns it (``status.capacity`` equals ``allocatable`` for the
    device plugin's resources)."""
    base = {"cpu": "255", "memory": "2113309416Ki", "pods": "110", "ephemeral-storage": "1.6Ti"}
    spec: dict[str, Any] = {
        "podCIDR": "10.244.1.0/24",
        "providerID": f"baremetal://{name}",
        "taints": taints
        if taints is not None
        else [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
    }
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"00000000-0000-4000-8000-{sum(map(ord, name)):012d}",
            "resourceVersion": "4242",
            "creationTimestamp": "2025-01-01T00:00:00Z",
            "labels": {"kubernetes.io/hostname": name, **labels},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": spec,
        "status": {
            "capacity": {**base, **nvidia},
            "allocatable": {**base, "cpu": "254", **nvidia},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "lastHeartbeatTime": "2025-01-01T00:00:00Z",
                    "lastTransitionTime": "2025-01-01T00:00:00Z",
                    "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                }
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "bootID": "b",
                "containerRuntimeVersion": "containerd://1.7.20",
                "kernelVersion": "5.15.0-1063-nvidia",
                "kubeProxyVersion": "v1.33.1",
                "kubeletVersion": "v1.33.1",
                "machineID": "m",
                "operatingSystem": "linux",
                "osImage": "Ubuntu 22.04.4 LTS",
                "systemUUID": "s",
            },
        },
    }


def h100_node(name: str = "dgx-h100-1") -> dict[str, Any]:
    """Eight whole H100s, MIG off (``all-disabled``)."""
    labels = gpu_node_labels("NVIDIA-H100-80GB-HBM3", "81559", 8, "all-disabled")
    return node(name, labels, {"nvidia.com/gpu": "8"})


def a100_mixed_node(name: str = "dgx-a100-1") -> dict[str, Any]:
    """Eight A100-80GBs: one whole, seven all-balanced (``mixed`` strategy)."""
    labels = gpu_node_labels("NVIDIA-A100-SXM4-80GB", "81920", 8, "balanced-7-whole-1")
    for profile, memory, n in (("1g.10gb", "9728", 14), ("2g.20gb", "19968", 7)):
        labels |= {
            f"nvidia.com/mig-{profile}.count": str(n),
            f"nvidia.com/mig-{profile}.memory": memory,
        }
    labels |= {"nvidia.com/mig-3g.40gb.count": "7", "nvidia.com/mig-3g.40gb.memory": "40192"}
    resources = {
        "nvidia.com/gpu": "1",
        "nvidia.com/mig-1g.10gb": "14",
        "nvidia.com/mig-2g.20gb": "7",
        "nvidia.com/mig-3g.40gb": "7",
    }
    return node(name, labels, resources)


T4_MIB = 15360  # GFD's nvidia.com/gpu.memory on a Tesla T4


def shared_node(
    name: str = "t4-shared",
    *,
    strategy: str = "time-slicing",
    renamed: bool = False,
    gpus: int = 4,
    replicas: int = 4,
) -> dict[str, Any]:
    """A node of ``gpus`` T4s, each shared into ``replicas`` by the device plugin."""
    product = "Tesla-T4" if renamed else "Tesla-T4-SHARED"
    labels = gpu_node_labels(product, str(T4_MIB), gpus, "all-disabled")
    labels |= {
        "nvidia.com/gpu.replicas": str(replicas),
        "nvidia.com/gpu.sharing-strategy": strategy,
        "nvidia.com/mig.capable": "false",
    }
    if renamed:
        resources = {"nvidia.com/gpu": "0", "nvidia.com/gpu.shared": str(gpus * replicas)}
    else:
        resources = {"nvidia.com/gpu": str(gpus * replicas)}
    return node(name, labels, resources)


def hami_node(name: str = "l40s-hami", gpus: int = 2, split: int = 10) -> dict[str, Any]:
    """A node of ``gpus`` L40S that HAMi's device plugin shares out, each GPU to at most
    ``split`` pods (its ``deviceSplitCount``, 10 by default)."""
    labels = {"kubernetes.io/hostname": name, "gpu": "on"}
    obj = node(name, labels, {"nvidia.com/gpu": str(split * gpus)})
    devices = [
        {
            "id": f"GPU-0000000{i}-1111-2222-3333-444444444444",
            "count": split,
            "devmem": 46068,
            "devcore": 100,
            "type": "NVIDIA-NVIDIA L40S",
            "numa": 0,
            "mode": "hami-core",
            "health": True,
        }
        for i in range(gpus)
    ]
    obj["metadata"]["annotations"]["hami.io/node-nvidia-register"] = json.dumps(devices)
    return obj


def kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig at ``path`` for an API server at ``server`` (a test token, no TLS)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": server}}],
        "users": [{"name": "test", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
        "current-context": "test",
    }
    path.write_text(json.dumps(config))
    return path
