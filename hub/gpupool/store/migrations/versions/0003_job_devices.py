"""The devices a job ran on, kept after it ends.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "gpupool_jobs", sa.Column("devices", sa.Text, nullable=False, server_default="[]")
    )


def downgrade() -> None:
    with op.batch_alter_table("gpupool_jobs") as batch:
        batch.drop_column("devices")
