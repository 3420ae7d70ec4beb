"""The hash chain over ledger events and the ledger's checkpoint signatures.

    hash_n = sha256( "veritrain/v1/event" || prev_hash_n || u64be(seq_n) || lp(kind_n) || body_n )

with ``prev_hash`` of the first event equal to 64 zeros. The ledger does not
sign each row: it signs *checkpoints*, a chain head ``(run_id, seq, hash_seq)``
in signing domain ``ledger_event`` with ``round = seq``. Because ``hash_seq``
commits to every row before it, one checkpoint vouches for the whole prefix
(specs/protocol.md, section 9). An auditor recomputes every hash and names the
first row that differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

from veritrain.protocol.signing import compute_signing_root, verify_ed25519

GENESIS_HASH = "0" * 64
_TAG = b"veritrain/v1/event"


def compute_event_hash(prev_hash: str, seq: int, kind: str, body: bytes) -> str:
    kind_raw = kind.encode()
    return hashlib.sha256(
        _TAG
        + bytes.fromhex(prev_hash)
        + seq.to_bytes(8, "big")
        + len(kind_raw).to_bytes(2, "big")
        + kind_raw
        + body
    ).hexdigest()


def checkpoint_signing_root(run_id: str, seq: int, event_hash: str) -> bytes:
    """What the ledger signs to vouch for rows 0..seq of a run."""
    return compute_signing_root("ledger_event", run_id, seq, bytes.fromhex(event_hash))


#: The first release signed every row with exactly this root; kept for callers.
event_signing_root = checkpoint_signing_root


def is_valid_checkpoint(ledger_key: bytes, run_id: str, seq: int, event_hash: str,
                        signature: str) -> bool:
    """True iff ``signature`` (hex) is the ledger's checkpoint over that chain head."""
    try:
        sig = bytes.fromhex(signature)
        root = checkpoint_signing_root(run_id, seq, event_hash)
    except (ValueError, TypeError):
        return False
    return verify_ed25519(ledger_key, root, sig)


def body_text(body: bytes) -> str:
    """A row's body as the API and export files carry it: one character per byte (Latin-1).

    A canonical body is ASCII, so this is the body itself; the bytes of a damaged row
    travel unchanged, so the audit recomputes the hash over what is stored and names it.
    """
    return body.decode("latin-1")


def body_bytes(text: str) -> bytes:
    """The bytes :func:`body_text` carried; UnicodeEncodeError above U+00FF."""
    return text.encode("latin-1")


@dataclass(frozen=True, slots=True)
class ChainRow:
    """One event row as an auditor sees it; ``checkpoint`` is the ledger's signature
    over this row's hash when the row is a checkpoint, else None."""

    seq: int
    run_id: str
    kind: str
    body: bytes
    prev_hash: str
    hash: str
    checkpoint: str | None = None


@dataclass(frozen=True)
class ChainProblem:
    seq: int
    problem: str


def verify_chain(rows: Iterable[ChainRow], *, start_prev: str = GENESIS_HASH,
                 start_seq: int = 0) -> ChainProblem | None:
    """The first row whose sequence number, link or hash is wrong, or None.

    Signatures are not checked here (see :mod:`veritrain.ledger.verify`).
    """
    prev = start_prev
    expected_seq = start_seq
    for row in rows:
        if row.seq != expected_seq:
            return ChainProblem(row.seq, f"sequence gap: expected {expected_seq}")
        if row.prev_hash != prev:
            return ChainProblem(row.seq, "prev_hash does not match the row before")
        try:
            recomputed = compute_event_hash(row.prev_hash, row.seq, row.kind, row.body)
        except (ValueError, OverflowError):
            recomputed = ""
        if recomputed != row.hash:
            return ChainProblem(row.seq, "hash does not match the row's content")
        prev = row.hash
        expected_seq = row.seq + 1
    return None
