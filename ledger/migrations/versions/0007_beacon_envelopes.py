"""Beacon shares keep their signed envelope (it names the sealed list the validator saw).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("beacon_shares") as batch:
        batch.add_column(sa.Column("envelope", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("beacon_shares") as batch:
        batch.drop_column("envelope")
