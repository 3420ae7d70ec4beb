"""The masked-bucket rules every party applies alike (protocol/secagg.py).

``round_buckets`` deals the sealed submitters into buckets; ``phase_schedule``
is the board's one clock: a phase closes at its last expected arrival or at its
deadline, a bucket that can no longer finish stops being waited for. The
property tests drive the schedule the way the ledger does (a post is stored only
while its phase is open and waits for its sender) and check that what is once
closed stays closed, at the same time, with the same expected senders.
"""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.secagg import (
    PHASES,
    BucketState,
    Phase,
    bucket_dropouts,
    bucket_rank,
    bucket_threshold,
    check_dealt,
    open_phase,
    phase_schedule,
    round_buckets,
    words_file_bytes,
)

SEED = b"\x07" * 32


def worker(i: int) -> str:
    """A 32-byte worker key (hex) that sorts in no particular relation to ``i``."""
    return hashlib.sha256(b"worker %d" % i).hexdigest()


def workers(n: int) -> list[str]:
    return [worker(i) for i in range(n)]


def flat(buckets: list[list[str]]) -> list[str]:
    return [w for b in buckets for w in b]


# --------------------------------------------------------------------------- round_buckets

@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 40), size=st.integers(2, 8), seed=st.binary(min_size=0, max_size=40),
       data=st.data())
def test_round_buckets_partition_the_distinct_workers(n, size, seed, data):
    ws = workers(n)
    # Any order, with repeats: the same workers give the same buckets.
    shuffled = data.draw(st.permutations(ws))
    repeats = data.draw(st.lists(st.sampled_from(ws), max_size=5)) if ws else []
    buckets = round_buckets(seed, ws, size)
    assert round_buckets(seed, shuffled + repeats, size) == buckets
    if n < 2:
        assert buckets == []
        return
    members = flat(buckets)
    assert sorted(members) == sorted(ws)  # every worker exactly once
    assert len(set(members)) == len(members)
    assert all(b == sorted(b) for b in buckets)
    if n < size:
        assert buckets == [sorted(ws)]
    else:
        assert len(buckets) == n // size
        sizes = [len(b) for b in buckets]
        assert all(size <= s <= 2 * size - 1 for s in sizes)
        assert max(sizes) - min(sizes) <= 1  # dealt round-robin


def test_round_buckets_depend_on_the_seed_and_mix_workers_across_seeds():
    ws = workers(37)
    assert round_buckets(b"beacon", ws, 8) != round_buckets(b"beacon2", ws, 8)
    assert sorted(len(b) for b in round_buckets(b"beacon", ws, 8)) == [9, 9, 9, 10]
    ws = workers(16)
    together = sum(1 for s in range(200)
                   if any(ws[0] in b and ws[1] in b
                          for b in round_buckets(s.to_bytes(4, "big"), ws, 4)))
    # P(same bucket of 4 among 16) = 3/15 = 0.2
    assert abs(together / 200 - 0.2) < 0.12


@settings(max_examples=100, deadline=None)
@given(n=st.integers(4, 30), size=st.integers(2, 6), data=st.data())
def test_check_dealt_takes_the_beacons_deal_and_nothing_else(n, size, data):
    ws = workers(n)
    fair = round_buckets(SEED, ws, size)
    check_dealt(SEED, list(reversed(ws)), size, fair)
    rigged = [list(b) for b in fair]
    how = data.draw(st.sampled_from(["swap", "drop", "other_seed", "merge"]))
    if how == "swap" and len(fair) >= 2:
        rigged[0][0], rigged[1][0] = rigged[1][0], rigged[0][0]
        rigged = [sorted(b) for b in rigged]
    elif how == "drop":  # a sealed submitter left out of every bucket
        rigged = round_buckets(SEED, ws[1:], size)
    elif how == "merge" and len(fair) >= 2:
        rigged = [sorted(rigged[0] + rigged[1]), *rigged[2:]]
    else:
        rigged = round_buckets(b"\x08" * 32, ws, size)
    event(how)
    if rigged == fair:  # a swap inside one bucket's order, or a seed dealing alike
        return
    with pytest.raises(RejectedInput) as err:
        check_dealt(SEED, ws, size, rigged)
    assert err.value.reason == "invalid_board"


