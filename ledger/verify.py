"""Verifying a run's ledger log without trusting the ledger (specs/protocol.md, section 9).

One pass over the rows, in order, recomputes every hash and link and checks
what each row claims against what came before (the run spec's validator set,
the round's submissions, its certified result). The signatures are then
checked in bulk:

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

import hashlib
import json
import multiprocessing
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from veritrain.protocol import bls
from veritrain.protocol.beacon import beacon_root, beacon_seed_of
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
    Submission,
    digest_of,
    open_signed,
)
from veritrain.protocol.signing import compute_signing_root, verify_ed25519

from .blsbatch import batch_fast_aggregate_verify
from .chain import GENESIS_HASH, ChainRow, is_valid_checkpoint

#: Signed kinds opened (signature verified) in every mode: a few rows per round.
ALWAYS_OPENED = {"run_spec": RunSpec, "beacon_share": BeaconShare,
                 "round_result": RoundResult}
#: Fields of a verdict row served by the API that must equal the certified result.
VIEW_FIELDS = ("status", "reason", "detail", "spot_checked", "distance", "samples", "quality",
               "score", "reward")
PARALLEL_MIN_JOBS = 2000
PARALLEL_MIN_ROWS = 20_000
MAX_BODY = 1 << 26


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
    """An earlier row (``index``) turns out to be wrong once a later row is read."""

    def __init__(self, index: int, problem: str) -> None:
        super().__init__(problem)
        self.index = index


# ----------------------------------------------------------------------------- jobs
# Jobs run in this process or in forked workers that inherit ``_ROWS``.

_ROWS: Sequence[ChainRow] = ()


def _open(row: ChainRow, cls: type[Any]) -> Any:
    return open_signed(decode_canonical(row.body, max_bytes=MAX_BODY), cls)


def _job_submission(i: int, ctx: dict[str, Any]) -> str | None:
    row = _ROWS[i]
    signed = _open(row, Submission)
    sub = signed.message
    if signed.signer != sub.worker:
        return "submission signed by a key other than its worker"
    if sub.run_id != row.run_id or sub.round != ctx["round"]:
        return f"submission for round {sub.round} recorded in round {ctx['round']}"
    return None


def _job_receipt(i: int, ctx: dict[str, Any]) -> str | None:
    row = _ROWS[i]
    signed = _open(row, Receipt)
    rec = signed.message
    if signed.signer != ctx["ledger_key"]:
        return "receipt not signed by this ledger"
    before = _ROWS[i - 1] if i > 0 else None
    if (before is None or before.kind != "submission" or rec.sequence != before.seq
            or rec.submission_digest != hashlib.sha256(before.body).hexdigest()):
        return "receipt does not name the submission row before it"
    return None


def _job_registration(i: int, ctx: dict[str, Any]) -> str | None:
    row = _ROWS[i]
    signed = _open(row, Registration)
    if signed.message.run_id != row.run_id or signed.signer != signed.message.participant:
        return "registration of another run or signed by another key"
    return None


def _job_checkpoint(i: int, ctx: dict[str, Any]) -> str | None:
    row = _ROWS[i]
    assert row.checkpoint is not None
    if not is_valid_checkpoint(bytes.fromhex(ctx["ledger_key"]), row.run_id, row.seq, row.hash,
                               row.checkpoint):
        return "ledger checkpoint signature does not verify"
    return None


def _job_share(i: int, ctx: dict[str, Any]) -> str | None:
    share = _open(_ROWS[i], BeaconShare).message
    if not bls.verify(bytes.fromhex(ctx["bls"]), beacon_root(share.run_id, share.round),
                      bytes.fromhex(share.share)):
        return "beacon share (BLS) does not verify"
    return None


def _job_certificate(i: int, ctx: dict[str, Any]) -> str | None:
    if not bls.fast_aggregate_verify(ctx["pubs"], ctx["root"], ctx["signature"]):
        return "certificate: aggregate signature does not verify"
    return None


def _job_certificate_batch(i: int, ctx: dict[str, Any]) -> str | None:
    if not batch_fast_aggregate_verify(ctx["items"]):
        return "batch"
    return None


JOBS: dict[str, Callable[[int, dict[str, Any]], str | None]] = {
    "submission": _job_submission, "receipt": _job_receipt, "checkpoint": _job_checkpoint,
    "registration": _job_registration,
    "share": _job_share, "certificate": _job_certificate, "batch": _job_certificate_batch,
}
Job = tuple[int, str, dict[str, Any]]  # (row index, job kind, context)
SLOW_JOBS = frozenset({"batch", "certificate", "share"})


def _run_jobs(jobs: Sequence[Job]) -> list[tuple[int, str]]:
    """(row index, problem) for every failing job, in this process."""
    out = []
    for i, kind, ctx in jobs:
        try:
            problem = JOBS[kind](i, ctx)
        except (RejectedInput, KeyError, TypeError, ValueError) as exc:
            problem = f"{_ROWS[i].kind}: {exc}"
        if problem is not None:
            out.append((i, problem))
    return out


def _run_all(rows: Sequence[ChainRow], jobs: list[Job], processes: int) -> list[tuple[int, str]]:
    global _ROWS
    _ROWS = rows
    try:
        if processes <= 1 or len(jobs) < PARALLEL_MIN_JOBS:
            return _run_jobs(jobs)
        # Slow BLS jobs one per task and first, then the many cheap ones in chunks.
        slow = [j for j in jobs if j[1] in SLOW_JOBS]
        cheap = [j for j in jobs if j[1] not in SLOW_JOBS]
        size = max(64, len(cheap) // (processes * 8))
        chunks = [[j] for j in slow] + [cheap[k:k + size] for k in range(0, len(cheap), size)]
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
            futures: list[Future[list[tuple[int, str]]]] = [
                pool.submit(_run_jobs, chunk) for chunk in chunks]
            return [bad for f in futures for bad in f.result()]
    finally:
        _ROWS = ()


# ----------------------------------------------------------------------------- results

_RESULT_TAIL = re.compile(rb',"kind":"round_result","signature":"([0-9a-f]{128})",'
                          rb'"signer":"([0-9a-f]{64})"\}')
_RESULT_TAIL_LEN = len(',"kind":"round_result","signature":"","signer":""}') + 128 + 64
_RESULT_KEYS = frozenset({"attestation", "base_model_hash", "beacon_seed", "certified", "round",
                          "run_id", "scores", "validator", "verdicts"})


@dataclass(frozen=True)
class ResultView:
    """The fields of a round result the audit uses (fast mode)."""

    run_id: str
    round: int
    validator: str
    base_model_hash: str
    beacon_seed: str
    verdicts: list[dict[str, Any]]
    scores: list[dict[str, Any]]
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
    if not all(isinstance(body[k], list) for k in ("verdicts", "scores")) or not all(
            isinstance(v, dict) for v in body["verdicts"] + body["scores"]):
        raise Bad("round result fields")
    return _Opened(ResultView(run_id, r, body["validator"], body["base_model_hash"],
                              body["beacon_seed"], body["verdicts"], body["scores"],
                              body["certified"]), signer)


# ----------------------------------------------------------------------------- the pass


@dataclass
class _Round:
    index: int
    base: str
    submissions: dict[str, int] = field(default_factory=dict)  # digest -> row index
    closed: list[str] | None = None
    beacon_seed: str | None = None
    results: list[RoundResult | ResultView] = field(default_factory=list)
    bans: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    penalties: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    certified: RoundResult | ResultView | None = None


class _Pass:
    """Sequential checks of one run's rows; collects the signature jobs."""

    def __init__(self, rows: Sequence[ChainRow], ledger_key: bytes, full: bool) -> None:
        self.rows = rows
        self.ledger_key = ledger_key.hex()
        self.full = full
        self.out = AuditResult(rows=len(rows), mode="full" if full else "fast")
        self.spec: RunSpec | None = None
        self.rounds: dict[int, _Round] = {}
        self.current: _Round | None = None
        self.next_base: str | None = None
        self.jobs: list[Job] = []
        self.expected_views: dict[tuple[int, str], dict[str, Any]] = {}
        self.last_checkpoint = -1

    def run(self) -> tuple[int, str] | None:
        """Check rows in order; the index and problem of the first failing row, if any."""
        prev, expected = GENESIS_HASH, 0
        sha256 = hashlib.sha256
        tag = b"veritrain/v1/event"
        kinds = self.out.kinds
        for i, row in enumerate(self.rows):
            if row.seq != expected:
                return i, f"sequence gap: expected {expected}"
            if row.prev_hash != prev:
                return i, "prev_hash does not match the row before"
            kind = row.kind
            try:
                kind_raw = kind.encode()
                digest = sha256(tag + bytes.fromhex(prev) + row.seq.to_bytes(8, "big")
                                + len(kind_raw).to_bytes(2, "big") + kind_raw + row.body
                                ).hexdigest()
            except (ValueError, OverflowError):
                digest = ""
            if digest != row.hash:
                return i, "hash does not match the row's content"
            prev, expected = row.hash, row.seq + 1
            kinds[kind] = kinds.get(kind, 0) + 1
            if row.checkpoint is not None:
                self.jobs.append((i, "checkpoint", {"ledger_key": self.ledger_key}))
                self.last_checkpoint = i
            try:
                if kind == "submission":
                    self._submission(i, row)
                elif kind == "receipt":
                    if self.full:
                        self.jobs.append((i, "receipt", {"ledger_key": self.ledger_key}))
                elif kind == "registration":
                    self._need_spec()
                    self.jobs.append((i, "registration", {}))
                else:
                    self._other(i, row)
            except Bad as exc:
                return i, f"{kind}: {exc}"
            except BadEarlier as exc:
                return exc.index, f"{self.rows[exc.index].kind}: {exc}"
            except (RejectedInput, KeyError, TypeError, ValueError) as exc:
                return i, f"{kind}: {exc}"
        return None

    # -- per kind

    def _submission(self, i: int, row: ChainRow) -> None:
        if self.current is None or self.current.closed is not None:
            raise Bad("no open round to record it in")
        self.current.submissions[hashlib.sha256(row.body).hexdigest()] = i
        if self.full:
            self.jobs.append((i, "submission", {"round": self.current.index}))

    def _other(self, i: int, row: ChainRow) -> None:
        kind = row.kind
        if i == 0 and kind != "run_spec":
            raise Bad("the first row must be the run spec")
        if kind == "round_result" and not self.full:
            self.out.signatures += 1
            self._round_result(i, row, open_result(row.body))
            return
        if kind in ALWAYS_OPENED:
            signed = open_signed(decode_canonical(row.body, max_bytes=MAX_BODY),
                                 ALWAYS_OPENED[kind])
            self.out.signatures += 1
            getattr(self, "_" + kind)(i, row, signed)
            return
        try:  # the ledger's own record: its bytes are what the hash and checkpoint cover
            body = json.loads(row.body)
        except (ValueError, RecursionError) as exc:
            raise Bad(f"not a JSON record: {exc}") from exc
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
        if self.full:
            self.jobs.append((i, "share", {"bls": self._need_spec().validators[idx]["bls"]}))

    def _round_result(self, i: int, row: ChainRow, signed: Any) -> None:
        res: RoundResult | ResultView = signed.message
        self._validator_index(signed.signer, res.validator)
        rnd = self._round_of(res.round)
        cert = CertifiedState.from_body(res.certified)
        if res.base_model_hash != rnd.base or cert.round != res.round + 1:
            raise Bad("result for another base model or round")
        if cert.verdicts_hash != digest_of(res.verdicts) or cert.scores_hash != digest_of(
                res.scores):
            raise Bad("verdicts or scores differ from the certified digests")
        if rnd.beacon_seed is None or res.beacon_seed != rnd.beacon_seed:
            raise Bad("result uses another beacon than the round's")
        rnd.results.append(res)

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
        if sorted(listed) != sorted(rnd.submissions):
            raise Bad("sealed list differs from the submissions recorded in the round")
        rnd.closed = listed

    def _rec_beacon_fixed(self, i: int, body: dict[str, Any]) -> None:
        rnd = self._round_of(body["round"])
        spec = self._need_spec()
        signers = body["signers"]
        if len(set(signers)) != len(signers) or len(signers) < spec.quorum or signers != sorted(
                signers) or any(not 0 <= k < len(spec.validators) for k in signers):
            raise Bad("beacon signers are not a quorum of the validator set")
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
        match = [res for res in rnd.results if res.certified == checked["certified"]]
        if not match:
            raise Bad("no recorded validator result carries the certified state")
        res = match[0]
        closed = rnd.closed or []
        if sorted(v["submission_digest"] for v in res.verdicts) != sorted(closed):
            raise Bad("certified verdicts do not cover exactly the sealed submissions")
        self._check_bans(rnd, res)
        rnd.certified = res
        self.out.covered_by_certificates += len(closed)
        self.out.certificates += 1  # its BLS signature: certificate_jobs(), run meanwhile
        self.next_base = state.model_hash
        self._expect_views(res)

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
        differs = any(res.validator == body["validator"] and digest_of(res.certified) == body[
            "result_digest"] != body["certified_digest"] for res in rnd.results)
        if not differs:
            raise Bad("fault without a recorded result that differs from the certificate")

    def _check_bans(self, rnd: _Round, res: RoundResult | ResultView) -> None:
        failed = {v["worker"] for v in res.verdicts if v["reason"] == "spot_check_failed"}
        spec = self._need_spec()
        ban_rounds = spec.verification["ban_rounds"]
        for i, body in rnd.bans:
            if body["worker"] not in failed or body["reason"] != "spot_check_failed" or body[
                    "until_round"] != rnd.index + ban_rounds:
                raise BadEarlier(i, "ban without a certified failed spot check")
        vesting = spec.verification.get("vesting_rounds", 0)
        for i, body in rnd.penalties:
            src = self.rounds.get(body["source_round"])
            earned = None if src is None or src.certified is None else next(
                (sc["reward"] for sc in src.certified.scores if sc["worker"] == body["worker"]),
                None)
            if (body["worker"] not in failed or earned is None or body["amount"] != earned
                    or not rnd.index - vesting < body["source_round"] < rnd.index):
                raise BadEarlier(i, "penalty that is not an unvested certified reward of a "
                                 "worker whose spot check failed")

    def _rec_run_finished(self, i: int, body: dict[str, Any]) -> None:
        if self.current is None or self.current.certified is None:
            raise Bad("run finished with a round not finalized")

    def _expect_views(self, res: RoundResult | ResultView) -> None:
        scores = {sc["worker"]: sc for sc in res.scores}
        for v in res.verdicts:
            sc = scores.get(v["worker"], {})
            row = {"status": v["status"], "reason": v["reason"], "detail": v["detail"],
                   "spot_checked": v["spot_checked"], "distance": v["distance"],
                   "samples": sc.get("samples", 0), "quality": sc.get("quality", 0.0),
                   "score": sc.get("score", 0.0), "reward": sc.get("reward", 0.0)}
            self.expected_views[(res.round, v["worker"])] = row
            tot = self.out.totals.setdefault(v["worker"], {
                "rounds": 0, "accepted": 0, "rejected": 0, "samples": 0, "score": 0.0,
                "reward": 0.0})
            tot["rounds"] += 1
            tot["accepted" if v["status"] == "accepted" else "rejected"] += 1
            tot["samples"] += row["samples"] if v["status"] == "accepted" else 0
            tot["score"] += row["score"]
            tot["reward"] += row["reward"]

    # -- after the pass

    def uncovered_submissions(self, upto: int) -> None:
        """Submissions no certificate vouches for get their own signature checked."""
        if self.full:
            return
        for rnd in self.rounds.values():
            if rnd.certified is None:
                for i in rnd.submissions.values():
                    if i < upto:
                        self.jobs.append((i, "submission", {"round": rnd.index}))

