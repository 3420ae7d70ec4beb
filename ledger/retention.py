"""Blob retention: which content-addressed files of a run the ledger deletes, and when
(specs/protocol.md 9.7).

The chain and every hash in it stay forever. What goes are the big files nobody needs
once a round is old: the reveal files of its spot checks (tens to hundreds of MB each at
GPT-2 size) and the models and outer states it superseded. A round's files may go once
it is finalized (or voided) and ``audit_window`` more rounds of its run have been
finalized after it.

Kept forever: the dataset and the genesis model; the current base model and the latest
certified model with their outer states (workers joining need them); everything of a round
still in the window (the current round included); every payload and broadcast update
(small, compressed; from the genesis model the updates rebuild every pruned model); a
masked run's reveal files (they carry the opened workers' payloads); and the **evidence of
every failed check**: the reveal file of each worker whose certified verdict is a
rejection by spot check (``EVIDENCE_REASONS``, or any recorded check that failed),
with the base model and outer state of its round, so that ``veritrain audit recheck`` can
still re-run it. Blobs are shared by content: a digest that another run keeps (its
dataset, genesis, latest or in-window models) stays for it too.

Every deletion is recorded first, a ``pruned_blobs`` row (digest, kind, run, round,
worker, size, time, policy), so that anyone can tell a blob gone by policy (HTTP 410,
reason ``pruned``) from one lost (404); the audit checks the list against the chain
(:func:`veritrain.ledger.audit_rules.audit_pruned`).

:func:`run_candidates` is the rule over what a run's rows say (no I/O); :func:`plan`
gathers those facts from the database and keeps the candidates whose file exists;
:func:`record` and :func:`BlobStore.remove <veritrain.ledger.blobs.BlobStore.remove>`
carry a plan out; :func:`prune` does it all (``veritrain ledger prune``), and the
server's ``BackgroundPruner`` (server.py) after each finalized round, off the request path.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import RunSpec, digest_of
from veritrain.protocol.schedule import RoundStatus

from . import schema as t
from .audit_rules import EVIDENCE_REASONS, is_failed_check
from .blobs import BlobPruned, BlobStore
from .lists import page_bounds

#: The only kinds of blob the policy deletes.
PRUNABLE_KINDS = frozenset({"reveal", "model", "outer_state"})
DEFAULT_AUDIT_WINDOW = 2
#: Files recorded (one writer transaction) and deleted together in the server.
BATCH = 256
#: A round result of up to 10,000 verdicts (store.MAX_RESULT_BYTES).
MAX_RESULT_BYTES = 16 << 20


@dataclass(frozen=True)
class RetentionPolicy:
    """``audit_window``: finalized rounds a round's files outlive it; ``keep_blobs``: never
    delete anything."""

    audit_window: int = DEFAULT_AUDIT_WINDOW
    keep_blobs: bool = False

    def __post_init__(self) -> None:
        if self.audit_window < 0:
            raise ValueError("the audit window is a number of rounds, 0 or more")

    @property
    def label(self) -> str:
        """How the ``policy`` column names it."""
        return f"audit_window={self.audit_window}"

    def expired_through(self, last_finalized: int | None) -> int:
        """The last round whose files may go (-1: none): finalized, with ``audit_window``
        finalized rounds after it."""
        if self.keep_blobs or last_finalized is None:
            return -1
        return last_finalized - self.audit_window


# ----------------------------------------------------------------------------- the rule


@dataclass(frozen=True)
class RoundFiles:
    """What a run's rows say about the files of one finalized round."""

    round: int
    base: str  # the model the round started from
    outer: str | None  # and its outer state (None in round 0)
    reveals: Mapping[str, str]  # worker -> its reveal file's hash
    failed: frozenset[str]  # workers whose certified verdict is evidence of a failed check
    uncertified: tuple[tuple[str, str], ...] = ()  # (kind, hash): models of results that
    # differ from the certificate


@dataclass(frozen=True)
class Candidate:
    """A file the policy deletes: what it was, and its size on disk."""

    sha256: str
    kind: str
    run_id: str
    round: int
    worker: str | None = None
    size: int = 0