def test_round_buckets_deal_the_ranked_workers_round_robin():
    ws = workers(11)
    ranked = sorted(ws, key=lambda w: bucket_rank(SEED, bytes.fromhex(w)))
    buckets = round_buckets(SEED, ws, 4)  # 11 // 4 = 2 buckets of 6 and 5
    assert buckets == [sorted(ranked[0::2]), sorted(ranked[1::2])]
    assert [len(b) for b in buckets] == [6, 5]


@pytest.mark.parametrize("ws", [[], [worker(1)], [worker(1)] * 5])
def test_round_buckets_need_two_distinct_workers(ws):
    assert round_buckets(SEED, ws, 3) == []


@pytest.mark.parametrize(("n", "size"), [(2, 3), (2, 64), (4, 5), (7, 8)])
def test_fewer_workers_than_a_bucket_share_one_bucket(n, size):
    ws = workers(n)
    assert round_buckets(SEED, ws, size) == [sorted(ws)]


def test_round_buckets_at_exactly_two_sizes_make_two_buckets():
    buckets = round_buckets(SEED, workers(6), 3)
    assert [len(b) for b in buckets] == [3, 3]
    # 2 size - 1 workers still make one bucket (not one of size and a short one).
    assert [len(b) for b in round_buckets(SEED, workers(5), 3)] == [5]


def test_round_buckets_are_keys_in_lowercase_hex():
    ws = workers(6)
    assert set(flat(round_buckets(SEED, ws, 2))) == set(ws)
    assert all(w == w.lower() and len(w) == 64 for w in flat(round_buckets(SEED, ws, 2)))


def test_different_seeds_mix_the_buckets():
    ws = workers(12)
    partitions = {tuple(tuple(b) for b in round_buckets(bytes([i]) * 32, ws, 3))
                  for i in range(8)}
    # 12 workers into 4 buckets of 3 can be dealt 15400 ways: 8 seeds giving one
    # partition would mean the seed is ignored.
    assert len(partitions) >= 6
    # The seed decides who is together, not only the bucket order.
    pair_sets = {frozenset(frozenset(b) for b in p) for p in partitions}
    assert len(pair_sets) == len(partitions)


def test_bucket_rank_depends_on_the_seed_length_prefix():
    w = bytes.fromhex(worker(0))
    assert bucket_rank(b"ab", w) != bucket_rank(b"a", b"b" + w)
    assert len(bucket_rank(SEED, w)) == 32


# --------------------------------------------------------------------------- bucket_dropouts

@given(t=st.integers(0, 64), s=st.integers(2, 127))
def test_bucket_dropouts_keep_the_threshold_above_two_thirds(t, s):
    d = bucket_dropouts(t, s)
    assert 0 <= d <= t
    assert 3 * (s - d) > 2 * s  # k = s - t exceeds 2s / 3 (spec E.2, consistency round)
    # and no smaller than it has to be: one more dropout would break k > 2s / 3 or the run's t
    assert d == t or 3 * (s - d - 1) <= 2 * s


@pytest.mark.parametrize(("t", "s", "want"), [(1, 3, 0), (1, 2, 0), (5, 4, 1), (2, 5, 1),
                                              (3, 7, 2), (0, 9, 0), (4, 9, 2)])
def test_bucket_dropouts_examples(t, s, want):
    assert bucket_dropouts(t, s) == want


@given(t=st.integers(0, 64), a=st.integers(2, 127))
def test_bucket_threshold_is_the_assigned_count_less_the_capped_dropouts(t, a):
    k = bucket_threshold(t, a)
    assert k == a - bucket_dropouts(t, a)
    assert 2 <= k <= a  # never a bucket of one, never more than were dealt
    # Two views each signed by k of the a members share 2k - a > a / 3 signers.
    assert 3 * k > 2 * a and 2 * k - a > a / 3


@pytest.mark.parametrize(("t", "a", "want"), [(1, 2, 2), (1, 3, 3), (1, 4, 3), (5, 4, 3),
                                              (2, 5, 4), (2, 7, 5), (4, 9, 7), (0, 9, 9)])