def _name_bad_certificate(rows: Sequence[ChainRow], ctx: dict[str, Any],
                          upto: int) -> tuple[int, str]:
    """A batch failed: check its certificates one by one to name the first bad row."""
    for i, pubs, root, sig in ctx["members"]:
        if i < upto and not bls.fast_aggregate_verify(pubs, root, sig):
            return i, "round_finalized: certificate: aggregate signature does not verify"
    return len(rows), "round_finalized: certificate batch does not verify"


def certificate_jobs(rows: Sequence[ChainRow], full: bool, parts: int) -> list[Job]:
    """The BLS work for every certificate in the log, known before the pass so that it
    can run while the pass does (rows the pass finds malformed are failed by the pass)."""
    certs = []
    try:
        spec = RunSpec.from_body(decode_canonical(rows[0].body, max_bytes=MAX_BODY)["body"])
    except (IndexError, RejectedInput, KeyError, TypeError, ValueError):
        return []
    for i, row in enumerate(rows):
        if row.kind != "round_finalized":
            continue
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


def verify_log(rows: Sequence[ChainRow], ledger_key: bytes, *, full: bool = False,
               views: Sequence[dict[str, Any]] | None = None,
               processes: int | None = None) -> AuditResult:
    """Verify one run's whole event log (and optionally its served verdict rows).

    With several processes, the certificates' BLS checks start at once on a process
    pool, the sequential pass runs here meanwhile, and the signature checks it
    collects follow on the pool.
    """
    global _ROWS
    n_proc = processes if processes is not None else (os.cpu_count() or 1)
    use_pool = n_proc > 1 and len(rows) >= PARALLEL_MIN_ROWS
    certs = certificate_jobs(rows, full, n_proc if use_pool else 1)
    _ROWS = rows
    pool: ProcessPoolExecutor | None = None
    try:
        futures: list[Future[list[tuple[int, str]]]] = []
        if use_pool:
            pool = ProcessPoolExecutor(max_workers=n_proc,
                                       mp_context=multiprocessing.get_context("fork"))
            futures = [pool.submit(_run_jobs, [job]) for job in certs]
        p = _Pass(rows, ledger_key, full)
        out = p.out
        first = p.run()
        upto = len(rows) if first is None else first[0]
        p.uncovered_submissions(upto)
        jobs = [j for j in p.jobs if j[0] < upto]
        if pool is not None:
            size = max(64, len(jobs) // (n_proc * 4))
            futures += [pool.submit(_run_jobs, jobs[k:k + size])
                        for k in range(0, len(jobs), size)]
            results = [bad for f in futures for bad in f.result()]
        else:
            results = _run_jobs(certs + jobs) if len(jobs) < PARALLEL_MIN_JOBS or n_proc <= 1 \
                else _run_jobs(certs) + _run_all(rows, jobs, n_proc)
    finally:
        if pool is not None:
            pool.shutdown()
        _ROWS = ()
    failures = [] if first is None else [first]
    batches = {j[0]: j for j in certs if j[1] == "batch"}
    for i, problem in results:
        if problem == "batch":
            failures.append(_name_bad_certificate(rows, batches[i][2], upto))
        elif i < upto:
            failures.append((i, problem))
    out.signatures += sum(1 for j in jobs if j[1] in ("submission", "receipt", "share",
                                                      "registration"))
    out.checkpoints = sum(1 for j in jobs if j[1] == "checkpoint")
    out.unsigned_tail = upto - 1 - p.last_checkpoint if first is None else 0
    if failures:
        # Rows before i are contiguous from seq 0, so i is the seq the bad row should have.
        i, problem = min(failures)
        out.first_bad_seq, out.problem = i, problem
        return out
    if views is not None:
        _check_views(out, p.expected_views, views)
    return out


def _check_views(out: AuditResult, expected: dict[tuple[int, str], dict[str, Any]],
                 views: Sequence[dict[str, Any]]) -> None:
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
