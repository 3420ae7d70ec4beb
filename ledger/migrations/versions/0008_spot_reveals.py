"""Spot checks answered by one signed reveal per worker and round (chunked commitments).

The content-addressed reveal files of earlier releases go: a round's checks are now
answered by a worker-signed ``SpotReveal`` naming one reveal file, receipted by the
ledger. Challenges record whether a reveal is due and its size bound.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_table("reveals")
    with op.batch_alter_table("challenges") as batch:
        batch.drop_column("needed")
        batch.add_column(sa.Column("due", sa.Boolean(), nullable=False,
                                   server_default=sa.true()))
        batch.add_column(sa.Column("max_bytes", sa.BigInteger(), nullable=False,
                                   server_default="0"))
    op.create_table(
        "spot_reveals",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("round", sa.Integer(), primary_key=True),
        sa.Column("worker", sa.String(64), primary_key=True),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("envelope", sa.LargeBinary(), nullable=False),
        sa.Column("reveal_hash", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.Column("receipt", sa.LargeBinary(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("spot_reveals")
    with op.batch_alter_table("challenges") as batch:
        batch.drop_column("max_bytes")
        batch.drop_column("due")
        batch.add_column(sa.Column("needed", sa.Text(), nullable=False, server_default="[]"))
    op.create_table(
        "reveals",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("round", sa.Integer(), primary_key=True),
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
    )
