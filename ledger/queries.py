"""Read-only views for the audit API (plain dicts, JSON-ready)."""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.messages import RunSpec

from . import membership
from . import schema as t
from .export import events_with_checkpoints, sealed_from
from .lists import totals_page
from .store import MAX_RESULT_BYTES, NotFound, beacon_envelopes

MAX_PAGE = 1000


def round_info(s: Session, run_id: str, r: int | None, now: float) -> dict[str, Any]:
    q = select(t.Round).where(t.Round.run_id == run_id)
    q = q.where(t.Round.round == r) if r is not None else q.order_by(t.Round.round.desc()).limit(1)
    rnd = s.execute(q).scalar_one_or_none()
    if rnd is None:
        raise NotFound(f"run {run_id!r} has no round {r}")
    run = s.get(t.Run, run_id)
    assert run is not None
    # The newest certificate before this round vouches for its base: the previous round's,
    # or an earlier one when the rounds between were voided (specs/protocol.md 6).
    prev = s.execute(select(t.Round.certificate).where(
        t.Round.run_id == run_id, t.Round.round < rnd.round, t.Round.certificate.is_not(None))
        .order_by(t.Round.round.desc()).limit(1)).scalar_one_or_none()
    base_cert = decode_canonical(prev) if prev is not None else None
    count = s.execute(select(func.count()).select_from(t.Submission).where(
        t.Submission.run_id == run_id, t.Submission.round == rnd.round)).scalar_one()
    return {
        "run_id": run_id,
        "run_status": run.status,
        "round": rnd.round,
        "status": rnd.status,
        "base_model_hash": rnd.base_model_hash,
        "outer_state_hash": rnd.outer_state_hash,
        "base_certificate": base_cert,
        "opened_at": rnd.opened_at,
        "deadline": rnd.deadline,
        "extensions": rnd.extensions,
        "closed_at": rnd.closed_at,
        "finalized_at": rnd.finalized_at,
        "submissions": count,
        "certificate": decode_canonical(rnd.certificate) if rnd.certificate else None,
        "eval_loss": rnd.eval_loss,
        "now": now,
    }


def _verdict_json(v: t.Verdict) -> dict[str, Any]:
    return {
        "round": v.round, "worker": v.worker, "status": v.status, "reason": v.reason,
        "detail": v.detail, "spot_checked": v.spot_checked, "distance": v.distance,
        "samples": v.samples, "quality": v.quality, "score": v.score, "reward": v.reward,
        "checks": json.loads(v.checks or "[]"),
    }


def penalty_json(p: t.Penalty) -> dict[str, Any]:
    return {"round": p.round, "worker": p.worker, "kind": p.kind, "amount": p.amount,
            "source_round": p.source_round, "reason": p.reason, "detail": p.detail}


def _rejection_json(x: t.Rejection) -> dict[str, Any]:
    return {"round": x.round, "signer": x.signer, "endpoint": x.endpoint, "reason": x.reason,
            "detail": x.detail, "at": x.at}


def bonds(s: Session, run: t.Run, workers: list[str]
          ) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]]]:
    """The run's admission policy and each worker's bond, slashes and admission
    (ledger/membership.py ``balances``, folded from the chain); ``(None, {})`` for an
    ``open`` run, whose report stays as it was."""
    spec = RunSpec.from_body(decode_canonical(run.spec)["body"])  # checked when stored
    if spec.admission is None or spec.admission.get("policy") == "open":
        return None, {}
    return dict(spec.admission), membership.balances(s, spec, workers)


