"""Batch jobs.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gpupool_jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(255), nullable=False),
        sa.Column("team", sa.String(255), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text, nullable=False, server_default=""),
        sa.Column("spec", sa.Text, nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("started", sa.Float, nullable=True),
        sa.Column("finished", sa.Float, nullable=True),
        sa.Column("exit_codes", sa.Text, nullable=False, server_default="{}"),
        sa.Column("restarts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("allocations", sa.Text, nullable=False, server_default="[]"),
        sa.Column("handle", sa.Text, nullable=False, server_default=""),
    )
    op.create_index("ix_gpupool_jobs_owner", "gpupool_jobs", ["owner"])
    op.create_index("ix_gpupool_jobs_state", "gpupool_jobs", ["state"])


def downgrade() -> None:
    op.drop_index("ix_gpupool_jobs_state", "gpupool_jobs")
    op.drop_index("ix_gpupool_jobs_owner", "gpupool_jobs")
    op.drop_table("gpupool_jobs")
