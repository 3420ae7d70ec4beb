"""Round lifecycle as a small state machine (no I/O, no clock of its own).

    open --(deadline passed and >= min_submissions, or every active worker in)--> closed
    open --(deadline passed, too few submissions)--> open, deadline extended
    closed --(quorum of matching validator attestations)--> finalized; next round opens
    closed --(no quorum possible, or none by certify_seconds)--> voided; next round opens
                                                               on the same base

The ledger feeds it the time and the counts and persists what it returns.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum


class RoundStatus(StrEnum):
    OPEN = "open"
    CLOSED = "closed"
    FINALIZED = "finalized"
    VOIDED = "voided"


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


def void_reason(*, closed_at: float, now: float, certify_seconds: float,
                results: Mapping[int, str], eligible: int, quorum: int) -> str | None:
    """Why a closed round that has no certificate is given up, or None while one can
    still come. ``results``: validator index -> the digest of the state it certified;
    ``eligible``: the validators whose attestation counts.

    A split is certain once the largest group of identical results plus the validators
    yet to post is under the quorum (``max_count + (eligible - posted) < quorum``); a
    timeout once ``certify_seconds`` passed since the close. Either way the run goes on:
    the round is voided and the next one opens on the same certified base."""
    groups = Counter(results.values())
    largest = max(groups.values(), default=0)
    if largest + (eligible - len(results)) < quorum:
        return (f"split: {len(results)} results certify {len(groups)} different states; "
                f"no {quorum} of them can agree")
    if now >= closed_at + certify_seconds:
        return f"timeout: no certificate {certify_seconds:g} s after the round closed"
    return None


def close_problem(*, opened_at: float, deadline: float, extensions: int,
                  closed_at: float | None, round_seconds: float, min_submissions: int,
                  sealed: Collection[str], active_at_close: Collection[str],
                  seen_closed_at: float, slack: float) -> str | None:
    """Why a party should not take a round's close as the schedule's, or None.

    ``next_action`` closes a round at its deadline, at least ``opened_at + round_seconds``
    and ``round_seconds`` more per extension, or before it only once every active worker
    is in with at least ``min_submissions`` (``sealed``: the workers of the sealed list;
    ``active_at_close``: registered, unbanned workers registered before ``closed_at``).
    The close time itself is checked against the party's own clock: it saw the round
    closed at ``seen_closed_at``, so a ``closed_at`` later than that by more than
    ``slack`` (clock skew allowed) is a close stamped after it happened, as a ledger that
    sealed early and claims the deadline would stamp it."""
    if closed_at is None:
        return "the round is closed but has no close time"
    if deadline < opened_at + round_seconds * (1 + extensions) - 1e-6:
        return (f"deadline {deadline:.3f} is earlier than opened_at + round_seconds x "
                f"{1 + extensions} ({opened_at + round_seconds * (1 + extensions):.3f})")
    if seen_closed_at + slack < closed_at:
        return (f"seen closed at {seen_closed_at:.3f} by this party's clock, "
                f"{closed_at - seen_closed_at:.1f} s before the close time the ledger "
                f"states ({closed_at:.3f}; or this party's clock is that far behind)")
    if closed_at < deadline:
        missing = set(active_at_close) - set(sealed)
        if missing:
            return (f"closed {deadline - closed_at:.1f} s before its deadline without "
                    f"{len(missing)} active worker(s) in, e.g. {sorted(missing)[0][:12]}")
        if len(set(sealed)) < min_submissions:
            return (f"closed before its deadline with {len(set(sealed))} submissions, "
                    f"{min_submissions} needed")
    return None