def test_bucket_threshold_examples(t, a, want):
    assert bucket_threshold(t, a) == want


def test_words_file_is_four_bytes_a_parameter():
    assert words_file_bytes(10) == 40
    assert words_file_bytes(1) == 4


# --------------------------------------------------------------------------- phase_schedule

START, SECONDS = 100.0, 5.0
A, B, C, D, E, F, G, H, M, N, P, Q = (worker(i) for i in range(12))


def got(kind: dict[str, float], buckets: list[list[str]]) -> dict[str, tuple[int, float]]:
    where = {w: b for b, ms in enumerate(buckets) for w in ms}
    return {w: (where.get(w, -1), at) for w, at in kind.items()}


def schedule(buckets, posts, now, *, max_dropouts=1, start=START, seconds=SECONDS):
    received = {k: got(v, buckets) for k, v in posts.items()}
    return phase_schedule(start, seconds, buckets, received, now, max_dropouts=max_dropouts)


def test_phase_closes_at_its_last_expected_arrival_when_everyone_posted():
    buckets = [[A, B, C]]
    phases, states = schedule(buckets, {"keys": {A: 101.0, C: 102.5, B: 101.5}}, now=102.6)
    keys, deal = phases
    assert (keys.name, keys.opened_at, keys.deadline, keys.closed_at) == ("keys", START,
                                                                          START + SECONDS, 102.5)
    assert keys.expected == {A, B, C}
    # The next phase opens when the previous one closed, not at its deadline.
    assert (deal.name, deal.opened_at, deal.deadline, deal.closed_at) == ("deal", 102.5,
                                                                          107.5, None)
    assert deal.expected == {A, B, C}
    assert states[0].members == (A, B, C) and states[0].dealers is None and states[0].live


def test_phase_closes_at_its_deadline_when_someone_is_missing():
    buckets = [[A, B, C, D]]  # t = 1, k = 3: D may stay away
    posts = {"keys": {A: 101.0, B: 104.0, C: 102.0}}
    before, _ = schedule(buckets, posts, now=START + SECONDS - 1e-6)
    assert [p.name for p in before] == ["keys"] and before[0].closed_at is None
    assert open_phase(before, "keys") is before[0]
    assert open_phase(before, "deal") is None  # not opened yet
    at, states = schedule(buckets, posts, now=START + SECONDS)
    assert at[0].closed_at == START + SECONDS  # exactly the deadline, not the last arrival
    assert open_phase(at, "keys") is None
    assert at[1].opened_at == START + SECONDS and at[1].expected == {A, B, C}
    assert states[0].members == (A, B, C) and states[0].live
    later, _ = schedule(buckets, posts, now=START + 50)
    assert later[0].closed_at == START + SECONDS  # the close time does not drift with now
    assert later[1].closed_at == START + 2 * SECONDS  # deal: nobody dealt, deadline passed


def test_open_phase_hides_later_phases():
    phases, states = schedule([[A, B, C]], {}, now=START + 1)
    assert len(phases) == 1 and phases[0].closed_at is None
    assert all(st.members is None and st.live for st in states)


def test_no_buckets_close_every_phase_at_once():
    phases, states = schedule([], {}, now=START)
    assert [p.name for p in phases] == list(PHASES)
    assert all(p.closed_at == START and p.opened_at == START and not p.expected for p in phases)
    assert states == []


def test_complete_round_closes_each_phase_at_its_last_post():
    buckets = [[A, B, C]]
    posts = {"keys": {A: 100.5, B: 101.0, C: 101.2},
             "deal": {A: 102.0, B: 102.5, C: 103.0},
             "masked": {A: 104.0, B: 104.5, C: 103.5},
             "view": {A: 105.0, B: 104.8, C: 104.9},
             "reveal": {A: 106.0, B: 105.2, C: 105.5}}
    phases, states = schedule(buckets, posts, now=106.0)
    assert [(p.name, p.opened_at, p.closed_at) for p in phases] == [
        ("keys", 100.0, 101.2), ("deal", 101.2, 103.0), ("masked", 103.0, 104.5),
        ("view", 104.5, 105.0), ("reveal", 105.0, 106.0)]
    assert [p.deadline for p in phases] == pytest.approx([105.0, 106.2, 108.0, 109.5, 110.0])
    assert states == [BucketState(0, (A, B, C), (A, B, C), (A, B, C), (A, B, C), True,
                                  (A, B, C))]
    assert [p.to_json()["expected"] for p in phases] == [sorted([A, B, C])] * 5


