"""Property: any single-byte change to any stored row is found, and that row is named."""

from __future__ import annotations

import dataclasses
import hashlib
from functools import cache

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ledger_scenarios import make_store, quick_run, register
from veritrain.ledger.audit import verify_events
from veritrain.ledger.chain import GENESIS_HASH, ChainRow, compute_event_hash, verify_chain
from veritrain.ledger.export import events_with_checkpoints
from veritrain.protocol.identity import Identity

FIELDS = ("seq", "kind", "body", "prev_hash", "hash", "checkpoint")


@cache
def open_round_log() -> tuple[bytes, tuple[ChainRow, ...]]:
    """A run with registrations and submissions in its open round: no certificate yet,
    so every signature is checked directly (the fast path has nothing to lean on)."""
    import tempfile
    from pathlib import Path

    from fakes import make_submission

    tmp = Path(tempfile.mkdtemp(prefix="chain-prop-"))
    store = make_store(f"sqlite:///{tmp / 'ledger.sqlite'}")
    run = quick_run("prop-run")
    for data, kind in ((run.dataset, "dataset"), (run.genesis, "model")):
        store.record_blob(hashlib.sha256(data).hexdigest(), len(data), kind, "prop-run")
    store.create_run(run.signed)
    workers = [Identity.generate("worker") for _ in range(3)]
    for w in workers:
        register(store, run, w)
    for w in workers[:2]:
        payload = b"update of " + w.public_key
        signed = make_submission(run, w, payload)
        store.record_blob(hashlib.sha256(payload).hexdigest(), len(payload), "payload",
                          "prop-run", 0)
        store.accept_submission(signed, hashlib.sha256(payload).hexdigest(), len(payload))
    store.checkpointer.sign_pending(store.sessions)
    with store.sessions() as s:
        events = events_with_checkpoints(s, "prop-run", -1, 1000)
    store.engine.dispose()
    rows = tuple(ChainRow(e["seq"], "prop-run", e["kind"], e["body"].encode(), e["prev_hash"],
                          e["hash"], e["checkpoint"]) for e in events)
    return store.identity.public_key, rows


def _flip(value: object, pos: int, byte: int) -> object:
    if isinstance(value, int):
        raw = bytearray(value.to_bytes(8, "big"))
        raw[pos % 8] = byte if raw[pos % 8] != byte else (byte + 1) % 256
        return int.from_bytes(raw, "big")
    raw = bytearray(value if isinstance(value, bytes) else str(value).encode("latin-1"))
    i = pos % len(raw)
    raw[i] = byte if raw[i] != byte else (byte + 1) % 256
    return bytes(raw) if isinstance(value, bytes) else raw.decode("latin-1")


def test_the_untouched_log_verifies():
    key, rows = open_round_log()
    result = verify_events(rows, key)
    assert result.ok, result.problem
    assert result.checkpoints >= 2 and result.unsigned_tail == 0
    assert result.signatures == 1 + 3 + 2  # spec, registrations, uncovered submissions


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_single_byte_change_is_found_at_its_row(data):
    key, rows = open_round_log()
    i = data.draw(st.integers(0, len(rows) - 1), label="row")
    fields = [f for f in FIELDS if getattr(rows[i], f) is not None]
    name = data.draw(st.sampled_from(fields), label="field")
    pos = data.draw(st.integers(0, 10_000), label="position")
    byte = data.draw(st.integers(0, 255), label="byte")
    changed = list(rows)
    changed[i] = dataclasses.replace(rows[i], **{name: _flip(getattr(rows[i], name), pos, byte)})
    result = verify_events(changed, key, processes=1)
    assert not result.ok
    assert result.first_bad_seq == i, (name, result.problem)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "bb", "receipt"]), st.binary(max_size=64)),
                min_size=1, max_size=12), st.data())
def test_verify_chain_names_the_first_inconsistent_row(entries, data):
    prev, rows = GENESIS_HASH, []
    for seq, (kind, body) in enumerate(entries):
        h = compute_event_hash(prev, seq, kind, body)
        rows.append(ChainRow(seq, "r", kind, body, prev, h))
        prev = h
    assert verify_chain(rows) is None
    i = data.draw(st.integers(0, len(rows) - 1))
    bad = list(rows)
    bad[i] = dataclasses.replace(rows[i], body=rows[i].body + b"!")
    problem = verify_chain(bad)
    assert problem is not None and problem.seq == i
    if i < len(rows) - 1:  # a deleted row shows as a gap at the row after it
        gap = verify_chain(rows[:i] + rows[i + 1:])
        assert gap is not None and gap.seq == rows[i + 1].seq


def test_invalid_gap_and_reordering_are_named():
    _, rows = open_round_log()
    gap = verify_chain(rows[:2] + rows[3:])
    assert gap is not None and gap.seq == rows[3].seq and "gap" in gap.problem
    swapped = verify_chain([rows[1], rows[0], *rows[2:]])
    assert swapped is not None and swapped.seq == rows[1].seq
