"""Jobs' scripts in a table of their own, and an index for retention.

- ``gpupool_job_scripts``: a job's script (up to 1 MiB), moved out of the job row's ``spec``, so
  the rows the hub loads, rewrites at every state change and keeps in memory stay small; the
  script is read when the job starts.
- ``ix_gpupool_jobs_finished``: the ended jobs retention looks for.

Revision ID: 0005
Revises: 0004
"""

import json

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

_jobs = sa.table("gpupool_jobs", sa.column("id", sa.String), sa.column("spec", sa.Text))
_scripts = sa.table(
    "gpupool_job_scripts", sa.column("job_id", sa.String), sa.column("script", sa.Text)
)


def upgrade() -> None:
    op.create_table(
        "gpupool_job_scripts",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("script", sa.Text, nullable=False),
    )
    op.create_index("ix_gpupool_jobs_finished", "gpupool_jobs", ["finished"])
    conn = op.get_bind()
    for row in conn.execute(sa.select(_jobs.c.id, _jobs.c.spec)).all():
        spec = json.loads(row.spec)
        script = spec.pop("script", "")
        conn.execute(sa.insert(_scripts).values(job_id=row.id, script=script))
        conn.execute(sa.update(_jobs).where(_jobs.c.id == row.id).values(spec=json.dumps(spec)))


def downgrade() -> None:
    conn = op.get_bind()
    scripts = dict(conn.execute(sa.select(_scripts.c.job_id, _scripts.c.script)).all())
    for row in conn.execute(sa.select(_jobs.c.id, _jobs.c.spec)).all():
        spec = {**json.loads(row.spec), "script": scripts.get(row.id, "")}
        conn.execute(sa.update(_jobs).where(_jobs.c.id == row.id).values(spec=json.dumps(spec)))
    op.drop_index("ix_gpupool_jobs_finished", "gpupool_jobs")
    op.drop_table("gpupool_job_scripts")