def test_expected_senders_follow_each_phase_of_each_bucket():
    """keys: every assigned member; deal: the advertisers; masked: the dealers; view: the
    survivors; reveal: the survivors that signed the view, each of live buckets only."""
    buckets = [[A, B, C, D], [E, F, G, H], [M, N, P, Q]]  # t = 1, k = 3 in each
    posts = {"keys": {A: 101, B: 101, C: 101, D: 101, E: 101, F: 101, G: 101,  # H never
                      M: 101, N: 101, P: 101, Q: 101},
             "deal": {A: 106, B: 106, C: 106, E: 106, F: 106, G: 106,  # D advertised only
                      M: 106, N: 106, P: 106, Q: 106},
             "masked": {A: 111, B: 111, C: 111, E: 111, F: 111,  # G dealt but drops out
                        M: 111, N: 111, P: 111, Q: 111},
             "view": {A: 116, B: 116, C: 116, M: 116, N: 116},  # P and Q do not sign
             "reveal": {}}
    phases, states = schedule(buckets, posts, now=1000.0, max_dropouts=1)
    keys, deal, masked, view, reveal = phases
    assert [p.name for p in phases] == ["keys", "deal", "masked", "view", "reveal"]
    assert keys.expected == {A, B, C, D, E, F, G, H, M, N, P, Q}
    assert deal.expected == {A, B, C, D, E, F, G, M, N, P, Q}
    assert masked.expected == {A, B, C, E, F, G, M, N, P, Q}
    # Bucket 1: survivors E F, fewer than k = 3: dropped, it signs no view.
    assert view.expected == {A, B, C, M, N, P, Q}
    # Bucket 0: three signers: they reveal. Bucket 2: four survivors but two signers,
    # fewer than k: dropped, nobody reveals (not even the signers M and N).
    assert reveal.expected == {A, B, C}
    b0, b1, b2 = states
    assert (b0.members, b0.dealers, b0.survivors, b0.signers, b0.live) == (
        (A, B, C, D), (A, B, C), (A, B, C), (A, B, C), True)
    assert (b1.members, b1.dealers, b1.survivors, b1.signers, b1.live) == (
        (E, F, G), (E, F, G), (E, F), (), False)
    assert (b2.members, b2.dealers, b2.survivors, b2.signers, b2.live) == (
        (M, N, P, Q), (M, N, P, Q), (M, N, P, Q), (M, N), False)
    assert [p.closed_at for p in phases] == [105.0, 110.0, 115.0, 120.0, 125.0]


def test_bucket_with_fewer_than_k_advertisers_is_dropped():
    buckets = [[A, B, C, D], [E, F, G, H]]  # t = 1, k = 3 in each
    posts = {"keys": {A: 101, B: 101, E: 101, F: 102, G: 102}}
    phases, states = schedule(buckets, posts, now=START + SECONDS)
    assert states[0].members == (A, B) and not states[0].live
    assert states[1].members == (E, F, G) and states[1].live
    deal = phases[1]
    assert deal.expected == {E, F, G}  # A and B are not waited for, too few to finish
    # Once E, F and G dealt the deal phase closes without A and B, who stay out of every
    # later phase.
    phases, states = schedule(buckets, {**posts, "deal": {E: 106, F: 107, G: 106.5}}, now=107)
    assert phases[1].closed_at == 107 and phases[2].expected == {E, F, G}
    assert not states[0].live and states[0].dealers == ()


