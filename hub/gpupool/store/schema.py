"""The allocation tables (SQLAlchemy Core). Alembic migrations create them; this module is the
model that ``tests/adapters/test_store.py`` compares the migrated database against.
"""

from __future__ import annotations

from sqlalchemy import Column, Float, ForeignKey, Integer, MetaData, String, Table, Text

metadata = MetaData()

allocations = Table(
    "gpupool_allocations",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("user", String(255), nullable=False, index=True),
    Column("team", String(255), nullable=False, index=True),
    Column("offer", String(255), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("ref", String(511), nullable=False, server_default=""),
    Column("count", Integer, nullable=False),
    Column("cost_milli", Integer, nullable=False),
    Column("node", String(255), nullable=True),
    Column("created", Float, nullable=False),
)

devices = Table(
    "gpupool_allocation_devices",
    metadata,
    Column(
        "allocation_id",
        String(64),
        ForeignKey("gpupool_allocations.id", ondelete="CASCADE"),
        primary_key=True,
    ),
    Column("position", Integer, primary_key=True),
    Column("gpu", String(300), nullable=False),
    Column("profile", String(64), nullable=True),
    Column("start", Integer, nullable=True),
    Column("instance", String(300), nullable=True),
    Column("share_milli", Integer, nullable=True),
)

mig_instances = Table(
    "gpupool_mig_instances",
    metadata,
    Column("node", String(255), primary_key=True),
    Column("gpu", String(128), primary_key=True),
    Column("start", Integer, primary_key=True),
    Column("profile", String(64), nullable=False),
    Column("gpu_instance_id", Integer, nullable=True),
    Column("compute_instance_id", Integer, nullable=True),
    Column("uuid", String(128), nullable=True),
    Column("state", String(16), nullable=False),
    Column("allocation_id", String(64), nullable=True),
    Column("created", Float, nullable=False),
)

jobs = Table(
    "gpupool_jobs",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(255), nullable=False, index=True),
    Column("team", String(255), nullable=False),
    Column("state", String(16), nullable=False, index=True),
    Column("reason", Text, nullable=False, server_default=""),
    Column("spec", Text, nullable=False),
    Column("created", Float, nullable=False),
    Column("started", Float, nullable=True),
    Column("finished", Float, nullable=True, index=True),
    Column("exit_codes", Text, nullable=False, server_default="{}"),
    Column("restarts", Integer, nullable=False, server_default="0"),
    Column("allocations", Text, nullable=False, server_default="[]"),
    Column("handle", Text, nullable=False, server_default=""),
    Column("devices", Text, nullable=False, server_default="[]"),
)

job_scripts = Table(
    "gpupool_job_scripts",
    metadata,
    Column("job_id", String(64), primary_key=True),
    Column("script", Text, nullable=False),
)
"""A job's script (up to 1 MiB), apart from its row: read when the job starts, never kept in
the hub's memory, deleted with the job's row when retention forgets the job."""
