"""Verifying a run's ledger log without trusting the ledger (specs/protocol.md, section 9).

The rows are first **scanned** (:class:`Scanner`): every hash and link is
recomputed and each row is reduced to what the rest of the audit reads (a
submission to its digest, a ledger record to its parsed body, a round result
to its opened envelope and the facts derived from its verdicts and scores).
A scan needs no row before its first one, so an export file is scanned in
chunks on several processes; the chunks are then joined by checking that each
one's first row follows the last row of the chunk before (``seq`` and
``prev_hash``), which is the same check every other row gets inside its
chunk. One **pass** over the scans, in order, then checks what each row claims
against what came before (the run spec's validator set, the round's
submissions, its certified result): it hands each row to its rule in
:mod:`veritrain.ledger.audit_rules` (one function per row kind, over the
audit's state, no I/O). The signatures are checked in bulk, here:

* **fast** (default): the ledger's checkpoint signatures (one per checkpoint,
  each vouching for every row up to it); every run spec, registration, beacon
  share and round result signature (a few per round); every quorum
  certificate, batched (:mod:`veritrain.ledger.blsbatch`). A submission whose
  digest is in a certified round's verdicts is vouched for by that quorum,
  which checked its signature (protocol.md 7.5, step 4): its own Ed25519
  signature is verified only when no certificate covers it.
* **full**: additionally every submission's and receipt's Ed25519 signature,
  each beacon share's BLS signature, and each certificate on its own; spread
  over processes.

The result names the first row that fails. Derived tables served by the API
(the verdicts with scores and rewards) can be passed as ``views`` and are
compared with the certified results they must come from.
"""

from __future__ import annotations

import gc
import hashlib
import json
import multiprocessing
import os
import re
from array import array
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from veritrain.protocol import bls
from veritrain.protocol.beacon import beacon_root, shard_check_root
from veritrain.protocol.certificates import CERTIFICATE
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.membership import MEMBERSHIP_MESSAGES
from veritrain.protocol.messages import (
    BeaconShare,
    CertifiedState,
    Receipt,
    Registration,
    RevealReceipt,
    RoundResult,
    RunSpec,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    SecaggReveal,
    SecaggView,
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    SpotReveal,
    Submission,
    digest_of,
    open_signed,
)
from veritrain.protocol.rules import PENALIZED_REASONS
from veritrain.protocol.signing import compute_signing_root, verify_ed25519

from . import audit_rules as rules
from .audit_rules import (
    RECORD_RULES,
    SIGNED_RULES,
    AuditState,
    Bad,
    BadEarlier,
    Deferred,
    Lists,
    RecordedResult,
    ResultFacts,
    ResultView,
    RoundState,
    take,
)
from .blsbatch import batch_fast_aggregate_verify
from .chain import GENESIS_HASH, ChainRow, is_valid_checkpoint

#: Signed kinds opened (signature verified) in every mode: a few rows per round.
ALWAYS_OPENED = {"run_spec": RunSpec, "beacon_share": BeaconShare,
                 "round_result": RoundResult, "shard_result": ShardPublication,
                 "shard_check_share": ShardCheckShare, "shard_finding": ShardFindingReport,
                 "secagg_keys": SecaggKeys, "secagg_deal": SecaggDeal,
                 "secagg_masked_input": SecaggMasked, "secagg_reveal": SecaggReveal,
                 "secagg_opening": SecaggOpening, "secagg_view": SecaggView,
                 "spot_reveal": SpotReveal,
                 "reveal_receipt": RevealReceipt,
                 **MEMBERSHIP_MESSAGES}
#: Fields of a verdict row served by the API that must equal the certified result.
VIEW_FIELDS = ("status", "reason", "detail", "spot_checked", "distance", "samples", "quality",
               "score", "reward")
PARALLEL_MIN_JOBS = 2000
PARALLEL_MIN_ROWS = 20_000
MAX_BODY = 1 << 26
#: Exceptions a malformed row raises in the checks; they name the row, not abort the audit.
ROW_ERRORS = (RejectedInput, KeyError, TypeError, ValueError)


@dataclass
class AuditResult:
    rows: int = 0
    signatures: int = 0
    certificates: int = 0
    checkpoints: int = 0
    covered_by_certificates: int = 0
    unsigned_tail: int = 0
    mode: str = "fast"
    first_bad_seq: int | None = None
    problem: str | None = None
    bad_view_row: str | None = None
    view_rows: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    totals: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Blobs the ledger says its retention policy deleted (None: it did not say), their
    #: bytes, and the first that is not the policy's to delete (protocol.md 9.7).
    pruned_blobs: int | None = None
    pruned_bytes: int = 0
    bad_pruned: str | None = None

    @property
    def ok(self) -> bool:
        return (self.first_bad_seq is None and self.bad_view_row is None
                and self.bad_pruned is None)

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__) | {"ok": self.ok}


def _attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ROW_ERRORS as exc:
        return Deferred(str(exc))


# ----------------------------------------------------------------------------- jobs
# A job reads its row (and, for a receipt, the row before) from the rows it is given.

RowsAt = Mapping[int, ChainRow] | Sequence[ChainRow]


def _open(row: ChainRow, cls: type[Any]) -> Any:
    return open_signed(decode_canonical(row.body, max_bytes=MAX_BODY), cls)


def _job_submission(rows: RowsAt, i: int, ctx: dict[str, Any]) -> None:
    row = rows[i]
    signed = _open(row, Submission)
    rules.check_submission(signed.message, signed.signer, row.run_id, ctx["round"])


