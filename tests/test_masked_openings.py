"""A masked run's spot checks never open a bucket down to one unopened member
(protocol/challenges.py ``select_openings``): the bucket sum minus the opened updates would
be that member's update."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.protocol.challenges import (
    MIN_UNOPENED,
    ChallengePolicy,
    compute_challenges,
    select_spot_checks,
)
from veritrain.protocol.secagg import round_buckets


def _keys(n: int, tag: int) -> list[str]:
    return sorted(hashlib.sha256(f"w{tag}/{i}".encode()).hexdigest() for i in range(n))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(2, 40), size=st.integers(2, 8), count=st.integers(0, 40),
       seed=st.binary(min_size=32, max_size=32), tag=st.integers(0, 1000))
def test_no_bucket_is_left_with_one_unopened_member(n, size, count, seed, tag):
    workers = _keys(n, tag)
    policy = ChallengePolicy(segments=4, per_worker=0.0, full_checks=count, always_last=False,
                             opened_only=True, bucket_size=size)
    opened = {w for w, segs in compute_challenges(seed, workers, policy).items() if segs}
    buckets = round_buckets(seed, workers, size)
    unopened = [len(set(b) - opened) for b in buckets]
    assert all(u == 0 or u >= MIN_UNOPENED for u in unopened)
    assert opened <= {w for b in buckets for w in b} and len(opened) <= count
    # Fewer than asked only where every bucket is opened or down to two unopened members
    # with one opening left to give (two would be needed).
    if len(opened) < count:
        assert all(u == 0 or (u == MIN_UNOPENED and count - len(opened) == 1)
                   for u in unopened)
    # Asked for everyone, every bucketed worker is opened; the first-ranked bucketed
    # worker always is (its bucket has at least two members).
    if count >= n:
        assert opened == {w for b in buckets for w in b}
    ranked = [w for w in select_spot_checks(seed, workers, n) if any(w in b for b in buckets)]
    if count >= 2 and ranked:
        assert ranked[0] in opened


def test_an_unmasked_run_opens_the_beacons_first_workers_whatever_their_number():
    workers = _keys(6, 0)
    seed = b"\x07" * 32
    policy = ChallengePolicy(segments=4, per_worker=0.0, full_checks=5, always_last=False)
    opened = {w for w, segs in compute_challenges(seed, workers, policy).items()
              if segs == [0, 1, 2, 3]}
    assert opened == set(select_spot_checks(seed, workers, 5))
    # The same count in a masked run of one bucket of 6: at most 4 opened.
    masked = ChallengePolicy(segments=4, per_worker=0.0, full_checks=5, always_last=False,
                             opened_only=True, bucket_size=6)
    assert sum(1 for segs in compute_challenges(seed, workers, masked).values() if segs) == 4
