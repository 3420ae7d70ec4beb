"""Drop two unique constraints that other keys already imply: ``events.hash`` and
``submissions.digest``.

Both are SHA-256 digests, so each kept a B-tree in random order that every
insert had to update: at a million rows they were a third of the random index
writes of an ingested submission (bench/ledger.py). Nothing looks rows up by
them, and both stay unique without them: an event's hash commits to its run's
chain (row 0 is the signed run spec, which names the run) and its ``seq``,
which ``(run_id, seq)`` keeps unique; a submission's digest is the hash of its
envelope, which names its ``run_id``, ``round`` and ``worker``, which
``(run_id, round, worker)`` keeps unique.

SQLite drops a constraint by copying the table (batch mode), so on a big
database this migration takes a while, once.

Revision ID: 0004
Revises: 0003
Create Date: 2025-01-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

DROPPED = (("events", "hash"), ("submissions", "digest"))
# Names for the unnamed constraints SQLite reflects (batch mode matches them by these).
NAMING = {"uq": "uq_%(table_name)s_%(column_0_name)s"}


def _name(table: str, column: str) -> str | None:
    """The constraint's name as the database knows it (None: unnamed, SQLite)."""
    for uq in sa.inspect(op.get_bind()).get_unique_constraints(table):
        if uq["column_names"] == [column]:
            return uq["name"]
    raise LookupError(f"no unique constraint on {table}.{column}")


def upgrade() -> None:
    for table, column in DROPPED:
        name = _name(table, column) or f"uq_{table}_{column}"
        with op.batch_alter_table(table, naming_convention=NAMING) as batch:
            batch.drop_constraint(name, type_="unique")


def downgrade() -> None:
    for table, column in DROPPED:
        with op.batch_alter_table(table, naming_convention=NAMING) as batch:
            batch.create_unique_constraint(f"uq_{table}_{column}", [column])
