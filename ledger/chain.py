"""The hash chain over ledger events.

    hash_n = sha256( "veritrain/v1/event" || prev_hash_n || u64be(seq_n) || lp(kind_n) || body_n )

with ``prev_hash`` of the first event equal to 64 zeros. The ledger signs each
``hash_n`` (signing domain ``ledger_event``) so it cannot later deny its own
log; an auditor recomputes the chain and names the first row that differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from veritrain.protocol.signing import compute_signing_root, verify_ed25519

GENESIS_HASH = "0" * 64


def compute_event_hash(prev_hash: str, seq: int, kind: str, body: bytes) -> str:
    kind_raw = kind.encode()
    return hashlib.sha256(
        b"veritrain/v1/event"
        + bytes.fromhex(prev_hash)
        + seq.to_bytes(8, "big")
        + len(kind_raw).to_bytes(2, "big")
        + kind_raw
        + body
    ).hexdigest()


def event_signing_root(run_id: str, seq: int, event_hash: str) -> bytes:
    return compute_signing_root("ledger_event", run_id, seq, bytes.fromhex(event_hash))


@dataclass(frozen=True)
class ChainRow:
    seq: int
    run_id: str
    kind: str
    body: bytes
    prev_hash: str
    hash: str
    ledger_signature: str


@dataclass(frozen=True)
class ChainProblem:
    seq: int
    problem: str


def verify_chain(
    rows: Iterable[ChainRow], ledger_key: bytes, *, start_prev: str = GENESIS_HASH
) -> ChainProblem | None:
    """The first row whose link, hash or ledger signature is wrong, or None."""
    prev = start_prev
    expected_seq: int | None = None
    for row in rows:
        if expected_seq is not None and row.seq != expected_seq:
            return ChainProblem(row.seq, f"sequence gap: expected {expected_seq}")
        if row.prev_hash != prev:
            return ChainProblem(row.seq, "prev_hash does not match the row before")
        if compute_event_hash(row.prev_hash, row.seq, row.kind, row.body) != row.hash:
            return ChainProblem(row.seq, "hash does not match the row's content")
        if not verify_ed25519(
            ledger_key,
            event_signing_root(row.run_id, row.seq, row.hash),
            bytes.fromhex(row.ledger_signature) if len(row.ledger_signature) == 128 else b"",
        ):
            return ChainProblem(row.seq, "ledger signature does not verify")
        prev = row.hash
        expected_seq = row.seq + 1
    return None
