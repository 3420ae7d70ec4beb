"""Schema migrations (Alembic): the server upgrades any ledger database at start."""

from __future__ import annotations

import sqlite3

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from fakes import make_fake_run
from ledger_backends import make_fixture
from ledger_scenarios import HONEST, make_store, play_run
from sqlalchemy import create_engine, inspect, text
from veritrain.ledger import migrate
from veritrain.ledger import schema as t
from veritrain.ledger.chain import (
    ChainRow,
    checkpoint_signing_root,
    compute_event_hash,
    is_valid_checkpoint,
    verify_chain,
)
from veritrain.ledger.store import LedgerStore
from veritrain.protocol.identity import Identity

ledger_url = make_fixture()


def test_store_upgrades_an_empty_database_to_the_models(ledger_url):
    store = make_store(ledger_url)
    try:
        assert migrate.current_revision(store.engine) == migrate.head_revision()
        with store.engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), t.Base.metadata) == []
    finally:
        store.engine.dispose()


def test_downgrade_to_base_and_back(ledger_url):
    engine = create_engine(ledger_url)
    try:
        migrate.upgrade(engine)
        migrate.downgrade(engine, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        migrate.upgrade(engine)
        assert "checkpoints" in inspect(engine).get_table_names()
    finally:
        engine.dispose()


def _legacy_rows(engine, run_id: str, key: Identity, n: int) -> list[tuple[int, str]]:
    """Rows as the first release wrote them: every row signed by the ledger."""
    prev, out = "0" * 64, []
    with engine.begin() as conn:
        for seq in range(n):
            body = b'{"kind":"note","n":%d,"run_id":"%s"}' % (seq, run_id.encode())
            h = compute_event_hash(prev, seq, "note", body)
            sig = key.sign_ed25519(checkpoint_signing_root(run_id, seq, h)).hex()
            conn.execute(text("INSERT INTO events (run_id, seq, kind, body, prev_hash, hash, "
                              "ledger_signature) VALUES (:r, :s, 'note', :b, :p, :h, :g)"),
                         {"r": run_id, "s": seq, "b": body, "p": prev, "h": h, "g": sig})
            out.append((seq, h))
            prev = h
    return out


def test_first_release_database_keeps_its_attested_history(tmp_path):
    """0001 signed every row; 0002 keeps each run's last signature as its checkpoint."""
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    engine = create_engine(url)
    migrate.upgrade(engine, "0001")
    key = Identity.generate("ledger")
    rows = _legacy_rows(engine, "old-run", key, 5)
    # Built by create_all in the first release: no alembic_version table at all.
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE alembic_version"))
    engine.dispose()
    store = LedgerStore(url, key)
    try:
        assert migrate.current_revision(store.engine) == migrate.head_revision()
        with store.sessions() as s:
            cps = s.query(t.Checkpoint).all()
            events = s.query(t.Event).order_by(t.Event.seq).all()
        assert [(c.seq, c.hash) for c in cps] == [rows[-1]]
        chain = [ChainRow(e.seq, e.run_id, e.kind, e.body, e.prev_hash, e.hash) for e in events]
        assert verify_chain(chain) is None
        assert is_valid_checkpoint(key.public_key, "old-run", cps[0].seq, cps[0].hash,
                                   cps[0].signature)
        assert not is_valid_checkpoint(Identity.generate("ledger").public_key, "old-run",
                                       cps[0].seq, cps[0].hash, cps[0].signature)
    finally:
        store.engine.dispose()


def test_a_migrated_store_keeps_working(tmp_path):
    url = f"sqlite:///{tmp_path / 'ledger.sqlite'}"
    store = make_store(url)
    play_run(store, make_fake_run("mig-run", schedule={
        "round_seconds": 3600.0, "min_submissions": 1, "max_rounds": 9}), [HONEST], 1)
    store.engine.dispose()
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:
        version = conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]
    assert version == migrate.head_revision()
    again = LedgerStore(url, store.identity)  # a restart upgrades nothing and loses nothing
    with again.sessions() as s:
        assert s.query(t.Verdict).count() == 1
    again.engine.dispose()


def test_digests_are_unique_through_the_keys_they_commit_to(ledger_url):
    """0004 dropped the unique indexes of events.hash and submissions.digest (random
    B-trees every insert updated); the keys those digests commit to stay unique."""
    store = make_store(ledger_url)
    try:
        insp = inspect(store.engine)
        uniques = {table: [u["column_names"] for u in insp.get_unique_constraints(table)]
                   for table in ("events", "submissions")}
        assert ["hash"] not in uniques["events"] and ["run_id", "seq"] in uniques["events"]
        assert ["digest"] not in uniques["submissions"]
        assert ["run_id", "round", "worker"] in uniques["submissions"]
    finally:
        store.engine.dispose()
