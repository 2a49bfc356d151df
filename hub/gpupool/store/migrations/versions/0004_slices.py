"""GPU slicing on demand: the share of a GPU a device holds, and the MIG instances gpupool made.

- ``gpupool_allocation_devices.share_milli``: for a share of a GPU without MIG, the thousandths
  of the GPU's memory it holds (NULL for whole GPUs and MIG instances).
- ``gpupool_mig_instances``: every MIG GPU instance (and its compute instance) gpupool created on
  a managed GPU, so a restart re-adopts the live ones and destroys only its own orphans. An
  instance an admin created is never recorded here, so never destroyed.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("gpupool_allocation_devices", sa.Column("share_milli", sa.Integer, nullable=True))
    op.create_table(
        "gpupool_mig_instances",
        sa.Column("node", sa.String(255), primary_key=True),
        sa.Column("gpu", sa.String(128), primary_key=True),
        sa.Column("start", sa.Integer, primary_key=True),
        sa.Column("profile", sa.String(64), nullable=False),
        sa.Column("gpu_instance_id", sa.Integer, nullable=True),
        sa.Column("compute_instance_id", sa.Integer, nullable=True),
        sa.Column("uuid", sa.String(128), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("allocation_id", sa.String(64), nullable=True),
        sa.Column("created", sa.Float, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("gpupool_mig_instances")
    with op.batch_alter_table("gpupool_allocation_devices") as batch:
        batch.drop_column("share_milli")
