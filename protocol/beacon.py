"""The round beacon: randomness nobody can know before a round closes or grind.

Each validator BLS-signs the beacon root of (run, round). BLS signatures are
unique (one valid signature per key and message), so a validator cannot try
several values; the shares are published only after the round has closed.

    seed_r = sha256( "veritrain/v1/beacon-seed" || share_i1 || share_i2 || ... )

over the shares of the lowest-indexed validators that make a quorum, in index
order. A withholding validator can refuse to publish (delaying the round until
another quorum forms) but cannot choose the seed: each possible quorum yields
one fixed value, so its influence is at most a choice among those values.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from .signing import compute_signing_root


def beacon_root(run_id: str, round_index: int) -> bytes:
    """What each validator BLS-signs for round ``round_index``'s beacon (empty body)."""
    return compute_signing_root("beacon", run_id, round_index, b"")


def shard_check_root(run_id: str, round_index: int, results: Sequence[str | None]) -> bytes:
    """What each validator BLS-signs to draw a sharded round's check seed.

    The body is ``shard_check_body`` of the shard results' digests in shard
    order, an empty digest where a shard has none (specs/secure-averaging.md A.4).
    """
    body = shard_check_body([bytes.fromhex(d) if d else b"" for d in results])
    return compute_signing_root("shard_check", run_id, round_index, body)


def shard_check_body(result_digests: Sequence[bytes]) -> bytes:
    """SHA-256 over the shard results' digests in shard order, each length-prefixed.

    Fixed by the results and unknown before they are all published; the check
    seed is ``compute_beacon_seed`` of a quorum's BLS signatures over it (unique
    signatures: nobody can grind the sample).
    """
    h = hashlib.sha256(b"veritrain/v1/secure/shard-check-body")
    for dgst in result_digests:
        h.update(len(dgst).to_bytes(4, "big") + dgst)
    return h.digest()


def compute_beacon_seed(shares_in_index_order: Sequence[bytes]) -> bytes:
    """32-byte seed from the quorum's beacon shares, ordered by validator index."""
    if not shares_in_index_order:
        raise ValueError("a beacon needs at least one share")
    h = hashlib.sha256(b"veritrain/v1/beacon-seed")
    for share in shares_in_index_order:
        h.update(share)
    return h.digest()


def beacon_seed_of(fixed: bytes | dict) -> str:
    """Hex seed of a fixed beacon ``{"signers": [...], "shares": [hex, ...]}`` (index order)."""
    beacon = json.loads(fixed) if isinstance(fixed, bytes) else fixed
    return compute_beacon_seed([bytes.fromhex(x) for x in beacon["shares"]]).hex()


def derive_seed(seed: bytes, label: str, *parts: bytes | str | int) -> int:
    """A 63-bit integer for one purpose (``label``) drawn from a beacon seed."""
    h = hashlib.sha256(b"veritrain/v1/derive" + seed + label.encode())
    for part in parts:
        raw = part if isinstance(part, bytes) else str(part).encode()
        h.update(len(raw).to_bytes(4, "big") + raw)
    return int.from_bytes(h.digest()[:8], "big") >> 1
