"""Blob retention: the files the policy deleted are recorded, never silently gone.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pruned_blobs",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(64), nullable=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("pruned_at", sa.Float(), nullable=False),
        sa.Column("policy", sa.String(64), nullable=False),
    )
    op.create_index("ix_pruned_blobs_sha256", "pruned_blobs", ["sha256"])
    op.create_index("ix_pruned_blobs_round", "pruned_blobs", ["run_id", "round"])


def downgrade() -> None:
    op.drop_index("ix_pruned_blobs_round", table_name="pruned_blobs")
    op.drop_index("ix_pruned_blobs_sha256", table_name="pruned_blobs")
    op.drop_table("pruned_blobs")
