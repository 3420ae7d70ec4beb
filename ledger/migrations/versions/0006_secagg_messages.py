"""Masked buckets: the workers' key adverts, deals, masked inputs, reveals and openings.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "secagg_messages",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("sender", sa.String(64), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.UniqueConstraint("run_id", "round", "kind", "sender"),
    )


def downgrade() -> None:
    op.drop_table("secagg_messages")
