"""Paged, filtered lists for the audit API: verdicts, per-worker totals, submissions.

Every list takes ``offset`` and ``limit`` (at most :data:`MAX_PAGE`) and
answers ``next_offset`` (null on the last page) rather than a total, so a page
costs an index range scan however many rows the run holds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, case, func, select
from sqlalchemy.orm import Session
from veritrain.protocol.rules import PENALIZED_REASONS

from . import schema as t
from .store import NotFound

MAX_PAGE = 1000
VERDICT_STATUSES = ("accepted", "rejected", "excluded")
VERDICT_COLUMNS = ("round", "worker", "status", "reason", "detail", "spot_checked", "distance",
                   "samples", "quality", "score", "reward")
TOTAL_COLUMNS = ("worker", "registered_round", "banned_until_round", "rounds", "accepted",
                 "rejected", "excluded", "spot_checked", "samples", "score", "reward",
                 "penalties")


@dataclass(frozen=True)
class VerdictFilter:
    worker: str | None = None
    round: int | None = None
    status: str | None = None


def _check_run(s: Session, run_id: str) -> None:
    if s.get(t.Run, run_id) is None:
        raise NotFound(f"no run {run_id!r}")


def page_bounds(offset: int, limit: int) -> tuple[int, int]:
    return max(0, offset), max(1, min(limit, MAX_PAGE))


def _verdict_query(run_id: str, f: VerdictFilter) -> Select[tuple[t.Verdict]]:
    q = select(t.Verdict).where(t.Verdict.run_id == run_id)
    if f.worker is not None:
        q = q.where(t.Verdict.worker == f.worker)
    if f.round is not None:
        q = q.where(t.Verdict.round == f.round)
    if f.status is not None:
        q = q.where(t.Verdict.status == f.status)
    return q.order_by(t.Verdict.round, t.Verdict.worker)


def verdict_json(v: t.Verdict) -> dict[str, Any]:
    return {name: getattr(v, name) for name in VERDICT_COLUMNS}


def verdicts_page(s: Session, run_id: str, f: VerdictFilter, offset: int = 0,
                  limit: int = 100) -> dict[str, Any]:
    _check_run(s, run_id)
    offset, limit = page_bounds(offset, limit)
    rows = s.execute(_verdict_query(run_id, f).offset(offset).limit(limit)).scalars().all()
    return {"run_id": run_id, "verdicts": [verdict_json(v) for v in rows], "offset": offset,
            "limit": limit, "next_offset": offset + limit if len(rows) == limit else None}


def iter_verdicts(s: Session, run_id: str, f: VerdictFilter, *, batch: int = 5000,
                  max_round: int | None = None) -> Iterator[dict[str, Any]]:
    """Every matching verdict row, in (round, worker) order, read in keyset batches."""
    _check_run(s, run_id)
    after: tuple[int, str] = (-1, "")
    while True:
        q = _verdict_query(run_id, f).where(
            (t.Verdict.round > after[0]) | ((t.Verdict.round == after[0])
                                            & (t.Verdict.worker > after[1])))
        if max_round is not None:
            q = q.where(t.Verdict.round <= max_round)
        rows = s.execute(q.limit(batch)).scalars().all()
        yield from (verdict_json(v) for v in rows)
        if len(rows) < batch:
            return
        after = (rows[-1].round, rows[-1].worker)


def _totals(s: Session, run_id: str, parts: list[t.Participant]) -> list[dict[str, Any]]:
    if not parts:
        return []
    keys = [p.pubkey for p in parts]
    accepted = t.Verdict.status == "accepted"
    # Excluded (a statistical filter's suspicion): verified work, paid, counted apart.
    excluded = t.Verdict.status == "excluded"
    agg = {row[0]: row for row in s.execute(
        select(t.Verdict.worker, func.count(), func.sum(case((accepted, 1), else_=0)),
               func.sum(case((t.Verdict.spot_checked, 1), else_=0)),
               func.sum(case((accepted | excluded, t.Verdict.samples), else_=0)),
               func.coalesce(func.sum(t.Verdict.score), 0.0),
               func.coalesce(func.sum(t.Verdict.reward), 0.0),
               func.sum(case((excluded, 1), else_=0)))
        .where(t.Verdict.run_id == run_id, t.Verdict.worker.in_(keys))
        .group_by(t.Verdict.worker)).all()}
    bans = dict(s.execute(
        select(t.Verdict.worker, func.count()).where(
            t.Verdict.run_id == run_id, t.Verdict.worker.in_(keys),
            t.Verdict.reason.in_(sorted(PENALIZED_REASONS))).group_by(t.Verdict.worker)).all())
    out = []
    for p in parts:
        row = agg.get(p.pubkey)
        n, acc, spot, samples, score, reward, excl = (row[1:] if row is not None
                                                      else (0, 0, 0, 0, 0.0, 0.0, 0))
        out.append({"worker": p.pubkey, "registered_round": p.registered_round,
                    "banned_until_round": p.banned_until_round, "rounds": int(n),
                    "accepted": int(acc or 0),
                    "rejected": int(n) - int(acc or 0) - int(excl or 0),
                    "excluded": int(excl or 0),
                    "spot_checked": int(spot or 0), "samples": int(samples or 0),
                    "score": float(score), "reward": float(reward),
                    "penalties": int(bans.get(p.pubkey, 0))})
    return out


def _workers_query(run_id: str, worker: str | None) -> Select[tuple[t.Participant]]:
    q = select(t.Participant).where(t.Participant.run_id == run_id,
                                    t.Participant.role == "worker")
    if worker is not None:
        q = q.where(t.Participant.pubkey == worker)
    return q.order_by(t.Participant.id)


def totals_page(s: Session, run_id: str, worker: str | None = None, offset: int = 0,
                limit: int = 100) -> dict[str, Any]:
    """Per-worker totals over the run: rounds, verdicts, verified samples, score, reward,
    penalties (failed spot checks, each of which bans the key)."""
    _check_run(s, run_id)
    offset, limit = page_bounds(offset, limit)
    parts = list(s.execute(_workers_query(run_id, worker).offset(offset).limit(limit))
                 .scalars().all())
    return {"run_id": run_id, "workers": _totals(s, run_id, parts), "offset": offset,
            "limit": limit, "next_offset": offset + limit if len(parts) == limit else None}


def iter_totals(s: Session, run_id: str, worker: str | None = None, *,
                batch: int = 500) -> Iterator[dict[str, Any]]:
    _check_run(s, run_id)
    after = 0
    while True:
        parts = list(s.execute(_workers_query(run_id, worker).where(t.Participant.id > after)
                               .limit(batch)).scalars().all())
        yield from _totals(s, run_id, parts)
        if len(parts) < batch:
            return
        after = parts[-1].id


def submissions_page(s: Session, run_id: str, worker: str | None = None,
                     round_index: int | None = None, offset: int = 0,
                     limit: int = 100) -> dict[str, Any]:
    _check_run(s, run_id)
    offset, limit = page_bounds(offset, limit)
    # Sealed: an open round's submissions are listed once it closes.
    q = select(t.Submission).join(t.Round, (t.Round.run_id == t.Submission.run_id)
                                  & (t.Round.round == t.Submission.round)).where(
        t.Submission.run_id == run_id, t.Round.status != "open")
    if worker is not None:
        q = q.where(t.Submission.worker == worker)
    if round_index is not None:
        q = q.where(t.Submission.round == round_index)
    rows = s.execute(q.order_by(t.Submission.round, t.Submission.worker).offset(offset)
                     .limit(limit)).scalars().all()
    return {"run_id": run_id, "submissions": [
        {"round": x.round, "worker": x.worker, "digest": x.digest,
         "payload_hash": x.payload_hash, "payload_bytes": x.payload_bytes,
         "samples": x.samples, "received_at": x.received_at} for x in rows],
        "offset": offset, "limit": limit,
        "next_offset": offset + limit if len(rows) == limit else None}