def _job_receipt(rows: RowsAt, i: int, ctx: dict[str, Any]) -> None:
    signed = _open(rows[i], Receipt)
    rules.check_receipt(signed.message, signed.signer, ctx["ledger_key"],
                        rows[i - 1] if i > 0 else None)


def _job_registration(rows: RowsAt, i: int, ctx: dict[str, Any]) -> None:
    row = rows[i]
    signed = _open(row, Registration)
    rules.check_registration(signed.message, signed.signer, row.run_id)


def _job_checkpoint(rows: RowsAt, i: int, ctx: dict[str, Any]) -> str | None:
    row = rows[i]
    assert row.checkpoint is not None
    if not is_valid_checkpoint(bytes.fromhex(ctx["ledger_key"]), row.run_id, row.seq, row.hash,
                               row.checkpoint):
        return "ledger checkpoint signature does not verify"
    return None


def _job_share(rows: RowsAt, i: int, ctx: dict[str, Any]) -> str | None:
    share = _open(rows[i], BeaconShare).message
    if not bls.verify(bytes.fromhex(ctx["bls"]), beacon_root(share.run_id, share.round),
                      bytes.fromhex(share.share)):
        return "beacon share (BLS) does not verify"
    return None


def _job_certificate(rows: RowsAt, i: int, ctx: dict[str, Any]) -> str | None:
    if not bls.fast_aggregate_verify(ctx["pubs"], ctx["root"], ctx["signature"]):
        return "certificate: aggregate signature does not verify"
    return None


def _job_certificate_batch(rows: RowsAt, i: int, ctx: dict[str, Any]) -> str | None:
    if not batch_fast_aggregate_verify(ctx["items"]):
        return "batch"
    return None


JOBS: dict[str, Callable[[RowsAt, int, dict[str, Any]], str | None]] = {
    "submission": _job_submission, "receipt": _job_receipt, "checkpoint": _job_checkpoint,
    "registration": _job_registration,
    "share": _job_share, "certificate": _job_certificate, "batch": _job_certificate_batch,
}
Job = tuple[int, str, dict[str, Any]]  # (row index, job kind, context)
SLOW_JOBS = frozenset({"batch", "certificate", "share"})
#: Jobs that read no row: certificates carry what they check in their context.
ROWLESS_JOBS = frozenset({"batch", "certificate"})


def _run_jobs(jobs: Sequence[Job], rows: RowsAt) -> list[tuple[int, str]]:
    """(row index, problem) for every failing job, in this process."""
    out = []
    for i, kind, ctx in jobs:
        try:
            problem = JOBS[kind](rows, i, ctx)
        except Bad as exc:  # the row's rule
            problem = str(exc)
        except ROW_ERRORS as exc:
            problem = f"{rows[i].kind}: {exc}"
        if problem is not None:
            out.append((i, problem))
    return out


def _rows_for(jobs: Sequence[Job], rows: RowsAt) -> dict[int, ChainRow]:
    """Just the rows a chunk of jobs reads, to send along with it to a worker process."""
    need: dict[int, ChainRow] = {}
    for i, kind, _ in jobs:
        if kind not in ROWLESS_JOBS:
            need[i] = rows[i]
            if kind == "receipt" and i > 0:
                need[i - 1] = rows[i - 1]
    return need


def _submit_jobs(pool: Executor, jobs: Sequence[Job], rows: RowsAt, processes: int
                 ) -> list[Future[list[tuple[int, str]]]]:
    """Slow BLS jobs one per task and first, then the many cheap ones in chunks."""
    slow = [j for j in jobs if j[1] in SLOW_JOBS]
    cheap = [j for j in jobs if j[1] not in SLOW_JOBS]
    size = max(64, len(cheap) // (processes * 4))
    chunks = [[j] for j in slow] + [cheap[k:k + size] for k in range(0, len(cheap), size)]
    return [pool.submit(_run_jobs, chunk, _rows_for(chunk, rows)) for chunk in chunks]


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for a while. An audit allocates millions of
    objects in no cycle (parsed rows, results, scans), and each full collection walks
    the whole heap: with it on, a quarter of the time scanning an export went to it."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def fork_pool(processes: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(max_workers=processes,
                               mp_context=multiprocessing.get_context("fork"))


# ----------------------------------------------------------------------------- results

_RESULT_TAIL = re.compile(rb',"kind":"round_result","signature":"([0-9a-f]{128})",'
                          rb'"signer":"([0-9a-f]{64})"\}')
_RESULT_TAIL_LEN = len(',"kind":"round_result","signature":"","signer":""}') + 128 + 64
_RESULT_KEYS = frozenset({"attestation", "base_model_hash", "beacon_seed", "certified", "round",
                          "run_id", "scores", "validator", "verdicts"})


@dataclass(frozen=True)
class _Opened:
    message: ResultView
    signer: str