def evidence_of(rounds: Iterable[RoundFiles]) -> set[str]:
    """The files a failed check's recheck needs: its reveal, the round's base and outer."""
    out: set[str] = set()
    for rnd in rounds:
        if rnd.failed:
            out |= {rnd.reveals[w] for w in rnd.failed if w in rnd.reveals}
            out |= {h for h in (rnd.base, rnd.outer) if h is not None}
    return out


def run_candidates(run_id: str, rounds: Sequence[RoundFiles], keep: AbstractSet[str], *,
                   masked: bool) -> list[Candidate]:
    """The files of ``rounds`` (all out of the window) that may go: their reveal files
    (none in a masked run), the base model and outer state each round started from, and
    the models of results the certificate did not take; never a digest in ``keep`` nor the
    evidence of a failed check. Each digest once, in round order."""
    evidence = evidence_of(rounds)
    seen: set[str] = set()
    out = []
    for rnd in rounds:
        files: list[tuple[str, str, str | None]] = []
        if not masked:
            files += [("reveal", h, w) for w, h in sorted(rnd.reveals.items())]
        files.append(("model", rnd.base, None))
        if rnd.outer is not None:
            files.append(("outer_state", rnd.outer, None))
        files += [(kind, h, None) for kind, h in rnd.uncertified]
        for kind, digest, worker in files:
            if digest in keep or digest in evidence or digest in seen:
                continue
            seen.add(digest)
            out.append(Candidate(digest, kind, run_id, rnd.round, worker))
    return out


# ----------------------------------------------------------------------------- facts


def _spec(run: t.Run) -> RunSpec:
    """The stored spec (its signature was checked when the run was created)."""
    return RunSpec.from_body(decode_canonical(run.spec)["body"])


def _certified(rnd: t.Round) -> dict[str, Any]:
    assert rnd.certificate is not None
    certified: dict[str, Any] = decode_canonical(rnd.certificate)["certified"]
    return certified


def last_finalized(s: Session, run_id: str) -> int | None:
    return s.execute(select(func.max(t.Round.round)).where(
        t.Round.run_id == run_id, t.Round.status == RoundStatus.FINALIZED.value)).scalar()


def kept_digests(s: Session, policy: RetentionPolicy) -> set[str]:
    """What every run keeps whatever its rounds' files: its dataset and genesis model, the
    base model and outer state, the reveals and payloads of every round still in the
    window (the current one too), and its latest certified model, outer state and
    update."""
    keep: set[str] = set()
    for run in s.execute(select(t.Run)).scalars():
        spec = _spec(run)
        keep |= {spec.dataset_hash, spec.genesis_model_hash}
        last = last_finalized(s, run.run_id)
        through = policy.expired_through(last)
        for base, outer in s.execute(select(t.Round.base_model_hash, t.Round.outer_state_hash)
                                     .where(t.Round.run_id == run.run_id,
                                            t.Round.round > through)):
            keep |= {h for h in (base, outer) if h is not None}
        # Files are shared by content: a reveal or payload of a round still in the window
        # stays even when a byte-identical file of another run's older round expires
        # (a validator would otherwise find a receipted reveal gone, protocol.md 7.5).
        keep |= set(s.execute(select(t.SpotRevealRow.reveal_hash).where(
            t.SpotRevealRow.run_id == run.run_id, t.SpotRevealRow.round > through)).scalars())
        keep |= set(s.execute(select(t.Submission.payload_hash).where(
            t.Submission.run_id == run.run_id, t.Submission.round > through)).scalars())
        if last is not None:
            rnd = s.get(t.Round, (run.run_id, last))
            assert rnd is not None
            certified = _certified(rnd)
            keep |= {certified[k] for k in ("model_hash", "outer_state_hash", "update_hash")}
    return keep


def _failed(status: str, reason: str, checks: str) -> bool:
    """A verdict row that is the evidence of a failed check (audit_rules.is_failed_check)."""
    try:
        parsed = json.loads(checks)
    except ValueError:
        parsed = None
    return is_failed_check(status, reason, parsed)