def worker_history(s: Session, run_id: str, worker: str, *, offset: int = 0,
                   limit: int = 100) -> dict[str, Any]:
    limit = max(1, min(limit, MAX_PAGE))
    part = s.execute(select(t.Participant).where(
        t.Participant.run_id == run_id, t.Participant.pubkey == worker)).scalar_one_or_none()
    if part is None:
        raise NotFound(f"{worker[:12]} is not a participant of run {run_id!r}")
    subs = s.execute(select(t.Submission).where(
        t.Submission.run_id == run_id, t.Submission.worker == worker)
        .order_by(t.Submission.round).offset(offset).limit(limit)).scalars().all()
    verdicts = s.execute(select(t.Verdict).where(
        t.Verdict.run_id == run_id, t.Verdict.worker == worker)
        .order_by(t.Verdict.round).offset(offset).limit(limit)).scalars().all()
    totals = s.execute(select(func.coalesce(func.sum(t.Verdict.score), 0.0),
                              func.coalesce(func.sum(t.Verdict.reward), 0.0),
                              func.count()).where(
        t.Verdict.run_id == run_id, t.Verdict.worker == worker)).one()
    by_status = dict(s.execute(select(t.Verdict.status, func.count()).where(
        t.Verdict.run_id == run_id, t.Verdict.worker == worker)
        .group_by(t.Verdict.status)).all())
    rejected = by_status.get("rejected", 0)
    forfeited = s.execute(select(func.coalesce(func.sum(t.Penalty.amount), 0.0)).where(
        t.Penalty.run_id == run_id, t.Penalty.worker == worker)).scalar_one()
    penalties = s.execute(select(t.Penalty).where(
        t.Penalty.run_id == run_id, t.Penalty.worker == worker)
        .order_by(t.Penalty.round, t.Penalty.source_round).offset(offset).limit(limit)
    ).scalars().all()
    run = s.get(t.Run, run_id)
    admission, bond = bonds(s, run, [worker]) if run is not None else (None, {})
    extra = {"admission": admission, "bond": bond[worker]} if admission else {}
    return {
        **extra,
        "run_id": run_id,
        "worker": worker,
        "role": part.role,
        "registered_round": part.registered_round,
        "banned_until_round": part.banned_until_round,
        "submissions": [{"round": x.round, "digest": x.digest, "payload_bytes": x.payload_bytes,
                         "received_at": x.received_at} for x in subs],
        "verdicts": [_verdict_json(v) for v in verdicts],
        "penalties": [penalty_json(p) for p in penalties],
        "totals": {"score": totals[0], "reward": totals[1], "verdicts": totals[2],
                   "rejected": rejected, "excluded": by_status.get("excluded", 0),
                   "forfeited": forfeited},
        "offset": offset,
        "limit": limit,
    }


def round_summary(s: Session, run_id: str, r: int, now: float) -> dict[str, Any]:
    info = round_info(s, run_id, r, now)
    verdicts = s.execute(select(t.Verdict).where(t.Verdict.run_id == run_id, t.Verdict.round == r)
                         .order_by(t.Verdict.worker)).scalars().all()
    rejections = s.execute(select(t.Rejection).where(
        t.Rejection.run_id == run_id, t.Rejection.round == r).order_by(t.Rejection.id)
        .limit(MAX_PAGE)).scalars().all()
    info["verdicts"] = [_verdict_json(v) for v in verdicts]
    info["rejections"] = [_rejection_json(x) for x in rejections]
    return info