def open_result(wire: bytes) -> _Opened:
    """A stored round result, its validator's signature verified, read at C speed.

    The signature covers ``canonical(body)``, which is the wire's ``body`` member byte
    for byte (the wire is canonical with sorted keys), so the audit verifies it over
    that slice and parses the slice with the plain JSON parser: a body the validator
    did not sign fails the signature, and the verdicts and scores used are the ones
    whose canonical digests the certificate names. (Full mode opens it strictly.)
    """
    if not wire.startswith(b'{"body":') or len(wire) < 8 + _RESULT_TAIL_LEN:
        raise Bad("not a signed round result")
    tail = _RESULT_TAIL.fullmatch(wire, len(wire) - _RESULT_TAIL_LEN)
    if tail is None:
        raise Bad("not a signed round result")
    raw = wire[8:len(wire) - _RESULT_TAIL_LEN]
    body = json.loads(raw)
    if not isinstance(body, dict) or set(body) != _RESULT_KEYS:
        raise Bad("round result fields")
    run_id, r = body["run_id"], body["round"]
    if not isinstance(run_id, str) or not isinstance(r, int) or isinstance(r, bool) or r < 0:
        raise Bad("round result fields")
    sig, signer = bytes.fromhex(tail.group(1).decode()), tail.group(2).decode()
    if not verify_ed25519(bytes.fromhex(signer),
                          compute_signing_root("round_result", run_id, r, raw), sig):
        raise Bad(f"round_result signature does not verify for {signer}")
    if not all(isinstance(body[k], list) for k in ("verdicts", "scores")) or not set(
            map(type, body["verdicts"] + body["scores"])) <= {dict}:  # parsed JSON: exact types
        raise Bad("round result fields")
    return _Opened(ResultView(run_id, r, body["validator"], body["base_model_hash"],
                              body["beacon_seed"], body["verdicts"], body["scores"],
                              body["certified"]), signer)


