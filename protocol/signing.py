"""Domain-separated signing roots.

Nothing is signed raw. A signature covers the signing root

    root = sha256( "veritrain/v1" || 0x00 || lp(domain) || lp(run_id) || u64be(round) || sha256(body) )

where ``lp(x)`` is a 2-byte big-endian length followed by the UTF-8 bytes and
``body`` is the message's canonical encoding. A signature made for one kind
of message, run or round therefore never verifies as another.
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

PROTOCOL_TAG = b"veritrain/v1"

#: Every signing domain in the protocol (specs/protocol.md, "Signing domains").
DOMAINS = (
    "run_spec",
    "registration",
    "submission",
    "receipt",
    "round_result",
    "beacon",
    "beacon_share",
    "certificate",
    "ledger_event",
    "blob_upload",
    "shard_result",
    "shard_check",
    "shard_check_share",
    "shard_finding",
    "secagg_keys",
    "secagg_deal",
    "secagg_masked_input",
    "secagg_reveal",
    "secagg_view",
    "secagg_opening",
    # Masked rounds' openings seed (protocol/openings.py): the validators' posts and the
    # BLS message they sign once the masked inputs are committed.
    "openings_share",
    "openings",
    "spot_reveal",
    "reveal_receipt",
    # Threshold beacon (specs/protocol.md 5.4a): the DKG's board posts, the partial
    # signatures' envelopes and the BLS message they sign.
    "dkg_keys",
    "dkg_deal",
    "dkg_complaint",
    "dkg_justification",
    "dkg_result",
    "beacon_partial",
    "threshold_beacon",
    # Admission (specs/protocol.md 4.2a, protocol/membership.py): tickets and their
    # revocations by the organiser's issuers, bond deposits by the treasury, withdrawals.
    "admission_ticket",
    "admission_revocation",
    "bond_deposit",
    "bond_withdrawal",
)


def _lp(text: str) -> bytes:
    raw = text.encode("utf-8")
    if len(raw) > 0xFFFF:
        raise ValueError("field too long for a signing root")
    return len(raw).to_bytes(2, "big") + raw


def compute_signing_root(domain: str, run_id: str, round_index: int, body: bytes) -> bytes:
    """The 32 bytes that a signature over ``body`` in this domain covers."""
    if domain not in DOMAINS:
        raise ValueError(f"unknown signing domain {domain!r}")
    if not 0 <= round_index < 1 << 63:
        raise ValueError("round out of range")
    return hashlib.sha256(
        PROTOCOL_TAG
        + b"\x00"
        + _lp(domain)
        + _lp(run_id)
        + round_index.to_bytes(8, "big")
        + hashlib.sha256(body).digest()
    ).digest()


def verify_ed25519(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True iff ``signature`` is a valid Ed25519 signature; False on any malformed input."""
    try:
        if len(public_key) != 32 or len(signature) != 64:
            return False
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
        return True
    except (InvalidSignature, ValueError):
        return False
