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
submissions, its certified result). The signatures are checked in bulk:

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
from typing import Any

from veritrain.protocol import bls
from veritrain.protocol.beacon import (
    beacon_root,
    beacon_seed_of,
    compute_beacon_seed,
    sealed_list_digest,
    shard_check_root,
)
from veritrain.protocol.certificates import CERTIFICATE
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import (
    BeaconShare,
    CertifiedState,
    Receipt,
    Registration,
    RoundResult,
    RunSpec,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    SecaggReveal,
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    Submission,
    digest_of,
    open_signed,
)
from veritrain.protocol.secagg import round_buckets
from veritrain.protocol.signing import compute_signing_root, verify_ed25519

from .blsbatch import batch_fast_aggregate_verify
from .chain import GENESIS_HASH, ChainRow, is_valid_checkpoint

#: Signed kinds opened (signature verified) in every mode: a few rows per round.
ALWAYS_OPENED = {"run_spec": RunSpec, "beacon_share": BeaconShare,
                 "round_result": RoundResult, "shard_result": ShardPublication,
                 "shard_check_share": ShardCheckShare, "shard_finding": ShardFindingReport,
                 "secagg_keys": SecaggKeys, "secagg_deal": SecaggDeal,
                 "secagg_masked_input": SecaggMasked, "secagg_reveal": SecaggReveal,
                 "secagg_opening": SecaggOpening}
#: A masked round's board posts: chain kind -> (board kind, the field naming the sender).
SECAGG_POSTS = {"secagg_keys": ("keys", "worker"), "secagg_deal": ("deal", "dealer"),
                "secagg_masked_input": ("masked", "worker"), "secagg_reveal": ("reveal", "holder"),
                "secagg_opening": ("opening", "worker")}
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

    @property
    def ok(self) -> bool:
        return self.first_bad_seq is None and self.bad_view_row is None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__) | {"ok": self.ok}


class Bad(Exception):
    """A row that fails a check (raised inside the pass, turned into the result)."""


class BadEarlier(Exception):
    """An earlier row (``index``, of ``kind``) turns out to be wrong once a later row is read."""

    def __init__(self, index: int, kind: str, problem: str) -> None:
        super().__init__(problem)
        self.index = index
        self.kind = kind


@dataclass(frozen=True)
class Deferred:
    """A problem met while deriving a value ahead of the pass (possibly in another process):
    the pass raises it where it reads the value, so the same row fails with the same text."""

    problem: str


def _attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except ROW_ERRORS as exc:
        return Deferred(str(exc))


def _take(value: Any) -> Any:
    if isinstance(value, Deferred):
        raise Bad(value.problem)
    return value


# ----------------------------------------------------------------------------- jobs
# A job reads its row (and, for a receipt, the row before) from the rows it is given.

RowsAt = Mapping[int, ChainRow] | Sequence[ChainRow]


def _open(row: ChainRow, cls: type[Any]) -> Any:
    return open_signed(decode_canonical(row.body, max_bytes=MAX_BODY), cls)


def _job_submission(rows: RowsAt, i: int, ctx: dict[str, Any]) -> str | None:
    row = rows[i]
    signed = _open(row, Submission)
    sub = signed.message
    if signed.signer != sub.worker:
        return "submission signed by a key other than its worker"
    if sub.run_id != row.run_id or sub.round != ctx["round"]:
        return f"submission for round {sub.round} recorded in round {ctx['round']}"
    return None


def _job_receipt(rows: RowsAt, i: int, ctx: dict[str, Any]) -> str | None:
    row = rows[i]
    signed = _open(row, Receipt)
    rec = signed.message
    if signed.signer != ctx["ledger_key"]:
        return "receipt not signed by this ledger"
    before = rows[i - 1] if i > 0 else None
    if (before is None or before.kind != "submission" or rec.sequence != before.seq
            or rec.submission_digest != hashlib.sha256(before.body).hexdigest()):
        return "receipt does not name the submission row before it"
    return None


