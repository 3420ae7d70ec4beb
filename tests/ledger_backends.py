"""The ledger tests' database backends: a SQLite file always, PostgreSQL when
``VERITRAIN_TEST_PG_URL`` names a server (``./dev test`` starts one where it can).

Each PostgreSQL test gets a schema of its own (dropped afterwards) through the
connection's ``search_path``, so tests never see each other's rows.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

PG_ENV = "VERITRAIN_TEST_PG_URL"
BACKENDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]


def pg_base_url() -> str | None:
    return os.environ.get(PG_ENV) or None


def _pg_admin(url: str) -> Any:
    import psycopg
    from sqlalchemy.engine import make_url

    u = make_url(url)
    return psycopg.connect(host=u.host, port=u.port, user=u.username, password=u.password,
                           dbname=u.database, autocommit=True, connect_timeout=10)


def backend_url(kind: str, tmp_path: Path) -> Iterator[str]:
    """A fresh, empty database of ``kind``; skips PostgreSQL when no server is configured."""
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.sqlite'}"
        return
    base = pg_base_url()
    if base is None:
        pytest.skip(f"{PG_ENV} is not set (./dev test starts a PostgreSQL server)")
    schema = "t_" + uuid.uuid4().hex[:16]
    with _pg_admin(base) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in base else "?"
    try:
        yield f"{base}{sep}options={quote(f'-csearch_path={schema}')}"
    finally:
        with _pg_admin(base) as conn:
            conn.execute("SET lock_timeout = '5s'")
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def make_fixture() -> Callable[..., Iterator[str]]:
    """A ``ledger_url`` fixture parametrized over both backends (assign it in a test module)."""

    @pytest.fixture(params=BACKENDS)
    def ledger_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
        yield from backend_url(request.param, tmp_path)

    return ledger_url
