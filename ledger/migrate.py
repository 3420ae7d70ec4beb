"""Schema migrations (Alembic) for the ledger database.

The migration scripts live in ``ledger/migrations`` and install with the
package. :func:`upgrade` brings any ledger database to the newest revision;
the server calls it at start instead of ``create_all``. A database made by an
older build with ``create_all`` (tables present, no ``alembic_version``) has
the first release's schema and is stamped ``0001`` before upgrading.

From a shell: ``python -m veritrain.ledger.migrate DATABASE_URL [REVISION]``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import Connection, Engine

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
FIRST_REVISION = "0001"


def alembic_config(connection: Connection | None = None) -> Config:
    """An Alembic config for the packaged scripts, bound to ``connection`` if given."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database behind ``engine`` to ``revision`` (default: the newest)."""
    with engine.begin() as conn:
        tables = set(inspect(conn).get_table_names())
        cfg = alembic_config(conn)
        if "events" in tables and "alembic_version" not in tables:
            command.stamp(cfg, FIRST_REVISION)
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    with engine.begin() as conn:
        command.downgrade(alembic_config(conn), revision)


def main(argv: list[str] | None = None) -> int:
    from sqlalchemy import create_engine

    args = sys.argv[1:] if argv is None else argv
    if not args:
        print("usage: python -m veritrain.ledger.migrate DATABASE_URL [REVISION]")
        return 2
    engine = create_engine(args[0])
    upgrade(engine, args[1] if len(args) > 1 else "head")
    print(f"{args[0]}: at revision {current_revision(engine)}")
    engine.dispose()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
