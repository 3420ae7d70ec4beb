import pytest
from hypothesis import given
from hypothesis import strategies as st
from veritrain.protocol.schedule import Action, RoundStatus, RoundView, next_action, void_reason


@pytest.mark.parametrize(("view", "now", "minimum", "expected"), [
    (RoundView(RoundStatus.OPEN, 10.0, 2, 4), 5.0, 1, Action.NONE),      # before deadline
    (RoundView(RoundStatus.OPEN, 10.0, 4, 4), 5.0, 1, Action.CLOSE),     # everyone is in
    (RoundView(RoundStatus.OPEN, 10.0, 2, 4), 10.0, 2, Action.CLOSE),    # deadline, quota met
    (RoundView(RoundStatus.OPEN, 10.0, 1, 4), 11.0, 2, Action.EXTEND),   # deadline, too few
    (RoundView(RoundStatus.OPEN, 10.0, 0, 0), 11.0, 1, Action.EXTEND),   # nobody at all
    (RoundView(RoundStatus.OPEN, 10.0, 2, 2), 5.0, 3, Action.NONE),      # all in, below minimum
    (RoundView(RoundStatus.CLOSED, 10.0, 4, 4), 50.0, 1, Action.NONE),
    (RoundView(RoundStatus.FINALIZED, 10.0, 4, 4), 50.0, 1, Action.NONE),
])
def test_next_action(view, now, minimum, expected):
    assert next_action(view, now, min_submissions=minimum) is expected


@given(st.integers(1, 7).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(1, n),
    st.dictionaries(st.integers(0, n - 1), st.sampled_from("abc"), max_size=n))))
def test_a_round_is_voided_as_split_exactly_when_no_quorum_can_still_agree(case):
    n, quorum, results = case
    why = void_reason(closed_at=0.0, now=1.0, certify_seconds=10.0, results=results,
                      eligible=n, quorum=quorum)
    # Could the validators yet to post, all siding with one state, make a quorum?
    outstanding = [k for k in range(n) if k not in results]
    reachable = any(list(results.values()).count(x) + len(outstanding) >= quorum
                    for x in "abcd")  # "d": a state nobody certified yet
    assert (why is None) == reachable
    assert why is None or why.startswith("split")
    late = void_reason(closed_at=0.0, now=10.0, certify_seconds=10.0, results=results,
                       eligible=n, quorum=quorum)
    assert late is not None  # past certify_seconds, always
