"""Checkpoint signatures instead of one ledger signature per event row.

The ledger now signs chain heads (``checkpoints``) rather than every row; an
old per-row signature is exactly a checkpoint signature over that row
(domain ``ledger_event``, round = seq, body = the row's hash), so each run's
last signed row becomes its checkpoint and the history stays attested.
Adds the indexes that the audit API's per-worker and per-signer lists use.

Revision ID: 0002
Revises: 0001
Create Date: 2025-01-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("run_id", sa.String(64), primary_key=True),
        sa.Column("seq", sa.Integer(), primary_key=True),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("signature", sa.String(128), nullable=False),
        sa.Column("signed_at", sa.Float(), nullable=False),
    )
    op.execute(
        "INSERT INTO checkpoints (run_id, seq, hash, signature, signed_at) "
        "SELECT e.run_id, e.seq, e.hash, e.ledger_signature, 0.0 FROM events e "
        "WHERE e.seq = (SELECT MAX(e2.seq) FROM events e2 WHERE e2.run_id = e.run_id)"
    )
    with op.batch_alter_table("events") as batch:
        batch.drop_column("ledger_signature")
    op.create_index("ix_submissions_worker", "submissions", ["run_id", "worker", "round"])
    op.create_index("ix_rejections_signer", "rejections", ["run_id", "signer"])


def downgrade() -> None:
    op.drop_index("ix_rejections_signer", "rejections")
    op.drop_index("ix_submissions_worker", "submissions")
    with op.batch_alter_table("events") as batch:
        batch.add_column(sa.Column("ledger_signature", sa.String(128), nullable=False,
                                   server_default=""))
    op.execute(
        "UPDATE events SET ledger_signature = (SELECT c.signature FROM checkpoints c "
        "WHERE c.run_id = events.run_id AND c.seq = events.seq) "
        "WHERE EXISTS (SELECT 1 FROM checkpoints c WHERE c.run_id = events.run_id "
        "AND c.seq = events.seq)"
    )
    op.drop_table("checkpoints")
