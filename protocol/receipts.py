"""Whether the ledger honoured a receipt it signed (issue #28): sans I/O.

A worker keeps the ledger's signed :class:`~veritrain.protocol.messages.Receipt` for each
submission and :class:`~veritrain.protocol.messages.RevealReceipt` for each reveal. A
receipt is the ledger's word that the message arrived in time; what the validators
certified must then carry it. The worker (workers/node.py) checks its own receipts once
a round is certified, and ``veritrain audit receipt FILE`` checks any receipt against a
ledger, so a ledger that drops a receipted submission, or has a worker failed for a
reveal it receipted in time, is named by the party it wronged.

The certified verdicts are taken from nothing but signed inputs: the quorum certificate
of the round's outcome (BLS-verified by the caller, :func:`verify_certificate`) fixes
``verdicts_hash``; a round result whose verdict list hashes to it, signed by a validator
of the run, gives the list (:func:`certified_verdicts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .board import BoardFault
from .errors import RejectedInput
from .messages import (
    CertifiedState,
    Receipt,
    RevealReceipt,
    RoundResult,
    RunSpec,
    Signed,
    SpotReveal,
    digest_of,
    open_signed,
)


def open_receipt(wire: Any, ledger_key: str) -> Signed[Receipt] | Signed[RevealReceipt]:
    """A submission or reveal receipt, signed by the ledger whose key is ``ledger_key``."""
    for cls in (Receipt, RevealReceipt):
        try:
            signed = open_signed(wire, cls)
        except RejectedInput:
            continue
        if signed.signer != ledger_key:
            raise RejectedInput(f"the {cls.KIND} is signed by {signed.signer[:12]}, not by this "
                                f"ledger ({ledger_key[:12]})", "bad_signature")
        return signed
    raise RejectedInput("not a signed submission or reveal receipt", "malformed")


#: A validator's receipt inbox's refusals, by reason (its error JSON ``{"error", "detail"}``)
#: -> HTTP status. The final ones the same claim would get again (a worker stops handing
#: it there); the others may pass later.
CLAIM_REFUSALS = {"malformed": 400, "bad_signature": 401, "not_found": 404,
                  "reveal_late": 409, "stale": 409, "oversized": 413, "full": 429,
                  "rate_limited": 429}
FINAL_CLAIM_REFUSALS = frozenset({"malformed", "bad_signature", "not_found", "reveal_late",
                                  "stale", "oversized"})


@dataclass(frozen=True)
class RevealClaim:
    """A worker's signed reveal envelope with the ledger's signed receipt for it: the
    ledger's word that this reveal (file ``envelope.reveal_hash``) arrived in time."""

    envelope: Signed[SpotReveal]
    receipt: Signed[RevealReceipt]

    @property
    def worker(self) -> str:
        return self.envelope.message.worker

    def to_wire(self) -> dict[str, Any]:
        return {"envelope": self.envelope.to_wire(), "receipt": self.receipt.to_wire()}


def open_reveal_claim(wire: Any, run_id: str, ledger_key: str) -> RevealClaim:
    """A ``{"envelope", "receipt"}`` pair checked as every party checks a reveal before it
    counts: the envelope signed by its worker for run ``run_id``, the receipt signed by the
    ledger (``ledger_key``) for that very envelope, and received by the deadline it states
    (``reveal_late`` otherwise: every validator leaves such a reveal out, one reveal set
    whichever moment it reads the board). Which submission it names is the caller's check
    (the sealed one)."""
    if not isinstance(wire, dict) or set(wire) != {"envelope", "receipt"}:
        raise RejectedInput("a reveal claim is {envelope, receipt}", "malformed")
    env = open_signed(wire["envelope"], SpotReveal)
    receipt = open_signed(wire["receipt"], RevealReceipt)
    msg, got = env.message, receipt.message
    if env.signer != msg.worker or msg.run_id != run_id:
        raise RejectedInput("the reveal envelope is not its worker's for this run",
                            "bad_signature")
    if (receipt.signer != ledger_key or got.reveal_digest != env.digest
            or got.reveal_hash != msg.reveal_hash or (got.run_id, got.round, got.worker) != (msg.run_id, msg.round, msg.worker)):
        raise RejectedInput("the reveal receipt is not this ledger's for this envelope",
                            "bad_signature")
    if got.received_at > got.deadline:
        raise RejectedInput(f"the ledger's receipt records the reveal after its deadline "
                            f"({got.received_at:.3f} > {got.deadline:.3f})", "reveal_late")
    return RevealClaim(env, receipt)