def test_bucket_with_fewer_than_k_dealers_is_dropped():
    buckets = [[A, B, C, D]]  # t = 1, k = 3
    posts = {"keys": {A: 101, B: 101, C: 101, D: 101}, "deal": {B: 102, D: 102}}
    phases, states = schedule(buckets, posts, now=500)
    assert states[0].dealers == (B, D) and not states[0].live
    masked = phases[2]
    assert masked.expected == frozenset() and masked.closed_at == masked.opened_at
    assert [(p.name, p.expected, p.closed_at) for p in phases[3:]] == [
        ("view", frozenset(), masked.opened_at), ("reveal", frozenset(), masked.opened_at)]


def test_an_empty_phase_closes_the_moment_it_opens():
    buckets = [[A, B]]
    # Nobody advertised: keys closes at its deadline, and deal, masked, view and reveal,
    # which then expect nobody, close at that same instant.
    phases, states = schedule(buckets, {}, now=START + SECONDS)
    assert [p.closed_at for p in phases] == [START + SECONDS] * 5
    assert [p.expected for p in phases[1:]] == [frozenset()] * 4
    assert states[0].members == () and not states[0].live


@pytest.mark.parametrize(("survivors", "max_dropouts", "live"), [
    ((A, B, C, D), 1, True),
    ((A, B, C), 1, True),  # k = 4 - 1 = 3
    ((A, B), 1, False),
    ((A, B, C), 0, False),  # t = 0: every dealer must survive
    ((A, B, C), 5, True),  # the run's t is capped at (4 - 1) // 3 = 1 for four assigned
    ((A, B), 5, False),  # ... so a large t never lowers k below 3
])
def test_survivors_below_the_threshold_drop_the_bucket(survivors, max_dropouts, live):
    buckets = [[A, B, C, D]]
    posts = {"keys": {A: 101, B: 101, C: 101, D: 101}, "deal": {A: 102, B: 102, C: 102, D: 102},
             "masked": {w: 103.0 for w in survivors}}
    # At 107 masked closed (at 103 when everyone posted, else at its deadline) and view
    # is open: the state is the one after masked.
    phases, states = schedule(buckets, posts, now=107, max_dropouts=max_dropouts)
    assert states[0].survivors == survivors and states[0].live is live
    assert phases[3].name == "view"
    assert phases[3].expected == (frozenset(survivors) if live else frozenset())


@pytest.mark.parametrize(("signers", "live"), [((A, B, C, D), True), ((A, C, D), True),
                                               ((B, D), False), ((), False)])
def test_view_signers_below_the_threshold_drop_the_bucket(signers, live):
    """Only the survivors that signed the view are waited for in ``reveal``, and only when
    at least k of them did (a member reveals only on k signatures of its view)."""
    buckets = [[A, B, C, D]]  # t = 1, k = 3
    everyone = {A: 101.0, B: 101.0, C: 101.0, D: 101.0}
    posts = {"keys": everyone, "deal": everyone, "masked": everyone,
             "view": {w: 102.0 for w in signers}}
    phases, states = schedule(buckets, posts, now=200)
    assert states[0].survivors == (A, B, C, D)
    assert states[0].signers == signers and states[0].live is live
    assert phases[4].name == "reveal"
    assert phases[4].expected == (frozenset(signers) if live else frozenset())


def test_threshold_counts_the_assigned_not_the_advertisers():
    # Seven assigned with t = 2: k = 7 - 2 = 5, whoever advertises. Counting the five
    # advertisers instead would give t = bucket_dropouts(2, 5) = 1 and k = 4, so a ledger
    # hiding members from the board could lower the threshold.
    buckets = [[A, B, C, D, E, F, G]]
    five = {A: 101.0, B: 101.0, C: 101.0, D: 101.0, E: 101.0}
    posts = {"keys": five, "deal": five, "masked": five}
    # keys closes at its deadline (105), deal and masked at that instant, view is open.
    phases, states = schedule(buckets, posts, now=106, max_dropouts=2)
    assert phases[3].name == "view" and phases[3].closed_at is None
    assert states[0].members == (A, B, C, D, E) and states[0].survivors == (A, B, C, D, E)
    assert states[0].live
    assert phases[3].expected == {A, B, C, D, E}
    four = {A: 107.0, B: 107.0, C: 107.0, D: 107.0}
    phases, states = schedule(buckets, {**posts, "masked": four}, now=300, max_dropouts=2)
    assert states[0].survivors == (A, B, C, D)
    assert not states[0].live and phases[3].expected == frozenset()
    # And four advertisers of seven cannot even start dealing.
    phases, states = schedule(buckets, {"keys": four}, now=300, max_dropouts=2)
    assert not states[0].live and phases[1].expected == frozenset()


