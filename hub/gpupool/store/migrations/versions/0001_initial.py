"""The first schema: allocations and their devices.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "gpupool_allocations",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("user", sa.String(255), nullable=False),
        sa.Column("team", sa.String(255), nullable=False),
        sa.Column("offer", sa.String(255), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("ref", sa.String(255), nullable=False, server_default=""),
        sa.Column("count", sa.Integer, nullable=False),
        sa.Column("cost_milli", sa.Integer, nullable=False),
        sa.Column("node", sa.String(255), nullable=True),
        sa.Column("created", sa.Float, nullable=False),
    )
    op.create_index("ix_gpupool_allocations_user", "gpupool_allocations", ["user"])
    op.create_index("ix_gpupool_allocations_team", "gpupool_allocations", ["team"])
    op.create_table(
        "gpupool_allocation_devices",
        sa.Column(
            "allocation_id",
            sa.String(64),
            sa.ForeignKey("gpupool_allocations.id", ondelete="CASCADE"),
            primary_key=True,
        ),
        sa.Column("position", sa.Integer, primary_key=True),
        sa.Column("gpu", sa.String(128), nullable=False),
        sa.Column("profile", sa.String(64), nullable=True),
        sa.Column("start", sa.Integer, nullable=True),
        sa.Column("instance", sa.String(128), nullable=True),
    )


def downgrade() -> None:
    op.drop_table("gpupool_allocation_devices")
    op.drop_index("ix_gpupool_allocations_team", "gpupool_allocations")
    op.drop_index("ix_gpupool_allocations_user", "gpupool_allocations")
    op.drop_table("gpupool_allocations")
