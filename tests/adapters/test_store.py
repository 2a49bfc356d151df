"""Persistence: migrations on an empty database, exact restore, write-before-answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from traitlets.config import Config

from gpupool.config import GPUPool
from gpupool.core import PoolError
from gpupool.pool import Pool
from gpupool.store import Store
from gpupool.store.schema import metadata

SPEC = "simulated:node1: 4x H100-80GB, mig=2; node2: 2x A100-40GB, mig=1:3g.20gb+2g.10gb"


def pool_config(db: Path, spec: str = SPEC) -> GPUPool:
    c = Config()
    c.GPUPool.inventory = spec
    c.GPUPool.db_url = f"sqlite:///{db}"
    c.GPUPool.offers = {
        "cpu": {},
        "h100": {"model": "H100-80GB", "max_count": 2},
        "mig-3g.40gb": {},
        "mig-2g.10gb": {"model": "A100-40GB"},
    }
    c.GPUPool.teams = {"vision": {"guarantee": 3}, "nlp": {"guarantee": 2}}
    return GPUPool(config=c)


def test_migrations_create_the_schema_on_an_empty_sqlite(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'empty.sqlite'}")
    with store.engine.connect() as conn:
        names = set(sa.inspect(conn).get_table_names())
        assert {"gpupool_allocations", "gpupool_allocation_devices", "gpupool_jobs"} <= names
        version = conn.execute(sa.text("select version_num from gpupool_alembic_version"))
        assert version.scalar_one() == "0005"
        context = MigrationContext.configure(
            conn, opts={"version_table": "gpupool_alembic_version"}
        )
        diff = compare_metadata(context, metadata)
    assert diff == [], f"migrations and schema.py disagree: {diff}"
    Store(str(store.engine.url)).close()  # running the upgrade again is a no-op
    store.close()


def test_restart_restores_the_ledger_exactly(tmp_path: Path) -> None:
    db = tmp_path / "pool.sqlite"
    pool = Pool.from_config(pool_config(db))
    assert pool.inventory.simulated
    held = [
        pool.allocate("ana", ["vision"], "h100", 2, ref="ana/"),
        pool.allocate("bob", ["nlp"], "mig-3g.40gb", kind="job", ref="job-1"),
        pool.allocate("cy", ["nlp", "vision"], "mig-2g.10gb", team="nlp"),
        pool.allocate("dee", [], "cpu"),
    ]
    pool.release(held[2].id)
    before = dict(pool.ledger.allocations)
    pool.store.close()
    del pool

    again = Pool.from_config(pool_config(db))
    assert again.ledger.allocations == before
    again.ledger.check_invariants()
    fixed = before[held[1].id].devices[0]
    assert fixed.profile == "3g.40gb"
    assert dict(again.ledger.team_used) == {"vision": 2000, "nlp": 500, "everyone": 0}


def test_allocations_whose_gpus_vanished_are_lost_and_forgotten(tmp_path: Path) -> None:
    db = tmp_path / "pool.sqlite"
    pool = Pool.from_config(pool_config(db))
    a100 = pool.allocate("cy", ["nlp"], "mig-2g.10gb")
    h100 = pool.allocate("ana", ["vision"], "h100", 2)
    pool.store.close()
    smaller = "simulated:node1: 4x H100-80GB, mig=2"  # node2 is gone
    again = Pool.from_config(pool_config(db, smaller))
    assert set(again.ledger.allocations) == {h100.id}
    assert a100.id not in {a.id for a in again.store.load()}


def test_a_failed_write_leaves_the_ledger_unchanged(tmp_path: Path) -> None:
    pool = Pool.from_config(pool_config(tmp_path / "pool.sqlite"))
    pool.new_id = lambda: "same-id"
    pool.allocate("ana", ["vision"], "h100", 1)
    pool.ledger.release("same-id")  # the ledger forgets it, the database does not
    before = (dict(pool.ledger.allocations), list(pool.ledger.occ.mask))
    with pytest.raises(sa.exc.IntegrityError):
        pool.allocate("ana", ["vision"], "h100", 1)
    assert (dict(pool.ledger.allocations), list(pool.ledger.occ.mask)) == before
    pool.ledger.check_invariants()


def test_refusals_are_not_persisted(tmp_path: Path) -> None:
    pool = Pool.from_config(pool_config(tmp_path / "pool.sqlite"))
    with pytest.raises(PoolError, match="several teams; choose one of: nlp, vision"):
        pool.allocate("cy", ["nlp", "vision"], "mig-3g.40gb")
    with pytest.raises(PoolError, match="not in team 'vision'"):
        pool.allocate("cy", ["nlp"], "mig-3g.40gb", team="vision")
    assert pool.store.load() == []


def test_jobs_round_trip(tmp_path: Path) -> None:
    from dataclasses import replace

    from gpupool.core.jobs import Job, JobSpec, transition

    store = Store(f"sqlite:///{tmp_path / 'jobs.sqlite'}")
    spec = JobSpec(
        "print(1)",
        "h100",
        2,
        1,
        "vision",
        "train",
        "train.ipynb",
        "/home/ada",
        ("--epochs", "3"),
        (("SEED", "1"),),
        600,
        2,
        5,
    )
    job = Job("j1", "ada", "vision", spec, created=10.0)
    store.save_job(job)
    without_script = replace(job, spec=replace(spec, script=""))
    running = transition(
        without_script, "starting", "GPUs granted", 11.0, allocations=("a1",), handle='{"pid": 42}'
    )
    store.save_job(running)
    assert store.load_jobs() == [running]  # the script is read apart, when the job starts
    assert store.job_script("j1") == "print(1)"
    done = transition(running, "failed", "rank 1 exited 1", 20.0, exit_codes=((0, 0), (1, 1)))
    store.save_job(done)
    assert store.load_jobs() == [done] and store.job_script("j1") == "print(1)"
    store.delete_jobs(["j1"])
    assert store.load_jobs() == [] and store.job_script("j1") is None
    store.close()


def test_a_share_device_round_trips(tmp_path: Path) -> None:
    from gpupool.core.ledger import Allocation, Device

    store = Store(f"sqlite:///{tmp_path / 'shares.sqlite'}")
    share = Allocation(
        "s1", "ana", "vision", "share-6gb", "notebook", "ana/", 1, 250, "node1",
        (Device("GPU-rtx-0", share_milli=250),), created=5.0,
    )  # fmt: skip
    whole = Allocation(
        "w1", "bob", "vision", "h100", "job", "job-1", 1, 1000, "node1",
        (Device("GPU-h100-0"),), created=6.0,
    )  # fmt: skip
    store.insert(share)
    store.insert(whole)
    assert store.load() == [share, whole]
    store.close()
    again = Store(f"sqlite:///{tmp_path / 'shares.sqlite'}")
    [loaded, plain] = again.load()
    assert loaded.devices[0].share_milli == 250 and plain.devices[0].share_milli is None
    again.close()
