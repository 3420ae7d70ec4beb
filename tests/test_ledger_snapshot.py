"""A ledger read sees one committed state (ledger/store.py ``begin_snapshot``): a view
built from several queries never mixes a write that lands between them with the state
before it. Without this a validator once read a DKG board whose group was fixed but
whose result posts that fixed it were missing, and declared the DKG failed."""

from __future__ import annotations

import hashlib

from ledger_backends import make_fixture
from ledger_scenarios import make_store, quick_run
from sqlalchemy import select
from veritrain.ledger import schema as t
from veritrain.ledger.store import LedgerStore

ledger_url = make_fixture()


def _runs(s) -> set[str]:
    return set(s.execute(select(t.Run.run_id)).scalars())


def _create(store: LedgerStore, run_id: str) -> None:
    run = quick_run(run_id)
    for data, kind in ((run.dataset, "dataset"), (run.genesis, "model")):
        store.record_blob(hashlib.sha256(data).hexdigest(), len(data), kind, run_id)
    store.create_run(run.signed)


def test_a_read_sees_one_state_while_a_write_commits(ledger_url):
    store = make_store(ledger_url)
    _create(store, "before")
    with store.snapshot() as s:
        seen = _runs(s)
        assert seen == {"before"}
        _create(store, "during")  # commits on another connection
        assert _runs(s) == seen
        assert s.scalar(select(t.Run.run_id).where(t.Run.run_id == "during")) is None
    with store.snapshot() as s:
        assert _runs(s) == {"before", "during"}
    store.engine.dispose()