def test_members_keep_the_assigned_order_and_ignore_other_senders():
    buckets = [[A, B, C]]
    posts = {"keys": {C: 101.0, A: 102.0, D: 100.5, B: 103.0}}  # D is in no bucket
    phases, states = schedule(buckets, posts, now=103.0)
    assert states[0].members == (A, B, C)
    assert phases[0].closed_at == 103.0  # D's post neither closes nor delays keys


def test_arrival_before_the_phase_opened_closes_it_on_opening():
    # The ledger never stores such a post; the rule still never closes a phase
    # before it opened.
    phases, _ = schedule([[A, B]], {"keys": {A: 101, B: 101}, "deal": {A: 100.5, B: 100.7}},
                         now=101)
    assert phases[1].opened_at == 101 and phases[1].closed_at == 101


# --------------------------------------------------------------------------- properties

#: When each worker posts in each phase, seconds after the phase opened (None: never).
Delays = dict[str, dict[str, float | None]]


@st.composite
def boards(draw):
    n = draw(st.integers(0, 9))
    size = draw(st.integers(2, 4))
    seed = draw(st.binary(min_size=1, max_size=8))
    buckets = round_buckets(seed, workers(n), size)
    seconds = draw(st.sampled_from([0.5, 1.0, 2.5, 5.0]))
    max_dropouts = draw(st.integers(0, 3))
    # Mostly on time, some late (after the deadline: the ledger refuses them), some never.
    delay = st.one_of(st.floats(0.0, seconds, allow_nan=False), st.just(0.0),
                      st.floats(seconds, 3 * seconds), st.none())
    delays = {w: {name: draw(st.one_of(delay, delay, st.floats(0.0, seconds * 0.9)))
                  for name in PHASES} for w in flat(buckets)}
    return buckets, seconds, max_dropouts, delays


def _check_phases(phases: list[Phase], seconds: float, now: float) -> None:
    assert [p.name for p in phases] == list(PHASES[: len(phases)])
    assert phases[0].opened_at == START
    for i, p in enumerate(phases):
        assert p.deadline == p.opened_at + seconds
        if p.closed_at is None:
            assert i == len(phases) - 1  # only the last phase listed may be open
            assert now < p.deadline
        else:
            assert p.opened_at <= p.closed_at <= p.deadline
            assert p.closed_at <= now
            if i + 1 < len(phases):
                assert phases[i + 1].opened_at == p.closed_at
    assert len(phases) == len(PHASES) or phases[-1].closed_at is None


def simulate(buckets, seconds, max_dropouts, delays, on_step=None):
    """Run the board as the ledger does: at each moment, the next post is the earliest
    pending one of a sender the open phase waits for, stored only while the phase is
    open; otherwise time jumps to the deadline. Returns the stored receipt times."""
    posts: dict[str, dict[str, float]] = {k: {} for k in PHASES}
    now = START
    for _ in range(len(PHASES) * (len(flat(buckets)) + 2)):
        phases, states = schedule(buckets, posts, now, max_dropouts=max_dropouts,
                                  seconds=seconds)
        if on_step is not None:
            on_step(now, posts, phases, states)
        cur = phases[-1]
        if cur.closed_at is not None:
            assert len(phases) == len(PHASES)
            return posts
        pending = [(cur.opened_at + d, w) for w in cur.expected - posts[cur.name].keys()
                   if (d := delays[w][cur.name]) is not None]
        at, who = min(pending, default=(float("inf"), ""))
        if at < cur.deadline:
            now = max(now, at)
            assert open_phase(phases, cur.name) is cur and who in cur.expected
            posts[cur.name][who] = now
            if cur.expected <= posts[cur.name].keys():
                # Everyone it waits for posted: the phase closes at this very post.
                after, _ = schedule(buckets, posts, now, max_dropouts=max_dropouts,
                                    seconds=seconds)
                assert after[PHASES.index(cur.name)].closed_at == now
        else:
            now = cur.deadline
    raise AssertionError("the board did not finish")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(board=boards())
