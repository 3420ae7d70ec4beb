"""Sharded aggregation: the ledger's part (specs/secure-averaging.md A and E).

The ledger is the validators' bulletin board for a sharded round. After the
round's beacon is fixed, each validator posts its shard result (a signed
``ShardPublication`` and the result's tensor file). The first valid BLS check
share fixes the list of published results: a share must sign exactly the
results stored at that moment, and from then on no result is taken. A quorum
of shares over that list fixes the check seed, as a quorum of beacon shares
fixes the beacon. Findings (settled disputes) are recorded as posted; a shard
that a quorum of validators found faulty is recorded as a ``shard_fault``.

Nothing here runs the aggregation or the checks: the ledger holds no torch and
no updates; it fixes, for everyone alike, which results exist and which seed
checks them.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from veritrain.protocol import bls
from veritrain.protocol.beacon import compute_beacon_seed, shard_check_root
from veritrain.protocol.certificates import shard_sources_problem
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import (
    RunSpec,
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    Signed,
)

from . import schema as t
from .admission import BlsVerify

LEDGER_INDEX = -1
#: What a proven shard fault costs its publisher: its attestation of that round does not
#: count toward the certificate (``faulted_validators``), and with bonds (#20) a slash.
SHARD_FAULT_PENALTY = "excluded_from_quorum"
#: What each ``accept_*`` returns: (reply, whether the message is new, ledger events).
Accepted = tuple[dict[str, Any], bool, list[dict[str, Any]]]


class ShardListFixed(RejectedInput):
    """A result after the list was fixed, or a share over another list than the fixed one."""

    reason = "shard_list_fixed"


class RoundFinalized(RejectedInput):
    """A shard message for a round whose certificate is already fixed."""

    reason = "round_finalized"


def _rows(s: Session, run_id: str, r: int, kind: str) -> list[t.ShardMessage]:
    return list(s.execute(select(t.ShardMessage).where(
        t.ShardMessage.run_id == run_id, t.ShardMessage.round == r, t.ShardMessage.kind == kind)
        .order_by(t.ShardMessage.id)).scalars())


def _fixed(s: Session, run_id: str, r: int, kind: str) -> Any:
    rows = _rows(s, run_id, r, kind)
    return decode_canonical(rows[0].body) if rows else None


def published_results(s: Session, spec: RunSpec, r: int) -> list[str | None]:
    """Each shard's stored result digest, in shard order (None where none was posted)."""
    out: list[str | None] = [None] * spec.shards
    for row in _rows(s, spec.run_id, r, "result"):
        out[row.shard] = row.digest
    return out


def _add(s: Session, run_id: str, r: int, kind: str, idx: int, shard: int, digest: str,
         body: bytes, now: float) -> None:
    s.add(t.ShardMessage(run_id=run_id, round=r, kind=kind, validator_index=idx, shard=shard,
                         digest=digest, body=body, received_at=now))
    s.flush()


def _sharded_round(spec: RunSpec, rnd: t.Round, what: str) -> None:
    if not spec.shards:
        raise RejectedInput(f"run {spec.run_id} does not shard its aggregation", "not_sharded")
    if rnd.beacon is None:
        raise RejectedInput(f"a {what} is taken only once round {rnd.round}'s beacon is fixed",
                            "wrong_state")
    if rnd.finalized_at is not None:
        raise RoundFinalized(f"round {rnd.round} is finalized: its shards are settled")


def accept_result(s: Session, spec: RunSpec, idx: int, rnd: t.Round,
                  signed: Signed[ShardPublication], now: float, *, store: bool = True
                  ) -> Accepted:
    """Store validator ``idx``'s shard result; idempotent for an exact resend (the same
    signed bytes: another file or inputs digest under the same result is refused).
    ``store=False`` runs the same checks and writes nothing (done before the result file
    is read)."""
    msg = signed.message
    _sharded_round(spec, rnd, "shard result")
    if msg.shard != idx:
        raise RejectedInput(f"validator {idx} publishes shard {idx}, not {msg.shard}",
                            "wrong_shard")
    stored = [row for row in _rows(s, spec.run_id, rnd.round, "result")
              if row.validator_index == idx]
    if stored:
        if stored[0].body == signed.encode():
            return {"shard": idx, "result_digest": msg.result_digest, "already": True}, False, []
        raise RejectedInput(f"validator {idx} already published another result",
                            "duplicate")
    if _fixed(s, spec.run_id, rnd.round, "list_fixed") is not None:
        raise ShardListFixed(f"round {rnd.round}'s shard results are fixed; this one is late")
    if store:
        _add(s, spec.run_id, rnd.round, "result", idx, idx, msg.result_digest, signed.encode(),
             now)
    return {"shard": idx, "result_digest": msg.result_digest, "already": False}, True, []