def run_report(s: Session, run_id: str) -> dict[str, Any]:
    """Per-round eval loss and verdict counts plus per-worker totals: the run at a glance."""
    run = s.get(t.Run, run_id)
    if run is None:
        raise NotFound(f"no run {run_id!r}")
    rounds = []
    by_round: dict[int, dict[str, int]] = {}
    for r, status, n in s.execute(select(t.Verdict.round, t.Verdict.status, func.count())
                                  .where(t.Verdict.run_id == run_id)
                                  .group_by(t.Verdict.round, t.Verdict.status)).all():
        by_round.setdefault(r, {})[status] = n
    for rnd in s.execute(select(t.Round).where(t.Round.run_id == run_id)
                         .order_by(t.Round.round)).scalars().all():
        counts = by_round.get(rnd.round, {})
        cert = decode_canonical(rnd.certificate) if rnd.certificate else None
        rounds.append({"round": rnd.round, "status": rnd.status, "eval_loss": rnd.eval_loss,
                       "accepted": counts.get("accepted", 0),
                       "rejected": counts.get("rejected", 0),
                       "excluded": counts.get("excluded", 0), "extensions": rnd.extensions,
                       "certified_by": cert["signers"] if cert else None,
                       "model_hash": cert["certified"]["model_hash"] if cert else None})
    forfeited = dict(s.execute(select(t.Penalty.worker, func.sum(t.Penalty.amount)).where(
        t.Penalty.run_id == run_id).group_by(t.Penalty.worker)).all())
    # A fixed number of queries whatever the number of workers: totals grouped by worker,
    # the rejected verdicts in one pass.
    totals = {w: (acc, spot, score, reward) for w, acc, spot, score, reward in s.execute(
        select(t.Verdict.worker,
               func.coalesce(func.sum(case((t.Verdict.status == "accepted", 1), else_=0)), 0),
               func.coalesce(func.sum(case((t.Verdict.spot_checked, 1), else_=0)), 0),
               func.coalesce(func.sum(t.Verdict.score), 0.0),
               func.coalesce(func.sum(t.Verdict.reward), 0.0))
        .where(t.Verdict.run_id == run_id).group_by(t.Verdict.worker)).all()}
    # Rejected (not admissible work) and excluded (a statistical filter's suspicion, paid)
    # are listed apart.
    rejected: dict[str, list[dict[str, Any]]] = {}
    excluded: dict[str, list[dict[str, Any]]] = {}
    for v in s.execute(select(t.Verdict.worker, t.Verdict.round, t.Verdict.reason,
                              t.Verdict.detail, t.Verdict.status)
                       .where(t.Verdict.run_id == run_id,
                              t.Verdict.status.in_(("rejected", "excluded")))
                       .order_by(t.Verdict.round)).all():
        (rejected if v.status == "rejected" else excluded).setdefault(v.worker, []).append(
            {"round": v.round, "reason": v.reason, "detail": v.detail})
    workers = []
    for part in s.execute(select(t.Participant).where(
            t.Participant.run_id == run_id, t.Participant.role == "worker")
            .order_by(t.Participant.id)).scalars().all():
        acc, spot, score, reward = totals.get(part.pubkey, (0, 0, 0.0, 0.0))
        workers.append({
            "worker": part.pubkey,
            "registered_round": part.registered_round,
            "banned_until_round": part.banned_until_round,
            "accepted": int(acc),
            "rejected": rejected.get(part.pubkey, []),
            "excluded": excluded.get(part.pubkey, []),
            "spot_checked": int(spot),
            "score": score,
            "reward": reward,
            "forfeited": forfeited.get(part.pubkey, 0.0),
        })
    # Bonds and slashes (admission runs only): folded from the chain's membership rows.
    admission, bond = bonds(s, run, [w["worker"] for w in workers])
    for w in workers:
        if admission:
            w["bond"] = bond[w["worker"]]
    rejections = s.execute(select(t.Rejection).where(t.Rejection.run_id == run_id)
                           .order_by(t.Rejection.id).limit(MAX_PAGE)).scalars().all()
    faults = s.execute(select(t.ValidatorFault).where(t.ValidatorFault.run_id == run_id)
                       .order_by(t.ValidatorFault.round)).scalars().all()
    return {**({"admission": admission} if admission else {}),
            "run_id": run_id, "status": run.status, "rounds": rounds, "workers": workers,
            "rejections": [_rejection_json(x) for x in rejections],
            "validator_faults": [{"round": f.round, "validator": f.validator,
                                  "result_digest": f.result_digest,
                                  "certified_digest": f.certified_digest} for f in faults]}


def events_page(s: Session, run_id: str, after: int, limit: int) -> dict[str, Any]:
    """Chain rows after ``seq``; each carries the ledger's checkpoint signature or null."""
    limit = max(1, min(limit, MAX_PAGE))
    cut = sealed_from(s, run_id)
    return {"run_id": run_id, "events": events_with_checkpoints(
        s, run_id, after, limit, None if cut is None else cut - 1)}


