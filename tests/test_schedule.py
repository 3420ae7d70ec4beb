import pytest
from veritrain.protocol.schedule import Action, RoundStatus, RoundView, next_action


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
