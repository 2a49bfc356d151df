"""Room for the longest names JupyterHub and Kubernetes allow.

- ``gpupool_allocations.ref``: a notebook's ``<user>/<server>``, up to 255 + 1 + 255 characters.
- ``gpupool_allocation_devices.gpu`` and ``.instance``: a Kubernetes device's id
  (``k8s-<node>-gpu<i>``, its MIG instance's ``-mig<profile>-<start>`` more; a node's name takes
  up to 253), up to 300.

PostgreSQL (and any database that enforces a VARCHAR's length) gets the wider columns. SQLite
never enforces a length, so there the declared types stay as they were: changing them would mean
recreating the tables, and dropping ``gpupool_allocations`` with foreign keys on would delete
every device row with it.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

WIDER = [
    ("gpupool_allocations", "ref", 255, 511, False),
    ("gpupool_allocation_devices", "gpu", 128, 300, False),
    ("gpupool_allocation_devices", "instance", 128, 300, True),
]


def _resize(to_new: bool) -> None:
    if op.get_bind().dialect.name == "sqlite":
        return
    for table, column, old, new, nullable in WIDER:
        op.alter_column(
            table,
            column,
            type_=sa.String(new if to_new else old),
            existing_type=sa.String(old if to_new else new),
            existing_nullable=nullable,
        )


def upgrade() -> None:
    _resize(to_new=True)


def downgrade() -> None:
    _resize(to_new=False)
