"""The ledger schema as first released (every event row signed by the ledger).

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "runs",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("organiser", sa.String(64), nullable=False),
        sa.Column("spec", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
    )
    op.create_table(
        "participants",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id"), nullable=False),
        sa.Column("pubkey", sa.String(64), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("registered_at", sa.Float(), nullable=False),
        sa.Column("registered_round", sa.Integer(), nullable=False),
        sa.Column("banned_until_round", sa.Integer(), nullable=False),
        sa.Column("registration", sa.LargeBinary(), nullable=True),
        sa.UniqueConstraint("run_id", "pubkey"),
    )
    op.create_table(
        "rounds",
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id"), primary_key=True),
        sa.Column("round", sa.Integer(), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("base_model_hash", sa.String(64), nullable=False),
        sa.Column("outer_state_hash", sa.String(64), nullable=True),
        sa.Column("opened_at", sa.Float(), nullable=False),
        sa.Column("deadline", sa.Float(), nullable=False),
        sa.Column("extensions", sa.Integer(), nullable=False),
        sa.Column("closed_at", sa.Float(), nullable=True),
        sa.Column("finalized_at", sa.Float(), nullable=True),
        sa.Column("certificate", sa.LargeBinary(), nullable=True),
        sa.Column("beacon", sa.LargeBinary(), nullable=True),
        sa.Column("eval_loss", sa.Float(), nullable=True),
    )
    op.create_table(
        "submissions",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id"), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(64), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False, unique=True),
        sa.Column("envelope", sa.LargeBinary(), nullable=False),
        sa.Column("payload_hash", sa.String(64), nullable=False),
        sa.Column("payload_bytes", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.Column("receipt", sa.LargeBinary(), nullable=False),
        sa.UniqueConstraint("run_id", "round", "worker"),
    )
    op.create_table(
        "beacon_shares",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id"), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("validator_index", sa.Integer(), nullable=False),
        sa.Column("share", sa.String(192), nullable=False),
        sa.UniqueConstraint("run_id", "round", "validator_index"),
    )
    op.create_table(
        "round_results",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id"), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("validator", sa.String(64), nullable=False),
        sa.Column("certified_digest", sa.String(64), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.UniqueConstraint("run_id", "round", "validator"),
    )
    op.create_table(
        "verdicts",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), sa.ForeignKey("runs.run_id"), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(64), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("spot_checked", sa.Boolean(), nullable=False),
        sa.Column("distance", sa.Float(), nullable=True),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("quality", sa.Float(), nullable=False),
        sa.Column("score", sa.Float(), nullable=False),
        sa.Column("reward", sa.Float(), nullable=False),
        sa.UniqueConstraint("run_id", "round", "worker"),
    )
    op.create_index("ix_verdicts_worker", "verdicts", ["run_id", "worker", "round"])
    op.create_table(
        "rejections",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("round", sa.Integer(), nullable=True),
        sa.Column("signer", sa.String(64), nullable=True),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
    )
    op.create_index("ix_rejections_run_round", "rejections", ["run_id", "round"])
    op.create_table(
        "blobs",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=True),
        sa.Column("sealed_round", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("prev_hash", sa.String(64), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False, unique=True),
        sa.Column("ledger_signature", sa.String(128), nullable=False),
        sa.UniqueConstraint("run_id", "seq"),
    )


def downgrade() -> None:
    for table in ("events", "blobs", "rejections", "verdicts", "round_results",
                  "beacon_shares", "submissions", "rounds", "participants", "runs"):
        op.drop_table(table)
