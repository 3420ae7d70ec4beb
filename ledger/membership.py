"""The ledger's edge of admission (protocol/membership.py): the membership rows of a run
folded from the chain, the checks at the door for registrations and membership
messages, the ``slash`` records a finalized round's proven faults get, and the rows
served to validators and auditors.

No balance or admission is stored anywhere but in the chained rows: every answer here is
a fold of them, as the validators' and the audit's are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from veritrain.protocol.board import BoardFault
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.membership import (
    MEMBERSHIP_KINDS,
    MEMBERSHIP_MESSAGES,
    SLASH,
    BondWithdrawal,
    Membership,
    open_membership,
    slash_record,
)
from veritrain.protocol.messages import RunSpec, Signed
from veritrain.protocol.rules import PENALIZED_REASONS
from veritrain.protocol.schedule import RoundStatus

from . import schema as t

Emit = Callable[[str, dict[str, Any]], None]


class NotAdmitted(RejectedInput):
    """A registration (or membership message) the run's admission policy does not allow."""

    reason = "not_admitted"


def first_unclosed_round(s: Session, run_id: str) -> int:
    """The first round that has not closed: the open one, or the next to open."""
    row = s.execute(select(t.Round).where(t.Round.run_id == run_id)
                    .order_by(t.Round.round.desc()).limit(1)).scalar_one_or_none()
    if row is None:
        return 0
    return row.round if row.status == RoundStatus.OPEN.value else row.round + 1


def _rows(s: Session, run_id: str, after: int = -1, limit: int | None = None
          ) -> list[t.Event]:
    query = select(t.Event).where(t.Event.run_id == run_id, t.Event.seq > after,
                                  t.Event.kind.in_(MEMBERSHIP_KINDS)).order_by(t.Event.seq)
    return list(s.execute(query if limit is None else query.limit(limit)).scalars())


def state_of(s: Session, spec: RunSpec) -> Membership:
    """The run's membership state from its chained rows (each checked when it was
    accepted: decoded here without verifying its signature again)."""
    state = Membership.of_run(spec)
    if state.policy.open:
        return state
    for row in _rows(s, spec.run_id):
        body = decode_canonical(bytes(row.body))
        if row.kind == SLASH:
            state.add_slash(body)
        else:
            state.add(MEMBERSHIP_MESSAGES[row.kind].from_body(body["body"]))
    return state


def check_registration(s: Session, spec: RunSpec, worker: str) -> None:
    """Refuse (``not_admitted``) a worker the chain does not admit in the first round not
    yet closed, saying why; nothing is stored."""
    state = state_of(s, spec)
    if state.policy.open:
        return
    problem = state.admission_problem(worker, first_unclosed_round(s, spec.run_id))
    if problem is not None:
        raise NotAdmitted(f"{spec.run_id} admits workers by {state.policy.policy}: {problem}")


def check_message(s: Session, spec: RunSpec, signed: Signed[Any]) -> None:
    """A membership message's door checks: signed by the key the policy gives its kind,
    for a round not yet closed (no back-dating), a withdrawal at least
    ``unbonding_rounds`` ahead, of no more than the bond, from a worker with no round
    pending."""
    state = state_of(s, spec)
    try:
        open_membership(signed.to_wire(), state.policy)
    except BoardFault as exc:
        raise NotAdmitted(str(exc)) from exc
    msg = signed.message
    if msg.run_id != spec.run_id:
        raise RejectedInput(f"a {msg.KIND} of another run", "wrong_run")
    now = first_unclosed_round(s, spec.run_id)
    if msg.round < now:
        raise RejectedInput(f"a {msg.KIND} for round {msg.round}; round {now} is the first "
                            "not yet closed", "wrong_round")
    if isinstance(msg, BondWithdrawal):
        if msg.round < now + state.policy.unbonding_rounds:
            raise RejectedInput(
                f"a withdrawal takes effect {state.policy.unbonding_rounds} rounds ahead at "
                f"the earliest: round {now + state.policy.unbonding_rounds}", "wrong_round")
        if msg.amount > state.balance(msg.worker, msg.round):
            raise RejectedInput(f"withdrawal of {msg.amount} units from a bond of "
                                f"{state.balance(msg.worker, msg.round)}", "malformed")
        pending = s.execute(select(t.Submission.round).join(t.Round, (
            t.Round.run_id == t.Submission.run_id) & (t.Round.round == t.Submission.round))
            .where(t.Submission.run_id == spec.run_id, t.Submission.worker == msg.worker,
                   t.Round.status != RoundStatus.FINALIZED.value).limit(1)).first()
        if pending is not None:
            raise RejectedInput(f"round {pending[0]} of this worker is still pending its "
                                "checks", "wrong_state")


