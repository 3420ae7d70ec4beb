"""Consequences recorded when a round finalizes (specs/scoring.md, "Penalties").

* A worker whose verdict proves misconduct (``PENALIZED_REASONS``: a failed spot check,
  or a due reveal that never came) scores 0 for the round, is banned for
  ``ban_rounds`` rounds, and forfeits its unvested rewards: rewards vest
  ``vesting_rounds`` rounds after they were earned, so what it earned in the
  rounds ``r - vesting_rounds + 1 .. r - 1`` is taken back (a ``forfeit``
  penalty row for each).
* A validator whose result differs from the certified one is recorded as a
  fault with both digests, whether it posted before or after the quorum.

Nothing is edited: penalties are new rows, chained like every other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from veritrain.protocol.messages import RunSpec
from veritrain.protocol.rules import PENALIZED_REASONS

from . import schema as t

Emit = Callable[[str, dict[str, Any]], None]


def apply_worker_penalties(s: Session, spec: RunSpec, r: int, verdicts: list[dict[str, Any]],
                           emit: Emit) -> None:
    ban_rounds = spec.verification["ban_rounds"]
    vesting = spec.verification["vesting_rounds"]
    for v in verdicts:
        if v["reason"] not in PENALIZED_REASONS:
            continue
        worker = v["worker"]
        part = s.execute(select(t.Participant).where(
            t.Participant.run_id == spec.run_id, t.Participant.pubkey == worker)
        ).scalar_one_or_none()
        if part is not None and ban_rounds > 0:
            part.banned_until_round = r + ban_rounds
            emit("ban", {"run_id": spec.run_id, "round": r, "worker": worker,
                         "until_round": part.banned_until_round, "reason": v["reason"]})
        unvested = s.execute(select(t.Verdict).where(
            t.Verdict.run_id == spec.run_id, t.Verdict.worker == worker,
            t.Verdict.round > r - vesting, t.Verdict.round < r, t.Verdict.reward > 0)
            .order_by(t.Verdict.round)).scalars().all()
        for earned in unvested:
            s.add(t.Penalty(run_id=spec.run_id, round=r, worker=worker, kind="forfeit",
                            amount=earned.reward, source_round=earned.round,
                            reason=v["reason"], detail=v["detail"][:500]))
            emit("penalty", {"run_id": spec.run_id, "round": r, "worker": worker,
                             "kind": "forfeit", "amount": earned.reward,
                             "source_round": earned.round, "reason": v["reason"]})


def record_validator_faults(s: Session, spec: RunSpec, r: int, certified_digest: str,
                            emit: Emit) -> None:
    """A fault for every result of round ``r`` whose certified state is not the certificate's."""
    known = {(f.validator) for f in s.execute(select(t.ValidatorFault).where(
        t.ValidatorFault.run_id == spec.run_id, t.ValidatorFault.round == r)).scalars()}
    for row in s.execute(select(t.RoundResultRow).where(
            t.RoundResultRow.run_id == spec.run_id, t.RoundResultRow.round == r)).scalars():
        if row.certified_digest == certified_digest or row.validator in known:
            continue
        s.add(t.ValidatorFault(run_id=spec.run_id, round=r, validator=row.validator,
                               result_digest=row.certified_digest,
                               certified_digest=certified_digest))
        emit("validator_fault", {"run_id": spec.run_id, "round": r, "validator": row.validator,
                                 "result_digest": row.certified_digest,
                                 "certified_digest": certified_digest})