def round_files(s: Session, run_id: str, after: int, through: int) -> list[RoundFiles]:
    """The files of run ``run_id``'s settled rounds ``after < r <= through``: finalized,
    or voided (no certificate: every result's model and outer state is uncertified, and
    no verdict is evidence of anything)."""
    rounds = s.execute(select(t.Round).where(
        t.Round.run_id == run_id, t.Round.round > after, t.Round.round <= through,
        t.Round.status.in_((RoundStatus.FINALIZED.value, RoundStatus.VOIDED.value)))
        .order_by(t.Round.round)).scalars().all()
    if not rounds:
        return []
    reveals: dict[int, dict[str, str]] = {}
    for r, worker, digest in s.execute(select(
            t.SpotRevealRow.round, t.SpotRevealRow.worker, t.SpotRevealRow.reveal_hash).where(
            t.SpotRevealRow.run_id == run_id, t.SpotRevealRow.round > after,
            t.SpotRevealRow.round <= through)):
        reveals.setdefault(r, {})[worker] = digest
    failed: dict[int, set[str]] = {}
    for r, worker, status, reason, checks in s.execute(select(
            t.Verdict.round, t.Verdict.worker, t.Verdict.status, t.Verdict.reason,
            t.Verdict.checks).where(
            t.Verdict.run_id == run_id, t.Verdict.round > after, t.Verdict.round <= through,
            (t.Verdict.status == "rejected") | t.Verdict.spot_checked)):
        if _failed(status, reason, checks):
            failed.setdefault(r, set()).add(worker)
    certified_digest = {rnd.round: digest_of(_certified(rnd)) for rnd in rounds
                        if rnd.certificate is not None}
    uncertified: dict[int, list[tuple[str, str]]] = {}
    for r, digest, body in s.execute(select(
            t.RoundResultRow.round, t.RoundResultRow.certified_digest, t.RoundResultRow.body)
            .where(t.RoundResultRow.run_id == run_id, t.RoundResultRow.round > after,
                   t.RoundResultRow.round <= through)):
        if digest == certified_digest.get(r):
            continue
        certified = decode_canonical(body, max_bytes=MAX_RESULT_BYTES)["body"]["certified"]
        uncertified.setdefault(r, []).extend(
            (kind, certified[key]) for kind, key in (("model", "model_hash"),
                                                     ("outer_state", "outer_state_hash")))
    return [RoundFiles(rnd.round, rnd.base_model_hash, rnd.outer_state_hash,
                       reveals.get(rnd.round, {}), frozenset(failed.get(rnd.round, ())),
                       tuple(uncertified.get(rnd.round, ())))
            for rnd in rounds]


# ----------------------------------------------------------------------------- plans


@dataclass
class PrunePlan:
    """The files to delete now (those on disk), and per run the last round it covers."""

    policy: RetentionPolicy
    candidates: list[Candidate] = field(default_factory=list)
    through: dict[str, int] = field(default_factory=dict)


def plan(s: Session, blobs: BlobStore, policy: RetentionPolicy, *,
         done: Mapping[str, int] | None = None, run_id: str | None = None) -> PrunePlan:
    """What the policy deletes now: for each run (or ``run_id``), the files of its rounds
    out of the window and after ``done[run]`` (rounds already pruned), whose blob is of a
    prunable kind and whose file exists (a file already gone is not recorded as pruned:
    it was lost, and the audit can tell)."""
    out = PrunePlan(policy)
    if policy.keep_blobs:
        return out
    keep: set[str] | None = None
    query = select(t.Run).order_by(t.Run.run_id)
    if run_id is not None:
        query = query.where(t.Run.run_id == run_id)
    for run in s.execute(query).scalars().all():
        through = policy.expired_through(last_finalized(s, run.run_id))
        after = (done or {}).get(run.run_id, -1)
        if through <= after:
            continue
        if keep is None:
            keep = kept_digests(s, policy)
        found = run_candidates(run.run_id, round_files(s, run.run_id, after, through), keep,
                               masked=_spec(run).masked is not None)
        kinds = _blob_kinds(s, [c.sha256 for c in found])
        for c in found:
            size = blobs.size_of(c.sha256) if kinds.get(c.sha256) in PRUNABLE_KINDS else None
            if size is not None:
                out.candidates.append(Candidate(c.sha256, c.kind, c.run_id, c.round, c.worker,
                                                size))
        out.through[run.run_id] = through
    return out


