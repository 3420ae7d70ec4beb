"""Batched certificate checks: the endomorphism subgroup test agrees with py-ecc's
multiplication by the group order, and a batch holds iff every certificate does."""

from __future__ import annotations

import random

import pytest
from py_ecc.bls import G2ProofOfPossession as Pop
from py_ecc.bls.g2_primitives import G2_to_signature, subgroup_check
from py_ecc.bls.hash_to_curve import hash_to_field_FQ2, map_to_curve_G2
from py_ecc.optimized_bls12_381 import G2, Z2, add, b2, curve_order, is_on_curve, multiply
from veritrain.ledger.blsbatch import batch_fast_aggregate_verify, in_g2, psi
from veritrain.protocol import bls

RNG = random.Random(20240611)


def curve_point(seed: int):
    """A point of E'(Fp2) that is (almost surely) not in G2: SSWU output, not cleared."""
    u0, _ = hash_to_field_FQ2(seed.to_bytes(8, "big"), 2, Pop.DST, Pop.xmd_hash_function)
    return map_to_curve_G2(u0)


def points():
    for k in range(4):
        yield "in G2", multiply(G2, RNG.randrange(1, curve_order))
        q = curve_point(k)
        yield "on the curve", q
        yield "cofactor torsion", multiply(q, curve_order)  # order divides the cofactor
        yield "G2 plus torsion", add(multiply(G2, 3 + k), multiply(q, curve_order))
    yield "infinity", Z2


@pytest.mark.parametrize("label,point", list(points()))
def test_endomorphism_test_agrees_with_multiplying_by_the_order(label, point):
    assert is_on_curve(point, b2) and is_on_curve(psi(point), b2)
    assert in_g2(point) == subgroup_check(point)
    assert in_g2(point) == (label in ("in G2", "infinity"))


def _certificates(n: int) -> list[tuple[list[bytes], bytes, bytes]]:
    secrets_ = [bls.keygen(RNG.randbytes(32)) for _ in range(3)]
    pubs = [bls.public_key(s) for s in secrets_]
    items = []
    for i in range(n):
        msg = b"certified state %d" % i
        items.append((pubs, msg, bls.aggregate([bls.sign(s, msg) for s in secrets_])))
    return items


def test_batch_holds_iff_every_certificate_does():
    items = _certificates(3)
    assert batch_fast_aggregate_verify(items)
    pubs, msg, _ = items[1]
    swapped = [items[0], (pubs, msg, items[2][2]), items[2]]
    assert not batch_fast_aggregate_verify(swapped)


def test_a_signature_outside_g2_is_refused():
    items = _certificates(2)
    pubs, msg, _ = items[1]
    outside = G2_to_signature(curve_point(99))  # decodes to a curve point, not in G2
    assert not bls.fast_aggregate_verify(pubs, msg, outside)
    assert not batch_fast_aggregate_verify([items[0], (pubs, msg, outside)])
