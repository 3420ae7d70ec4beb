"""Alembic environment for the ledger schema.

The ledger runs migrations itself (:func:`veritrain.ledger.migrate.upgrade`)
on a connection it passes in ``config.attributes["connection"]``; the
``alembic`` command line works too with ``-x url=...`` (see migrate.py).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from veritrain.ledger.schema import Base

config = context.config
target_metadata = Base.metadata


def _run(connection: object) -> None:
    context.configure(
        connection=connection,  # type: ignore[arg-type]
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite alters tables by copying them
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
        "sqlalchemy.url")
    if not url:
        raise SystemExit("pass the database URL: alembic -x url=sqlite:///ledger.sqlite upgrade head")
    engine = create_engine(url)
    with engine.begin() as conn:
        _run(conn)
    engine.dispose()
