"""Bulk ingest of signed submissions: many in one transaction, under the same rules.

:meth:`LedgerStore.accept_submission` takes one submission per transaction
(one fsync, two ORM flushes, a handful of queries each). :func:`accept_batch`
takes a batch of them in one transaction and gives each the *same* outcome
the one-by-one path would, in order: the same checks
(:func:`veritrain.protocol.rules.check_submission`, duplicates, payload
hash and size), the same rows (submission, receipt, blob, chain events) and
the round closes at the same submission. A test replays one sequence both
ways and compares. What is saved: the spec, round, participants and blobs are
read once per batch, rows are inserted with one ``executemany`` per table,
and the ledger signs one checkpoint per batch instead of per request.

:func:`open_submissions` decodes received envelopes and verifies their
Ed25519 signatures, on several processes when there are many.
:class:`SubmissionBatcher` groups concurrent requests of a server into
batches (group commit) for the writer thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import Receipt, RunSpec, Signed, Submission, open_signed, sign
from veritrain.protocol.rules import SubmissionContext, check_submission
from veritrain.protocol.schedule import Action, RoundStatus, RoundView, next_action

from . import schema as t
from .blobs import StagedBlob
from .chain import GENESIS_HASH, compute_event_hash
from .checkpoints import chain_head, note_append
from .store import Conflict, LedgerStore

MAX_BATCH = 1000


@dataclass(frozen=True)
class Incoming:
    """A submission whose payload is stored: its signed envelope (and, when known, the exact
    bytes received, which are its canonical encoding) and the payload's hash and size."""

    signed: Signed[Submission]
    payload_hash: str
    payload_size: int
    raw: bytes | None = None
    #: False in a masked run: the worker keeps its payload and reveals it only when
    #: spot-checked, so no blob row is written for it.
    stored: bool = True
    #: The server's upload of the payload, published only if this submission is accepted.
    staged: StagedBlob | None = None

    def encoded(self) -> bytes:
        return self.raw if self.raw is not None else self.signed.encode()


Outcome = Signed[Receipt] | RejectedInput


def _open_one(raw: bytes) -> Signed[Submission] | RejectedInput:
    try:
        return open_signed(decode_canonical(raw), Submission)
    except RejectedInput as exc:
        return exc


def _open_chunk(raws: list[bytes]) -> list[Signed[Submission] | RejectedInput]:
    return [_open_one(raw) for raw in raws]


