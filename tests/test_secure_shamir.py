"""Shamir secret sharing over GF(2^256 + 297) and its hash commitments."""

from __future__ import annotations

import itertools
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.aggregation.secure import PRIME, SecureAggregationError, Share, split_secret
from veritrain.aggregation.secure.shamir import (
    commit_share,
    interpolate_at_zero,
    is_consistent,
    reconstruct_secret,
)

secrets_st = st.binary(min_size=32, max_size=32)


def test_prime_is_the_documented_one():
    assert PRIME == 2**256 + 297
    # Fermat witnesses (the value was also checked with `openssl prime`)
    assert all(pow(a, PRIME - 1, PRIME) == 1 for a in (2, 3, 5, 7, 11, 13))


@settings(max_examples=25, deadline=None)
@given(secret=secrets_st, n=st.integers(2, 9), data=st.data())
def test_any_threshold_subset_reconstructs(secret, n, data):
    k = data.draw(st.integers(1, n))
    shares = split_secret(secret, k, n)
    subset = data.draw(st.permutations(shares)).copy()[: data.draw(st.integers(k, n))]
    assert reconstruct_secret(subset, k) == secret


def test_all_threshold_subsets_of_a_bucket_reconstruct():
    secret = os.urandom(32)
    shares = split_secret(secret, 5, 8)
    for subset in itertools.combinations(shares, 5):
        assert reconstruct_secret(list(subset), 5) == secret


@settings(max_examples=20, deadline=None)
@given(secret=secrets_st, other=secrets_st, n=st.integers(3, 9), data=st.data())
def test_fewer_than_threshold_shares_say_nothing_about_the_secret(secret, other, n, data):
    """k-1 shares fit a polynomial through any other secret just as well (perfect secrecy)."""
    k = data.draw(st.integers(2, n))
    shares = split_secret(secret, k, n)[: k - 1]
    with pytest.raises(SecureAggregationError, match="cannot reconstruct"):
        reconstruct_secret(shares, k)
    # The k - 1 shares plus the point (0, other) define a degree k-1 polynomial
    # whose shares at 1..k-1 are exactly the real ones: the real shares are
    # equally consistent with `other`.
    xs = [0] + [s.x for s in shares]
    ys = [int.from_bytes(other, "big")] + [s.y for s in shares]

    def at(x: int) -> int:
        total = 0
        for i, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
            num = den = 1
            for j, xj in enumerate(xs):
                if i != j:
                    num = num * (x - xj) % PRIME
                    den = den * (xi - xj) % PRIME
            total = (total + yi * num * pow(den, -1, PRIME)) % PRIME
        return total

    forged_k = Share(k, at(k))
    assert reconstruct_secret([*shares, forged_k], k) == other


def test_commitments_bind_index_value_context_and_salt():
    s = Share(3, 12345)
    salt = bytes(32)
    c = commit_share(b"ctx", s, salt)
    assert c == commit_share(b"ctx", Share(3, 12345), bytes(32))
    assert c != commit_share(b"ctx", Share(3, 12346), salt)
    assert c != commit_share(b"ctx", Share(4, 12345), salt)
    assert c != commit_share(b"ctx2", s, salt)
    assert c != commit_share(b"ctx", s, b"\x01" * 32)


def test_invalid_inconsistent_shares_are_detected():
    shares = split_secret(os.urandom(32), 3, 6)
    assert is_consistent(shares, 3)
    tampered = [*shares[:5], Share(6, (shares[5].y + 1) % PRIME)]
    assert not is_consistent(tampered, 3)
    with pytest.raises(SecureAggregationError, match="one polynomial"):
        reconstruct_secret(tampered, 3)
    # with exactly k shares a single tampered share goes unnoticed here but
    # yields a different secret: callers compare with the secret's commitment
    assert reconstruct_secret(tampered[3:], 3) != reconstruct_secret(shares[3:], 3)


def test_invalid_share_inputs():
    with pytest.raises(SecureAggregationError):
        Share(0, 1)
    with pytest.raises(SecureAggregationError):
        Share(1, PRIME)
    with pytest.raises(SecureAggregationError):
        split_secret(b"short", 2, 3)
    with pytest.raises(SecureAggregationError):
        split_secret(bytes(32), 4, 3)
    with pytest.raises(SecureAggregationError, match="two different values"):
        interpolate_at_zero([Share(1, 1), Share(1, 2)])
    with pytest.raises(SecureAggregationError):
        Share.from_bytes(1, b"\x00" * 32)
    with pytest.raises(SecureAggregationError):
        commit_share(b"c", Share(1, 1), b"short")
