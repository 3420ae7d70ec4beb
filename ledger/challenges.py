"""Challenges and reveals: the ledger's part of spot checks.

When a round's beacon is fixed the ledger derives, with the same pure rule as the
validators and the workers (:mod:`veritrain.protocol.challenges`), which segments
each worker in the sealed list must open, records them with a reveal deadline and a
bound on each reveal file's size, and from then on takes from each worker whose
reveal is due exactly one signed ``SpotReveal`` and its file, before the deadline,
answering with a signed ``RevealReceipt``. A reveal is refused before its file is
read when it is from a stranger, for a worker with nothing due, late, too large, or a
second one (an exact resend gets its receipt again).
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from veritrain.protocol.challenges import (
    ChallengePolicy,
    compute_challenges,
    max_reveal_file_bytes,
)
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import RunSpec, Signed, SpotReveal, Submission, open_signed
from veritrain.protocol.schedule import RoundStatus
from veritrain.protocol.secagg import PHASES

from . import schema as t


class NotChallenged(RejectedInput):
    reason = "not_challenged"


class RevealLate(RejectedInput):
    reason = "reveal_late"


def fix_challenges(s: Session, spec: RunSpec, rnd: t.Round, seed: bytes, now: float, *,
                   buckets: list[list[str]] | None = None) -> dict[str, list[int]]:
    """Record every worker's challenged segments, whether a reveal is due, and its bound.
    A masked round's come from its openings seed over the survivor sets (``buckets``),
    once the masked inputs are committed (ledger/openings.py)."""
    subs = {}
    for envelope in s.execute(select(t.Submission.envelope).where(
            t.Submission.run_id == rnd.run_id, t.Submission.round == rnd.round)).scalars():
        sub = open_signed(decode_canonical(envelope), Submission).message
        subs[sub.worker] = sub
    masked = spec.masked
    policy = ChallengePolicy.of_run(spec)
    challenges = compute_challenges(seed, sorted(subs), policy, buckets=buckets)
    due = set(policy.checked_workers(challenges))
    for worker, segments in challenges.items():
        bound = max_reveal_file_bytes(
            spec.num_params, spec.inner["trail_every"], len(segments), policy,
            payload_bytes=subs[worker].payload_bytes if masked is not None else 0)
        s.add(t.ChallengeRow(run_id=rnd.run_id, round=rnd.round, worker=worker,
                             segments=encode_canonical(segments).decode(),
                             due=worker in due, max_bytes=bound))
    # A masked round's openings are drawn once the masked phase closed: the view and reveal
    # phases may still run, and the opened workers' reveals follow.
    board = (len(PHASES) - PHASES.index("masked") - 1) * masked["phase_seconds"] \
        if masked is not None else 0.0
    rnd.reveal_deadline = now + board + spec.verification["reveal_seconds"]
    return challenges


def check_reveal_allowed(s: Session, signed: Signed[SpotReveal], now: float
                         ) -> t.SpotRevealRow | None:
    """Refuse (before reading the file) a reveal the round does not take now; the stored
    row when this exact envelope is already recorded (its receipt is answered again)."""
    msg = signed.message
    if signed.signer != msg.worker:
        raise RejectedInput("a reveal is signed by its worker", "bad_signature")
    rnd = s.get(t.Round, (msg.run_id, msg.round))
    if rnd is None:
        raise RejectedInput(f"run {msg.run_id!r} has no round {msg.round}", "not_found")
    row = s.get(t.ChallengeRow, (msg.run_id, msg.round, msg.worker))
    if rnd.reveal_deadline is None or row is None or not row.due:
        raise NotChallenged(f"no reveal of {msg.worker[:12]} is due in round {msg.round}")
    stored = s.get(t.SpotRevealRow, (msg.run_id, msg.round, msg.worker))
    if stored is not None:
        if stored.digest == signed.digest:
            return stored
        raise RejectedInput("this worker already revealed for this round", "duplicate")
    if rnd.finalized_at is not None:
        raise RejectedInput(f"round {msg.round} is finalized", "round_finalized")
    if now > rnd.reveal_deadline:
        raise RevealLate(f"the reveal deadline of round {msg.round} has passed")
    submitted = s.execute(select(t.Submission.digest).where(
        t.Submission.run_id == msg.run_id, t.Submission.round == msg.round,
        t.Submission.worker == msg.worker)).scalar_one_or_none()
    if submitted != msg.submission_digest:
        raise RejectedInput("the reveal names another submission than the sealed one",
                            "wrong_submission")
    if msg.reveal_bytes > row.max_bytes:
        raise RejectedInput(f"a reveal of these checks is at most {row.max_bytes} bytes",
                            "oversized")
    blob = s.get(t.Blob, msg.reveal_hash)
    if blob is not None and still_sealed(s, blob):
        # Receipted, a file nobody may fetch yet could not be served, and validators
        # holding the receipt would certify nothing (protocol.md 7.5 step 3).
        raise RejectedInput("the reveal file is a submission payload still sealed in "
                            "an open round", "blob_sealed")
    return None


def still_sealed(s: Session, blob: t.Blob) -> bool:
    """Whether ``blob`` is a payload whose round is still open: nobody may fetch it yet,
    so nobody can copy it."""
    if blob.sealed_round is None or blob.run_id is None:
        return False
    rnd = s.get(t.Round, (blob.run_id, blob.sealed_round))
    return rnd is None or rnd.status == RoundStatus.OPEN.value


def challenges_view(s: Session, run_id: str, r: int, now: float) -> dict[str, Any]:
    """Every worker's checks of round ``r`` and, where it arrived, its signed reveal and
    the ledger's receipt (validators take nothing else: each is signed)."""
    rnd = s.get(t.Round, (run_id, r))
    if rnd is None:
        raise RejectedInput(f"run {run_id!r} has no round {r}", "not_found")
    reveals = {row.worker: row for row in s.execute(select(t.SpotRevealRow).where(
        t.SpotRevealRow.run_id == run_id, t.SpotRevealRow.round == r)).scalars()}
    rows = s.execute(select(t.ChallengeRow).where(
        t.ChallengeRow.run_id == run_id, t.ChallengeRow.round == r)
        .order_by(t.ChallengeRow.worker)).scalars().all()
    challenges = []
    for row in rows:
        got = reveals.get(row.worker)
        challenges.append({
            "worker": row.worker, "segments": json.loads(row.segments), "due": row.due,
            "max_bytes": row.max_bytes,
            "reveal": None if got is None else {
                "envelope": decode_canonical(got.envelope),
                "receipt": decode_canonical(got.receipt)}})
    fixed = rnd.reveal_deadline is not None
    return {
        "run_id": run_id, "round": r, "fixed": fixed, "reveal_deadline": rnd.reveal_deadline,
        "now": now, "challenges": challenges,
        "complete": fixed and all(c["reveal"] is not None for c in challenges if c["due"]),
    }


__all__ = ["NotChallenged", "RevealLate", "challenges_view", "check_reveal_allowed",
           "fix_challenges", "still_sealed"]
