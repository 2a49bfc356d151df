"""What a share's server and job processes get from the local spawner and the local job backend:
exactly the GPU's UUID, the share and its cap, gpupool_lab's startup file, and under MPS the
client limits; a per-user server is refused a share on an MPS GPU. Share allocations are made
directly (two simulated L40S-48GB without MIG; a quarter is 12288 MiB)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tornado import web
from traitlets.config import Config

import gpupool_lab
from gpupool.config import GPUPool
from gpupool.core.ledger import Allocation, Device
from gpupool.core.offers import Offer
from gpupool.hub.objects import SETTINGS_KEY, HubObjects, build
from gpupool.jobs.manager import JobManager
from gpupool.pool import Pool
from gpupool_spawner.local import LocalGPUSpawner
from tests.accounts import shared_mode

LOG = logging.getLogger("gpupool.tests.share_env")
STARTUP = str(Path(gpupool_lab.__file__).parent / "ipython_startup.py")


def config(tmp: Path, **enforcement: Any) -> Config:
    tmp.mkdir(parents=True, exist_ok=True)
    c = Config()
    c.GPUPool.inventory = "simulated:n: 2x L40S-48GB"
    c.GPUPool.db_url = f"sqlite:///{tmp / 'pool.sqlite'}"
    c.GPUPool.offers = {"cpu": {}}
    for key, value in enforcement.items():
        setattr(c.ShareEnforcement, key, value)
    shared_mode(c)
    return c


def hub(c: Config) -> HubObjects:
    return build(Pool.from_config(GPUPool(config=c)), c, LOG)


def share(objects: HubObjects, kind: str = "notebook") -> Allocation:
    gpu = objects.pool.inventory.gpus[0]
    a = Allocation(
        "share1", "ada", "everyone", "share-q", kind, "ada/" if kind == "notebook" else "job1",
        1, 250, "n", (Device(gpu.uuid, share_milli=250),),
    )  # fmt: skip
    objects.pool.ledger.allocations[a.id] = a
    return a


def spawner(c: Config, objects: HubObjects, allocation: Allocation, **settings: Any) -> Any:
    for key, value in settings.items():
        setattr(c.LocalGPUSpawner, key, value)
    user = SimpleNamespace(
        name="ada", groups=[], url="/user/ada/", escaped_name="ada",
        settings={SETTINGS_KEY: objects},
    )  # fmt: skip
    the_hub = SimpleNamespace(
        public_host="", url="http://127.0.0.1:8081/hub/",
        api_url="http://127.0.0.1:8081/hub/api", base_url="/hub/",
    )  # fmt: skip
    s = LocalGPUSpawner(config=c, user=user, hub=the_hub)
    s.gpupool_allocation_id = allocation.id
    return s


def test_a_share_server_sees_its_gpu_uuid_its_cap_and_the_startup_file(tmp_path: Path) -> None:
    c = config(tmp_path)
    objects = hub(c)
    a = share(objects)
    env = spawner(c, objects, a).get_env()
    assert env["CUDA_VISIBLE_DEVICES"] == objects.pool.inventory.gpus[0].uuid
    assert env["GPUPOOL_ALLOCATION"] == a.id
    assert (env["GPUPOOL_SHARE_MILLI"], env["GPUPOOL_SHARE_MIB"]) == ("250", "12288")
    assert env["GPUPOOL_SHARE_ENFORCEMENT"] == "watched"
    assert env["PYTHONSTARTUP"] == STARTUP
    assert not [k for k in env if k.startswith("CUDA_MPS_")]


def test_an_mps_share_server_gets_the_client_limits_and_an_admins_startup_file_stays(
    tmp_path: Path,
) -> None:
    c = config(tmp_path, mps=["L40S-48GB"], mps_pipe_directory="/run/nvidia-mps")
    objects = hub(c)
    a = share(objects)
    s = spawner(c, objects, a, environment={"PYTHONSTARTUP": "/etc/site-startup.py"})
    env = s.get_env()
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=12288M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == "/run/nvidia-mps"
    assert env["GPUPOOL_SHARE_ENFORCEMENT"] == "mps"
    assert env["PYTHONSTARTUP"] == "/etc/site-startup.py"


def test_a_per_user_server_is_refused_a_share_on_an_mps_gpu(tmp_path: Path) -> None:
    c = config(tmp_path, mps=["*"])
    objects = hub(c)
    a = share(objects)
    s = spawner(c, objects, a, run_as_hub_user=False)
    with pytest.raises(web.HTTPError) as e:
        s.gpupool_check_allocation(a)
    assert e.value.status_code == 403
    assert "one unix user at a time" in str(e.value.log_message)
    shared = spawner(config(tmp_path / "x", mps=["*"]), objects, a)
    shared.gpupool_check_allocation(a)  # the shared mode: one account, MPS is fine


def test_the_spawn_page_note_names_the_enforcement_in_force(tmp_path: Path) -> None:
    c = config(tmp_path)
    objects = hub(c)
    a = share(objects)
    objects.pool.ledger.offers["share-q"] = Offer("share-q", "share", share_milli=250)
    notes = spawner(c, objects, a).gpupool_offer_notes()
    assert notes == {
        "share-q": "Shared; capped in PyTorch and watched; over the cap you are warned, then "
        "stopped after 10 minutes"
    }
    c2 = config(tmp_path / "mps", mps=["*"])
    objects2 = hub(c2)
    objects2.pool.ledger.offers["share-q"] = Offer("share-q", "share", share_milli=250)
    assert spawner(c2, objects2, share(objects2)).gpupool_offer_notes() == {
        "share-q": "MPS: hard memory limit"
    }


@pytest.mark.parametrize("mps", [[], ["*"]])
def test_a_share_jobs_ranks_get_the_same_variables(tmp_path: Path, mps: list[str]) -> None:
    c = config(tmp_path, mps=mps)
    pool = Pool.from_config(GPUPool(config=c))
    objects = build(pool, c, LOG)
    a = share(objects, kind="job")
    backend = JobManager(pool, config=c).backend
    job = SimpleNamespace(
        id="job1", owner="ada", team="everyone",
        spec=SimpleNamespace(env=(), workdir=None),
    )  # fmt: skip
    account = SimpleNamespace(name="ada")
    env = backend._env(job, [a], tmp_path / "j", tmp_path, account)  # type: ignore[attr-defined]
    assert env["CUDA_VISIBLE_DEVICES"] == pool.inventory.gpus[0].uuid
    assert (env["GPUPOOL_SHARE_MILLI"], env["GPUPOOL_SHARE_MIB"]) == ("250", "12288")
    assert ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in env) == bool(mps)
    assert env["GPUPOOL_JOB"] == "job1"
