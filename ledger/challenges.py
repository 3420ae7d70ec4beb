"""Challenges and reveals: the ledger's part of spot checks.

When a round's beacon is fixed the ledger derives, with the same pure rule
as the validators (:mod:`veritrain.protocol.challenges`), which segments each
worker in the sealed list must reveal, records them with a reveal deadline,
and from then on accepts exactly the files those challenges name: a reveal is
a content-addressed upload whose hash must be in some worker's ``needed``
list, so no signature is required and nothing else can be stored.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges, needed_hashes
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import RunSpec, Submission, open_signed

from . import schema as t


class NotChallenged(RejectedInput):
    reason = "not_challenged"


def fix_challenges(s: Session, spec: RunSpec, rnd: t.Round, seed: bytes, now: float
                   ) -> dict[str, list[int]]:
    """Record every worker's challenged segments and the files they must reveal."""
    subs = {}
    for envelope in s.execute(select(t.Submission.envelope).where(
            t.Submission.run_id == rnd.run_id, t.Submission.round == rnd.round)).scalars():
        sub = open_signed(decode_canonical(envelope), Submission).message
        subs[sub.worker] = sub
    masked = spec.masked
    policy = ChallengePolicy.from_spec(spec.inner, spec.verification, masked=masked is not None)
    challenges = compute_challenges(seed, sorted(subs), policy)
    for worker, segments in challenges.items():
        sub = subs[worker]
        need = needed_hashes(sub.trail, segments, sub.ef_hash,
                             sub.payload_hash if masked is not None else None)
        s.add(t.ChallengeRow(
            run_id=rnd.run_id, round=rnd.round, worker=worker,
            segments=encode_canonical(segments).decode(),
            needed=encode_canonical(need).decode()))
    # A masked round's four board phases come first: openings follow the masked inputs.
    board = 4 * masked["phase_seconds"] if masked is not None else 0.0
    rnd.reveal_deadline = now + board + spec.verification["reveal_seconds"]
    return challenges


def needed_by(s: Session, run_id: str, r: int) -> dict[str, list[str]]:
    """Content hash -> workers whose challenges need it."""
    out: dict[str, list[str]] = {}
    for row in s.execute(select(t.ChallengeRow).where(
            t.ChallengeRow.run_id == run_id, t.ChallengeRow.round == r)).scalars():
        for digest in json.loads(row.needed):
            out.setdefault(digest, []).append(row.worker)
    return out


def check_reveal_wanted(s: Session, run_id: str, r: int, digest: str) -> bool:
    """Refuse (before reading the body) a reveal nobody asked for; True if already stored.

    Identical files (for example the all-zero residual of every new worker)
    share one hash, so a second upload of a stored reveal is not an error.
    """
    if digest not in needed_by(s, run_id, r):
        raise NotChallenged(f"no challenge of round {r} needs {digest[:12]}")
    return s.get(t.RevealRow, (run_id, r, digest)) is not None


def challenges_view(s: Session, run_id: str, r: int, now: float) -> dict[str, Any]:
    rnd = s.get(t.Round, (run_id, r))
    if rnd is None:
        raise RejectedInput(f"run {run_id!r} has no round {r}", "not_found")
    received = set(s.execute(select(t.RevealRow.digest).where(
        t.RevealRow.run_id == run_id, t.RevealRow.round == r)).scalars())
    rows = s.execute(select(t.ChallengeRow).where(
        t.ChallengeRow.run_id == run_id, t.ChallengeRow.round == r)
        .order_by(t.ChallengeRow.worker)).scalars().all()
    challenges = []
    for row in rows:
        needed = json.loads(row.needed)
        challenges.append({"worker": row.worker, "segments": json.loads(row.segments),
                           "needed": needed,
                           "received": [d for d in needed if d in received]})
    fixed = rnd.reveal_deadline is not None
    return {
        "run_id": run_id, "round": r, "fixed": fixed, "reveal_deadline": rnd.reveal_deadline,
        "now": now, "challenges": challenges,
        "complete": fixed and all(len(c["received"]) == len(c["needed"]) for c in challenges),
    }
