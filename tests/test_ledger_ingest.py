"""Bulk ingest gives every submission the outcome, rows and chain the one-by-one path gives."""

from __future__ import annotations

import asyncio
import hashlib
from concurrent.futures import ThreadPoolExecutor

from fakes import make_submission
from ledger_backends import make_fixture
from ledger_scenarios import quick_run, register
from sqlalchemy import select
from veritrain.ledger import schema as t
from veritrain.ledger.ingest import Incoming, SubmissionBatcher, accept_batch, open_submissions
from veritrain.ledger.store import LedgerStore
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity

ledger_url = make_fixture()


def setup(url: str, ledger: Identity, run, workers) -> LedgerStore:
    store = LedgerStore(url, ledger, clock=lambda: 1000.0)
    for data, kind in ((run.dataset, "dataset"), (run.genesis, "model")):
        store.record_blob(hashlib.sha256(data).hexdigest(), len(data), kind, run.spec.run_id)
    store.create_run(run.signed)
    for w in workers:
        register(store, run, w)
    return store


def sequence(run, workers, outsider) -> list[Incoming]:
    """Valid, replayed, unregistered, wrong round, mismatched payload, then the last valid
    one (closes the round: every registered worker is in), then one too late."""
    def item(who, payload=b"p", **kw):
        signed = make_submission(run, who, payload + who.public_key[:4], **kw)
        m = signed.message
        return Incoming(signed, m.payload_hash, m.payload_bytes)

    a, b, c = workers
    bad_size = item(b)
    return [item(a), item(a), item(outsider), item(b, round_index=1),
            Incoming(bad_size.signed, bad_size.payload_hash, bad_size.payload_size + 1),
            item(b), item(c), item(c, payload=b"again")]


def outcome(x) -> str:
    return x.reason if isinstance(x, RejectedInput) else x.encode().hex()


def dump(store: LedgerStore) -> tuple[list, list, list]:
    with store.sessions() as s:
        events = [(e.seq, e.kind, e.body, e.hash) for e in s.execute(
            select(t.Event).order_by(t.Event.seq)).scalars()]
        subs = [(x.worker, x.digest, x.receipt) for x in s.execute(
            select(t.Submission).order_by(t.Submission.worker)).scalars()]
        rounds = [(r.round, r.status, r.closed_at) for r in s.execute(select(t.Round)).scalars()]
    return events, subs, rounds


def test_batch_equals_one_by_one(tmp_path, ledger_url):
    run = quick_run("ingest-run")
    ledger = Identity.generate("ledger")
    workers = [Identity.generate("worker") for _ in range(3)]
    outsider = Identity.generate("worker")
    items = sequence(run, workers, outsider)

    one = setup(f"sqlite:///{tmp_path / 'one.sqlite'}", ledger, run, workers)
    singles = []
    for item in items:
        try:
            singles.append(one.accept_submission(item.signed, item.payload_hash,
                                                 item.payload_size))
        except RejectedInput as exc:
            singles.append(exc)
    many = setup(ledger_url, ledger, run, workers)
    batched = accept_batch(many, items)

    assert [outcome(x) for x in batched] == [outcome(x) for x in singles]
    assert [outcome(x) for x in batched if isinstance(x, RejectedInput)] == [
        "duplicate", "unknown_worker", "wrong_round", "payload_mismatch", "wrong_round"]
    assert dump(many) == dump(one)  # the same rows, the same chain, the same close
    one.engine.dispose()
    many.engine.dispose()


def test_invalid_envelopes_are_refused_when_opened(tmp_path):
    run = quick_run("open-run")
    w = Identity.generate("worker")
    good = make_submission(run, w, b"x").encode()
    forged = good.replace(b'"loss_last":2.0', b'"loss_last":1.0')
    out = open_submissions([good, forged, b"{not json", good], processes=1)
    assert out[0].signer == w.public_key.hex() and out[3].message == out[0].message
    assert out[1].reason == "bad_signature" and out[2].reason == "malformed"
    assert [type(x) for x in open_submissions([good] * 300, processes=2)] == [type(out[0])] * 300


def test_batcher_groups_concurrent_requests(tmp_path):
    run = quick_run("batch-run")
    workers = [Identity.generate("worker") for _ in range(6)]
    store = setup(f"sqlite:///{tmp_path / 'b.sqlite'}", Identity.generate("ledger"), run,
                  workers)
    writer = ThreadPoolExecutor(max_workers=1)
    batcher = SubmissionBatcher(store, writer)
    items = [make_submission(run, w, b"u" + w.public_key[:3]) for w in workers]

    async def main():
        got = await asyncio.gather(*[batcher.accept(Incoming(
            sg, sg.message.payload_hash, sg.message.payload_bytes)) for sg in items],
            return_exceptions=True)
        again = await asyncio.gather(batcher.accept(Incoming(
            items[0], items[0].message.payload_hash, items[0].message.payload_bytes)),
            return_exceptions=True)
        return got, again

    got, again = asyncio.run(main())
    assert [r.message.worker for r in got] == [w.public_key.hex() for w in workers]
    assert isinstance(again[0], RejectedInput) and again[0].reason == "wrong_round"
    with store.sessions() as s:
        cps = s.execute(select(t.Checkpoint.seq)).scalars().all()
    # One commit for the first request alone, one for the five that queued behind it
    # (its round close is a boundary, so the ledger signed the head there).
    assert len(cps) <= 4
    writer.shutdown()
    store.engine.dispose()
