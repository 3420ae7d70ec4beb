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

The subgroup check of a signature is the endomorphism test ``psi(P) == [x]P``
(x the curve's parameter, -0xd201000000010000): a point of E'(Fp2) passes it iff
it lies in G2 (Scott, ePrint 2021/1130; proof for BLS12-381 in 2022/352, the
test the zkcrypto and blst libraries use). It costs a 64-bit scalar
multiplication instead of py-ecc's multiplication by the 255-bit group order.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence

from py_ecc.bls import G2ProofOfPossession as _Pop
from py_ecc.bls.g2_primitives import pubkey_to_G1, signature_to_G2
from py_ecc.bls.hash_to_curve import clear_cofactor_G2, hash_to_field_FQ2, map_to_curve_G2
from py_ecc.fields import optimized_bls12_381_FQ2 as FQ2
from py_ecc.fields import optimized_bls12_381_FQ12 as FQ12
from py_ecc.optimized_bls12_381 import (
    G1,
    Z1,
    Z2,
    add,
    eq,
    field_modulus,
    final_exponentiate,
    multiply,
    neg,
    pairing,
)
from py_ecc.typing import Optimized_Point3D

Item = tuple[Sequence[bytes], bytes, bytes]

#: |x| for the BLS12-381 parameter x = -0xd201000000010000.
X_ABS = 0xD201000000010000
# psi(x, y) = (conj(x) / (1+i)^((p-1)/3), conj(y) / (1+i)^((p-1)/2)), conj the Frobenius on Fp2.
_PSI_X = FQ2.one() / FQ2([1, 1]) ** ((field_modulus - 1) // 3)
_PSI_Y = FQ2.one() / FQ2([1, 1]) ** ((field_modulus - 1) // 2)


def _conj(a: FQ2) -> FQ2:
    return FQ2([a.coeffs[0], -a.coeffs[1]])


def psi(pt: Optimized_Point3D[FQ2]) -> Optimized_Point3D[FQ2]:
    """The untwist-Frobenius-twist endomorphism of E'(Fp2), on projective (X, Y, Z)."""
    x, y, z = pt
    return (_conj(x) * _PSI_X, _conj(y) * _PSI_Y, _conj(z))


def in_g2(pt: Optimized_Point3D[FQ2]) -> bool:
    """Whether a point of E'(Fp2) lies in G2: ``psi(P) == [x]P`` (see the module doc)."""
    return bool(eq(psi(pt), neg(multiply(pt, X_ABS))))


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
            if not in_g2(point):
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