def rejections_page(s: Session, run_id: str, *, round_index: int | None, signer: str | None,
                    reason: str | None, offset: int, limit: int) -> dict[str, Any]:
    limit = max(1, min(limit, MAX_PAGE))
    q = select(t.Rejection).where(t.Rejection.run_id == run_id)
    if round_index is not None:
        q = q.where(t.Rejection.round == round_index)
    if signer is not None:
        q = q.where(t.Rejection.signer == signer)
    if reason is not None:
        q = q.where(t.Rejection.reason == reason)
    rows = s.execute(q.order_by(t.Rejection.id).offset(offset).limit(limit)).scalars().all()
    return {"run_id": run_id, "rejections": [_rejection_json(x) for x in rows],
            "offset": offset, "limit": limit}


def list_runs(s: Session) -> list[dict[str, Any]]:
    return [{"run_id": r.run_id, "status": r.status, "organiser": r.organiser,
             "created_at": r.created_at}
            for r in s.execute(select(t.Run).order_by(t.Run.created_at)).scalars().all()]


def run_overview(s: Session, run_id: str) -> dict[str, Any]:
    """The signed run spec as stored, the run's status and its current round."""
    run = s.get(t.Run, run_id)
    if run is None:
        raise NotFound(f"no run {run_id!r}")
    current = s.execute(select(func.max(t.Round.round)).where(t.Round.run_id == run_id)).scalar()
    return {"spec": decode_canonical(run.spec), "status": run.status, "current_round": current}


def round_results(s: Session, run_id: str, r: int) -> dict[str, Any]:
    """Every validator's signed result for round ``r``, in arrival order."""
    rows = s.execute(select(t.RoundResultRow.body).where(
        t.RoundResultRow.run_id == run_id, t.RoundResultRow.round == r)
        .order_by(t.RoundResultRow.id)).scalars().all()
    return {"results": [decode_canonical(b, max_bytes=MAX_RESULT_BYTES) for b in rows]}


def participants(s: Session, run_id: str, offset: int = 0,
                 limit: int = MAX_PAGE) -> dict[str, Any]:
    """Workers' signed registrations (so validators can check them) and ban state, a page
    at a time in registration order (``next_offset`` null on the last page)."""
    limit = max(1, min(limit, MAX_PAGE))
    offset = max(0, offset)
    rows = s.execute(select(t.Participant).where(
        t.Participant.run_id == run_id, t.Participant.role == "worker")
        .order_by(t.Participant.id).offset(offset).limit(limit + 1)).scalars().all()
    more = len(rows) > limit
    return {"run_id": run_id, "offset": offset, "limit": limit,
            "next_offset": offset + limit if more else None, "participants": [
                {"registration": decode_canonical(p.registration) if p.registration else None,
                 "pubkey": p.pubkey, "registered_round": p.registered_round,
                 "registered_at": p.registered_at,
                 "banned_until_round": p.banned_until_round} for p in rows[:limit]]}


def beacon(s: Session, run_id: str, r: int) -> dict[str, Any]:
    """The round's fixed beacon shares, or null while fewer than a quorum arrived."""
    rnd = s.get(t.Round, (run_id, r))
    if rnd is None:
        raise NotFound(f"run {run_id!r} has no round {r}")
    fixed = decode_canonical(rnd.beacon) if rnd.beacon else None
    return {"run_id": run_id, "round": r, "beacon": fixed,
            "envelopes": beacon_envelopes(s, run_id, r, fixed)}



# ----------------------------------------------------------------------------- web pages
# The round and worker pages (web_page.py): one page of rows each, never a whole table.

PAGE_ROWS = 100
DOOR_ROWS = 50


def _challenged(s: Session, run_id: str, pairs: list[tuple[int, str]]) -> dict[tuple[int, str],
                                                                           list[int]]:
    """The segments each (round, worker) was challenged to reveal."""
    if not pairs:
        return {}
    rounds, workers = {r for r, _ in pairs}, {w for _, w in pairs}
    rows = s.execute(select(t.ChallengeRow).where(
        t.ChallengeRow.run_id == run_id, t.ChallengeRow.round.in_(rounds),
        t.ChallengeRow.worker.in_(workers))).scalars().all()
    return {(c.round, c.worker): json.loads(c.segments) for c in rows
            if (c.round, c.worker) in set(pairs)}


