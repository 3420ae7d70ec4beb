"""Round lifecycle as a small state machine (no I/O, no clock of its own).

    open --(deadline passed and >= min_submissions, or every active worker in)--> closed
    open --(deadline passed, too few submissions)--> open, deadline extended
    closed --(quorum of matching validator attestations)--> finalized; next round opens

The ledger feeds it the time and the counts and persists what it returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class RoundStatus(StrEnum):
    OPEN = "open"
    CLOSED = "closed"
    FINALIZED = "finalized"


class Action(StrEnum):
    NONE = "none"
    CLOSE = "close"
    EXTEND = "extend"


@dataclass(frozen=True)
class RoundView:
    """What the schedule needs to know about one round."""

    status: RoundStatus
    deadline: float
    submissions: int
    active_workers: int


def next_action(view: RoundView, now: float, *, min_submissions: int) -> Action:
    """What the ledger should do with a round at time ``now``."""
    if view.status is not RoundStatus.OPEN:
        return Action.NONE
    everyone_in = view.active_workers > 0 and view.submissions >= max(
        view.active_workers, min_submissions
    )
    if everyone_in:
        return Action.CLOSE
    if now < view.deadline:
        return Action.NONE
    return Action.CLOSE if view.submissions >= min_submissions else Action.EXTEND


def is_accepting_submissions(view: RoundView, now: float) -> bool:
    """Submissions are taken while the round is open (late ones are stragglers)."""
    return view.status is RoundStatus.OPEN
