"""Submission admission rules shared by the ledger (at its door) and validators.

Validators do not trust the ledger, so they re-apply every rule here to the
sealed submission list before decoding anything. Each rule raises
:class:`RejectedInput` with a stable reason code (specs/protocol.md,
"Rejection reasons").
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import OversizedError, RejectedInput
from .messages import RunSpec, Signed, Submission

#: Every reason a submission can be rejected for, in the order they are checked.
REJECTION_REASONS = (
    "malformed",
    "bad_signature",
    "wrong_run",
    "wrong_round",
    "unknown_worker",
    "banned",
    "wrong_base_model",
    "wrong_codec",
    "oversized",
    "payload_mismatch",
    "duplicate",
    "undecodable",
    "non_finite",
    "norm_outlier",
    "spot_check_failed",
    "missing_reveal",
    "missing_payload",
)

#: Verdict reasons that prove misconduct and cost the worker its ban and unvested rewards
#: (specs/scoring.md, "Penalties"): a failed recomputation or binding, or a due reveal
#: that never came (a worker holding the ledger's receipt for it can show the ledger hid it).
PENALIZED_REASONS = frozenset({"spot_check_failed", "missing_reveal"})

#: Statistical filters: suspicion, not proof. An update they flag is kept out of the
#: aggregate with verdict status ``excluded`` (not ``rejected``), and the worker is paid as
#: if it had been aggregated (specs/scoring.md, "Excluded updates"; specs/protocol.md 8).
FILTER_REASONS = frozenset({"norm_outlier", "loss_regression"})


def verdict_status(reason: str) -> str:
    """``accepted`` for no reason, ``excluded`` for a statistical filter, else ``rejected``."""
    if not reason:
        return "accepted"
    return "excluded" if reason in FILTER_REASONS else "rejected"


@dataclass(frozen=True)
class SubmissionContext:
    """What a checker knows about the round a submission claims to belong to."""

    spec: RunSpec
    round: int  # the open round, -1 while none is open
    base_model_hash: str
    worker_registered: bool
    worker_banned: bool


def expected_trail_length(spec: RunSpec) -> int:
    """S = H / k commitment hashes per submission."""
    return spec.inner["steps"] // spec.inner["trail_every"]


def expected_samples(spec: RunSpec) -> int:
    return spec.inner["steps"] * spec.inner["batch_size"]


def check_submission(signed: Signed[Submission], ctx: SubmissionContext) -> None:
    """Raise :class:`RejectedInput` if ``signed`` may not enter round ``ctx.round``.

    The signature itself was verified when ``signed`` was opened.
    """
    sub = signed.message
    spec = ctx.spec
    if signed.signer != sub.worker:
        raise RejectedInput("submission signed by a key other than its worker", "bad_signature")
    if sub.run_id != spec.run_id:
        raise RejectedInput(f"submission is for run {sub.run_id!r}", "wrong_run")
    if sub.round != ctx.round:
        now = (f"the open round is {ctx.round}" if ctx.round >= 0
               else "no round is open")
        raise RejectedInput(f"submission is for round {sub.round}; {now}", "wrong_round")
    if not ctx.worker_registered:
        raise RejectedInput("worker is not registered for this run", "unknown_worker")
    if ctx.worker_banned:
        raise RejectedInput("worker is banned for this round", "banned")
    if sub.base_model_hash != ctx.base_model_hash:
        raise RejectedInput(
            f"base model {sub.base_model_hash[:12]} is not the round's {ctx.base_model_hash[:12]}",
            "wrong_base_model",
        )
    if sub.codec != spec.codec:
        raise RejectedInput("codec or codec parameters differ from the run spec", "wrong_codec")
    if sub.payload_bytes > spec.limits["max_payload_bytes"]:
        raise OversizedError(
            f"payload of {sub.payload_bytes} bytes exceeds {spec.limits['max_payload_bytes']}"
        )
    if len(sub.trail) != expected_trail_length(spec):
        raise RejectedInput(
            f"trail has {len(sub.trail)} hashes, the run needs {expected_trail_length(spec)}",
            "malformed",
        )
    if sub.samples != expected_samples(spec):
        raise RejectedInput(
            f"claims {sub.samples} samples, a round is {expected_samples(spec)}", "malformed"
        )