def check_share_list(s: Session, spec: RunSpec, rnd: t.Round,
                     msg: ShardCheckShare) -> dict[str, Any] | None:
    """A check share's cheap checks: a sharded round, one result per shard, signing the
    fixed list (or, before one is fixed, the published results). Raises the refusal;
    returns the fixed list's record, None while none is fixed."""
    _sharded_round(spec, rnd, "shard check share")
    if len(msg.results) != spec.shards:
        raise RejectedInput(f"{len(msg.results)} results for {spec.shards} shards", "malformed")
    fixed = _fixed(s, spec.run_id, rnd.round, "list_fixed")
    if fixed is None:
        stored = published_results(s, spec, rnd.round)
        if msg.results != stored:
            raise ShardListFixed(
                f"the share signs {msg.results}, but the published results are {stored}")
    elif msg.results != fixed["results"]:
        raise ShardListFixed(f"the fixed list is {fixed['results']}")
    return fixed


def accept_check_share(s: Session, spec: RunSpec, idx: int, rnd: t.Round,
                       signed: Signed[ShardCheckShare], now: float,
                       verify: BlsVerify = bls.verify) -> Accepted:
    """Store a BLS check share once :func:`check_share_list` passed; its events say which
    list and seed it fixed. ``verify`` is ``bls.verify`` or a cache of it (the store's,
    filled off the writer thread)."""
    msg = signed.message
    fixed = check_share_list(s, spec, rnd, msg)
    if not verify(bytes.fromhex(spec.validators[idx]["bls"]),
                  shard_check_root(spec.run_id, rnd.round, msg.results),
                  bytes.fromhex(msg.share)):
        raise RejectedInput("shard check share does not verify", "bad_signature")
    events: list[dict[str, Any]] = []
    if fixed is None:
        fixed = {"results": msg.results}
        _add(s, spec.run_id, rnd.round, "list_fixed", LEDGER_INDEX, LEDGER_INDEX, "",
             encode_canonical(fixed), now)
        events.append({"kind": "shard_list_fixed", "round": rnd.round, **fixed})
    shares = _rows(s, spec.run_id, rnd.round, "check_share")
    new = idx not in {row.validator_index for row in shares}
    if new:
        _add(s, spec.run_id, rnd.round, "check_share", idx, LEDGER_INDEX, signed.digest,
             signed.encode(), now)
        shares = _rows(s, spec.run_id, rnd.round, "check_share")
    check = _fixed(s, spec.run_id, rnd.round, "check_fixed")
    if check is None and len(shares) >= spec.quorum:
        chosen = sorted(shares[: spec.quorum], key=lambda row: row.validator_index)
        values = [decode_canonical(row.body)["body"]["share"] for row in chosen]
        check = {"results": fixed["results"], "signers": [row.validator_index for row in chosen],
                 "shares": values,
                 "seed": compute_beacon_seed([bytes.fromhex(v) for v in values]).hex()}
        _add(s, spec.run_id, rnd.round, "check_fixed", LEDGER_INDEX, LEDGER_INDEX, check["seed"],
             encode_canonical(check), now)
        events.append({"kind": "shard_check_fixed", "round": rnd.round, **check})
    return {"results": fixed["results"], "check": check, "shares": len(shares)}, new, events