def certified_verdicts(results: Iterable[Any], cert: CertifiedState, spec: RunSpec
                       ) -> list[dict[str, Any]]:
    """The verdict list ``cert`` vouches for: that of a round result, signed by a validator
    of the run for the certificate's round, whose list hashes to ``cert.verdicts_hash``
    (rule 2 of protocol/board.py: a list from the signed messages it comes from)."""
    for wire in results:
        try:
            signed = open_signed(wire, RoundResult)
        except RejectedInput:
            continue
        msg = signed.message
        if (spec.validator_index(signed.signer) is not None and msg.validator == signed.signer
                and (msg.run_id, msg.round) == (cert.run_id, cert.round - 1)
                and digest_of(msg.verdicts) == cert.verdicts_hash):
            return list(msg.verdicts)
    raise BoardFault(f"no round result served for round {cert.round - 1} carries the verdicts "
                     f"the certificate vouches for ({cert.verdicts_hash[:12]})")


@dataclass(frozen=True)
class ReceiptCheck:
    """What a receipt's holder may conclude: ``honoured`` (None: not decided yet, the
    round is not certified) and why."""

    honoured: bool | None
    reason: str


def check_submission_receipt(receipt: Receipt, verdicts: Sequence[dict[str, Any]] | None,
                             sealed: Sequence[str] | None = None) -> ReceiptCheck:
    """A receipted submission must be in the round's sealed list (digests, once closed)
    and have a certified verdict naming that very submission."""
    if sealed is not None and receipt.submission_digest not in sealed:
        return ReceiptCheck(False, f"round {receipt.round}: the receipted submission "
                                   f"{receipt.submission_digest[:12]} is not in the sealed list")
    if verdicts is None:
        return ReceiptCheck(None, f"round {receipt.round} is not certified yet")
    mine = [v for v in verdicts if v["worker"] == receipt.worker]
    if not any(v["submission_digest"] == receipt.submission_digest for v in mine):
        return ReceiptCheck(False, f"round {receipt.round}: the certified verdicts have no "
                                   f"verdict on the receipted submission "
                                   f"{receipt.submission_digest[:12]} of worker "
                                   f"{receipt.worker[:12]}")
    v = next(v for v in mine if v["submission_digest"] == receipt.submission_digest)
    return ReceiptCheck(True, f"round {receipt.round}: certified {v['status']}"
                              + (f" ({v['reason']})" if v.get("reason") else ""))


def check_reveal_receipt(receipt: RevealReceipt, verdicts: Sequence[dict[str, Any]] | None
                         ) -> ReceiptCheck:
    """A reveal the ledger receipted by its deadline must not be certified missing."""
    if receipt.received_at > receipt.deadline:
        return ReceiptCheck(True, f"round {receipt.round}: the receipt itself records a late "
                                  f"reveal ({receipt.received_at:.0f} > {receipt.deadline:.0f})")
    if verdicts is None:
        return ReceiptCheck(None, f"round {receipt.round} is not certified yet")
    mine = [v for v in verdicts if v["worker"] == receipt.worker]
    if not mine:
        return ReceiptCheck(False, f"round {receipt.round}: no certified verdict for worker "
                                   f"{receipt.worker[:12]}, whose reveal was receipted in time")
    if any(v.get("reason") == "missing_reveal" for v in mine):
        return ReceiptCheck(False, f"round {receipt.round}: certified missing_reveal for a "
                                   f"reveal the ledger receipted in time (received "
                                   f"{receipt.received_at:.0f}, deadline "
                                   f"{receipt.deadline:.0f}): the validators were not shown it")
    return ReceiptCheck(True, f"round {receipt.round}: the reveal counted (certified "
                              f"{mine[0]['status']})")
