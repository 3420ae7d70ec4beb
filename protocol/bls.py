"""BLS12-381 signatures, proof-of-possession ciphersuite (py-ecc).

Stateless wrappers: producers raise on bad input, verifiers return False on
anything malformed and never throw. The proof-of-possession scheme is the one
that makes ``fast_aggregate_verify`` safe against rogue-key attacks, so every
BLS public key is accepted only together with a valid proof.
Public keys are 48-byte compressed G1 points, signatures 96-byte G2 points.
"""

from __future__ import annotations

from collections.abc import Sequence

from py_ecc.bls import G2ProofOfPossession as _Pop

PUBLIC_KEY_BYTES = 48
SIGNATURE_BYTES = 96


def keygen(ikm: bytes) -> int:
    """Secret key from at least 32 bytes of input key material."""
    return _Pop.KeyGen(ikm)


def public_key(secret: int) -> bytes:
    return bytes(_Pop.SkToPk(secret))


def sign(secret: int, message: bytes) -> bytes:
    return bytes(_Pop.Sign(secret, message))


def prove_possession(secret: int) -> bytes:
    return bytes(_Pop.PopProve(secret))


def verify(pub: bytes, message: bytes, signature: bytes) -> bool:
    try:
        if len(pub) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
            return False
        return bool(_Pop.Verify(pub, message, signature))
    except Exception:
        return False


def verify_possession(pub: bytes, proof: bytes) -> bool:
    try:
        if len(pub) != PUBLIC_KEY_BYTES or len(proof) != SIGNATURE_BYTES:
            return False
        return bool(_Pop.PopVerify(pub, proof))
    except Exception:
        return False


def aggregate(signatures: Sequence[bytes]) -> bytes:
    if not signatures:
        raise ValueError("nothing to aggregate")
    return bytes(_Pop.Aggregate(list(signatures)))


def fast_aggregate_verify(pubs: Sequence[bytes], message: bytes, signature: bytes) -> bool:
    """One pairing check that every key in ``pubs`` signed ``message``.

    Safe only for keys whose proofs of possession were verified.
    """
    try:
        if not pubs or len(set(pubs)) != len(pubs):
            return False
        if any(len(p) != PUBLIC_KEY_BYTES for p in pubs) or len(signature) != SIGNATURE_BYTES:
            return False
        return bool(_Pop.FastAggregateVerify(list(pubs), message, signature))
    except Exception:
        return False
