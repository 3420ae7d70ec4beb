"""Spot checks: challenges and reveals, segment checks on verdicts, penalties, validator faults.

Revision ID: 0003
Revises: 0002
Create Date: 2025-01-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rounds") as batch:
        batch.add_column(sa.Column("reveal_deadline", sa.Float(), nullable=True))
    op.create_table(
        "challenges",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("round", sa.Integer(), primary_key=True),
        sa.Column("worker", sa.String(64), primary_key=True),
        sa.Column("segments", sa.Text(), nullable=False),
        sa.Column("needed", sa.Text(), nullable=False),
    )
    with op.batch_alter_table("verdicts") as batch:
        batch.add_column(sa.Column("checks", sa.Text(), nullable=False, server_default="[]"))
    op.create_table(
        "penalties",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("amount", sa.Float(), nullable=False),
        sa.Column("source_round", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
    )
    op.create_index("ix_penalties_worker", "penalties", ["run_id", "worker", "round"])
    op.create_table(
        "validator_faults",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("round", sa.Integer(), primary_key=True),
        sa.Column("validator", sa.String(64), primary_key=True),
        sa.Column("result_digest", sa.String(64), nullable=False),
        sa.Column("certified_digest", sa.String(64), nullable=False),
    )
    op.create_table(
        "reveals",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("round", sa.Integer(), primary_key=True),
        sa.Column("digest", sa.String(64), primary_key=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("reveals")
    op.drop_table("validator_faults")
    op.drop_index("ix_penalties_worker", "penalties")
    op.drop_table("penalties")
    with op.batch_alter_table("verdicts") as batch:
        batch.drop_column("checks")
    op.drop_table("challenges")
    with op.batch_alter_table("rounds") as batch:
        batch.drop_column("reveal_deadline")