def accept_finding(s: Session, spec: RunSpec, idx: int, rnd: t.Round,
                   signed: Signed[ShardFindingReport], now: float) -> Accepted:
    """Store a finding; once a quorum found one shard faulty, a ``shard_fault`` event."""
    msg = signed.message
    if not spec.shards:  # taken after finalization too: evidence is never late
        raise RejectedInput(f"run {spec.run_id} does not shard its aggregation", "not_sharded")
    if not 0 <= msg.shard < spec.shards or msg.shard == idx:
        raise RejectedInput("a validator reports on another validator's shard", "wrong_shard")
    if msg.publisher != spec.validators[msg.shard]["ed25519"]:
        raise RejectedInput("the finding names another publisher than the shard's", "malformed")
    check = _fixed(s, spec.run_id, rnd.round, "check_fixed")
    if check is None:
        raise RejectedInput("findings are taken once the check seed is fixed", "wrong_state")
    if msg.published_digest != check["results"][msg.shard]:
        raise RejectedInput("the finding is about another result than the published one",
                            "malformed")
    for row in _rows(s, spec.run_id, rnd.round, "finding"):
        if row.validator_index == idx and row.shard == msg.shard:
            if row.digest == signed.digest:
                return {"already": True}, False, []
            raise RejectedInput("this validator already reported on this shard", "duplicate")
    _add(s, spec.run_id, rnd.round, "finding", idx, msg.shard, signed.digest, signed.encode(),
         now)
    events: list[dict[str, Any]] = []
    reporters = sorted({row.validator_index for row in _rows(s, spec.run_id, rnd.round, "finding")
                        if row.shard == msg.shard and decode_canonical(row.body)["body"]["faulty"]})
    if msg.faulty and len(reporters) == spec.quorum:
        events.append({"kind": "shard_fault", "round": rnd.round, "shard": msg.shard,
                       "publisher": msg.publisher, "reporters": reporters,
                       "reason": msg.reason, "penalty": SHARD_FAULT_PENALTY})
    return {"already": False, "faulty_reports": len(reporters)}, True, events


def faulted_validators(s: Session, spec: RunSpec, r: int) -> set[int]:
    """The validators of round ``r`` whose shard a quorum of findings proved faulty: the
    penalty of a ``shard_fault`` is that their attestation does not count toward the
    round's certificate (findings rest on the exact check, never on a sample)."""
    faulty: dict[int, set[int]] = {}
    for row in _rows(s, spec.run_id, r, "finding"):
        if decode_canonical(row.body)["body"]["faulty"]:
            faulty.setdefault(row.shard, set()).add(row.validator_index)
    return {k for k, v in faulty.items() if len(v) >= spec.quorum}


def sources_problem(s: Session, spec: RunSpec, r: int, sources: list[dict[str, Any]] | None,
                    faulted: set[int]) -> str | None:
    """``shard_sources_problem`` of a certified state's ``sources`` against round ``r``'s
    fixed list and its proven faults (``faulted``, from ``faulted_validators``)."""
    fixed = _fixed(s, spec.run_id, r, "list_fixed") if spec.shards else None
    return shard_sources_problem(spec.shards, sources, fixed and fixed["results"], faulted)


def round_shards(s: Session, spec: RunSpec, r: int) -> dict[str, Any]:
    """What the audit API serves: results, the fixed list and seed, findings, faults."""
    findings = [decode_canonical(row.body) for row in _rows(s, spec.run_id, r, "finding")]
    faulty: dict[int, set[int]] = {}
    for row, wire in zip(_rows(s, spec.run_id, r, "finding"), findings, strict=True):
        if wire["body"]["faulty"]:
            faulty.setdefault(row.shard, set()).add(row.validator_index)
    return {
        "run_id": spec.run_id, "round": r, "shards": spec.shards, "quorum": spec.quorum,
        "results": [decode_canonical(row.body) for row in _rows(s, spec.run_id, r, "result")],
        "list": (_fixed(s, spec.run_id, r, "list_fixed") or {}).get("results"),
        "check": _fixed(s, spec.run_id, r, "check_fixed"),
        "check_shares": [decode_canonical(row.body)
                         for row in _rows(s, spec.run_id, r, "check_share")],
        "findings": findings,
        "faulty_shards": sorted(k for k, v in faulty.items() if len(v) >= spec.quorum),
    }