def _job_registration(rows: RowsAt, i: int, ctx: dict[str, Any]) -> str | None:
    row = rows[i]
    signed = _open(row, Registration)
    if signed.message.run_id != row.run_id or signed.signer != signed.message.participant:
        return "registration of another run or signed by another key"
    return None


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
class ResultView:
    """The fields of a round result the audit uses (fast mode). ``verdicts`` and ``scores``
    are None once their :class:`ResultFacts` are derived and the result has travelled
    between processes without them (they are parsed again from the row when needed)."""

    run_id: str
    round: int
    validator: str
    base_model_hash: str
    beacon_seed: str
    verdicts: list[dict[str, Any]] | None
    scores: list[dict[str, Any]] | None
    certified: dict[str, Any]


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
    accepted: bytes  # 1 where the verdict's status is "accepted"
    samples: Sequence[Any]
    scores: Sequence[Any]
    rewards: Sequence[Any]

    @classmethod
    def of(cls, views: list[dict[str, Any]]) -> Totals:
        return cls([row["worker"] for row in views],
                   bytes(row["status"] == "accepted" for row in views),
                   _compact([row["samples"] for row in views]),
                   _compact([row["score"] for row in views]),
                   _compact([row["reward"] for row in views]))

    def rows(self) -> Iterator[tuple[Any, int, Any, Any, Any]]:
        return zip(self.workers, self.accepted, self.samples, self.scores, self.rewards,
                   strict=True)


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
class ResultFacts:
    """What the audit reads of a result's verdicts and scores, derived where they were
    parsed so the lists need not travel between processes. Each is its value or the
    :class:`Deferred` problem its derivation raised."""

    verdicts_digest: str | Deferred
    scores_digest: str | Deferred
    submission_digests: list[str] | Deferred  # sorted
    failed: set[str] | Deferred  # workers whose spot check failed
    totals: Totals | Deferred
    lines: bytes | None  # render_view_lines, when asked for

    @classmethod
    def of(cls, r: int, verdicts: Sequence[dict[str, Any]], scores: Sequence[dict[str, Any]],
           *, render: bool) -> ResultFacts:
        views = _attempt(lambda: certified_views(r, verdicts, scores))
        totals = views if isinstance(views, Deferred) else Totals.of(views)
        return cls(
            verdicts_digest=_attempt(lambda: digest_of(verdicts)),
            scores_digest=_attempt(lambda: digest_of(scores)),
            submission_digests=_attempt(lambda: sorted(v["submission_digest"] for v in verdicts)),
            failed=_attempt(lambda: {v["worker"] for v in verdicts
                                     if v["reason"] == "spot_check_failed"}),
            totals=totals,
            lines=render_view_lines(views) if render and not isinstance(views, Deferred)
            else None)


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


def _prepare_result(row: ChainRow, render: bool) -> tuple[_Opened, ResultFacts] | Deferred:
    try:
        opened = open_result(row.body)
    except (Bad, *ROW_ERRORS) as exc:
        return Deferred(str(exc))
    res = opened.message
    assert res.verdicts is not None and res.scores is not None
    return opened, ResultFacts.of(res.round, res.verdicts, res.scores, render=render)


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