def certified_views(r: int, verdicts: Sequence[dict[str, Any]],
                    scores: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The verdict rows the ledger serves for a certified result, in verdict order: each
    verdict with its worker's score entry (specs/ledger-api.md), as export lines
    (``{"type": "verdict", ...}``, the keys in the export's order)."""
    by_worker = {sc["worker"]: sc for sc in scores}
    out = []
    for v in verdicts:
        sc = by_worker.get(v["worker"], {})
        out.append({"type": "verdict", "round": r, "worker": v["worker"], "status": v["status"],
                    "reason": v["reason"], "detail": v["detail"],
                    "spot_checked": v["spot_checked"], "distance": v["distance"],
                    "samples": sc.get("samples", 0), "quality": sc.get("quality", 0.0),
                    "score": sc.get("score", 0.0), "reward": sc.get("reward", 0.0)})
    return out


_LINE_ENCODER = json.JSONEncoder(separators=(",", ":"))  # the export's line encoding
_LINE_START = '{"type":"verdict","round":'


def render_view_lines(views: list[dict[str, Any]]) -> bytes | None:
    """The export lines of one round's verdict rows, one per worker (the last verdict of a
    worker counts, as in the comparison) in worker order, as the ledger writes them; None
    when they cannot be rendered so (the views are then compared field by field).

    The list is encoded in one call and split at the item boundaries: every item starts
    with ``_LINE_START`` and no string can hold an unescaped quote, so each boundary is
    a ``},{`` followed by it; a count check refuses a match inside an item."""
    last = {row["worker"]: row for row in views}
    if not last:
        return b""
    try:
        ordered = [last[w] for w in sorted(last)]
        text = _LINE_ENCODER.encode(ordered)
    except (TypeError, ValueError):
        return None
    lines = text[1:-1].replace("}," + _LINE_START, "}\n" + _LINE_START) + "\n"
    if lines.count("\n") != len(ordered):
        return None
    return lines.encode("ascii")


@dataclass(frozen=True)
class Totals:
    """One certified result's contribution to the per-worker totals, a verdict a column
    entry (columns of numbers travel as arrays when every entry is a float, or an int)."""

    workers: list[Any]
    accepted: bytes  # 1 where the verdict's status is "accepted", 2 "excluded", else 0
    samples: Sequence[Any]
    scores: Sequence[Any]
    rewards: Sequence[Any]

    @classmethod
    def of(cls, views: list[dict[str, Any]]) -> Totals:
        return cls([row["worker"] for row in views],
                   bytes(_STATUS_CODE.get(row["status"], 0) for row in views),
                   _compact([row["samples"] for row in views]),
                   _compact([row["score"] for row in views]),
                   _compact([row["reward"] for row in views]))

    def rows(self) -> Iterator[tuple[Any, int, Any, Any, Any]]:
        return zip(self.workers, self.accepted, self.samples, self.scores, self.rewards,
                   strict=True)


#: ``Totals.accepted``: an excluded verdict (a statistical filter's suspicion) is verified
#: work, paid, and counted apart from both accepted and rejected.
_STATUS_CODE = {"accepted": 1, "excluded": 2}


def _compact(values: list[Any]) -> Sequence[Any]:
    """``values`` as an array when they all are floats (or ints that fit), else as is: an
    array gives back equal values of the same type, and pickles as one buffer."""
    types = set(map(type, values))
    if types == {float}:
        return array("d", values)
    if types == {int} and min(values) >= -(1 << 63) and max(values) < 1 << 63:
        return array("q", values)
    return values


@dataclass(frozen=True)
class ResultFactsAndViews(ResultFacts):
    """A result's :class:`ResultFacts` (what the rules read) and what the report reads of
    it: its contribution to the per-worker totals and its verdict rows' export lines."""

    totals: Totals | Deferred
    lines: bytes | None  # render_view_lines, when asked for

    @classmethod
    def of(cls, r: int, verdicts: Sequence[dict[str, Any]], scores: Sequence[dict[str, Any]],
           *, render: bool) -> ResultFactsAndViews:
        views = _attempt(lambda: certified_views(r, verdicts, scores))
        totals = views if isinstance(views, Deferred) else Totals.of(views)
        return cls(
            verdicts_digest=_attempt(lambda: digest_of(verdicts)),
            scores_digest=_attempt(lambda: digest_of(scores)),
            submission_digests=_attempt(lambda: sorted(v["submission_digest"] for v in verdicts)),
            failed=_attempt(lambda: {v["worker"] for v in verdicts
                                     if v["reason"] in PENALIZED_REASONS}),
            submitted=_attempt(lambda: {v["worker"]: v["submission_digest"] for v in verdicts}),
            excluded=_attempt(lambda: {v["worker"]: v["reason"] for v in verdicts
                                       if v["reason"] in ("banned", "unknown_worker")}),
            missing_reveal=_attempt(lambda: {v["worker"] for v in verdicts
                                             if v["reason"] == "missing_reveal"}),
            totals=totals,
            lines=render_view_lines(views) if render and not isinstance(views, Deferred)
            else None)


def _views_facts(res: RecordedResult) -> ResultFactsAndViews:
    facts = res.facts
    assert isinstance(facts, ResultFactsAndViews), "the pass records its results' views"
    return facts


# ----------------------------------------------------------------------------- the scan


@dataclass
class Scan:
    """Consecutive rows after the checks that need no row before them: from the second
    row on, ``seq`` follows, ``prev_hash`` links and every hash recomputes; the first
    row's hash recomputes (its ``seq`` and link are checked where the scan is joined to
    the one before). Indices are the rows' positions in the scan."""

    n: int = 0
    first_seq: Any = None
    first_prev: Any = None
    last_seq: Any = None
    last_hash: Any = None
    failure: tuple[int, str] | None = None  # the first row failing those checks
    subs: list[int] = field(default_factory=list)  # the submission rows, in order,
    sub_digests: list[str] = field(default_factory=list)  # with their sha256(body)
    sub_offsets: list[int] = field(default_factory=list)  # and lines' file offsets (if read)
    others: list[int] = field(default_factory=list)  # rows neither submission nor receipt
    rows: dict[int, ChainRow] = field(default_factory=dict)  # those, and checkpoint rows
    row_offsets: dict[int, int] = field(default_factory=dict)  # and their lines' (if read)
    checkpoints: list[int] = field(default_factory=list)
    prepared: dict[int, Any] = field(default_factory=dict)  # parsed ahead of the pass


@dataclass
class Columns:
    """Rows as parallel lists: what a file reader produces without a row object per line
    (only the rows a scan keeps become :class:`ChainRow`)."""

    seq: list[Any] = field(default_factory=list)
    kind: list[Any] = field(default_factory=list)
    body: list[Any] = field(default_factory=list)
    prev_hash: list[Any] = field(default_factory=list)
    hash: list[Any] = field(default_factory=list)
    checkpoint: list[Any] = field(default_factory=list)
    offset: list[int] | None = None  # where each row's line starts in its file
    run_id: str = ""
    rows: Sequence[ChainRow] | None = None  # the row objects, when they exist

    @classmethod
    def of(cls, rows: Sequence[ChainRow]) -> Columns:
        return cls([r.seq for r in rows], [r.kind for r in rows], [r.body for r in rows],
                   [r.prev_hash for r in rows], [r.hash for r in rows],
                   [r.checkpoint for r in rows], rows=rows)

    def row(self, j: int) -> ChainRow:
        if self.rows is not None:
            return self.rows[j]
        return ChainRow(self.seq[j], self.run_id, self.kind[j], self.body[j],
                        self.prev_hash[j], self.hash[j], self.checkpoint[j])


def _participant(row: ChainRow) -> str:
    """The key a registration row registers (its signature is a job of its own)."""
    participant = json.loads(row.body)["body"]["participant"]
    if not isinstance(participant, str):
        raise Bad("registration names no participant key")
    return participant


def _record_body(row: ChainRow) -> Any:
    """A ledger record's parsed body (the ledger's own record: its bytes are what the
    hash and checkpoint cover)."""
    try:
        return json.loads(row.body)
    except (ValueError, RecursionError) as exc:
        raise Bad(f"not a JSON record: {exc}") from exc


def _prepare_record(row: ChainRow) -> Any:
    try:
        return _record_body(row)
    except Bad as exc:
        return Deferred(str(exc))


def _prepare_result(row: ChainRow, render: bool
                    ) -> tuple[_Opened, ResultFactsAndViews] | Deferred:
    try:
        opened = open_result(row.body)
    except (Bad, *ROW_ERRORS) as exc:
        return Deferred(str(exc))
    res = opened.message
    assert res.verdicts is not None and res.scores is not None
    return opened, ResultFactsAndViews.of(res.round, res.verdicts, res.scores, render=render)


class Scanner:
    """Builds a :class:`Scan` from rows fed in order (in one call or several)."""

    def __init__(self, *, full: bool = False, render: bool = False) -> None:
        self.full = full
        self.render = render
        self.scan = Scan()
        self._kind_raw: dict[str, bytes] = {}

    def feed(self, cols: Columns) -> None:
        """Scan the next rows, in order."""
        scan = self.scan
        subs, sub_digests, others, kept, prepared = (scan.subs, scan.sub_digests, scan.others,
                                                     scan.rows, scan.prepared)
        kind_raws = self._kind_raw
        sha256, fromhex, tag = hashlib.sha256, bytes.fromhex, b"veritrain/v1/event"
        seqs, bodies, prevs, hashes, cps, offsets = (cols.seq, cols.body, cols.prev_hash,
                                                     cols.hash, cols.checkpoint, cols.offset)
        failure = scan.failure
        expected, prev = ((scan.last_seq + 1, scan.last_hash) if scan.n and failure is None
                          else (None, None))
        seq = scan.last_seq
        k = scan.n - 1
        for j, kind in enumerate(cols.kind):
            k += 1
            if failure is not None:
                continue  # rows after a broken link are not trusted: nothing to keep
            seq, row_hash, body = seqs[j], hashes[j], bodies[j]
            if k == 0:
                scan.first_seq, scan.first_prev = seq, prevs[j]
                problem = None  # checked against the scan before this one
            elif seq != expected:
                problem = f"sequence gap: expected {expected}"
            elif prevs[j] != prev:
                problem = "prev_hash does not match the row before"
            else:
                problem = None
            if problem is None:
                kind_raw = kind_raws.get(kind) if isinstance(kind, str) else None
                if kind_raw is None:
                    kind_raw = kind_raws[kind] = kind.encode()
                try:
                    digest = sha256(tag + fromhex(prevs[j]) + seq.to_bytes(8, "big")
                                    + len(kind_raw).to_bytes(2, "big") + kind_raw + body
                                    ).hexdigest()
                except (ValueError, OverflowError, TypeError, AttributeError):
                    digest = ""
                if digest != row_hash:
                    problem = "hash does not match the row's content"
            if problem is not None:
                failure = scan.failure = (k, problem)
                seq = scan.last_seq
                continue
            prev = row_hash
            expected = seq + 1
            if cps[j] is not None:
                scan.checkpoints.append(k)
                kept[k] = cols.row(j)
            if kind == "submission":
                subs.append(k)
                sub_digests.append(sha256(body).hexdigest())
                if offsets is not None:
                    scan.sub_offsets.append(offsets[j])
            elif kind != "receipt":
                others.append(k)
                row = kept[k] = cols.row(j)
                if offsets is not None:
                    scan.row_offsets[k] = offsets[j]
                if kind == "round_result":
                    if not self.full:
                        prepared[k] = _prepare_result(row, self.render)
                elif kind not in ALWAYS_OPENED and kind != "registration":
                    prepared[k] = _prepare_record(row)
        scan.n = k + 1
        if failure is None:
            scan.last_seq, scan.last_hash = seq, prev

    def travelling(self) -> Scan:
        """The scan made light to send to another process: without the verdict and score
        lists of its results, nor the bodies of rows parsed already (both are read again
        from the file where a rare check needs them; the certificates are read from their
        rows before the pass)."""
        scan = self.scan
        prepared, kept = scan.prepared, scan.rows
        for k, value in prepared.items():
            kind = kept[k].kind
            if k in scan.row_offsets and kind != "round_finalized":
                kept[k] = replace(kept[k], body=b"")
            if kind not in RECORD_CHECKS and isinstance(value, dict):
                prepared[k] = {"run_id": value.get("run_id")}  # all the pass reads of it
            if isinstance(value, tuple):
                opened, facts = value
                prepared[k] = (_Opened(replace(opened.message, verdicts=None, scores=None),
                                       opened.signer), facts)
        return self.scan


def scan_rows(rows: Sequence[ChainRow], *, full: bool = False) -> Scan:
    scanner = Scanner(full=full)
    scanner.feed(Columns.of(rows))
    return scanner.scan


# ----------------------------------------------------------------------------- the pass


Loader = Callable[[list[int]], Mapping[int, ChainRow]]


def _reread_lists(row: ChainRow, index: int, load: Loader | None) -> Lists:
    """A round result's verdicts and scores parsed again from its row (read again with
    ``load`` if it travelled without its body)."""
    if not row.body and load is not None:
        row = load([index])[index]
    msg = open_result(row.body).message
    assert msg.verdicts is not None and msg.scores is not None
    return msg.verdicts, msg.scores


class _Pass:
    """Sequential checks of one run's scanned rows: each row to its rule
    (:mod:`veritrain.ledger.audit_rules`) over the audit's state, in order; collects the
    signature jobs and the certified results' totals."""

    def __init__(self, ledger_key: bytes, full: bool, load: Loader | None = None) -> None:
        self.load = load
        self.ledger_key = ledger_key.hex()
        self.full = full
        self.out = AuditResult(mode="full" if full else "fast")
        self.state = AuditState()
        self.jobs: list[Job] = []
        self.certified: list[RecordedResult] = []  # in the order the rounds were finalized
        self._sums: dict[str, list[Any]] = {}

    def run(self, scans: Iterable[Scan]) -> tuple[int, str] | None:
        """Join the scans and check their rows in order; the index and problem of the
        first failing row, if any (the rows scanned are counted in ``out.rows``)."""
        prev, expected, base = GENESIS_HASH, 0, 0
        first: tuple[int, str] | None = None
        for scan in scans:
            self.out.rows += scan.n
            if first is not None or scan.n == 0:
                continue
            if scan.first_seq != expected:
                first = (base, f"sequence gap: expected {expected}")
            elif scan.first_prev != prev:
                first = (base, "prev_hash does not match the row before")
            stop = 0 if first is not None else scan.failure[0] if scan.failure else scan.n
            bad = self._walk(scan, base, stop)
            if bad is not None:
                first = bad
            elif first is None and scan.failure is not None:
                first = (base + scan.failure[0], scan.failure[1])
            prev, expected = scan.last_hash, (scan.last_seq + 1 if first is None else None)
            base += scan.n
        return first

    def _walk(self, scan: Scan, base: int, stop: int) -> tuple[int, str] | None:
        """The rows ``base + [0, stop)`` of a scan: each row that is neither a submission nor
        a receipt on its own, the runs of those between them at once."""
        counts, kept, prepared = self.out.kinds, scan.rows, scan.prepared
        start, at = 0, 0  # the next row to walk, its place among the scan's submissions
        for k in [*scan.others[:bisect_left(scan.others, stop)], stop]:
            bad, at = self._run_of_submissions(scan, base, start, k, at)
            if bad is not None or k == stop:
                return bad
            i, row = base + k, kept[k]
            kind = row.kind
            counts[kind] = counts.get(kind, 0) + 1
            try:
                if kind == "registration":  # its signature: row_jobs()
                    rules.process_registration(self.state, i, _participant(row))
                else:
                    self._other(i, row, prepared.get(k))
            except Bad as exc:
                return i, f"{kind}: {exc}"
            except BadEarlier as exc:
                return exc.index, f"{exc.kind}: {exc}"
            except ROW_ERRORS as exc:
                return i, f"{kind}: {exc}"
            start = k + 1
        return None

    def _run_of_submissions(self, scan: Scan, base: int, start: int, stop: int, at: int
                            ) -> tuple[tuple[int, str] | None, int]:
        """Rows ``[start, stop)`` of a scan, all submissions and receipts: the submissions
        go to their rule at once (:func:`audit_rules.process_submissions`). The first
        failing row, if any, and where the next run starts among the scan's submissions."""
        if start >= stop:
            return None, at
        subs = scan.subs
        end = bisect_left(subs, stop, at)
        bad: tuple[int, str] | None = None
        if end > at:
            try:
                rules.process_submissions(self.state, map(base.__add__, subs[at:end]),
                                          scan.sub_digests[at:end])
            except Bad as exc:
                stop = subs[at] + 1  # the rows up to that submission are counted
                end = at + 1
                bad = (base + subs[at], f"submission: {exc}")
        n_subs, counts = end - at, self.out.kinds
        first_is_sub = n_subs > 0 and subs[at] == start
        for kind, n in ((("submission", n_subs), ("receipt", stop - start - n_subs))
                        if first_is_sub else
                        (("receipt", stop - start - n_subs), ("submission", n_subs))):
            if n:
                counts[kind] = counts.get(kind, 0) + n
        if bad is not None:
            return bad, end
        if self.full:
            rnd, is_sub = self.state.current, set(subs[at:end])
            for k in range(start, stop):
                if k in is_sub:
                    assert rnd is not None
                    self.jobs.append((base + k, "submission", {"round": rnd.index}))
                else:
                    self.jobs.append((base + k, "receipt", {"ledger_key": self.ledger_key}))
        return None, end

    def _other(self, i: int, row: ChainRow, prepared: Any) -> None:
        """One row that is neither a submission, a receipt nor a registration: a signed row
        opened (its signature verified) or a ledger record parsed, then its rule."""
        kind = row.kind
        rules.check_first_row(i, kind)
        if kind == "round_result" and not self.full:
            self.out.signatures += 1
            opened, facts = take(prepared)
            self._round_result(i, row, opened.message, opened.signer, facts)
            return
        if kind in ALWAYS_OPENED:
            signed = open_signed(decode_canonical(row.body, max_bytes=MAX_BODY),
                                 ALWAYS_OPENED[kind])
            self.out.signatures += 1
            self._signed(i, row, signed.message, signed.signer)
            return
        body = rules.check_ledger_record(
            take(prepared) if prepared is not None else _record_body(row), row.run_id)
        rule = RECORD_RULES.get(kind)
        if rule is not None:
            finalized = rule(self.state, i, body)
            if finalized is not None:  # round_finalized: the round it certified
                self._add_certified(finalized)

    def _signed(self, i: int, row: ChainRow, message: Any, signer: str) -> None:
        """A signed row's rule; in full mode also its BLS share (a job for a beacon share)."""
        kind, state = row.kind, self.state
        if kind == "run_spec":
            rules.process_run_spec(state, i, message, signer, row.run_id)
            return
        if kind == "round_result":
            self._round_result(i, row, message, signer, ResultFactsAndViews.of(
                message.round, message.verdicts, message.scores, render=False))
            return
        if kind == "spot_reveal":
            rules.process_spot_reveal(state, i, message, signer,
                                      hashlib.sha256(row.body).hexdigest())
            return
        if kind == "reveal_receipt":
            rules.process_reveal_receipt(state, i, message, signer, self.ledger_key)
            return
        if kind == "secagg_masked_input":
            rules.process_secagg_masked(state, i, message, signer,
                                        hashlib.sha256(row.body).hexdigest())
            return
        idx = SIGNED_RULES[kind](state, i, message, signer)
        if not self.full or idx is None:
            return
        bls_key = rules.get_spec(state).validators[idx]["bls"]
        if kind == "beacon_share":
            self.jobs.append((i, "share", {"bls": bls_key}))
        elif kind == "shard_check_share" and not bls.verify(
                bytes.fromhex(bls_key), shard_check_root(message.run_id, message.round,
                                                         message.results),
                bytes.fromhex(message.share)):
            raise Bad("shard check share does not verify")

    def _round_result(self, i: int, row: ChainRow, message: RoundResult | ResultView,
                      signer: str, facts: ResultFacts) -> None:
        rules.process_round_result(self.state, i, message, signer, facts,
                                   partial(_reread_lists, row, i, self.load))

    def _add_certified(self, rnd: RoundState) -> None:
        """A finalized round's certified result: counted, and added to the per-worker sums
        (the views are compared after the pass): [rounds, accepted, rejected, samples,
        score, reward, excluded], made dicts by totals()."""
        res = rnd.certified
        assert res is not None
        self.out.covered_by_certificates += len(rnd.closed or [])
        self.out.certificates += 1  # its BLS signature: certificate_jobs(), run meanwhile
        totals: Totals = take(_views_facts(res).totals)
        self.certified.append(res)
        sums = self._sums
        for worker, accepted, samples, score, reward in totals.rows():
            tot = sums.get(worker)
            if tot is None:
                tot = sums[worker] = [0, 0, 0, 0, 0.0, 0.0, 0]
            tot[0] += 1
            if accepted == 1:
                tot[1] += 1
                tot[3] += samples
            elif accepted == 2:
                tot[6] += 1
                tot[3] += samples
            else:
                tot[2] += 1
                tot[3] += 0
            tot[4] += score
            tot[5] += reward

    def totals(self) -> dict[str, dict[str, float]]:
        keys = ("rounds", "accepted", "rejected", "samples", "score", "reward", "excluded")
        return {w: dict(zip(keys, tot, strict=True)) for w, tot in self._sums.items()}

    # -- after the pass

    def uncovered_submissions(self, upto: int) -> list[int]:
        """Submissions no certificate vouches for get their own signature checked."""
        if self.full:
            return []
        added = []
        for rnd in self.state.rounds.values():
            if rnd.certified is None:
                for i in rnd.submissions.values():
                    if i < upto:
                        self.jobs.append((i, "submission", {"round": rnd.index}))
                        added.append(i)
        return added

    def expected_views(self) -> dict[tuple[int, str], dict[str, Any]]:
        """The verdict row each (round, worker) must have, from the certified results."""
        expected: dict[tuple[int, str], dict[str, Any]] = {}
        for res in self.certified:
            for row in certified_views(res.message.round, *res.lists()):
                expected[(row["round"], row["worker"])] = {name: row[name]
                                                           for name in VIEW_FIELDS}
        return expected

    def expected_lines(self) -> bytes | None:
        """The export lines of every certified verdict row, in the export's order, or None
        where a round's could not be rendered."""
        parts = [_views_facts(res).lines for res in self.certified]
        return None if any(p is None for p in parts) else b"".join(parts)  # type: ignore[misc]


#: Ledger records the pass checks beyond their run (the others: a JSON object of the run).
RECORD_CHECKS = frozenset(RECORD_RULES)


def _name_bad_certificate(total: int, ctx: dict[str, Any], upto: int) -> tuple[int, str]:
    """A batch failed: check its certificates one by one to name the first bad row."""
    for i, pubs, root, sig in ctx["members"]:
        if i < upto and not bls.fast_aggregate_verify(pubs, root, sig):
            return i, "round_finalized: certificate: aggregate signature does not verify"
    return total, "round_finalized: certificate batch does not verify"


def certificate_jobs(spec_row: ChainRow | None, finalized: Iterable[tuple[int, ChainRow]],
                     full: bool, parts: int) -> list[Job]:
    """The BLS work for the certificates of the ``round_finalized`` rows, known before the
    pass so that it can run while the pass does (rows the pass finds malformed are failed
    by the pass). ``spec_row`` is row 0, the run spec naming the validators' keys."""
    certs = []
    try:
        assert spec_row is not None
        spec = RunSpec.from_body(decode_canonical(spec_row.body, max_bytes=MAX_BODY)["body"])
    except (AssertionError, RejectedInput, KeyError, TypeError, ValueError):
        return []
    for i, row in finalized:
        try:
            checked = CERTIFICATE(decode_canonical(row.body, max_bytes=MAX_BODY)["certificate"],
                                  "certificate")
            pubs = [bytes.fromhex(spec.validators[k]["bls"]) for k in checked["signers"]]
            root = CertifiedState.from_body(checked["certified"]).signing_root()
            certs.append((i, pubs, root, bytes.fromhex(checked["signature"])))
        except (RejectedInput, KeyError, TypeError, ValueError, IndexError):
            continue
    if full or len(certs) <= 1:
        return [(i, "certificate", {"pubs": pubs, "root": root, "signature": sig})
                for i, pubs, root, sig in certs]
    step = max(1, -(-len(certs) // max(1, parts)))  # one batch per process
    return [(part[0][0], "batch", {"items": [(pubs, root, sig) for _, pubs, root, sig in part],
                                   "members": part})
            for part in (certs[k:k + step] for k in range(0, len(certs), step))]


def _finalized_rows(scans: Sequence[Scan]) -> Iterator[tuple[int, ChainRow]]:
    base = 0
    for scan in scans:
        for k in scan.others:
            if scan.rows[k].kind == "round_finalized":
                yield base + k, scan.rows[k]
        base += scan.n


def row_jobs(scans: Sequence[Scan], ledger_key: str) -> list[Job]:
    """The signature checks that need nothing but their row (every checkpoint and every
    registration), known before the pass so that they can run while it does; the
    pass fails a registration before the run spec, and rows after the first failure
    are dropped, as for every job."""
    jobs: list[Job] = []
    base = 0
    for scan in scans:
        jobs += [(base + k, "checkpoint", {"ledger_key": ledger_key}) for k in scan.checkpoints]
        jobs += [(base + k, "registration", {}) for k in scan.others
                 if scan.rows[k].kind == "registration"]
        base += scan.n
    return jobs


@dataclass
class Verified:
    """A finished pass: the result so far and what the views check needs."""

    out: AuditResult
    passed: _Pass


def verify_scans(scans: Sequence[Scan], rows: RowsAt | None, ledger_key: bytes, *,
                 full: bool = False, processes: int | None = None,
                 pool: Executor | None = None, load: Loader | None = None) -> Verified:
    """The pass over ``scans`` and every signature check, without the views.

    ``rows``: the rows themselves when they are at hand (else the jobs read the rows the
    scans kept, and ``load`` reads rows they did not keep: the submissions the pass finds
    no certificate for, a result's row whose lists a rare check needs again).
    With several processes (``pool``, or one made here for a big log) the certificates'
    BLS checks and the checks of single rows start before the pass, and the signature
    checks it collects follow.
    """
    n_proc = processes if processes is not None else (os.cpu_count() or 1)
    total = sum(scan.n for scan in scans)
    spec_row = scans[0].rows.get(0) if scans else None
    own_pool: ProcessPoolExecutor | None = None
    use_pool = pool is not None or (n_proc > 1 and total >= PARALLEL_MIN_ROWS)
    # One batch per two processes: a batch costs a pairing and a final exponentiation more.
    certs = certificate_jobs(spec_row, _finalized_rows(scans), full,
                             max(1, n_proc // 2) if use_pool else 1)
    at: RowsAt
    if rows is not None:
        at = rows
    else:
        at = {}
        base = 0
        for scan in scans:
            at.update((base + k, row) for k, row in scan.rows.items())
            base += scan.n
    early = row_jobs(scans, ledger_key.hex())
    try:
        futures: list[Future[list[tuple[int, str]]]] = []
        if use_pool and pool is None:
            pool = own_pool = fork_pool(n_proc)
        if pool is not None:
            futures = _submit_jobs(pool, certs + early, at, n_proc)
        p = _Pass(ledger_key, full, load)
        out = p.out
        first = p.run(scans)
        upto = total if first is None else first[0]
        uncovered = p.uncovered_submissions(upto)
        if uncovered and rows is None:
            assert load is not None, "scans without their rows need a loader"
            assert isinstance(at, dict)
            at.update(load(uncovered))
        late = [j for j in p.jobs if j[0] < upto]
        if pool is not None:
            futures += _submit_jobs(pool, late, at, n_proc)
        elif n_proc > 1 and len(early) + len(late) >= PARALLEL_MIN_JOBS:  # a small log,
            pool = own_pool = fork_pool(n_proc)  # many signatures
            futures = _submit_jobs(pool, certs + early + late, at, n_proc)
        results = ([bad for f in futures for bad in f.result()] if pool is not None
                   else _run_jobs(certs + early + late, at))
    finally:
        if own_pool is not None:
            own_pool.shutdown()
    jobs = [j for j in early if j[0] < upto] + late
    failures = [] if first is None else [first]
    batches = {j[0]: j for j in certs if j[1] == "batch"}
    for i, problem in results:
        if problem == "batch":
            failures.append(_name_bad_certificate(total, batches[i][2], upto))
        elif i < upto:
            failures.append((i, problem))
    out.signatures += sum(1 for j in jobs if j[1] in ("submission", "receipt", "share",
                                                      "registration"))
    out.checkpoints = sum(1 for j in jobs if j[1] == "checkpoint")
    last_checkpoint = max((j[0] for j in jobs if j[1] == "checkpoint"), default=-1)
    out.unsigned_tail = upto - 1 - last_checkpoint if first is None else 0
    out.totals = p.totals()
    if failures:
        # Rows before i are contiguous from seq 0, so i is the seq the bad row should have.
        i, problem = min(failures)
        out.first_bad_seq, out.problem = i, problem
    return Verified(out, p)


def verify_log(rows: Sequence[ChainRow], ledger_key: bytes, *, full: bool = False,
               views: Sequence[dict[str, Any]] | None = None,
               processes: int | None = None,
               pruned: Sequence[dict[str, Any]] | None = None) -> AuditResult:
    """Verify one run's whole event log (and optionally its served verdict rows and the
    blobs the ledger lists as pruned by its retention policy)."""
    with gc_paused():
        done = verify_scans([scan_rows(rows, full=full)], rows, ledger_key, full=full,
                            processes=processes)
        if done.out.ok and views is not None:
            check_views(done.out, done.passed.expected_views(), views)
        if done.out.ok and pruned is not None:
            check_pruned_blobs(done.out, done.passed.state, pruned)
    return done.out


def check_pruned_blobs(out: AuditResult, state: AuditState,
                       pruned: Sequence[dict[str, Any]]) -> None:
    """The pruned blobs counted, and each checked against the rows (``audit_pruned``)."""
    out.pruned_blobs = len(pruned)
    out.pruned_bytes = sum(row.get("size", 0) for row in pruned
                           if isinstance(row, dict) and type(row.get("size")) is int)
    try:
        rules.audit_pruned(state, pruned)
    except (Bad, *ROW_ERRORS, AttributeError) as exc:
        out.bad_pruned = str(exc) if isinstance(exc, Bad) else f"pruned blobs: {exc!r}"


def check_views(out: AuditResult, expected: dict[tuple[int, str], dict[str, Any]],
                views: Iterable[dict[str, Any]]) -> None:
    """Each served verdict row against the certified one; names the first that differs."""
    seen = set()
    # Rounds finalized after the rows were read have no certificate here yet: skipped.
    last = max((r for r, _ in expected), default=-1)
    for v in views:
        key = (v.get("round"), v.get("worker"))
        if isinstance(key[0], int) and key[0] > last:
            continue
        label = f"verdicts row (round {key[0]}, worker {str(key[1])[:16]})"
        want = expected.get(key)  # type: ignore[arg-type]
        out.view_rows += 1
        if want is None:
            out.bad_view_row = f"{label}: no certified verdict for it"
            return
        seen.add(key)
        for name in VIEW_FIELDS:
            if v.get(name) != want[name]:
                out.bad_view_row = (f"{label}: {name} is {v.get(name)!r}, the certified "
                                    f"result says {want[name]!r}")
                return
    missing = sorted(set(expected) - seen)
    if missing:
        r, w = missing[0]
        out.bad_view_row = f"verdicts row (round {r}, worker {w[:16]}): certified but not served"
