"""A masked round's openings seed (protocol/openings.py): drawn from a quorum's signature
over the committed masked inputs, so it exists only once they are committed, follows from
them alone (threshold) and cannot be carried over to other inputs.

The ledger's side (a share before the masked phase closed, or over other inputs, is
refused; the checks are fixed from the seed) is in tests/test_ledger_secagg.py; real
workers and validators drawing it over HTTP in tests/test_masked_rounds.py.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.protocol import bls, dkg
from veritrain.protocol.challenges import MIN_UNOPENED, ChallengePolicy, compute_challenges
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import SecaggView, sign
from veritrain.protocol.openings import (
    committed_inputs,
    inputs_digest,
    openings_root,
    seed_of_shares,
    seed_of_signature,
    survivor_buckets,
    verify_openings,
)
from veritrain.workers.masked import drawn_over_other_survivors

RUN = "openings-run"
SECRETS = [bls.keygen(bytes([i + 1]) * 32) for i in range(3)]
VALIDATORS = [{"bls": bls.public_key(k).hex()} for k in SECRETS]
#: A (2, 3) threshold key: f(x) = a0 + a1 x, validator j holds f(j + 1).
COEFFS = [12345678901234567890, 98765432109876543210]
GROUP_KEY = bls.public_key(COEFFS[0]).hex()
KEY_SHARES = [dkg.eval_poly(COEFFS, dkg.point_x(j)) for j in range(3)]


def _inputs(n: int, tag: int = 0) -> list[list]:
    return committed_inputs((i % 3, hashlib.sha256(f"w{i}".encode()).hexdigest(),
                             hashlib.sha256(f"post{i}/{tag}".encode()).hexdigest())
                            for i in range(n))


def _group_fixed(digest: str, signers: tuple[int, int]) -> dict:
    root = openings_root(RUN, 4, digest)
    sig = dkg.combine({j: dkg.partial_sign(KEY_SHARES[j], root) for j in signers}, 2)
    return {"signature": sig.hex(), "signers": list(signers)}


def _shares_fixed(digest: str, signers: list[int]) -> dict:
    root = openings_root(RUN, 4, digest)
    return {"signers": signers, "shares": [bls.sign(SECRETS[j], root).hex() for j in signers]}


def test_the_threshold_seed_is_the_same_whichever_quorum_signed_and_only_for_its_inputs():
    digest = inputs_digest(_inputs(6))
    seeds = {verify_openings(VALIDATORS, 2, GROUP_KEY, RUN, 4, _group_fixed(digest, q), digest)
             for q in ((0, 1), (0, 2), (1, 2))}
    assert len(seeds) == 1  # unique: no party picks among quorums
    (seed,) = seeds
    assert seed == seed_of_signature(bytes.fromhex(_group_fixed(digest, (0, 1))["signature"]))
    other = inputs_digest(_inputs(6, tag=1))  # one post of each worker differs
    with pytest.raises(RejectedInput) as err:  # the seed does not carry over to other inputs
        verify_openings(VALIDATORS, 2, GROUP_KEY, RUN, 4, _group_fixed(digest, (0, 1)), other)
    assert err.value.reason == "invalid_openings"
    with pytest.raises(RejectedInput):  # nor to another round
        verify_openings(VALIDATORS, 2, GROUP_KEY, RUN, 5, _group_fixed(digest, (0, 1)), digest)
    with pytest.raises(RejectedInput):  # a partial is no group signature
        verify_openings(VALIDATORS, 2, GROUP_KEY, RUN, 4, {"signature": dkg.partial_sign(
            KEY_SHARES[0], openings_root(RUN, 4, digest)).hex()}, digest)


def test_individual_shares_need_a_sorted_quorum_each_over_these_inputs():
    digest = inputs_digest(_inputs(5))
    fixed = _shares_fixed(digest, [0, 2])
    seed = verify_openings(VALIDATORS, 2, None, RUN, 4, fixed, digest)
    assert seed == seed_of_shares([bytes.fromhex(x) for x in fixed["shares"]])
    other = inputs_digest(_inputs(4))
    bad = [
        _shares_fixed(digest, [0]),  # not a quorum
        {"signers": [2, 0], "shares": list(reversed(fixed["shares"]))},  # not sorted
        {"signers": [0, 0], "shares": [fixed["shares"][0]] * 2},  # one signer twice
        {"signers": [0, 2], "shares": [fixed["shares"][1], fixed["shares"][0]]},  # swapped
        _shares_fixed(other, [0, 2]),  # over other inputs
        {"signers": [0, 3], "shares": fixed["shares"]},  # no validator 3
        {"signers": [0, 2], "shares": [fixed["shares"][0], "zz"]},  # not hex
        "not an object",
    ]
    for b in bad:
        with pytest.raises(RejectedInput) as err:
            verify_openings(VALIDATORS, 2, None, RUN, 4, b, digest)
        assert err.value.reason == "invalid_openings"


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 30), flip=st.integers(0, 29), perm=st.randoms(use_true_random=False))
def test_the_inputs_digest_is_order_free_and_moves_with_any_input(n, flip, perm):
    inputs = _inputs(n)
    shuffled = list(inputs)
    perm.shuffle(shuffled)
    assert inputs_digest(committed_inputs(tuple(x) for x in shuffled)) == inputs_digest(inputs)
    changed = [list(x) for x in inputs]
    changed[flip % n][2] = hashlib.sha256(b"another post").hexdigest()
    assert inputs_digest(committed_inputs(tuple(x) for x in changed)) != inputs_digest(inputs)
    dropped = inputs[: flip % n] + inputs[flip % n + 1:]
    assert inputs_digest(dropped) != inputs_digest(inputs)
    assert sorted(w for b in survivor_buckets(inputs) for w in b) == sorted(x[1] for x in inputs)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(2, 30), size=st.integers(2, 6), count=st.integers(0, 30),
       dropped=st.sets(st.integers(0, 29), max_size=10),
       seed=st.binary(min_size=32, max_size=32))
def test_openings_over_survivor_sets_never_leave_one_survivor_unopened(n, size, count, dropped,
                                                                       seed):
    """With the draw over the survivors themselves, no dropout can leave one unopened
    survivor whose update the bucket sum minus the opened ones would be."""
    workers = sorted(hashlib.sha256(f"w{i}".encode()).hexdigest() for i in range(n))
    inputs = committed_inputs((i % max(1, n // size), w, "0" * 64)
                              for i, w in enumerate(workers) if i not in dropped)
    buckets = survivor_buckets(inputs)
    policy = ChallengePolicy(segments=4, per_worker=0.0, full_checks=count, always_last=False,
                             opened_only=True, bucket_size=size)
    opened = {w for w, segs in compute_challenges(seed, workers, policy, buckets=buckets).items()
              if segs}
    assert opened <= {w for b in buckets for w in b} and len(opened) <= count
    for b in buckets:
        unopened = len(set(b) - opened)
        assert unopened == 0 or unopened >= MIN_UNOPENED or len(b) == 1


def _bucket_view(signed_by: list[Identity], survivors: list[str], assigned: list[str]) -> dict:
    views = [sign(w, SecaggView(run_id=RUN, round=4, bucket=0, worker=w.public_key.hex(),
                                members=assigned, dealers=assigned, survivors=survivors)
                  ).to_wire() for w in signed_by]
    return {"buckets": [{"index": 0, "assigned": assigned, "members": assigned,
                         "dealers": assigned, "survivors": survivors, "live": False}],
            "posts": {"view": views}}


def test_a_worker_opens_only_over_the_survivors_its_bucket_signed():
    """Scenario of a review: the draw saw {A, B} while the bucket's survivors signed
    {A, B, C}; A and B opening would leave C's update the bucket sum minus theirs."""
    ids = sorted((Identity.generate("worker") for _ in range(3)),
                 key=lambda w: w.public_key.hex())
    a, b, c = (w.public_key.hex() for w in ids)
    spec = SimpleNamespace(run_id=RUN, masked={"max_dropouts": 0})  # k = 3 of 3
    signed = _bucket_view(ids, [a, b, c], [a, b, c])
    assert drawn_over_other_survivors(spec, 4, signed, 0, [[a, b, c]]) is None
    assert "not the ones of the view its survivors signed" in drawn_over_other_survivors(
        spec, 4, signed, 0, [[a, b]])
    assert "not the ones" in drawn_over_other_survivors(spec, 4, signed, 0, [])
    # Fewer than k signatures on any view: no sum can be unmasked, nothing to expose.
    assert drawn_over_other_survivors(spec, 4, _bucket_view(ids[:2], [a, b, c], [a, b, c]),
                                      0, [[a, b]]) is None


def test_validators_refuse_a_draw_over_other_survivors_than_the_board_sums():
    from veritrain.validators.masked import filter_masked_round

    a, b, c = (f"{i:064x}" for i in (1, 2, 3))
    spec = SimpleNamespace(run_id=RUN, masked={"max_dropouts": 0, "bucket_size": 3})
    view = {"round": 4, **_bucket_view([], [a, b, c], [a, b, c])}
    with pytest.raises(RejectedInput) as err:
        filter_masked_round(SimpleNamespace(spec=spec), 4, "00" * 32, None, [], set(), set(),
                            b"\0" * 32, [[a, b]], view, {})
    assert err.value.reason == "invalid_board"