@dataclass
class _Result:
    """A recorded round result: its row, the message and the facts of its lists."""

    index: int
    row: ChainRow
    message: RoundResult | ResultView
    facts: ResultFacts
    load: Loader | None = None  # reads the row again if it travelled without its body

    def lists(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The verdicts and scores, parsed again from the row if they travelled without."""
        msg = self.message
        if msg.verdicts is None or msg.scores is None:
            row = self.row
            if not row.body and self.load is not None:
                row = self.load([self.index])[self.index]
            msg = open_result(row.body).message
        assert msg.verdicts is not None and msg.scores is not None
        return msg.verdicts, msg.scores


@dataclass
class _Round:
    index: int
    base: str
    submissions: dict[str, int] = field(default_factory=dict)  # digest -> row index
    closed: list[str] | None = None
    sealed: str | None = None  # sealed_list_digest(closed), once closed
    shares: dict[int, str] = field(default_factory=dict)  # validator -> its logged BLS share
    beacon_seed: str | None = None
    results: list[_Result] = field(default_factory=list)
    shard_results: list[str | None] | None = None  # result digests by shard, once published
    shard_list: list[str | None] | None = None
    shard_shares: dict[int, str] = field(default_factory=dict)  # validator -> BLS share
    shard_seed: str | None = None
    shard_findings: dict[tuple[int, int], bool] = field(default_factory=dict)  # -> faulty
    shard_faults: set[int] = field(default_factory=set)
    secagg_bucket_of: dict[str, int] | None = None  # worker -> bucket, once dealt
    secagg_posts: set[tuple[str, str]] = field(default_factory=set)  # (board kind, sender)
    bans: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    penalties: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    certified: _Result | None = None


class _Pass:
    """Sequential checks of one run's scanned rows; collects the signature jobs."""

    def __init__(self, ledger_key: bytes, full: bool, load: Loader | None = None) -> None:
        self.load = load
        self.ledger_key = ledger_key.hex()
        self.full = full
        self.out = AuditResult(mode="full" if full else "fast")
        self.spec: RunSpec | None = None
        self.rounds: dict[int, _Round] = {}
        self.current: _Round | None = None
        self.next_base: str | None = None
        self.jobs: list[Job] = []
        self.certified: list[_Result] = []  # in the order the rounds were finalized
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
                if kind == "registration":
                    self._need_spec()  # its signature: row_jobs()
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
        """Rows ``[start, stop)`` of a scan, all submissions and receipts: each submission is
        recorded in the open round under its digest. The first failing row, if any, and
        where the next run starts among the scan's submissions."""
        if start >= stop:
            return None, at
        subs = scan.subs
        end = bisect_left(subs, stop, at)
        rnd = self.current
        if end > at and (rnd is None or rnd.closed is not None):
            stop = subs[at] + 1  # the rows up to that submission are counted
            end = at + 1
            bad: tuple[int, str] | None = (base + subs[at],
                                           "submission: no open round to record it in")
        else:
            bad = None
        n_subs, counts = end - at, self.out.kinds
        first_is_sub = n_subs > 0 and subs[at] == start
        for kind, n in ((("submission", n_subs), ("receipt", stop - start - n_subs))
                        if first_is_sub else
                        (("receipt", stop - start - n_subs), ("submission", n_subs))):
            if n:
                counts[kind] = counts.get(kind, 0) + n
        if bad is not None:
            return bad, end
        assert rnd is not None or n_subs == 0
        if n_subs:
            assert rnd is not None
            rnd.submissions.update(zip(scan.sub_digests[at:end],
                                       map(base.__add__, subs[at:end]), strict=True))
        if self.full:
            is_sub = set(subs[at:end])
            for k in range(start, stop):
                if k in is_sub:
                    assert rnd is not None
                    self.jobs.append((base + k, "submission", {"round": rnd.index}))
                else:
                    self.jobs.append((base + k, "receipt", {"ledger_key": self.ledger_key}))
        return None, end

    # -- per kind

    def _other(self, i: int, row: ChainRow, prepared: Any) -> None:
        kind = row.kind
        if i == 0 and kind != "run_spec":
            raise Bad("the first row must be the run spec")
        if kind == "round_result" and not self.full:
            self.out.signatures += 1
            opened, facts = _take(prepared)
            self._round_result(i, row, opened, facts)
            return
        if kind in ALWAYS_OPENED:
            signed = open_signed(decode_canonical(row.body, max_bytes=MAX_BODY),
                                 ALWAYS_OPENED[kind])
            self.out.signatures += 1
            if kind == "round_result":
                res = signed.message
                self._round_result(i, row, signed, ResultFacts.of(
                    res.round, res.verdicts, res.scores, render=False))
            elif kind in SECAGG_POSTS:
                self._secagg_post(kind, signed)
            else:
                getattr(self, "_" + kind)(i, row, signed)
            return
        body = _take(prepared) if prepared is not None else _record_body(row)
        if not isinstance(body, dict):
            raise Bad("a ledger record is a JSON object")
        if body.get("run_id") != row.run_id:
            raise Bad("record of another run")
        handler = getattr(self, "_rec_" + kind, None)
        if handler is not None:
            handler(i, body)

    def _need_spec(self) -> RunSpec:
        if self.spec is None:
            raise Bad("before the run spec")
        return self.spec

    def _run_spec(self, i: int, row: ChainRow, signed: Any) -> None:
        if i != 0 or self.spec is not None:
            raise Bad("a second run spec")
        spec: RunSpec = signed.message
        if signed.signer != spec.organiser:
            raise Bad("run spec not signed by its organiser")
        if spec.run_id != row.run_id:
            raise Bad("run spec of another run")
        self.spec = spec
        self.next_base = spec.genesis_model_hash

    def _validator_index(self, signer: str, named: str) -> int:
        idx = self._need_spec().validator_index(signer)
        if idx is None or signer != named:
            raise Bad("not signed by a validator of this run")
        return idx

    def _round_of(self, r: int) -> _Round:
        rnd = self.rounds.get(r)
        if rnd is None:
            raise Bad(f"round {r} was never opened")
        return rnd

    def _beacon_share(self, i: int, row: ChainRow, signed: Any) -> None:
        share: BeaconShare = signed.message
        idx = self._validator_index(signed.signer, share.validator)
        rnd = self._round_of(share.round)
        if rnd.closed is None:
            raise Bad("beacon share before the round closed")
        if share.sealed != rnd.sealed:
            raise Bad("beacon share names another sealed list than the round's")
        rnd.shares.setdefault(idx, share.share)
        if self.full:
            self.jobs.append((i, "share", {"bls": self._need_spec().validators[idx]["bls"]}))

    def _sharded_round(self, signer: str, named: str, r: int, *, open_only: bool = True
                       ) -> tuple[int, _Round]:
        spec = self._need_spec()
        idx = self._validator_index(signer, named)
        rnd = self._round_of(r)
        if not spec.shards:
            raise Bad("shard message in a run that does not shard")
        if rnd.beacon_seed is None:
            raise Bad("shard message before the round's beacon was fixed")
        if open_only and rnd.certified is not None:
            raise Bad("shard result or check share after the round was finalized")
        if rnd.shard_results is None:
            rnd.shard_results = [None] * spec.shards
        return idx, rnd

    def _shard_result(self, i: int, row: ChainRow, signed: Any) -> None:
        pub: ShardPublication = signed.message
        idx, rnd = self._sharded_round(signed.signer, pub.validator, pub.round)
        assert rnd.shard_results is not None
        if pub.shard != idx or rnd.shard_results[idx] is not None or rnd.shard_list is not None:
            raise Bad("shard result for another shard, repeated, or after the list was fixed")
        rnd.shard_results[idx] = pub.result_digest

    def _shard_check_share(self, i: int, row: ChainRow, signed: Any) -> None:
        share: ShardCheckShare = signed.message
        idx, rnd = self._sharded_round(signed.signer, share.validator, share.round)
        if share.results != (rnd.shard_list if rnd.shard_list is not None
                             else rnd.shard_results) or idx in rnd.shard_shares:
            raise Bad("check share over another list than the published results, or repeated")
        if self.full and not bls.verify(
                bytes.fromhex(self._need_spec().validators[idx]["bls"]),
                shard_check_root(share.run_id, share.round, share.results),
                bytes.fromhex(share.share)):
            raise Bad("shard check share does not verify")
        rnd.shard_shares[idx] = share.share

    def _shard_finding(self, i: int, row: ChainRow, signed: Any) -> None:
        found: ShardFindingReport = signed.message
        idx, rnd = self._sharded_round(signed.signer, found.validator, found.round,
                                       open_only=False)
        spec = self._need_spec()
        if rnd.shard_seed is None or rnd.shard_list is None:
            raise Bad("finding before the round's check seed was fixed")
        if (found.shard == idx or not 0 <= found.shard < len(rnd.shard_list)
                or found.published_digest != rnd.shard_list[found.shard]
                or found.publisher != spec.validators[found.shard]["ed25519"]):
            raise Bad("finding about a shard result that is not another validator's listed one")
        if (idx, found.shard) in rnd.shard_findings:
            raise Bad("a second finding of one validator on one shard")
        rnd.shard_findings[(idx, found.shard)] = found.faulty

    def _rec_shard_list_fixed(self, i: int, body: dict[str, Any]) -> None:
        rnd = self._round_of(body["round"])
        if rnd.shard_list is not None or body["results"] != rnd.shard_results:
            raise Bad("fixed shard list differs from the published results")
        rnd.shard_list = body["results"]

    def _rec_shard_check_fixed(self, i: int, body: dict[str, Any]) -> None:
        spec = self._need_spec()
        rnd = self._round_of(body["round"])
        signers = body["signers"]
        if len(set(signers)) != len(signers) or len(signers) < spec.quorum or signers != sorted(
                signers) or any(not 0 <= k < len(spec.validators) for k in signers):
            raise Bad("shard check signers are not a quorum of the validator set")
        if rnd.shard_seed is not None or [rnd.shard_shares.get(k) for k in signers] != body[
                "shares"]:
            raise Bad("shard check seed fixed twice, or from shares that were not recorded")
        if body["results"] != rnd.shard_list or body["seed"] != compute_beacon_seed(
                [bytes.fromhex(x) for x in body["shares"]]).hex():
            raise Bad("shard check seed does not follow from its list and shares")
        rnd.shard_seed = body["seed"]

    def _rec_shard_fault(self, i: int, body: dict[str, Any]) -> None:
        spec = self._need_spec()
        rnd = self._round_of(body["round"])
        shard = body["shard"]
        reporters = sorted(k for (k, sh), faulty in rnd.shard_findings.items()
                           if sh == shard and faulty)
        if shard in rnd.shard_faults or body["reporters"] != reporters or len(
                reporters) < spec.quorum:
            raise Bad("shard fault without a quorum of recorded faulty findings")
        rnd.shard_faults.add(shard)

    def _rec_secagg_started(self, i: int, body: dict[str, Any]) -> None:
        spec = self._need_spec()
        rnd = self._round_of(body["round"])
        if spec.masked is None or rnd.beacon_seed is None or rnd.secagg_bucket_of is not None:
            raise Bad("buckets dealt in an unmasked run, before the beacon, or twice")
        buckets = body["buckets"]
        members = [w for b in buckets for w in b]
        if (len(set(members)) != len(members) or len(members) > len(rnd.closed or ())
                or any(len(b) < 2 or b != sorted(b) for b in buckets)):
            raise Bad("buckets overlap, hold more workers than the sealed list, or are short")
        if buckets != round_buckets(bytes.fromhex(rnd.beacon_seed), members,
                                    spec.masked["bucket_size"]):
            raise Bad("buckets are not the beacon's deal of their members")
        rnd.secagg_bucket_of = {w: b for b, ws in enumerate(buckets) for w in ws}

    def _secagg_post(self, kind: str, signed: Any) -> None:
        board_kind, field_name = SECAGG_POSTS[kind]
        msg = signed.message
        sender = getattr(msg, field_name)
        rnd = self._round_of(msg.round)
        if signed.signer != sender or rnd.secagg_bucket_of is None or (
                rnd.secagg_bucket_of.get(sender) != msg.bucket):
            raise Bad("board post not signed by its sender, before the buckets, or from "
                      "outside the bucket it names")
        if (board_kind, sender) in rnd.secagg_posts or (
                board_kind == "opening" and ("masked", sender) not in rnd.secagg_posts):
            raise Bad("a second board post of one kind, or an opening without a masked input")
        if rnd.certified is not None:
            raise Bad("board post after the round was finalized")
        rnd.secagg_posts.add((board_kind, sender))

    def _round_result(self, i: int, row: ChainRow, signed: Any, facts: ResultFacts) -> None:
        res: RoundResult | ResultView = signed.message
        self._validator_index(signed.signer, res.validator)
        rnd = self._round_of(res.round)
        cert = CertifiedState.from_body(res.certified)
        if res.base_model_hash != rnd.base or cert.round != res.round + 1:
            raise Bad("result for another base model or round")
        if cert.verdicts_hash != _take(facts.verdicts_digest) or cert.scores_hash != _take(
                facts.scores_digest):
            raise Bad("verdicts or scores differ from the certified digests")
        if rnd.beacon_seed is None or res.beacon_seed != rnd.beacon_seed:
            raise Bad("result uses another beacon than the round's")
        rnd.results.append(_Result(i, row, res, facts, self.load))

    def _rec_round_opened(self, i: int, body: dict[str, Any]) -> None:
        r = body["round"]
        if self.current is not None and self.current.certified is None:
            raise Bad("a round opened before the previous one finalized")
        if r != (0 if self.current is None else self.current.index + 1):
            raise Bad(f"round {r} opened out of order")
        if body["base_model_hash"] != self.next_base:
            raise Bad("base model is not the one the last certificate vouches for")
        self.current = self.rounds[r] = _Round(r, body["base_model_hash"])

    def _rec_round_closed(self, i: int, body: dict[str, Any]) -> None:
        rnd = self._round_of(body["round"])
        if rnd is not self.current or rnd.closed is not None:
            raise Bad("closes a round that is not open")
        listed = list(body["submissions"])
        if set(map(type, listed)) <= {str}:  # as sorted lists, without sorting:
            # the digests recorded are distinct, so equal multisets are equal sets
            same = len(listed) == len(rnd.submissions) and set(listed) == rnd.submissions.keys()
        else:
            same = sorted(listed) == sorted(rnd.submissions)
        if not same:
            raise Bad("sealed list differs from the submissions recorded in the round")
        rnd.closed = listed
        rnd.sealed = sealed_list_digest(listed)

    def _rec_beacon_fixed(self, i: int, body: dict[str, Any]) -> None:
        rnd = self._round_of(body["round"])
        spec = self._need_spec()
        signers = body["signers"]
        if len(set(signers)) != len(signers) or len(signers) != spec.quorum or signers != sorted(
                signers) or any(not 0 <= k < len(spec.validators) for k in signers):
            raise Bad("beacon signers are not a quorum of the validator set")
        if [rnd.shares.get(k) for k in signers] != list(body["shares"]):
            raise Bad("beacon shares are not the signers' logged beacon_share rows")
        rnd.beacon_seed = beacon_seed_of({"shares": body["shares"]})

    def _rec_round_finalized(self, i: int, body: dict[str, Any]) -> None:
        spec = self._need_spec()
        rnd = self._round_of(body["round"])
        checked = CERTIFICATE(body["certificate"], "certificate")
        state = CertifiedState.from_body(checked["certified"])
        signers = checked["signers"]
        if state.run_id != spec.run_id or state.round != rnd.index + 1:
            raise Bad(f"certificate is for {state.run_id} round {state.round}")
        if len(set(signers)) != len(signers) or len(signers) < spec.quorum or any(
                k >= len(spec.validators) for k in signers):
            raise Bad("certificate signers are not a quorum of the validator set")
        match = [res for res in rnd.results if res.message.certified == checked["certified"]]
        if not match:
            raise Bad("no recorded validator result carries the certified state")
        res = match[0]
        closed = rnd.closed or []
        if _take(res.facts.submission_digests) != sorted(closed):
            raise Bad("certified verdicts do not cover exactly the sealed submissions")
        self._check_bans(rnd, res)
        rnd.certified = res
        self.out.covered_by_certificates += len(closed)
        self.out.certificates += 1  # its BLS signature: certificate_jobs(), run meanwhile
        self.next_base = state.model_hash
        self._add_totals(res)

    def _rec_ban(self, i: int, body: dict[str, Any]) -> None:
        # Written just before the round's certificate: checked when that arrives.
        rnd = self._round_of(body["round"])
        if rnd.certified is not None or rnd.closed is None:
            raise Bad("ban outside the finalization of its round")
        rnd.bans.append((i, body))

    def _rec_penalty(self, i: int, body: dict[str, Any]) -> None:
        # A forfeit of an earlier certified reward, written just before the certificate.
        rnd = self._round_of(body["round"])
        if rnd.certified is not None or rnd.closed is None:
            raise Bad("penalty outside the finalization of its round")
        rnd.penalties.append((i, body))

    def _rec_validator_fault(self, i: int, body: dict[str, Any]) -> None:
        rnd = self._round_of(body["round"])
        differs = any(res.message.validator == body["validator"] and digest_of(
            res.message.certified) == body["result_digest"] != body["certified_digest"]
            for res in rnd.results)
        if not differs:
            raise Bad("fault without a recorded result that differs from the certificate")

    def _check_bans(self, rnd: _Round, res: _Result) -> None:
        failed = _take(res.facts.failed)
        spec = self._need_spec()
        ban_rounds = spec.verification["ban_rounds"]
        for i, body in rnd.bans:
            if body["worker"] not in failed or body["reason"] != "spot_check_failed" or body[
                    "until_round"] != rnd.index + ban_rounds:
                raise BadEarlier(i, "ban", "ban without a certified failed spot check")
        vesting = spec.verification.get("vesting_rounds", 0)
        for i, body in rnd.penalties:
            src = self.rounds.get(body["source_round"])
            earned = None if src is None or src.certified is None else next(
                (sc["reward"] for sc in src.certified.lists()[1]
                 if sc["worker"] == body["worker"]), None)
            if (body["worker"] not in failed or earned is None or body["amount"] != earned
                    or not rnd.index - vesting < body["source_round"] < rnd.index):
                raise BadEarlier(i, "penalty", "penalty that is not an unvested certified "
                                 "reward of a worker whose spot check failed")

    def _rec_run_finished(self, i: int, body: dict[str, Any]) -> None:
        if self.current is None or self.current.certified is None:
            raise Bad("run finished with a round not finalized")

    def _add_totals(self, res: _Result) -> None:
        """Per-worker sums of the certified verdicts (the views are compared after the pass):
        [rounds, accepted, rejected, samples, score, reward], made dicts by totals()."""
        totals: Totals = _take(res.facts.totals)
        self.certified.append(res)
        sums = self._sums
        for worker, accepted, samples, score, reward in totals.rows():
            tot = sums.get(worker)
            if tot is None:
                tot = sums[worker] = [0, 0, 0, 0, 0.0, 0.0]
            tot[0] += 1
            if accepted:
                tot[1] += 1
                tot[3] += samples
            else:
                tot[2] += 1
                tot[3] += 0
            tot[4] += score
            tot[5] += reward

    def totals(self) -> dict[str, dict[str, float]]:
        keys = ("rounds", "accepted", "rejected", "samples", "score", "reward")
        return {w: dict(zip(keys, tot, strict=True)) for w, tot in self._sums.items()}

    # -- after the pass

    def uncovered_submissions(self, upto: int) -> list[int]:
        """Submissions no certificate vouches for get their own signature checked."""
        if self.full:
            return []
        added = []
        for rnd in self.rounds.values():
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
        parts = [res.facts.lines for res in self.certified]
        return None if any(p is None for p in parts) else b"".join(parts)  # type: ignore[misc]


#: Ledger records the pass checks beyond their run (the others: a JSON object of the run).
RECORD_CHECKS = frozenset(name[5:] for name in dir(_Pass) if name.startswith("_rec_"))


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
               processes: int | None = None) -> AuditResult:
    """Verify one run's whole event log (and optionally its served verdict rows)."""
    with gc_paused():
        done = verify_scans([scan_rows(rows, full=full)], rows, ledger_key, full=full,
                            processes=processes)
        if done.out.ok and views is not None:
            check_views(done.out, done.passed.expected_views(), views)
    return done.out


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
