"""Persistence: migrations on an empty database, exact restore, write-before-answer; each on a
SQLite file and on a real PostgreSQL server (``db_url``: :mod:`tests.databases`)."""

from __future__ import annotations

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


def pool_config(url: str, spec: str = SPEC) -> GPUPool:
    c = Config()
    c.GPUPool.inventory = spec
    c.GPUPool.db_url = url
    c.GPUPool.offers = {
        "cpu": {},
        "h100": {"model": "H100-80GB", "max_count": 2},
        "mig-3g.40gb": {},
        "mig-2g.10gb": {"model": "A100-40GB"},
    }
    c.GPUPool.teams = {"vision": {"guarantee": 3}, "nlp": {"guarantee": 2}}
    return GPUPool(config=c)


def test_migrations_create_the_schema_on_an_empty_database(db_url: str) -> None:
    store = Store(db_url)
    with store.engine.connect() as conn:
        names = set(sa.inspect(conn).get_table_names())
        assert {"gpupool_allocations", "gpupool_allocation_devices", "gpupool_jobs"} <= names
        version = conn.execute(sa.text("select version_num from gpupool_alembic_version"))
        assert version.scalar_one() == "0006"
        opts: dict[str, object] = {"version_table": "gpupool_alembic_version"}
        if conn.dialect.name == "sqlite":  # lengths are not enforced, nor widened (0006)
            opts["compare_type"] = lambda _ctx, _icol, _mcol, old, _new: (
                False if isinstance(old, sa.String) else None  # None: Alembic's own comparison
            )
        context = MigrationContext.configure(conn, opts=opts)
        diff = compare_metadata(context, metadata)
    assert diff == [], f"migrations and schema.py disagree: {diff}"
    Store(db_url).close()  # running the upgrade again is a no-op
    store.close()


def test_restart_restores_the_ledger_exactly(db_url: str) -> None:
    pool = Pool.from_config(pool_config(db_url))
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

    again = Pool.from_config(pool_config(db_url))
    assert again.ledger.allocations == before
    again.ledger.check_invariants()
    fixed = before[held[1].id].devices[0]
    assert fixed.profile == "3g.40gb"
    assert dict(again.ledger.team_used) == {"vision": 2000, "nlp": 500, "everyone": 0}


def test_allocations_whose_gpus_vanished_are_lost_and_forgotten(db_url: str) -> None:
    pool = Pool.from_config(pool_config(db_url))
    a100 = pool.allocate("cy", ["nlp"], "mig-2g.10gb")
    h100 = pool.allocate("ana", ["vision"], "h100", 2)
    pool.store.close()
    smaller = "simulated:node1: 4x H100-80GB, mig=2"  # node2 is gone
    again = Pool.from_config(pool_config(db_url, smaller))
    assert set(again.ledger.allocations) == {h100.id}
    assert a100.id not in {a.id for a in again.store.load()}


def test_a_failed_write_leaves_the_ledger_unchanged(db_url: str) -> None:
    pool = Pool.from_config(pool_config(db_url))
    pool.new_id = lambda: "same-id"
    pool.allocate("ana", ["vision"], "h100", 1)
    pool.ledger.release("same-id")  # the ledger forgets it, the database does not
    before = (dict(pool.ledger.allocations), list(pool.ledger.occ.mask))
    with pytest.raises(sa.exc.IntegrityError):
        pool.allocate("ana", ["vision"], "h100", 1)
    assert (dict(pool.ledger.allocations), list(pool.ledger.occ.mask)) == before
    pool.ledger.check_invariants()


def test_refusals_are_not_persisted(db_url: str) -> None:
    pool = Pool.from_config(pool_config(db_url))
    with pytest.raises(PoolError, match="several teams; choose one of: nlp, vision"):
        pool.allocate("cy", ["nlp", "vision"], "mig-3g.40gb")
    with pytest.raises(PoolError, match="not in team 'vision'"):
        pool.allocate("cy", ["nlp"], "mig-3g.40gb", team="vision")
    assert pool.store.load() == []


def test_jobs_round_trip(db_url: str) -> None:
    from dataclasses import replace

    from gpupool.core.jobs import Job, JobSpec, transition

    store = Store(db_url)
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


def test_a_share_device_round_trips(db_url: str) -> None:
    from gpupool.core.ledger import Allocation, Device

    store = Store(db_url)
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
    again = Store(db_url)
    [loaded, plain] = again.load()
    assert loaded.devices[0].share_milli == 250 and plain.devices[0].share_milli is None
    again.close()


def test_names_as_long_as_jupyterhub_and_kubernetes_allow_round_trip(db_url: str) -> None:
    """A notebook's ref is ``<user>/<server>``: JupyterHub keeps each name in up to 255
    characters. A GPU found on Kubernetes is ``k8s-<node>-gpu<i>`` (its MIG instances add
    ``-mig<start>``), and a node's name takes up to 253. SQLite ignores a column's length;
    PostgreSQL refused these before migration 0006 (value too long for type character
    varying)."""
    from gpupool.core.ledger import Allocation, Device

    user, server, node = "u" * 255, "s" * 255, "n" * 253
    gpu = f"k8s-{node}-gpu7"
    held = Allocation(
        "a1", user, "vision", "mig-3g.40gb", "notebook", f"{user}/{server}", 1, 500, node,
        (Device(gpu, "3g.40gb", 4, f"{gpu}-mig4"),), created=5.0,
    )  # fmt: skip
    store = Store(db_url)
    try:
        store.insert(held)
        assert store.load() == [held]
    finally:
        store.close()
