"""The DKG and threshold BLS beacon (protocol/dkg.py): any quorum gives one signature and
one seed, a bad share is caught and its dealer disqualified, and only qualified dealers
contribute to the group key."""

from __future__ import annotations

import functools

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from veritrain.protocol import bls, dkg
from veritrain.protocol.beacon import EVERY_WORKER_ADMITTED
from veritrain.protocol.board import members_posts
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import sign

RUN = "dkg-run"
SEALED = "ab" * 32
SLOW = settings(max_examples=12, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def enc_keys(n: int) -> tuple[list[X25519PrivateKey], list[str]]:
    secrets_ = [X25519PrivateKey.generate() for _ in range(n)]
    return secrets_, [dkg.x25519_public(s) for s in secrets_]


def run_dkg(n: int, q: int, *, coeffs: list[list[int]] | None = None,
            tamper: dict[int, int] | None = None, justify_bad: bool = False):
    """An in-memory DKG; ``tamper`` maps a dealer to a recipient it sends a bad share."""
    enc, pubs = enc_keys(n)
    dealings = [dkg.deal(run_id=RUN, round_index=0, dealer=i, dealer_key=f"{i:064x}",
                         quorum=q, enc_secret=enc[i], enc_keys=pubs,
                         coeffs=coeffs[i] if coeffs else None) for i in range(n)]
    for i, j in (tamper or {}).items():  # dealer i seals f_i(x_j) + 1 to j
        d = dealings[i].deal
        bad = dkg.seal_share(enc[i], pubs[j], run_id=RUN, dealer=i, recipient=j,
                             commitments=d.commitments,
                             share=(dkg.eval_poly(dealings[i].coeffs, dkg.point_x(j)) + 1) % dkg.R)
        shares = list(d.shares)
        shares[j] = bad
        dealings[i].deal = dkg.DkgDeal(run_id=RUN, round=0, dealer=d.dealer,
                                       commitments=d.commitments, enc_keys=d.enc_keys,
                                       shares=shares)
    deals = {i: d.deal for i, d in enumerate(dealings)}
    views = [dkg.accusations(enc[j], deals, me=j, n=n, quorum=q) for j in range(n)]
    complaints = {j: bad for j, (_, bad) in enumerate(views) if bad}
    accused_by: dict[int, list[int]] = {}
    for j, bad in complaints.items():
        for i in bad:
            accused_by.setdefault(i, []).append(j)
    just = {}
    for i, accusers in accused_by.items():
        revealed = dkg.justify(dealings[i], accusers)
        if justify_bad:  # the dealer stands by its bad share
            revealed = [{"to": r["to"], "share": f"{(int(r['share'], 16) + 1) % dkg.R:064x}"}
                        for r in revealed]
        just[i] = revealed
    q_ = dkg.qualify(n=n, quorum=q, deals={i: [d] for i, d in deals.items()},
                     complaints=complaints, justifications=just)
    shares = [dkg.secret_share(q_, j, views[j][0]) for j in range(n)]
    return dealings, q_, shares, complaints


@functools.cache
def honest(n: int, q: int):
    dealings, q_, shares, _ = run_dkg(n, q)
    return dealings, q_, shares


@functools.cache
def partials(n: int, q: int, r: int) -> dict[int, bytes]:
    _, _, shares = honest(n, q)
    m = dkg.threshold_beacon_root(RUN, r, SEALED, EVERY_WORKER_ADMITTED)
    return {j: dkg.partial_sign(x, m) for j, x in enumerate(shares)}


@functools.cache
def group_verifies(n: int, q: int, r: int, sig: bytes) -> bool:
    return dkg.verify_group_signature(honest(n, q)[1].group_key,
                                      dkg.threshold_beacon_root(
                                          RUN, r, SEALED, EVERY_WORKER_ADMITTED), sig)


def test_shares_match_public_shares_and_group_key():
    dealings, q_, shares = honest(4, 3)
    assert q_.qualified == [0, 1, 2, 3] and not q_.disqualified
    assert [bls.public_key(x).hex() for x in shares] == q_.public_shares
    group_secret = sum(d.coeffs[0] for d in dealings) % dkg.R
    assert bls.public_key(group_secret).hex() == q_.group_key


@given(coeffs=st.lists(st.lists(st.integers(1, dkg.R - 1), min_size=2, max_size=2),
                       min_size=3, max_size=3),
       quorum_a=st.permutations(range(3)), quorum_b=st.permutations(range(3)))
@SLOW
def test_any_quorum_of_secret_shares_interpolates_the_group_secret(coeffs, quorum_a, quorum_b):
    """Scalar side of the property: shares of any 2-of-3 interpolate sum_i a_i0."""
    _, q_, shares, _ = run_dkg(3, 2, coeffs=coeffs)
    group_secret = sum(c[0] for c in coeffs) % dkg.R
    for chosen in (quorum_a[:2], quorum_b[:2]):
        lam = dkg.lagrange_at_zero(chosen)
        assert sum(lam[j] * shares[j] for j in chosen) % dkg.R == group_secret
    assert bls.public_key(group_secret).hex() == q_.group_key


@given(n_q=st.sampled_from([(3, 2), (4, 3), (4, 2)]), data=st.data())
@SLOW
def test_any_two_quorums_give_the_identical_signature_and_seed(n_q, data):
    n, q = n_q
    r = data.draw(st.integers(0, 2), label="round")
    a = data.draw(st.sets(st.integers(0, n - 1), min_size=q, max_size=q), label="quorum a")
    b = data.draw(st.sets(st.integers(0, n - 1), min_size=q, max_size=q), label="quorum b")
    p = partials(n, q, r)
    sig_a = dkg.combine({j: p[j] for j in a}, q)
    sig_b = dkg.combine({j: p[j] for j in b}, q)
    assert sig_a == sig_b
    assert dkg.threshold_seed(sig_a) == dkg.threshold_seed(sig_b)
    assert group_verifies(n, q, r, sig_a)


def test_seeds_differ_by_round_and_sealed_list():
    _, _, shares = honest(3, 2)
    sigs = set()
    for r, sealed in ((0, SEALED), (1, SEALED), (0, "cd" * 32)):
        m = dkg.threshold_beacon_root(RUN, r, sealed, EVERY_WORKER_ADMITTED)
        sigs.add(dkg.combine({j: dkg.partial_sign(shares[j], m) for j in (0, 1)}, 2))
    assert len(sigs) == 3


def test_a_partial_from_a_wrong_share_is_refused():
    _, q_, shares = honest(3, 2)
    m = dkg.threshold_beacon_root(RUN, 0, SEALED, EVERY_WORKER_ADMITTED)
    good = partials(3, 2, 0)[1]
    forged = dkg.partial_sign((shares[1] + 1) % dkg.R, m)
    assert dkg.partial_verifies(q_.public_shares[1], m, good)
    assert not dkg.partial_verifies(q_.public_shares[1], m, forged)
    assert not dkg.partial_verifies(q_.public_shares[0], m, good)  # someone else's partial
    # and a combination using it is not the group signature
    assert not dkg.verify_group_signature(q_.group_key, m, dkg.combine({0: partials(3, 2, 0)[0],
                                                                         1: forged}, 2))


@given(dealer=st.integers(0, 3), victim=st.integers(0, 3))
@settings(max_examples=4, deadline=None)
def test_a_bad_share_is_detected_and_its_dealer_disqualified(dealer, victim):
    dealings, q_, shares, complaints = run_dkg(4, 3, tamper={dealer: victim}, justify_bad=True)
    assert complaints == {victim: [dealer]}
    assert dealer not in q_.qualified and "does not match" in q_.disqualified[dealer]
    # the disqualified dealer does not contribute: the group secret is the others' sum
    others = sum(d.coeffs[0] for i, d in enumerate(dealings) if i != dealer) % dkg.R
    assert bls.public_key(others).hex() == q_.group_key
    assert [bls.public_key(x).hex() for x in shares] == q_.public_shares
    lam = dkg.lagrange_at_zero([0, 1, 2])
    assert sum(lam[j] * shares[j] for j in (0, 1, 2)) % dkg.R == others


def test_a_dealer_that_does_not_answer_a_complaint_is_disqualified():
    enc, pubs = enc_keys(3)
    dealings = [dkg.deal(run_id=RUN, round_index=0, dealer=i, dealer_key=f"{i:064x}",
                         quorum=2, enc_secret=enc[i], enc_keys=pubs) for i in range(3)]
    q_ = dkg.qualify(n=3, quorum=2, deals={i: [d.deal] for i, d in enumerate(dealings)},
                     complaints={1: [0]}, justifications={})
    assert q_.qualified == [1, 2] and "did not answer" in q_.disqualified[0]


def test_a_falsely_accused_dealer_stays_and_the_accuser_gets_its_share_in_the_clear():
    enc, pubs = enc_keys(3)
    dealings = [dkg.deal(run_id=RUN, round_index=0, dealer=i, dealer_key=f"{i:064x}",
                         quorum=2, enc_secret=enc[i], enc_keys=pubs) for i in range(3)]
    deals = {i: d.deal for i, d in enumerate(dealings)}
    q_ = dkg.qualify(n=3, quorum=2, deals={i: [d] for i, d in deals.items()},
                     complaints={2: [0]}, justifications={0: dkg.justify(dealings[0], [2])})
    assert q_.qualified == [0, 1, 2]
    opened, _ = dkg.accusations(enc[2], deals, me=2, n=3, quorum=2)
    opened.pop(0)  # as if the accuser could not open it
    x2 = dkg.secret_share(q_, 2, opened)
    assert bls.public_key(x2).hex() == q_.public_shares[2]


def test_equivocating_and_malformed_dealers_are_disqualified_and_too_few_fail():
    enc, pubs = enc_keys(4)
    mk = [dkg.deal(run_id=RUN, round_index=0, dealer=i, dealer_key=f"{i:064x}", quorum=3,
                   enc_secret=enc[i], enc_keys=pubs) for i in range(4)]
    twice = dkg.deal(run_id=RUN, round_index=0, dealer=0, dealer_key=f"{0:064x}", quorum=3,
                     enc_secret=enc[0], enc_keys=pubs).deal
    short = dkg.deal(run_id=RUN, round_index=0, dealer=1, dealer_key=f"{1:064x}", quorum=2,
                     enc_secret=enc[1], enc_keys=pubs).deal
    deals = {0: [mk[0].deal, twice], 1: [short], 2: [mk[2].deal], 3: [mk[3].deal]}
    with pytest.raises(dkg.DkgFault, match="only 2 dealers qualified"):
        dkg.qualify(n=4, quorum=3, deals=deals, complaints={}, justifications={})
    q_ = dkg.qualify(n=4, quorum=3, deals={**deals, 1: [mk[1].deal]}, complaints={},
                     justifications={})
    assert q_.qualified == [1, 2, 3] and "two different deals" in q_.disqualified[0]
    assert "malformed" in dkg.qualify(n=4, quorum=3, deals={**deals, 0: [mk[0].deal]},
                                      complaints={}, justifications={}).disqualified[1]


def test_messages_are_signed_bound_posts_and_a_result_needs_a_quorum():
    ids = [Identity.generate("validator") for _ in range(3)]
    members = [i.public_key.hex() for i in ids]
    _, q_, _ = honest(3, 2)
    digests = {i: f"{i:064x}" for i in q_.qualified}
    wires = [sign(ids[k], dkg.result_message(q_, run_id=RUN, round_index=0, validator=members[k],
                                             digests=digests)).to_wire() for k in range(3)]
    faults: list[str] = []
    forged = sign(ids[0], dkg.result_message(q_, run_id=RUN, round_index=0,
                                             validator=members[1], digests=digests)).to_wire()
    posts = members_posts(wires[:1] + [forged], dkg.DkgResult, member_field="validator",
                          members=members, run_id=RUN, round_index=0, faults=faults)
    assert list(posts) == [0] and "signed by" in faults[0]
    with pytest.raises(dkg.DkgFault, match="quorum"):
        dkg.agreed_result(posts, quorum=2)
    posts = members_posts(wires, dkg.DkgResult, member_field="validator", members=members,
                          run_id=RUN, round_index=0)
    assert dkg.agreed_result(posts, quorum=2).group_key == q_.group_key
