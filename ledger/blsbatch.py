"""Batch verification of many BLS quorum certificates at once (py-ecc primitives).

Each item is one FastAggregateVerify instance ``(pubkeys, message,
signature)`` of the proof-of-possession ciphersuite. Verifying n of them one
by one costs 2n pairings; with random 64-bit coefficients ``c_i`` (the
small-exponent batch test of Bellare, Garay and Rabin, 1998) all of them
hold, except with probability at most 2^-64, iff

    e(g1, sum_i c_i sig_i) == prod_g e(apk_g, sum_{i in g} c_i H(m_i))

where items are grouped by their aggregate public key ``apk_g`` (a run's
certificates are usually signed by one quorum, so one group). Hash-to-curve
ends with cofactor clearing, a multiplication by the constant ``h_eff``; it
is linear, so it is applied once to each group's sum instead of once per
message: ``sum c_i H(m_i) = h_eff * sum c_i (map(u0_i) + map(u1_i))``. Cost
per item: hashing to the field, two SSWU maps, one subgroup check and two
64-bit scalar multiplications; per group: one cofactor clearing and one
pairing; one final exponentiation in all. Every input is
validated as FastAggregateVerify does: keys pass KeyValidate, signatures
decode and lie in the prime-order subgroup. Verifiers return False on any
malformed input and never raise.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

from py_ecc.bls import G2ProofOfPossession as _Pop
from py_ecc.bls.g2_primitives import pubkey_to_G1, signature_to_G2, subgroup_check
from py_ecc.bls.hash_to_curve import clear_cofactor_G2, hash_to_field_FQ2, map_to_curve_G2
from py_ecc.fields import optimized_bls12_381_FQ12 as FQ12
from py_ecc.optimized_bls12_381 import G1, Z1, Z2, add, final_exponentiate, multiply, neg, pairing

Item = tuple[Sequence[bytes], bytes, bytes]


def _aggregate_key(pubs: Sequence[bytes], valid: dict[bytes, bool]) -> object | None:
    if not pubs or len(set(pubs)) != len(pubs):
        return None
    total = Z1
    for pub in pubs:
        ok = valid.get(pub)
        if ok is None:
            ok = valid[pub] = len(pub) == 48 and bool(_Pop.KeyValidate(pub))
        if not ok:
            return None
        total = add(total, pubkey_to_G1(pub))
    return total


def batch_fast_aggregate_verify(items: Sequence[Item], *,
                                randbits: Callable[[int], int] = secrets.randbits) -> bool:
    """True iff every item passes FastAggregateVerify (soundness error <= 2^-64)."""
    if not items:
        return True
    try:
        valid: dict[bytes, bool] = {}
        groups: dict[tuple[bytes, ...], object] = {}
        hashed: dict[tuple[bytes, ...], object] = {}
        sig_sum = Z2
        for pubs, message, signature in items:
            key = tuple(pubs)
            if key not in groups:
                apk = _aggregate_key(pubs, valid)
                if apk is None:
                    return False
                groups[key], hashed[key] = apk, Z2
            if len(signature) != 96:
                return False
            point = signature_to_G2(signature)
            if not subgroup_check(point):
                return False
            coeff = randbits(64) | 1
            sig_sum = add(sig_sum, multiply(point, coeff))
            u0, u1 = hash_to_field_FQ2(message, 2, _Pop.DST, _Pop.xmd_hash_function)
            h = add(map_to_curve_G2(u0), map_to_curve_G2(u1))  # H(m) before clearing
            hashed[key] = add(hashed[key], multiply(h, coeff))  # type: ignore[arg-type]
        acc = pairing(sig_sum, G1, final_exponentiate=False)
        for key, apk in groups.items():
            h_sum = clear_cofactor_G2(hashed[key])  # type: ignore[arg-type]
            acc = acc * pairing(h_sum, neg(apk), final_exponentiate=False)  # type: ignore[arg-type]
        return bool(final_exponentiate(acc) == FQ12.one())
    except Exception:
        return False