def test_ledger_driven_schedule_only_moves_forward(board):
    """Arrivals stored as the ledger stores them (to an open phase, from a sender it waits
    for, once): close times stay within [opened, deadline] and never change once fixed."""
    buckets, seconds, max_dropouts, delays = board
    seen: dict[str, Phase] = {}  # the closed phases so far
    seen_states: list[list[BucketState]] = []

    def step(now, posts, phases, states):
        _check_phases(phases, seconds, now)
        for p in phases:
            if p.closed_at is not None:
                if p.name in seen:
                    assert p == seen[p.name], "a closed phase changed"
                seen[p.name] = p
            else:
                assert p.name not in seen, "a closed phase reopened"
        if seen_states:
            for old, new in zip(seen_states[-1], states, strict=True):
                for field in ("members", "dealers", "survivors", "signers"):
                    if getattr(old, field) is not None:
                        assert getattr(new, field) == getattr(old, field)
                if not old.live:
                    assert not new.live  # a dropped bucket never comes back
        seen_states.append(states)

    posts = simulate(buckets, seconds, max_dropouts, delays, step)
    now = max([START, *(t for kind in posts.values() for t in kind.values())]) + 1000.0
    final, states = schedule(buckets, posts, now, max_dropouts=max_dropouts, seconds=seconds)
    step(now, posts, final, states)
    assert len(final) == len(PHASES) and all(p.closed_at is not None for p in final)
    for p in final:
        if p.closed_at < p.deadline:
            assert p.expected <= posts[p.name].keys()  # closed early only when all posted
            if p.expected:
                event(f"{p.name} closed early")
        # Nobody posts to a phase that does not wait for it.
        assert posts[p.name].keys() <= p.expected
    if any(not s_.live for s_ in states):
        event("a bucket was dropped")
    if states and all(s_.live for s_ in states):
        event("every bucket finished")
    for st_ in states:
        if st_.live:
            k = bucket_threshold(max_dropouts, len(st_.assigned))
            assert k >= 2
            for field, kind in (("members", "keys"), ("dealers", "deal"),
                                ("survivors", "masked"), ("signers", "view")):
                listed = getattr(st_, field)
                # each list: the assigned that posted, in order, at least k of them
                assert listed == tuple(w for w in st_.assigned if w in posts[kind])
                assert len(listed) >= k
            assert set(st_.signers) <= set(st_.survivors) <= set(st_.dealers)
            assert set(st_.dealers) <= set(st_.members)
            # exactly the signers reveal-expected; nobody else of the bucket
            assert set(st_.assigned) & final[-1].expected == set(st_.signers)
        else:
            assert not set(st_.assigned) & final[-1].expected


@settings(max_examples=200, deadline=None)
@given(board=boards(), cut=st.floats(0.0, 25.0, allow_nan=False))
def test_schedule_at_any_time_is_a_prefix_of_the_final_one(board, cut):
    """What a reader saw at time ``cut`` (the rows stored by then) agrees with what the
    audit recomputes from all rows later: every phase closed then is closed alike, and
    the open one has the same opening, deadline and expected senders."""
    buckets, seconds, max_dropouts, delays = board
    posts = simulate(buckets, seconds, max_dropouts, delays)
    at = START + cut
    stored = {k: {w: t for w, t in v.items() if t <= at} for k, v in posts.items()}
    snapshot, _ = schedule(buckets, stored, at, max_dropouts=max_dropouts, seconds=seconds)
    final, _ = schedule(buckets, posts, at + 1000.0, max_dropouts=max_dropouts,
                        seconds=seconds)
    assert len(snapshot) <= len(final) == len(PHASES)
    for early, late in zip(snapshot, final, strict=False):
        if early.closed_at is not None:
            assert early == late
        else:
            assert (early.opened_at, early.deadline, early.expected) == (
                late.opened_at, late.deadline, late.expected)
            assert late.closed_at is None or late.closed_at > at