def round_page(s: Session, run_id: str, r: int, *, offset: int = 0,
               limit: int = PAGE_ROWS) -> dict[str, Any]:
    """One round at a glance: its certificate and times (:func:`round_info`), verdict
    counts, one page of verdicts with their segment checks and challenged segments, the
    penalties and validator faults it recorded, and the first refusals at the door."""
    offset, limit = max(0, offset), max(1, min(limit, MAX_PAGE))
    info = round_info(s, run_id, r, 0.0)
    del info["now"]
    last = s.execute(select(func.max(t.Round.round)).where(t.Round.run_id == run_id)).scalar()
    counts = dict(s.execute(select(t.Verdict.status, func.count()).where(
        t.Verdict.run_id == run_id, t.Verdict.round == r).group_by(t.Verdict.status)).all())
    paid = s.execute(select(func.coalesce(func.sum(t.Verdict.reward), 0.0)).where(
        t.Verdict.run_id == run_id, t.Verdict.round == r)).scalar_one()
    verdicts = s.execute(select(t.Verdict).where(t.Verdict.run_id == run_id,
                                                 t.Verdict.round == r)
                         .order_by(t.Verdict.worker).offset(offset).limit(limit)).scalars().all()
    challenged = _challenged(s, run_id, [(r, v.worker) for v in verdicts])
    penalties = s.execute(select(t.Penalty).where(t.Penalty.run_id == run_id,
                                                  t.Penalty.round == r)
                          .order_by(t.Penalty.worker, t.Penalty.source_round)
                          .limit(MAX_PAGE)).scalars().all()
    faults = s.execute(select(t.ValidatorFault).where(
        t.ValidatorFault.run_id == run_id, t.ValidatorFault.round == r)
        .order_by(t.ValidatorFault.validator)).scalars().all()
    door = s.execute(select(func.count()).select_from(t.Rejection).where(
        t.Rejection.run_id == run_id, t.Rejection.round == r)).scalar_one()
    refusals = s.execute(select(t.Rejection).where(t.Rejection.run_id == run_id,
                                                   t.Rejection.round == r)
                         .order_by(t.Rejection.id).limit(DOOR_ROWS)).scalars().all()
    return {**info, "last_round": last,
            "accepted": counts.get("accepted", 0), "rejected": counts.get("rejected", 0),
            "excluded": counts.get("excluded", 0), "rewards_paid": paid,
            "verdicts": [{**_verdict_json(v), "challenged": challenged.get((r, v.worker), [])}
                         for v in verdicts],
            "offset": offset, "limit": limit,
            "next_offset": offset + limit if len(verdicts) == limit else None,
            "penalties": [penalty_json(p) for p in penalties],
            "validator_faults": [{"validator": f.validator, "result_digest": f.result_digest,
                                  "certified_digest": f.certified_digest} for f in faults],
            "door_rejections": door, "rejections": [_rejection_json(x) for x in refusals]}


def worker_page(s: Session, run_id: str, worker: str, *, offset: int = 0,
                limit: int = PAGE_ROWS) -> dict[str, Any]:
    """One worker at a glance: its totals over the run, and one page of its rounds (the
    submission, the verdict with its segment checks and challenged segments) and of its
    penalties (:func:`worker_history`)."""
    offset, limit = max(0, offset), max(1, min(limit, MAX_PAGE))
    history = worker_history(s, run_id, worker, offset=offset, limit=limit)
    totals = totals_page(s, run_id, worker, 0, 1)["workers"]
    challenged = _challenged(s, run_id, [(v["round"], worker) for v in history["verdicts"]])
    for v in history["verdicts"]:
        v["challenged"] = challenged.get((v["round"], worker), [])
    run = s.get(t.Run, run_id)
    assert run is not None  # worker_history found its participant
    page_full = max(len(history["submissions"]), len(history["verdicts"])) == history["limit"]
    return {**history, "run_status": run.status,
            "summary": totals[0] if totals else None,
            "next_offset": offset + history["limit"] if page_full else None}
