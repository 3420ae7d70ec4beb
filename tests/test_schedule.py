import pytest
from hypothesis import given
from hypothesis import strategies as st
from veritrain.protocol.schedule import (
    Action,
    RoundStatus,
    RoundView,
    close_problem,
    next_action,
    void_reason,
)


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


@given(st.data())
def test_a_close_the_schedule_allows_is_accepted_and_an_early_one_is_named(data):
    """Simulate the ledger's own rule (``next_action``) over a round: every close it makes
    at the time it makes it passes ``close_problem``; the same sealed list stamped at the
    deadline while it was seen closed earlier, or closed early without an active worker,
    does not."""
    active = data.draw(st.integers(1, 6))
    minimum = data.draw(st.integers(1, 6))
    arrivals = sorted(data.draw(st.lists(st.floats(0.0, 25.0), min_size=active,
                                         max_size=active)))
    late = data.draw(st.integers(0, active))  # how many never submit
    times = arrivals[: active - late]
    workers = [f"w{k}" for k in range(active)]
    deadline, round_seconds, slack = 10.0, 10.0, 1.0
    closed_at = None
    for now in sorted({*times, deadline}):
        count = sum(a <= now for a in times)
        if next_action(RoundView(RoundStatus.OPEN, deadline, count, active), now,
                       min_submissions=minimum) is Action.CLOSE:
            closed_at = now
            break
    if closed_at is None:
        return  # extended: not a close
    sealed = {w for w, a in zip(workers, times, strict=False) if a <= closed_at}
    kwargs = dict(opened_at=0.0, deadline=deadline, extensions=0, round_seconds=round_seconds,
                  min_submissions=minimum, active_at_close=workers, slack=slack)
    assert close_problem(closed_at=closed_at, sealed=sealed, seen_closed_at=closed_at + 0.1,
                         **kwargs) is None
    if closed_at < deadline - 2 * slack:  # an early close stamped as the deadline
        assert "before the close time" in close_problem(
            closed_at=deadline, sealed=sealed, seen_closed_at=closed_at + 0.1, **kwargs)
    if sealed and closed_at < deadline:  # the same close without one of the active workers
        dropped = sorted(sealed)[0]
        assert "without 1 active worker" in close_problem(
            closed_at=closed_at, sealed=sealed - {dropped}, seen_closed_at=closed_at,
            **kwargs)


def test_a_deadline_shorter_than_the_schedule_is_named():
    assert "earlier than opened_at" in close_problem(
        opened_at=0.0, deadline=15.0, extensions=1, closed_at=15.0, round_seconds=10.0,
        min_submissions=1, sealed={"a"}, active_at_close={"a"}, seen_closed_at=15.0,
        slack=1.0)
    assert close_problem(
        opened_at=0.0, deadline=20.0, extensions=1, closed_at=20.0, round_seconds=10.0,
        min_submissions=1, sealed={"a"}, active_at_close={"a", "b"}, seen_closed_at=20.0,
        slack=1.0) is None  # at the (extended) deadline a missing worker is allowed