def _blob_kinds(s: Session, digests: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k in range(0, len(digests), 500):
        out.update((digest, kind) for digest, kind in s.execute(
            select(t.Blob.sha256, t.Blob.kind).where(t.Blob.sha256.in_(digests[k:k + 500]))))
    return out


def record(s: Session, candidates: Sequence[Candidate], policy: RetentionPolicy,
           now: float) -> int:
    """Write a ``pruned_blobs`` row per candidate not recorded yet (a file whose deletion
    a crash cut short is deleted again, not recorded twice); how many are new."""
    recorded: set[tuple[str, str]] = set()
    digests = [c.sha256 for c in candidates]
    for k in range(0, len(digests), 500):
        recorded.update((run_id, digest) for run_id, digest in s.execute(
            select(t.PrunedBlob.run_id, t.PrunedBlob.sha256).where(
                t.PrunedBlob.sha256.in_(digests[k:k + 500]))))
    new = 0
    for c in candidates:
        if (c.run_id, c.sha256) in recorded:
            continue
        recorded.add((c.run_id, c.sha256))
        s.add(t.PrunedBlob(run_id=c.run_id, sha256=c.sha256, kind=c.kind, round=c.round,
                           worker=c.worker, size=c.size, pruned_at=now, policy=policy.label))
        new += 1
    return new


def record_batch(sessions: sessionmaker[Session], candidates: Sequence[Candidate],
                 policy: RetentionPolicy, now: float) -> int:
    """:func:`record` in a transaction of its own (again, if another process recorded some
    of the same files at the same time)."""
    try:
        with sessions.begin() as s:
            return record(s, candidates, policy, now)
    except IntegrityError:
        with sessions.begin() as s:
            return record(s, candidates, policy, now)


def delete_files(blobs: BlobStore, candidates: Iterable[Candidate]) -> int:
    """Delete the candidates' files (recorded already); the bytes freed."""
    return sum(blobs.remove(c.sha256) for c in candidates)


def batches(items: Sequence[Candidate], size: int = BATCH) -> Iterator[Sequence[Candidate]]:
    for k in range(0, len(items), size):
        yield items[k:k + size]


# ----------------------------------------------------------------------------- reports


@dataclass
class Usage:
    """Blob bytes still on disk (recorded, not pruned): the ledger's, and per run with its
    finalized rounds, so that the bytes kept per round can be read off."""

    total: int = 0
    runs: dict[str, tuple[int, int]] = field(default_factory=dict)  # run -> (bytes, rounds)


def usage(s: Session) -> Usage:
    pruned = select(t.PrunedBlob.sha256).where(t.PrunedBlob.sha256 == t.Blob.sha256).exists()
    out = Usage()
    for run_id, size in s.execute(select(t.Blob.run_id, func.sum(t.Blob.size)).where(
            ~pruned).group_by(t.Blob.run_id)):
        out.total += int(size or 0)
        if run_id is not None:
            out.runs[run_id] = (int(size or 0), 0)
    for run_id, n in s.execute(select(t.Round.run_id, func.count()).where(
            t.Round.status == RoundStatus.FINALIZED.value).group_by(t.Round.run_id)):
        out.runs[run_id] = (out.runs.get(run_id, (0, 0))[0], int(n))
    return out


def human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


@dataclass
class PruneReport:
    """What a prune deleted (or, dry, would delete) and what stays on disk."""

    policy: RetentionPolicy
    deleted: list[Candidate]
    freed: int
    recorded: int
    usage: Usage
    dry_run: bool = False

    def lines(self) -> list[str]:
        verb = "would delete" if self.dry_run else "deleted"
        by_run: dict[str, list[Candidate]] = {}
        for c in self.deleted:
            by_run.setdefault(c.run_id, []).append(c)
        out = []
        for run_id, cands in sorted(by_run.items()):
            kinds = ", ".join(f"{sum(1 for c in cands if c.kind == k)} {k}"
                              for k in sorted(PRUNABLE_KINDS) if any(c.kind == k for c in cands))
            first, last = min(c.round for c in cands), max(c.round for c in cands)
            rounds = f"round {first}" if first == last else f"rounds {first}-{last}"
            out.append(f"run {run_id}: {verb} {len(cands)} blob(s) ({kinds}) of {rounds}: "
                       f"{sum(c.size for c in cands)} bytes ({human(sum(c.size for c in cands))})")
        if not self.deleted:
            out.append(f"nothing to prune ({self.policy.label})")
        else:
            out.append(f"{'would free' if self.dry_run else 'freed'} {self.freed} bytes "
                       f"({human(self.freed)}) under {self.policy.label}")
        out.append(self.usage_line())
        return out

    def usage_line(self) -> str:
        runs = "; ".join(
            f"run {run_id}: {size} bytes over {n} finalized round(s)"
            + (f", {human(size / n)} per round" if n else "")
            for run_id, (size, n) in sorted(self.usage.runs.items()))
        return (f"{'would keep' if self.dry_run else 'kept'} on disk: {self.usage.total} "
                f"bytes ({human(self.usage.total)})"
                + (f" ({runs})" if runs else ""))


def prune(sessions: sessionmaker[Session], blobs: BlobStore, policy: RetentionPolicy, *,
          dry_run: bool = False, run_id: str | None = None,
          clock: Callable[[], float] = time.time) -> PruneReport:
    """Prune every run (or ``run_id``) now, each batch recorded before its files go; a dry
    run records and deletes nothing."""
    with sessions() as s:
        todo = plan(s, blobs, policy, run_id=run_id)
    freed = recorded = 0
    if dry_run:
        freed = sum(c.size for c in todo.candidates)
    else:
        for batch in batches(todo.candidates):
            recorded += record_batch(sessions, batch, policy, clock())
            freed += delete_files(blobs, batch)
    with sessions() as s:
        kept = usage(s)
    if dry_run:  # what would stay
        kept.total -= freed
        for c in todo.candidates:
            size, rounds = kept.runs.get(c.run_id, (c.size, 0))
            kept.runs[c.run_id] = (size - c.size, rounds)
    return PruneReport(policy, todo.candidates, freed, recorded, kept, dry_run)


# ----------------------------------------------------------------------------- reads


def pruned_row(s: Session, digest: str) -> t.PrunedBlob | None:
    return s.execute(select(t.PrunedBlob).where(t.PrunedBlob.sha256 == digest)
                     .order_by(t.PrunedBlob.pruned_at).limit(1)).scalar_one_or_none()


def describe(row: t.PrunedBlob) -> str:
    """What a pruned blob was, in words."""
    if row.kind == "reveal":
        return f"the reveal file of worker {(row.worker or '?')[:16]} in round {row.round}"
    what = "model" if row.kind == "model" else "outer state"
    return f"a {what} of round {row.round}"


def gone(row: t.PrunedBlob) -> BlobPruned:
    """The 410 problem for a pruned blob: what it was, when and by which policy it went."""
    at = datetime.fromtimestamp(row.pruned_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return BlobPruned(
        f"blob {row.sha256[:16]} ({describe(row)} of run {row.run_id}) was deleted at {at} by "
        f"the ledger's retention policy ({row.policy}); the chain keeps its hash, but "
        f"nothing that needs the file (such as `veritrain audit recheck {row.round}`) can "
        f"run any more. GET /v1/runs/{row.run_id}/pruned lists what is gone")


def pruned_json(row: t.PrunedBlob) -> dict[str, Any]:
    return {"sha256": row.sha256, "kind": row.kind, "round": row.round, "worker": row.worker,
            "size": row.size, "pruned_at": row.pruned_at, "policy": row.policy}


def pruned_page(s: Session, run_id: str, offset: int = 0, limit: int = 100) -> dict[str, Any]:
    """The run's pruned blobs, by round, kind and digest, a page at a time."""
    if s.get(t.Run, run_id) is None:
        raise RejectedInput(f"no run {run_id!r}", "not_found")
    offset, limit = page_bounds(offset, limit)
    rows = s.execute(select(t.PrunedBlob).where(t.PrunedBlob.run_id == run_id).order_by(
        t.PrunedBlob.round, t.PrunedBlob.kind, t.PrunedBlob.sha256).offset(offset)
        .limit(limit)).scalars().all()
    return {"run_id": run_id, "pruned": [pruned_json(r) for r in rows], "offset": offset,
            "limit": limit, "next_offset": offset + limit if len(rows) == limit else None}


__all__ = ["BATCH", "EVIDENCE_REASONS", "PRUNABLE_KINDS", "BlobPruned",
           "Candidate", "PrunePlan", "PruneReport", "RetentionPolicy", "RoundFiles",
           "evidence_of", "gone", "plan", "prune", "pruned_page", "record", "run_candidates",
           "usage"]
