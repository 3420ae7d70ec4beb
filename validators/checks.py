"""Per-submission checks a validator applies to a closed round's sealed list.

The ledger is not trusted: every admission rule is applied again here, then
the payload is decoded safely and its norm compared with the round's.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass

import torch
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import Signed, Submission
from veritrain.protocol.rules import SubmissionContext, check_submission
from veritrain.protocol.runtime import RunContext


@dataclass
class Candidate:
    """One sealed submission and its payload bytes (None if the blob was missing)."""

    signed: Signed[Submission]
    payload: bytes | None

    @property
    def worker(self) -> str:
        return self.signed.message.worker


def group_by_worker(candidates: list[Candidate]) -> tuple[dict[str, Candidate], set[str]]:
    """Each worker's first submission (by digest) and the workers with more than one."""
    by_worker: dict[str, Candidate] = {}
    repeated: set[str] = set()
    for c in sorted(candidates, key=lambda c: (c.worker, c.signed.digest)):
        if c.worker in by_worker:
            repeated.add(c.worker)
        else:
            by_worker[c.worker] = c
    return by_worker, repeated


@dataclass
class Rejection:
    worker: str
    digest: str
    reason: str
    detail: str


def admit_envelope(
    candidate: Candidate,
    run: RunContext,
    round_index: int,
    base_model_hash: str,
    registered: set[str],
    banned: set[str],
) -> None:
    """Every admission rule that needs no payload; raises RejectedInput."""
    ctx = SubmissionContext(
        spec=run.spec,
        round=round_index,
        base_model_hash=base_model_hash,
        worker_registered=candidate.worker in registered,
        worker_banned=candidate.worker in banned,
    )
    check_submission(candidate.signed, ctx)


def admit(
    candidate: Candidate,
    run: RunContext,
    round_index: int,
    base_model_hash: str,
    registered: set[str],
    banned: set[str],
) -> torch.Tensor:
    """The decoded pseudo-gradient of an admissible submission; raises RejectedInput."""
    admit_envelope(candidate, run, round_index, base_model_hash, registered, banned)
    sub = candidate.signed.message
    if candidate.payload is None:
        raise RejectedInput("payload blob is missing", "missing_payload")
    if len(candidate.payload) != sub.payload_bytes or (
        hashlib.sha256(candidate.payload).hexdigest() != sub.payload_hash
    ):
        raise RejectedInput("payload differs from the envelope", "payload_mismatch")
    return run.codec.decode(
        candidate.payload, run.numel, seed=run.codec_seed(round_index, candidate.worker)
    )


def norm_outliers(norms: dict[str, float], factor: float) -> dict[str, str]:
    """Workers whose update norm is over ``factor`` times the median, or under median/factor.

    Needs at least three updates to say anything; a lone update has no
    distribution to be far from.
    """
    if len(norms) < 3:
        return {}
    median = statistics.median(norms.values())
    out: dict[str, str] = {}
    for worker, n in norms.items():
        if n > factor * median or n * factor < median:
            out[worker] = f"update norm {n:.4g} vs round median {median:.4g} (factor {factor:g})"
    return out