def stored(s: Session, run_id: str, signed: Signed[Any]) -> bool:
    """Whether this exact message is recorded already."""
    body = signed.encode()
    return any(bytes(row.body) == body for row in s.execute(select(t.Event).where(
        t.Event.run_id == run_id, t.Event.kind == signed.message.KIND)).scalars())


def apply_slashes(s: Session, spec: RunSpec, r: int, verdicts: list[dict[str, Any]],
                  emit: Emit) -> None:
    """A ``slash`` record for every proven fault of round ``r`` under a non-open policy,
    written after the round's certificate: ``slash_share`` of the bond (0 under an
    allowlist) with the verdict's submission digest as its evidence; it voids the
    worker's tickets up to round ``r`` and lowers its bond from round ``r + 1``."""
    state = state_of(s, spec)
    if state.policy.open:
        return
    for v in verdicts:
        if v["reason"] not in PENALIZED_REASONS:
            continue
        amount, balance = (state.slash_amount(v["worker"], r) if state.policy.policy == "bond"
                           else (0, 0))
        emit(SLASH, slash_record(spec.run_id, r, v["worker"], v["reason"],
                                 v["submission_digest"], amount, balance))


def rows_served(s: Session, run_id: str, after: int = -1, limit: int | None = None
                ) -> list[dict[str, Any]]:
    """The run's membership rows as validators and auditors fold them, in chain order:
    ``seq``, ``kind`` and ``body`` (the signed wire of a message, the record of a slash);
    those with ``seq`` > ``after``, at most ``limit`` of them (all when None)."""
    out = []
    for row in _rows(s, run_id, after, limit):
        body = decode_canonical(bytes(row.body))
        if row.kind == SLASH:
            body = {k: v for k, v in body.items() if k != "kind"} | {"kind": SLASH}
        out.append({"seq": row.seq, "kind": row.kind, "body": body})
    return out


def balances(s: Session, spec: RunSpec, workers: list[str]) -> dict[str, dict[str, Any]]:
    """Each worker's bond, slashes and admission in the first round not yet closed, all
    folded from the chained rows: ``bond`` (what it holds in that round), ``deposited``,
    ``withdrawn`` (effective by that round; ``withdrawal_pending``: later), ``slashed``
    (the units its slashes took) and ``slashes`` (``{round, amount}`` per proven fault),
    ``admitted`` and, when not, ``why_not``."""
    state = state_of(s, spec)
    r = first_unclosed_round(s, spec.run_id)
    out = {}
    for w in workers:
        moves = state.moves.get(w, [])
        cut = {rr: amount for rr, phase, amount in moves if phase == 2}
        problem = state.admission_problem(w, r)
        out[w] = {
            "bond": state.balance(w, r),
            "deposited": sum(a for rr, phase, a in moves if phase == 0 and rr <= r),
            "withdrawn": sum(a for rr, phase, a in moves if phase == 1 and rr <= r),
            "withdrawal_pending": sum(a for rr, phase, a in moves if phase == 1 and rr > r),
            "slashed": sum(cut.values()),
            "slashes": [{"round": v, "amount": cut.get(v, 0)}
                        for v in sorted(state.slashed.get(w, []))],
            "slashed_rounds": state.slashed.get(w, []),
            "admitted": problem is None, "why_not": problem,
        }
    return out


def encode_record(kind: str, body: dict[str, Any]) -> bytes:
    return encode_canonical({"kind": kind, **body})