def open_submissions(raws: Sequence[bytes], *, processes: int = 1,
                     pool: Executor | None = None) -> list[Signed[Submission] | RejectedInput]:
    """Decode and signature-check envelopes (each refusal is returned, not raised)."""
    if pool is None and (processes <= 1 or len(raws) < 256):
        return _open_chunk(list(raws))
    size = max(64, len(raws) // (4 * max(1, processes)))
    chunks = [list(raws[k:k + size]) for k in range(0, len(raws), size)]
    if pool is not None:
        return [x for part in pool.map(_open_chunk, chunks) for x in part]
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as own:
        return [x for part in own.map(_open_chunk, chunks) for x in part]


@dataclass
class _RunState:
    """What one batch reads once about a run's open round."""

    spec: RunSpec
    rnd: t.Round
    parts: dict[str, tuple[str, int]]
    submitted: set[str]
    count: int
    active: int
    min_submissions: int


@dataclass
class _Buffers:
    events: list[dict[str, Any]] = field(default_factory=list)
    submissions: list[dict[str, Any]] = field(default_factory=list)
    blobs: list[dict[str, Any]] = field(default_factory=list)

    def flush(self, s: Session) -> None:
        """One ``executemany`` per table on the driver's cursor. No ORM bookkeeping for rows
        nobody reads back, nor Core's per-row parameter processing, which cost as much as
        SQLite's inserts themselves: the values are str, int, float and bytes, which the
        drivers take as they are."""
        conn = s.connection()
        quote = conn.dialect.identifier_preparer.quote
        mark = _NAMED_MARK[conn.dialect.paramstyle]
        for model, rows in ((t.Blob, self.blobs), (t.Event, self.events),
                            (t.Submission, self.submissions)):
            if rows:
                cols = list(rows[0])
                conn.exec_driver_sql(
                    f"INSERT INTO {quote(model.__tablename__)} "
                    f"({', '.join(quote(c) for c in cols)}) "
                    f"VALUES ({', '.join(mark.format(c) for c in cols)})", rows)
                rows.clear()


#: A named parameter in each DB-API paramstyle (sqlite3 takes named ones in any).
_NAMED_MARK = {"qmark": ":{}", "named": ":{}", "numeric": ":{}", "format": "%({})s",
               "pyformat": "%({})s"}


def _in_chunks(values: Sequence[str], n: int = 500) -> list[Sequence[str]]:
    return [values[k:k + n] for k in range(0, len(values), n)]


def _run_state(store: LedgerStore, s: Session, run_id: str, workers: list[str]) -> _RunState:
    spec = store.get_spec(s, run_id)
    rnd = store._current_round(s, run_id)
    parts: dict[str, tuple[str, int]] = {}
    submitted: set[str] = set()
    for chunk in _in_chunks(workers):
        for key, role, banned in s.execute(select(
                t.Participant.pubkey, t.Participant.role, t.Participant.banned_until_round)
                .where(t.Participant.run_id == run_id, t.Participant.pubkey.in_(chunk))):
            parts[key] = (role, banned)
        submitted.update(s.execute(select(t.Submission.worker).where(
            t.Submission.run_id == run_id, t.Submission.round == rnd.round,
            t.Submission.worker.in_(chunk))).scalars())
    return _RunState(spec, rnd, parts, submitted, store._count_submissions(s, rnd),
                     store._active_workers(s, run_id, rnd.round),
                     spec.schedule["min_submissions"])


def _append(s: Session, buf: _Buffers, run_id: str, kind: str, body: bytes) -> int:
    head = chain_head(s, run_id)
    seq = 0 if head is None else head[0] + 1
    prev = GENESIS_HASH if head is None else head[1]
    digest = compute_event_hash(prev, seq, kind, body)
    buf.events.append({"run_id": run_id, "seq": seq, "kind": kind, "body": body,
                       "prev_hash": prev, "hash": digest})
    note_append(s, run_id, seq, digest, kind)
    return seq


def accept_batch(store: LedgerStore, items: Sequence[Incoming]) -> list[Outcome]:
    """Record each submission as :meth:`LedgerStore.accept_submission` would, in one
    transaction; the outcome of each, in order (a receipt, or the refusal)."""
    if len(items) > MAX_BATCH:
        raise ValueError(f"at most {MAX_BATCH} submissions per batch")
    now = store.clock()
    outcomes: list[Outcome] = []
    with store.sessions.begin() as s:
        states: dict[str, _RunState | RejectedInput] = {}
        for run_id in dict.fromkeys(i.signed.message.run_id for i in items):
            try:
                states[run_id] = _run_state(store, s, run_id, sorted(
                    {i.signed.message.worker for i in items if i.signed.message.run_id == run_id}))
            except RejectedInput as exc:
                states[run_id] = exc
        have_blobs: set[str] = set()
        for chunk in _in_chunks(sorted({i.payload_hash for i in items})):
            have_blobs.update(s.execute(select(t.Blob.sha256).where(t.Blob.sha256.in_(chunk)))
                              .scalars())
        buf = _Buffers()
        for item in items:
            try:
                outcomes.append(_accept_one(store, s, buf, states, have_blobs, item, now))
            except RejectedInput as exc:
                outcomes.append(exc)
        buf.flush(s)
        store._publish(tuple(i.staged for i, o in zip(items, outcomes, strict=True)
                             if i.staged is not None and not isinstance(o, RejectedInput)))
    return outcomes


def _accept_one(store: LedgerStore, s: Session, buf: _Buffers,
                states: dict[str, _RunState | RejectedInput], have_blobs: set[str],
                item: Incoming, now: float) -> Signed[Receipt]:
    signed, sub = item.signed, item.signed.message
    if item.payload_hash != sub.payload_hash or item.payload_size != sub.payload_bytes:
        raise RejectedInput("payload differs from the envelope's hash or size",
                            "payload_mismatch")
    state = states[sub.run_id]
    if isinstance(state, RejectedInput):
        raise state
    rnd = state.rnd
    role, banned = state.parts.get(sub.worker, (None, -1))
    is_open = rnd.status == RoundStatus.OPEN.value
    ctx = SubmissionContext(
        spec=state.spec, round=rnd.round if is_open else -1,
        base_model_hash=rnd.base_model_hash, worker_registered=role == "worker",
        worker_banned=role is not None and banned >= rnd.round)
    check_submission(signed, ctx)
    if sub.worker in state.submitted:
        raise Conflict("this worker already submitted for this round")
    raw = item.encoded()
    digest = hashlib.sha256(raw).hexdigest()
    if item.stored and item.payload_hash not in have_blobs:
        buf.blobs.append({"sha256": item.payload_hash, "size": item.payload_size,
                          "kind": "payload", "run_id": sub.run_id, "sealed_round": sub.round,
                          "created_at": now})
        have_blobs.add(item.payload_hash)
    seq = _append(s, buf, sub.run_id, "submission", raw)
    receipt = sign(store.identity, Receipt(
        run_id=sub.run_id, round=sub.round, worker=sub.worker, submission_digest=digest,
        received_at=now, sequence=seq))
    receipt_raw = receipt.encode()
    buf.submissions.append({
        "run_id": sub.run_id, "round": sub.round, "worker": sub.worker, "digest": digest,
        "envelope": raw, "payload_hash": item.payload_hash, "payload_bytes": item.payload_size,
        "samples": sub.samples, "received_at": now, "receipt": receipt_raw})
    _append(s, buf, sub.run_id, "receipt", receipt_raw)
    state.submitted.add(sub.worker)
    state.count += 1
    view = RoundView(RoundStatus.OPEN, rnd.deadline, state.count, state.active)
    if next_action(view, now, min_submissions=state.min_submissions) is Action.CLOSE:
        buf.flush(s)
        store._close(s, rnd, now)
    return receipt


class SubmissionBatcher:
    """Group commit for a server: concurrent ``accept`` calls share one transaction.

    Each call waits for the batch it joined; a batch starts as soon as the writer
    is free, so a lone request waits for nobody.
    """

    def __init__(self, store: LedgerStore, writer: Executor, max_batch: int = 256) -> None:
        self.store, self.writer, self.max_batch = store, writer, max_batch
        self._queue: list[tuple[Incoming, asyncio.Future[Outcome]]] = []
        self._running = False

    async def accept(self, item: Incoming) -> Signed[Receipt]:
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._queue.append((item, fut))
        if not self._running:
            self._running = True
            asyncio.get_running_loop().create_task(self._drain())
        outcome = await fut
        if isinstance(outcome, RejectedInput):
            raise outcome
        return outcome

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._queue:
                batch, self._queue = (self._queue[: self.max_batch],
                                      self._queue[self.max_batch:])
                try:
                    outcomes = await loop.run_in_executor(
                        self.writer, accept_batch, self.store, [i for i, _ in batch])
                except Exception as exc:
                    for _, fut in batch:
                        if not fut.done():
                            fut.set_exception(exc)
                    continue
                for (_, fut), outcome in zip(batch, outcomes, strict=True):
                    if not fut.done():
                        fut.set_result(outcome)
        finally:
            self._running = False


def default_processes() -> int:
    return max(1, os.cpu_count() or 1)
