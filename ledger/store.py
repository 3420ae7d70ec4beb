"""Ledger state transitions over a SQLAlchemy session.

Each public method is one transaction: it checks its input, appends the
hash-chained event(s) and updates the query tables together, so a crash
leaves either all of a write or none of it. Methods are synchronous; the HTTP
server runs them on one writer thread, which also serializes the chain.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy import create_engine, event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from veritrain.protocol import bls, dkg
from veritrain.protocol.beacon import (
    bans_round,
    beacon_root,
    beacon_seed_of,
    participant_exclusions,
    participants_digest,
    sealed_list_digest,
    shard_check_root,
)
from veritrain.protocol.board import open_member_post
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.membership import admission_problem_of_spec
from veritrain.protocol.messages import (
    BeaconShare,
    OpeningsShare,
    Receipt,
    Registration,
    RevealReceipt,
    RoundResult,
    RunSpec,
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    Signed,
    SpotReveal,
    Submission,
    digest_of,
    open_signed,
    sign,
)
from veritrain.protocol.openings import openings_root, survivor_buckets
from veritrain.protocol.rules import SubmissionContext, check_submission
from veritrain.protocol.schedule import Action, RoundStatus, RoundView, next_action, void_reason

from . import dkg as dkg_board
from . import membership, migrate, openings, secagg, shards
from . import schema as t
from .admission import BlsVerifier
from .blobs import BlobStore, StagedBlob
from .chain import GENESIS_HASH, compute_event_hash
from .challenges import check_reveal_allowed, fix_challenges, still_sealed
from .checkpoints import Checkpointer, chain_head, note_append
from .penalties import apply_worker_penalties, record_validator_faults

#: A round result carries up to 10,000 verdicts and scores (protocol.md 2.2: 16 MiB).
MAX_RESULT_BYTES = 16 << 20


class NotFound(RejectedInput):
    reason = "not_found"


class Conflict(RejectedInput):
    reason = "duplicate"


class WrongState(RejectedInput):
    reason = "wrong_state"


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite files get WAL, full sync and foreign keys."""
    engine = create_engine(url, future=True)
    if engine.dialect.name == "sqlite":

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=10000")
            # 64 MiB of page cache: the chain's and digests' unique indexes take random
            # inserts, which the 2 MiB default turns into disk reads past ~100k rows.
            cur.execute("PRAGMA cache_size=-65536")
            cur.close()

    return engine


def begin_snapshot(s: Session) -> None:
    """Make every later SELECT of the read session ``s`` see one committed state.

    A view built from several queries (a board's posts and the group they fixed, a
    round and its results) must never mix two states: a reader that saw the group but
    not the post that fixed it would act on a board that never existed. PostgreSQL's
    default READ COMMITTED and pysqlite's deferred BEGIN both give each statement its own
    snapshot; a REPEATABLE READ transaction, or on SQLite an explicit BEGIN (WAL: readers
    never block the writer), gives the whole session one."""
    if s.get_bind().dialect.name == "sqlite":
        s.connection().exec_driver_sql("BEGIN")
    else:
        s.connection(execution_options={"isolation_level": "REPEATABLE READ"})


@dataclass(frozen=True)
class Certificate:
    """A quorum of validators' BLS signatures over one certified state."""

    certified: dict[str, Any]
    signers: list[int]
    signature: str

    def to_json(self) -> dict[str, Any]:
        return {"certified": self.certified, "signers": self.signers, "signature": self.signature}


def beacon_envelopes(s: Session, run_id: str, r: int, fixed: dict[str, Any] | None
                     ) -> list[Any]:
    """The signed BeaconShares of a fixed beacon's signers, in signer order: each names
    the sealed list its validator saw, so a reader need not take the ledger's list."""
    if fixed is None:
        return []
    rows = {row.validator_index: row for row in s.execute(select(t.BeaconShareRow).where(
        t.BeaconShareRow.run_id == run_id, t.BeaconShareRow.round == r)).scalars()}
    return [decode_canonical(rows[k].envelope) for k in fixed["signers"]
            if k in rows and rows[k].envelope is not None]


class LedgerStore:
    def __init__(self, url: str, identity: Identity, clock: Callable[[], float] = time.time):
        self.engine = make_engine(url)
        migrate.upgrade(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.identity = identity
        self.clock = clock
        self.checkpointer = Checkpointer(identity, clock)
        #: (run, round) -> the participant view of a closed round (participant_exclusions)
        self._participant_views: dict[tuple[str, int], dict[str, str]] = {}
        self.checkpointer.install(self.sessions)
        self._specs: dict[bytes, RunSpec] = {}
        #: BLS outcomes computed once per exact input (admission.py).
        self.bls = BlsVerifier()
        #: The most validators a run spec may name (``LedgerConfig.max_validators``).
        self.max_validators = 256
        #: Where staged uploads are published on acceptance (the server sets it).
        self.blobs: BlobStore | None = None

    @contextmanager
    def snapshot(self) -> Iterator[Session]:
        """A read-only session over one committed state (:func:`begin_snapshot`)."""
        with self.sessions() as s:
            begin_snapshot(s)
            yield s

    # ----------------------------------------------------------------- chain

    def _append(self, s: Session, run_id: str, kind: str, body: bytes) -> t.Event:
        """Chain one row; the ledger signs the chain head at commit (checkpoints.py)."""
        head = chain_head(s, run_id)
        seq = 0 if head is None else head[0] + 1
        prev = GENESIS_HASH if head is None else head[1]
        digest = compute_event_hash(prev, seq, kind, body)
        row = t.Event(run_id=run_id, seq=seq, kind=kind, body=body, prev_hash=prev, hash=digest)
        s.add(row)
        s.flush()
        note_append(s, run_id, seq, digest, kind)
        return row

    def _ledger_event(self, s: Session, run_id: str, kind: str, body: dict[str, Any]) -> None:
        self._append(s, run_id, kind, encode_canonical({"kind": kind, **body}))

    # ----------------------------------------------------------------- runs

    def get_spec(self, s: Session, run_id: str) -> RunSpec:
        run = s.get(t.Run, run_id)
        if run is None:
            raise NotFound(f"no run {run_id!r}")
        spec = self._specs.get(run.spec)  # opened once per stored spec, not per request
        if spec is None:
            spec = self._specs[run.spec] = open_signed(decode_canonical(run.spec),
                                                       RunSpec).message
        return spec

    def precheck_run(self, s: Session, signed: Signed[RunSpec]) -> None:
        """``create_run``'s cheap checks (shape, validator cap, an existing run id): no
        cryptography, nothing stored; run before any proof of possession or upload."""
        spec = signed.message
        if s.get(t.Run, spec.run_id) is not None:
            raise Conflict(f"run {spec.run_id!r} exists")
        if signed.signer != spec.organiser:
            raise RejectedInput("run spec not signed by its organiser", "bad_signature")
        if len(spec.validators) > self.max_validators:
            raise RejectedInput(f"a run may name at most {self.max_validators} validators "
                                "on this ledger", "malformed")
        if (problem := spec.quorum_problem() or spec.sharding_problem() or spec.masking_problem()) is not None:
            raise RejectedInput(problem, "malformed")
        if (problem := admission_problem_of_spec(spec.admission)) is not None:
            raise RejectedInput(problem, "malformed")
        keys = [v["ed25519"] for v in spec.validators]
        if len(set(keys)) != len(keys) or len({v["bls"] for v in spec.validators}) != len(keys):
            raise RejectedInput("validator keys repeat", "malformed")

    def organiser_bytes(self, s: Session, organiser: str) -> int:
        """The bytes of the datasets and genesis models of the runs ``organiser`` created
        (bounded by ``LedgerConfig.organiser_quota_bytes``)."""
        total = 0
        for run_id in s.execute(select(t.Run.run_id).where(t.Run.organiser == organiser)
                                ).scalars().all():
            spec = self.get_spec(s, run_id)
            total += s.execute(select(func.coalesce(func.sum(t.Blob.size), 0)).where(
                t.Blob.sha256.in_({spec.dataset_hash, spec.genesis_model_hash}))).scalar_one()
        return int(total)

    def verify_possessions(self, spec: RunSpec) -> None:
        """Every validator's BLS proof of possession (each verified once per key, ever)."""
        for v in spec.validators:
            if not self.bls.verify_possession(bytes.fromhex(v["bls"]),
                                              bytes.fromhex(v["bls_pop"])):
                raise RejectedInput(
                    f"validator {v['ed25519'][:12]} has no valid BLS proof of possession",
                    "bad_signature",
                )

    def _stage_rows(self, s: Session, staged: tuple[StagedBlob, ...]) -> None:
        """Blob rows for the staged uploads of the message being accepted (rolled back
        with it when it is refused)."""
        for blob in staged:
            if s.get(t.Blob, blob.digest) is None:
                s.add(t.Blob(sha256=blob.digest, size=blob.size, kind=blob.kind,
                             run_id=blob.run_id, sealed_round=blob.sealed_round,
                             created_at=self.clock()))
        s.flush()

    def _publish(self, staged: tuple[StagedBlob, ...]) -> None:
        """Move the accepted message's files into place, just before its commit (a crash
        in between leaves a file no row names, collected at the next start)."""
        if staged:
            assert self.blobs is not None, "staged uploads need the server's blob store"
            self.blobs.publish(staged)

    def create_run(self, signed: Signed[RunSpec], staged: tuple[StagedBlob, ...] = ()) -> None:
        spec = signed.message
        with self.sessions() as s:
            self.precheck_run(s, signed)
        self.verify_possessions(spec)
        now = self.clock()
        with self.sessions.begin() as s:
            if s.get(t.Run, spec.run_id) is not None:
                raise Conflict(f"run {spec.run_id!r} exists")
            self._stage_rows(s, staged)
            for digest in (spec.dataset_hash, spec.genesis_model_hash):
                if s.get(t.Blob, digest) is None:
                    raise RejectedInput(f"blob {digest[:12]} was not uploaded", "missing_payload")
            s.add(t.Run(run_id=spec.run_id, organiser=spec.organiser, spec=signed.encode(),
                        created_at=now))
            s.flush()
            self._append(s, spec.run_id, "run_spec", signed.encode())
            for v in spec.validators:
                s.add(t.Participant(run_id=spec.run_id, pubkey=v["ed25519"], role="validator",
                                    registered_at=now, registered_round=0))
            self._open_round(s, spec, 0, spec.genesis_model_hash, None, now)
            self._publish(staged)

    def _open_round(
        self, s: Session, spec: RunSpec, r: int, base: str, outer: str | None, now: float
    ) -> None:
        deadline = now + spec.schedule["round_seconds"]
        s.add(t.Round(run_id=spec.run_id, round=r, status=RoundStatus.OPEN.value,
                      base_model_hash=base, outer_state_hash=outer, opened_at=now,
                      deadline=deadline))
        self._ledger_event(s, spec.run_id, "round_opened", {
            "run_id": spec.run_id, "round": r, "base_model_hash": base,
            "outer_state_hash": outer, "opened_at": now, "deadline": deadline})

    # ----------------------------------------------------------------- blobs

    def record_blob(self, digest: str, size: int, kind: str, run_id: str | None,
                    sealed_round: int | None = None) -> None:
        with self.sessions.begin() as s:
            if s.get(t.Blob, digest) is None:
                s.add(t.Blob(sha256=digest, size=size, kind=kind, run_id=run_id,
                             sealed_round=sealed_round, created_at=self.clock()))

    def blob_visible(self, digest: str) -> bool:
        """Payload blobs are sealed until their round closes, so nobody can copy them."""
        with self.sessions() as s:
            blob = s.get(t.Blob, digest)
            if blob is None:
                raise NotFound(f"no blob {digest}")
            return not still_sealed(s, blob)

    # ----------------------------------------------------------------- participants

    def registered(self, s: Session, signed: Signed[Registration]
                   ) -> tuple[dict[str, Any], bool] | None:
        """The reply a registration gets when its key is registered already, and whether
        it is this exact registration resent (then nobody is charged for it); else None."""
        reg = signed.message
        self.get_spec(s, reg.run_id)
        existing = self._participant(s, reg.run_id, reg.participant)
        if existing is None:
            return None
        reply = {"participant": existing.pubkey, "role": existing.role,
                 "registered_round": existing.registered_round, "new": False}
        return reply, existing.registration is not None and bytes(
            existing.registration) == signed.encode()

    def register(self, signed: Signed[Registration]) -> dict[str, Any]:
        reg = signed.message
        if signed.signer != reg.participant:
            raise RejectedInput("registration signed by another key", "bad_signature")
        with self.sessions.begin() as s:
            self.get_spec(s, reg.run_id)
            existing = s.execute(select(t.Participant).where(
                t.Participant.run_id == reg.run_id, t.Participant.pubkey == reg.participant
            )).scalar_one_or_none()
            if existing is not None:
                return {"participant": existing.pubkey, "role": existing.role,
                        "registered_round": existing.registered_round, "new": False}
            # The run's admission policy, from its chained rows (ledger/membership.py).
            membership.check_registration(s, self.get_spec(s, reg.run_id), reg.participant)
            current = self._current_round(s, reg.run_id)
            s.add(t.Participant(run_id=reg.run_id, pubkey=reg.participant, role=reg.role,
                                registered_at=self.clock(), registered_round=current.round,
                                registration=signed.encode()))
            self._append(s, reg.run_id, "registration", signed.encode())
            return {"participant": reg.participant, "role": reg.role,
                    "registered_round": current.round, "new": True}

    def post_membership(self, signed: Signed[Any]) -> dict[str, Any]:
        """A signed admission ticket, revocation, bond deposit or withdrawal
        (protocol/membership.py): checked against the run's policy and chained; an exact
        resend is answered as stored."""
        msg = signed.message
        with self.sessions.begin() as s:
            spec = self.get_spec(s, msg.run_id)
            if membership.stored(s, msg.run_id, signed):
                return {"kind": msg.KIND, "digest": signed.digest, "new": False}
            membership.check_message(s, spec, signed)
            row = self._append(s, msg.run_id, msg.KIND, signed.encode())
            return {"kind": msg.KIND, "digest": signed.digest, "sequence": row.seq,
                    "new": True}

    def _participant(self, s: Session, run_id: str, pubkey: str) -> t.Participant | None:
        return s.execute(select(t.Participant).where(
            t.Participant.run_id == run_id, t.Participant.pubkey == pubkey
        )).scalar_one_or_none()

    # ----------------------------------------------------------------- rounds

    def _current_round(self, s: Session, run_id: str) -> t.Round:
        row = s.execute(select(t.Round).where(t.Round.run_id == run_id)
                        .order_by(t.Round.round.desc()).limit(1)).scalar_one_or_none()
        if row is None:
            raise NotFound(f"run {run_id!r} has no rounds")
        return row

    def _round(self, s: Session, run_id: str, r: int) -> t.Round:
        row = s.get(t.Round, (run_id, r))
        if row is None:
            raise NotFound(f"run {run_id!r} has no round {r}")
        return row

    def _active_workers(self, s: Session, run_id: str, r: int) -> int:
        return s.execute(select(func.count()).select_from(t.Participant).where(
            t.Participant.run_id == run_id, t.Participant.role == "worker",
            t.Participant.banned_until_round < r)).scalar_one()

    def tick(self) -> list[tuple[str, int, str]]:
        """End the runs whose DKG failed; close or extend open rounds whose time has come.
        Returns what it did."""
        now = self.clock()
        done: list[tuple[str, int, str]] = []
        with self.sessions.begin() as s:
            for run in s.execute(select(t.Run).where(t.Run.status == "active")).scalars().all():
                spec = self.get_spec(s, run.run_id)
                if spec.threshold_beacon and (
                        why := dkg_board.failed(s, spec, run.created_at, now)) is not None:
                    self._fail_run(s, run, "dkg_failed", why)
                    done.append((run.run_id, 0, "failed"))
            for rnd in s.execute(select(t.Round).join(t.Run).where(
                    t.Round.status == RoundStatus.OPEN.value,
                    t.Run.status == "active")).scalars().all():
                spec = self.get_spec(s, rnd.run_id)
                action = next_action(self._view(s, rnd), now,
                                     min_submissions=spec.schedule["min_submissions"])
                if action is Action.CLOSE:
                    self._close(s, rnd, now)
                elif action is Action.EXTEND:
                    rnd.deadline = now + spec.schedule["round_seconds"]
                    rnd.extensions += 1
                    self._ledger_event(s, rnd.run_id, "round_extended", {
                        "run_id": rnd.run_id, "round": rnd.round, "deadline": rnd.deadline,
                        "submissions": self._count_submissions(s, rnd),
                        "min_submissions": spec.schedule["min_submissions"]})
                if action is not Action.NONE:
                    done.append((rnd.run_id, rnd.round, action.value))
            for rnd in s.execute(select(t.Round).join(t.Run).where(
                    t.Round.status == RoundStatus.CLOSED.value,
                    t.Run.status == "active")).scalars().all():
                spec = self.get_spec(s, rnd.run_id)
                why, results = self._void_reason(s, spec, rnd, now)
                if why is not None:
                    self._void(s, spec, rnd, why, results, now)
                    done.append((rnd.run_id, rnd.round, "voided"))
        return done

    def _void_reason(self, s: Session, spec: RunSpec, rnd: t.Round, now: float
                     ) -> tuple[str | None, dict[int, str]]:
        """``void_reason`` of a closed round from its recorded results (a validator whose
        shard a quorum proved faulty does not count, as in ``post_result``)."""
        faulted = shards.faulted_validators(s, spec, rnd.round) if spec.shards else set()
        results: dict[int, str] = {}
        for validator, digest in s.execute(select(
                t.RoundResultRow.validator, t.RoundResultRow.certified_digest).where(
                t.RoundResultRow.run_id == rnd.run_id, t.RoundResultRow.round == rnd.round)):
            idx = spec.validator_index(validator)
            if idx is not None and idx not in faulted:
                results[idx] = digest
        assert rnd.closed_at is not None
        why = void_reason(closed_at=rnd.closed_at, now=now,
                          certify_seconds=spec.certify_seconds, results=results,
                          eligible=len(spec.validators) - len(faulted), quorum=spec.quorum)
        return why, results

    def _void(self, s: Session, spec: RunSpec, rnd: t.Round, why: str,
              results: dict[int, str], now: float) -> None:
        """Give up a round no certificate can finalize (specs/protocol.md 6): chained with
        each counted validator's certified digest, so an auditor sees who disagreed; its
        workers get no verdicts or rewards; the next round opens on the same base."""
        rnd.status = RoundStatus.VOIDED.value
        self._ledger_event(s, rnd.run_id, "round_voided", {
            "run_id": rnd.run_id, "round": rnd.round, "reason": why, "voided_at": now,
            "results": [{"validator": k, "certified_digest": d}
                        for k, d in sorted(results.items())]})
        self._next_round(s, spec, rnd.round + 1, rnd.base_model_hash, rnd.outer_state_hash,
                         now)

    def _fail_run(self, s: Session, run: t.Run, reason: str, detail: str) -> None:
        """End a run that cannot go on (specs/protocol.md 6): ``run_failed`` in its chain,
        no more submissions; workers and validators see the status and stop."""
        run.status = "failed"
        self._ledger_event(s, run.run_id, "run_failed", {
            "run_id": run.run_id, "reason": reason, "detail": detail})

    def _count_submissions(self, s: Session, rnd: t.Round) -> int:
        return s.execute(select(func.count()).select_from(t.Submission).where(
            t.Submission.run_id == rnd.run_id, t.Submission.round == rnd.round)).scalar_one()

    def _view(self, s: Session, rnd: t.Round) -> RoundView:
        return RoundView(RoundStatus(rnd.status), rnd.deadline, self._count_submissions(s, rnd),
                         self._active_workers(s, rnd.run_id, rnd.round))

    def _close(self, s: Session, rnd: t.Round, now: float) -> None:
        rnd.status = RoundStatus.CLOSED.value
        rnd.closed_at = now
        digests = s.execute(select(t.Submission.digest).where(
            t.Submission.run_id == rnd.run_id, t.Submission.round == rnd.round)
            .order_by(t.Submission.worker)).scalars().all()
        self._ledger_event(s, rnd.run_id, "round_closed", {
            "run_id": rnd.run_id, "round": rnd.round, "closed_at": now,
            "submissions": list(digests)})

    # ----------------------------------------------------------------- submissions

    def submission_context(self, s: Session, run_id: str, r: int, worker: str
                           ) -> tuple[RunSpec, t.Round, SubmissionContext]:
        spec = self.get_spec(s, run_id)
        run = s.get(t.Run, run_id)
        if run is not None and run.status == "failed":
            raise WrongState(f"run {run_id} failed (its DKG did not fix a group key): it "
                             "takes no more submissions")
        current = self._current_round(s, run_id)
        part = self._participant(s, run_id, worker)
        ctx = SubmissionContext(
            spec=spec,
            round=current.round if current.status == RoundStatus.OPEN.value else -1,
            base_model_hash=current.base_model_hash,
            worker_registered=part is not None and part.role == "worker",
            worker_banned=part is not None and part.banned_until_round >= current.round,
        )
        return spec, current, ctx

    def precheck_submission(self, signed: Signed[Submission]) -> None:
        """The checks that need no payload: done before the payload is read."""
        sub = signed.message
        with self.sessions() as s:
            _, _, ctx = self.submission_context(s, sub.run_id, sub.round, sub.worker)
            check_submission(signed, ctx)
            if self._has_submission(s, sub.run_id, sub.round, sub.worker):
                raise Conflict("this worker already submitted for this round")

    def recorded_receipt(self, s: Session, signed: Signed[Submission]) -> Signed[Receipt] | None:
        """The receipt of this exact submission if it is already recorded, so that a retry
        whose reply was lost (a dropped link, a ledger restart) gets the same receipt."""
        sub = signed.message
        row = s.execute(select(t.Submission.receipt).where(
            t.Submission.run_id == sub.run_id, t.Submission.round == sub.round,
            t.Submission.worker == sub.worker, t.Submission.digest == signed.digest)).first()
        return None if row is None else open_signed(decode_canonical(row.receipt), Receipt)

    def _has_submission(self, s: Session, run_id: str, r: int, worker: str) -> bool:
        return s.execute(select(t.Submission.id).where(
            t.Submission.run_id == run_id, t.Submission.round == r,
            t.Submission.worker == worker)).first() is not None

    def accept_submission(self, signed: Signed[Submission], payload_hash: str,
                          payload_size: int) -> Signed[Receipt]:
        """Record a submission whose payload is stored; returns the ledger's receipt."""
        sub = signed.message
        now = self.clock()
        if payload_hash != sub.payload_hash or payload_size != sub.payload_bytes:
            raise RejectedInput("payload differs from the envelope's hash or size",
                                "payload_mismatch")
        try:
            with self.sessions.begin() as s:
                _, current, ctx = self.submission_context(s, sub.run_id, sub.round, sub.worker)
                check_submission(signed, ctx)
                if self._has_submission(s, sub.run_id, sub.round, sub.worker):
                    raise Conflict("this worker already submitted for this round")
                if s.get(t.Blob, payload_hash) is None:
                    s.add(t.Blob(sha256=payload_hash, size=payload_size, kind="payload",
                                 run_id=sub.run_id, sealed_round=sub.round, created_at=now))
                ev = self._append(s, sub.run_id, "submission", signed.encode())
                receipt = sign(self.identity, Receipt(
                    run_id=sub.run_id, round=sub.round, worker=sub.worker,
                    submission_digest=signed.digest, received_at=now, sequence=ev.seq))
                s.add(t.Submission(
                    run_id=sub.run_id, round=sub.round, worker=sub.worker, digest=signed.digest,
                    envelope=signed.encode(), payload_hash=payload_hash,
                    payload_bytes=payload_size, samples=sub.samples, received_at=now,
                    receipt=receipt.encode()))
                self._append(s, sub.run_id, "receipt", receipt.encode())
                view = self._view(s, current)
                if next_action(view, now, min_submissions=ctx.spec.schedule["min_submissions"]
                               ) is Action.CLOSE:
                    self._close(s, current, now)
                return receipt
        except IntegrityError as exc:
            raise Conflict("this submission is already recorded") from exc

    def sealed_submissions(self, run_id: str, r: int) -> tuple[list[bytes], dict[str, str]]:
        """The fixed submission list of a closed round, ordered by worker key, and the
        ledger's participant view of it (``participant_exclusions``), which a worker checks
        against the digest the round's beacon was signed over."""
        with self.sessions() as s:
            rnd = self._round(s, run_id, r)
            if rnd.status == RoundStatus.OPEN.value:
                raise WrongState(f"round {r} is still open: submissions are sealed")
            envelopes = list(s.execute(select(t.Submission.envelope).where(
                t.Submission.run_id == run_id, t.Submission.round == r)
                .order_by(t.Submission.worker)).scalars().all())
            return envelopes, self.participant_exclusions(s, self.get_spec(s, run_id), r)

    def participant_exclusions(self, s: Session, spec: RunSpec, r: int) -> dict[str, str]:
        """:meth:`participant_view` of a round, computed once per closed round: the view of
        a closed round does not change (its submissions are sealed, bans count only from
        earlier rounds, membership rows name open rounds), and every worker reads it."""
        key = (spec.run_id, r)
        if (cached := self._participant_views.get(key)) is not None:
            return dict(cached)
        view = self.participant_view(s, spec, r)
        if len(self._participant_views) >= 256:
            self._participant_views.clear()
        self._participant_views[key] = view
        return dict(view)

    def participant_view(self, s: Session, spec: RunSpec, r: int) -> dict[str, str]:
        """The ledger's own participant view of round r's sealed list
        (``participant_exclusions``: its registrations, the chain's admission rows, bans
        covering r). Empty for every list this ledger sealed unless a worker lost its
        admission after submitting; validators sign the digest of theirs beside the sealed
        list, and a share or partial naming another is refused (``wrong_participants``)."""
        workers = list(s.execute(select(t.Submission.worker).where(
            t.Submission.run_id == spec.run_id, t.Submission.round == r)).scalars())
        rows = s.execute(select(t.Participant).where(
            t.Participant.run_id == spec.run_id, t.Participant.role == "worker",
            t.Participant.pubkey.in_(workers))).scalars().all() if workers else []
        registered = {p.pubkey for p in rows if p.registration is not None}
        state = membership.state_of(s, spec)
        if not state.policy.open:
            registered = state.admitted(registered, r)
        ban_rounds = spec.verification["ban_rounds"]
        banned = {p.pubkey for p in rows if bans_round(p.banned_until_round, ban_rounds, r)}
        return participant_exclusions(workers, registered, banned)

    def _check_round_inputs(self, s: Session, spec: RunSpec, r: int, sealed: str,
                            participants: str, what: str) -> None:
        """A share or partial names the round's sealed list and the ledger's participant
        view of it (``wrong_sealed_list`` / ``wrong_participants`` otherwise)."""
        if sealed != sealed_list_digest(s.execute(select(t.Submission.digest).where(
                t.Submission.run_id == spec.run_id, t.Submission.round == r)).scalars()):
            raise RejectedInput(f"the {what} names another sealed list than the round's",
                                "wrong_sealed_list")
        if participants != participants_digest(self.participant_exclusions(s, spec, r)):
            raise RejectedInput(f"the {what} judges the round against another participant "
                                "view than the chain's", "wrong_participants")

    # ----------------------------------------------------------------- beacon

    def _closed_round_for_validator(self, s: Session, spec: RunSpec, signer: str, named: str,
                                    r: int, what: str) -> tuple[int, t.Round]:
        """The signer's validator index and round ``r``, which must be closed already."""
        idx = spec.validator_index(signer)
        if idx is None or signer != named:
            raise RejectedInput(f"{what} not signed by a validator of this run",
                                "unknown_validator")
        rnd = self._round(s, spec.run_id, r)
        if rnd.status == RoundStatus.OPEN.value:
            raise WrongState(f"a {what} is taken only after round {r} closes")
        if rnd.status == RoundStatus.VOIDED.value:
            raise WrongState(f"round {r} was voided (no certificate could come): no {what} "
                             "is taken for it")
        return idx, rnd

    def _beacon_state(self, s: Session, rnd: t.Round) -> dict[str, Any]:
        if rnd.beacon is not None:
            fixed = decode_canonical(rnd.beacon)
            return {"beacon": fixed, "envelopes": beacon_envelopes(s, rnd.run_id, rnd.round,
                                                                   fixed)}
        shares = s.execute(select(func.count()).select_from(t.BeaconShareRow).where(
            t.BeaconShareRow.run_id == rnd.run_id, t.BeaconShareRow.round == rnd.round)
        ).scalar_one()
        return {"beacon": None, "shares": shares}

    def precheck_beacon_share(self, s: Session, signed: Signed[BeaconShare]
                              ) -> tuple[dict[str, Any] | None, int]:
        """``post_beacon_share``'s cheap checks (validator, closed round, sealed list), no
        cryptography: (the round's beacon state if this exact share is stored already,
        else None; the validator's index). Raises the refusal."""
        msg = signed.message
        spec = self.get_spec(s, msg.run_id)
        if spec.threshold_beacon:  # its beacon is the group signature (5.4a), never shares
            raise WrongState(f"run {msg.run_id} uses the threshold beacon: post a partial")
        idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, msg.validator,
                                                    msg.round, "beacon share")
        stored = s.execute(select(t.BeaconShareRow.envelope).where(
            t.BeaconShareRow.run_id == msg.run_id, t.BeaconShareRow.round == msg.round,
            t.BeaconShareRow.validator_index == idx)).scalar_one_or_none()
        if stored is not None and bytes(stored) == signed.encode():
            return self._beacon_state(s, rnd), idx
        self._check_round_inputs(s, spec, msg.round, msg.sealed, msg.participants, "share")
        return None, idx

    def beacon_share_verifies(self, signed: Signed[BeaconShare]) -> bool:
        """The share's BLS signature (cached): the expensive check, run last."""
        msg = signed.message
        with self.sessions() as s:
            spec = self.get_spec(s, msg.run_id)
        idx = spec.validator_index(signed.signer)
        return idx is not None and self.bls.verify(
            bytes.fromhex(spec.validators[idx]["bls"]), beacon_root(msg.run_id, msg.round),
            bytes.fromhex(msg.share))

    def post_beacon_share(self, signed: Signed[BeaconShare]) -> dict[str, Any]:
        """Collect validators' beacon shares after close; fix the first quorum to arrive."""
        msg = signed.message
        with self.sessions.begin() as s:
            spec = self.get_spec(s, msg.run_id)
            resent, idx = self.precheck_beacon_share(s, signed)
            if resent is not None:
                return resent
            rnd = self._round(s, msg.run_id, msg.round)
            if not self.bls.verify(bytes.fromhex(spec.validators[idx]["bls"]),
                                   beacon_root(msg.run_id, msg.round), bytes.fromhex(msg.share)):
                raise RejectedInput("beacon share does not verify", "bad_signature")
            if rnd.beacon is not None:
                fixed = decode_canonical(rnd.beacon)
                return {"beacon": fixed,
                        "envelopes": beacon_envelopes(s, msg.run_id, msg.round, fixed)}
            known = {row.validator_index for row in s.execute(select(t.BeaconShareRow).where(
                t.BeaconShareRow.run_id == msg.run_id, t.BeaconShareRow.round == msg.round)
            ).scalars()}
            if idx not in known:
                s.add(t.BeaconShareRow(run_id=msg.run_id, round=msg.round, validator_index=idx,
                                       share=msg.share, envelope=signed.encode()))
                self._append(s, msg.run_id, "beacon_share", signed.encode())
                s.flush()
            rows = s.execute(select(t.BeaconShareRow).where(
                t.BeaconShareRow.run_id == msg.run_id, t.BeaconShareRow.round == msg.round)
                .order_by(t.BeaconShareRow.id)).scalars().all()
            if len(rows) < spec.quorum:
                return {"beacon": None, "shares": len(rows)}
            chosen = sorted(rows[: spec.quorum], key=lambda row: row.validator_index)
            beacon = {"signers": [row.validator_index for row in chosen],
                      "shares": [row.share for row in chosen]}
            rnd.beacon = encode_canonical(beacon)
            self._ledger_event(s, msg.run_id, "beacon_fixed", {
                "run_id": msg.run_id, "round": msg.round, **beacon})
            self._beacon_fixed_effects(s, spec, rnd)
            return {"beacon": beacon,
                    "envelopes": beacon_envelopes(s, msg.run_id, msg.round, beacon)}

    # ----------------------------------------------------------------- threshold beacon
    # specs/protocol.md 5.4a: the DKG's board (ledger/dkg.py) and each round's partials.

    def dkg_view(self, s: Session, run_id: str, posts: bool = True) -> dict[str, Any]:
        spec = self.get_spec(s, run_id)
        run = s.get(t.Run, run_id)
        assert run is not None
        return dkg_board.view(s, spec, run.created_at, self.clock(), posts=posts)

    def post_dkg(self, wire: Any) -> dict[str, Any]:
        """A validator's DKG post; the group key is fixed (and chained, with the results a
        quorum signed) by the result post that makes a quorum agree."""
        run_id = wire.get("body", {}).get("run_id") if isinstance(wire, dict) else None
        if not isinstance(run_id, str):
            raise RejectedInput("a DKG post names its run", "malformed")
        with self.sessions.begin() as s:
            spec = self.get_spec(s, run_id)
            run = s.get(t.Run, run_id)
            assert run is not None
            reply, _, group = dkg_board.accept_post(s, spec, wire, run.created_at, self.clock())
            if group is not None:
                self._ledger_event(s, run_id, "dkg_group_fixed",
                                   {"run_id": run_id, "round": 0, **group})
            return reply

    def _threshold_round(self, s: Session, signed: Signed[Any]
                         ) -> tuple[RunSpec, int, t.Round, Any]:
        """A partial's cheap checks: a threshold run with its group fixed, a validator of
        it, a closed round, the round's sealed list. (spec, index, round, group)."""
        msg = signed.message
        spec = self.get_spec(s, msg.run_id)
        if not spec.threshold_beacon:
            raise WrongState(f"run {msg.run_id} uses the quorum-of-shares beacon")
        idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, msg.validator,
                                                    msg.round, "beacon partial")
        group = dkg_board.group_result(s, msg.run_id)
        if group is None:
            raise WrongState("the run's DKG has not fixed a group key yet")
        self._check_round_inputs(s, spec, msg.round, msg.sealed, msg.participants, "partial")
        return spec, idx, rnd, group

    def open_partial(self, s: Session, run_id: str, r: int, wire: Any) -> Signed[Any]:
        """A posted partial opened against the run's validator set (``open_member_post``:
        its signature in domain ``beacon_partial``, signer = the validator it names, the
        URL's run and round)."""
        spec = self.get_spec(s, run_id)
        return open_member_post(wire, dkg.BeaconPartial, member_field="validator",
                                members={v["ed25519"] for v in spec.validators},
                                run_id=run_id, round_index=r)

    def partial_verifies(self, signed: Signed[Any]) -> bool:
        """The partial against its validator's public key share (one pairing, cached)."""
        msg = signed.message
        with self.sessions() as s:
            _, idx, _, group = self._threshold_round(s, signed)
        return self.bls.verify(bytes.fromhex(group.public_shares[idx]),
                               dkg.threshold_beacon_root(msg.run_id, msg.round, msg.sealed,
                                                         msg.participants),
                               bytes.fromhex(msg.partial))

    def threshold_beacon_state(self, s: Session, run_id: str, r: int) -> dict[str, Any]:
        rnd = self._round(s, run_id, r)
        return {"run_id": run_id, "round": r,
                "beacon": decode_canonical(rnd.beacon) if rnd.beacon else None,
                "partials": dkg_board.partials(s, run_id, r)}

    def resent_partial(self, signed: Signed[Any]) -> dict[str, Any] | None:
        """The round's threshold-beacon state when ``signed`` is exactly a stored partial
        (answered with no pairing), else None."""
        msg = signed.message
        with self.sessions() as s:
            stored = dkg_board.stored_partial(s, msg.run_id, msg.round, signed.signer)
            if stored is None or stored.digest != signed.digest:
                return None
            return self.threshold_beacon_state(s, msg.run_id, msg.round)

    def post_beacon_partial(self, signed: Signed[Any]) -> dict[str, Any]:
        """A validator's partial signature for a closed round: refused (``bad_signature``,
        nothing stored) unless it verifies against the validator's public key share, so a
        bad partial never blocks the round; the beacon is fixed (``threshold_beacon_fixed``)
        when ``quorum`` verified partials are in. Later ones are kept, not chained."""
        msg = signed.message
        with self.sessions.begin() as s:
            spec, idx, rnd, group = self._threshold_round(s, signed)
            stored = dkg_board.stored_partial(s, msg.run_id, msg.round, signed.signer)
            if stored is not None:
                if stored.digest == signed.digest:
                    return self.threshold_beacon_state(s, msg.run_id, msg.round)
                raise Conflict(f"validator {idx} already posted another partial")
            if not self.bls.verify(bytes.fromhex(group.public_shares[idx]),
                                   dkg.threshold_beacon_root(msg.run_id, msg.round, msg.sealed,
                                                             msg.participants),
                                   bytes.fromhex(msg.partial)):
                raise RejectedInput(f"validator {idx}'s partial signature does not verify "
                                    "against its public key share", "bad_signature")
            dkg_board.store_partial(s, signed, self.clock())
            if rnd.beacon is None and (fixed := dkg_board.combine_stored(s, spec, msg.round)):
                rnd.beacon = encode_canonical(fixed)
                self._ledger_event(s, msg.run_id, "threshold_beacon_fixed", {
                    "run_id": msg.run_id, "round": msg.round, "sealed": msg.sealed,
                    "participants": msg.participants, **fixed})
                self._beacon_fixed_effects(s, spec, rnd)
            return self.threshold_beacon_state(s, msg.run_id, msg.round)

    def _beacon_fixed_effects(self, s: Session, spec: RunSpec, rnd: t.Round) -> None:
        """What follows a fixed beacon, of either kind: the checks, and the masked buckets
        in a masked run."""
        assert rnd.beacon is not None
        seed = bytes.fromhex(beacon_seed_of(rnd.beacon))
        if spec.masked is None:
            fixed = fix_challenges(s, spec, rnd, seed, self.clock())
            self._ledger_event(s, rnd.run_id, "challenges_fixed", {
                "run_id": rnd.run_id, "round": rnd.round,
                "reveal_deadline": rnd.reveal_deadline, "challenges": fixed})
        else:  # a masked round's checks wait for its openings seed (post_openings_share)
            workers = sorted(s.execute(select(t.Submission.worker).where(
                t.Submission.run_id == rnd.run_id, t.Submission.round == rnd.round)).scalars())
            started = secagg.start_round(s, spec, rnd.round, seed, workers, self.clock())
            self._ledger_event(s, rnd.run_id, "secagg_started", {"run_id": rnd.run_id,
                                                                 **started})

    # ----------------------------------------------------------------- sharded rounds

    def _shard_post(self, signed: Signed[Any], what: str, accept: Callable[..., Any],
                    chain_kind: str, staged: tuple[StagedBlob, ...] = ()) -> dict[str, Any]:
        msg = signed.message
        with self.sessions.begin() as s:
            self._stage_rows(s, staged)
            spec = self.get_spec(s, msg.run_id)
            idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, msg.validator,
                                                        msg.round, what)
            reply, new, events = accept(s, spec, idx, rnd, signed, self.clock())
            if new:
                self._append(s, msg.run_id, chain_kind, signed.encode())
            for ev in events:
                kind = ev.pop("kind")
                self._ledger_event(s, msg.run_id, kind, {"run_id": msg.run_id, **ev})
                if kind == "shard_fault" and rnd.status == RoundStatus.CLOSED.value:
                    self._certify_after_fault(s, spec, rnd)
            self._publish(staged)
            return reply

    def stored_board_post(self, table: str, kind: str, signed: Signed[Any]) -> bool:
        """Whether ``signed`` is, byte for byte, a stored post of a sharded round's board
        (``table`` "shard": kind "result", "check_share" or "finding") or a masked round's
        (``table`` "secagg"): an exact resend, answered from the store with no
        cryptography and charged to no key's own budget (anyone may copy a public post)."""
        msg, body = signed.message, signed.encode()
        row: Any = t.ShardMessage if table == "shard" else t.SecaggMessage
        with self.sessions() as s:
            return s.execute(select(row.id).where(
                row.run_id == msg.run_id, row.round == msg.round, row.kind == kind,
                row.body == body).limit(1)).first() is not None

    def precheck_shard_result(self, signed: Signed[ShardPublication]) -> dict[str, Any] | None:
        """``post_shard_result``'s checks without storing anything, so a result file is
        streamed only for a publication the board would take now. Raises the refusal;
        the stored reply for an exact resend, else None."""
        msg = signed.message
        with self.sessions() as s:
            spec = self.get_spec(s, msg.run_id)
            idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, msg.validator,
                                                        msg.round, "shard result")
            reply, new, _ = shards.accept_result(s, spec, idx, rnd, signed, self.clock(),
                                                 store=False)
            return None if new else reply

    def post_shard_result(self, signed: Signed[ShardPublication],
                          staged: tuple[StagedBlob, ...] = ()) -> dict[str, Any]:
        """A validator's shard result (its tensor file stored already, or ``staged``)."""
        return self._shard_post(signed, "shard result", shards.accept_result, "shard_result",
                                staged)

    def forget_unclaimed_shard_file(self, run_id: str, file_hash: str) -> bool:
        """After a refused shard publication whose file was already stored (two different
        publications of one shard that both passed the precheck: the loser's file): drop
        its blob row unless a stored publication of the run names that file. True when
        the caller should delete the file."""
        with self.sessions.begin() as s:
            for body in s.execute(select(t.ShardMessage.body).where(
                    t.ShardMessage.run_id == run_id, t.ShardMessage.kind == "result")
            ).scalars():
                if open_signed(decode_canonical(bytes(body)), ShardPublication
                               ).message.result_hash == file_hash:
                    return False
            blob = s.get(t.Blob, file_hash)
            if blob is None or blob.kind != "shard":
                return False
            s.delete(blob)
            return True

    def precheck_shard_check_share(self, signed: Signed[ShardCheckShare]
                                   ) -> tuple[bytes, bytes, bytes]:
        """A check share's cheap checks (they raise their refusal), on a reader; the
        (key, message, signature) of its one pairing, which the server verifies on its
        verifier thread (cached) before the write, so the writer finds it cached."""
        msg = signed.message
        with self.sessions() as s:
            spec = self.get_spec(s, msg.run_id)
            idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, msg.validator,
                                                        msg.round, "shard check share")
            shards.check_share_list(s, spec, rnd, msg)
        return (bytes.fromhex(spec.validators[idx]["bls"]),
                shard_check_root(msg.run_id, msg.round, msg.results), bytes.fromhex(msg.share))

    def post_shard_check_share(self, signed: Signed[ShardCheckShare]) -> dict[str, Any]:
        """A BLS share over the published results; the first fixes the list, a quorum the seed."""
        return self._shard_post(signed, "shard check share",
                                partial(shards.accept_check_share, verify=self.bls.verify),
                                "shard_check_share")

    def post_shard_finding(self, signed: Signed[ShardFindingReport]) -> dict[str, Any]:
        """A settled dispute over another validator's shard."""
        return self._shard_post(signed, "shard finding", shards.accept_finding, "shard_finding")

    # ----------------------------------------------------------------- masked rounds

    def post_secagg(self, kind: str, signed: Signed[Any],
                    staged: tuple[StagedBlob, ...] = ()) -> dict[str, Any]:
        """A worker's post to a masked round's board (keys, deal, masked, reveal, opening)."""
        msg = signed.message
        with self.sessions.begin() as s:
            self._stage_rows(s, staged)
            spec = self.get_spec(s, msg.run_id)
            rnd = self._round(s, msg.run_id, msg.round)
            opened = set(s.execute(select(t.ChallengeRow.worker).where(
                t.ChallengeRow.run_id == msg.run_id, t.ChallengeRow.round == msg.round)
            ).scalars()) if kind == "opening" else None
            reply, new = secagg.accept_post(s, spec, rnd, kind, signed, self.clock(),
                                            opened=opened)
            if new:
                self._append(s, msg.run_id, msg.KIND, signed.encode())
            self._publish(staged)
            return reply

    def precheck_secagg(self, kind: str, signed: Signed[Any]) -> bool:
        """``post_secagg``'s checks without storing anything, so a masked input's words
        are streamed only for a post the board would take now (a phase that closes during
        the upload still refuses it after). Raises the refusal; True for an exact resend."""
        msg = signed.message
        with self.sessions() as s:
            spec = self.get_spec(s, msg.run_id)
            rnd = self._round(s, msg.run_id, msg.round)
            _, new = secagg.accept_post(s, spec, rnd, kind, signed, self.clock(), store=False)
            return not new

    def round_secagg(self, s: Session, run_id: str, r: int,
                     bucket: int | None = None) -> dict[str, Any]:
        spec = self.get_spec(s, run_id)
        self._round(s, run_id, r)
        board = secagg.Board(s, spec, r, self.clock())
        return {**board.view(bucket), "openings": openings.state(board)}

    def _openings_share_key(self, s: Session, signed: Signed[OpeningsShare]
                            ) -> tuple[RunSpec, int, t.Round, str]:
        """(spec, validator index, round, the BLS key the share verifies under: the
        validator's key share in a threshold run, else its own key); the share's cheap
        refusals (not masked, not a validator's, round not closed, no group key yet)."""
        msg = signed.message
        spec = self.get_spec(s, msg.run_id)
        if spec.masked is None:
            raise RejectedInput(f"run {spec.run_id} does not mask its updates", "not_masked")
        idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, msg.validator,
                                                    msg.round, "openings share")
        if not spec.threshold_beacon:
            return spec, idx, rnd, spec.validators[idx]["bls"]
        group = dkg_board.group_result(s, msg.run_id)
        if group is None:
            raise WrongState("the run's DKG has not fixed a group key yet")
        return spec, idx, rnd, group.public_shares[idx]

    def precheck_openings_share(self, signed: Signed[OpeningsShare]
                                ) -> tuple[bytes, bytes, bytes] | None:
        """An openings share's cheap checks (they raise their refusal), on a reader; the
        (key, message, signature) of its one pairing, which the server verifies on its
        verifier thread (cached) before the write, so the writer finds it cached; None for
        an exact resend (answered by the write with no cryptography)."""
        msg = signed.message
        with self.sessions() as s:
            spec, _, rnd, key = self._openings_share_key(s, signed)
            if openings.check_share(s, spec, rnd, signed, self.clock())[2] is not None:
                return None
        return (bytes.fromhex(key), openings_root(msg.run_id, msg.round, msg.masked),
                bytes.fromhex(msg.share))

    def post_openings_share(self, signed: Signed[OpeningsShare]) -> dict[str, Any]:
        """A validator's share of a masked round's openings seed (ledger/openings.py); the
        share that makes a quorum fixes the seed (``openings_fixed``) and, from it, the
        round's checks (``challenges_fixed``)."""
        msg = signed.message
        with self.sessions.begin() as s:
            spec, idx, rnd, key = self._openings_share_key(s, signed)
            reply, _, fixed = openings.accept_share(s, spec, rnd, idx, signed, key,
                                                      self.clock(), spec.threshold_beacon,
                                                      self.bls.verify)
            if fixed is not None:  # shares are kept, not chained: the record verifies alone
                self._ledger_event(s, msg.run_id, "openings_fixed",
                                   {"run_id": msg.run_id, **fixed})
                checks = fix_challenges(s, spec, rnd, bytes.fromhex(fixed["seed"]),
                                        self.clock(),
                                        buckets=survivor_buckets(fixed["inputs"]))
                self._ledger_event(s, rnd.run_id, "challenges_fixed", {
                    "run_id": rnd.run_id, "round": rnd.round,
                    "reveal_deadline": rnd.reveal_deadline, "challenges": checks})
            return reply

    def round_shards(self, s: Session, run_id: str, r: int) -> dict[str, Any]:
        spec = self.get_spec(s, run_id)
        self._round(s, run_id, r)
        return shards.round_shards(s, spec, r)

    # ----------------------------------------------------------------- reveals

    def precheck_spot_reveal(self, signed: Signed[SpotReveal]) -> Signed[RevealReceipt] | None:
        """``accept_spot_reveal``'s checks without storing anything, so a reveal file is read
        only when the round takes it; the stored receipt for an exact resend, else None."""
        with self.sessions() as s:
            stored = check_reveal_allowed(s, signed, self.clock())
            return None if stored is None else open_signed(decode_canonical(stored.receipt),
                                                           RevealReceipt)

    def accept_spot_reveal(self, signed: Signed[SpotReveal], digest: str, size: int,
                           staged: tuple[StagedBlob, ...] = ()) -> Signed[RevealReceipt]:
        """Record a worker's reveal whose file is stored; returns the ledger's receipt."""
        msg = signed.message
        if digest != msg.reveal_hash or size != msg.reveal_bytes:
            raise RejectedInput("reveal file differs from the envelope's hash or size",
                                "payload_mismatch")
        with self.sessions.begin() as s:
            now = self.clock()
            stored = check_reveal_allowed(s, signed, now)
            if stored is not None:
                return open_signed(decode_canonical(stored.receipt), RevealReceipt)
            if s.get(t.Blob, digest) is None:
                s.add(t.Blob(sha256=digest, size=size, kind="reveal", run_id=msg.run_id,
                             sealed_round=None, created_at=now))
            ev = self._append(s, msg.run_id, "spot_reveal", signed.encode())
            rnd = self._round(s, msg.run_id, msg.round)
            receipt = sign(self.identity, RevealReceipt(
                run_id=msg.run_id, round=msg.round, worker=msg.worker,
                reveal_digest=signed.digest, reveal_hash=digest, received_at=now,
                deadline=rnd.reveal_deadline or now, sequence=ev.seq))
            s.add(t.SpotRevealRow(run_id=msg.run_id, round=msg.round, worker=msg.worker,
                                  digest=signed.digest, envelope=signed.encode(),
                                  reveal_hash=digest, size=size, received_at=now,
                                  receipt=receipt.encode()))
            self._append(s, msg.run_id, "reveal_receipt", receipt.encode())
            self._publish(staged)
            return receipt

    # ----------------------------------------------------------------- results

    def stored_result(self, s: Session, signed: Signed[RoundResult]) -> bool:
        """Whether this exact result is stored already (a replay: answered ``duplicate``
        from the store, with no cryptography and charging no one)."""
        res = signed.message
        body = s.execute(select(t.RoundResultRow.body).where(
            t.RoundResultRow.run_id == res.run_id, t.RoundResultRow.round == res.round,
            t.RoundResultRow.validator == res.validator)).scalar_one_or_none()
        return body is not None and bytes(body) == signed.encode()

    def precheck_result(self, s: Session, signed: Signed[RoundResult]) -> int:
        """``post_result``'s cheap checks (validator, round state, duplicate, base, digests,
        beacon), before the attestation is verified or any file read; the validator's
        index. Raises the refusal."""
        res = signed.message
        cert = res.certified_state
        spec = self.get_spec(s, res.run_id)
        idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, res.validator,
                                                    res.round, "result")
        existing = s.execute(select(t.RoundResultRow.id).where(
            t.RoundResultRow.run_id == res.run_id, t.RoundResultRow.round == res.round,
            t.RoundResultRow.validator == res.validator)).first()
        if existing is not None:
            raise Conflict("this validator already posted a result for this round")
        if res.base_model_hash != rnd.base_model_hash or cert.round != res.round + 1:
            raise RejectedInput("result is for another base model or round", "wrong_round")
        if cert.verdicts_hash != digest_of(res.verdicts) or cert.scores_hash != digest_of(
                res.scores):
            raise RejectedInput("verdict or score digest mismatch", "malformed")
        if (cert.shards is not None) != bool(spec.shards) or (cert.shards is not None and [
                x["shard"] for x in cert.shards] != list(range(spec.shards))):
            raise RejectedInput("a sharded run's certified state names each shard's source "
                                "in order; any other run's names none", "malformed")
        if rnd.beacon is None or res.beacon_seed != beacon_seed_of(rnd.beacon):
            raise RejectedInput("result uses another beacon than the round's", "wrong_beacon")
        return idx

    def result_verifies(self, signed: Signed[RoundResult]) -> bool:
        """The result's BLS attestation (cached): the expensive check, run last."""
        res = signed.message
        with self.sessions() as s:
            spec = self.get_spec(s, res.run_id)
        idx = spec.validator_index(signed.signer)
        return idx is not None and self.bls.verify(
            bytes.fromhex(spec.validators[idx]["bls"]), res.certified_state.signing_root(),
            bytes.fromhex(res.attestation))

    def post_result(self, signed: Signed[RoundResult],
                    staged: tuple[StagedBlob, ...] = ()) -> dict[str, Any]:
        """Record one validator's result (its staged files with it); finalize the round
        once a quorum agrees."""
        res = signed.message
        cert = res.certified_state
        with self.sessions.begin() as s:
            spec = self.get_spec(s, res.run_id)
            idx = self.precheck_result(s, signed)
            rnd = self._round(s, res.run_id, res.round)
            self._stage_rows(s, staged)
            for digest in (cert.model_hash, cert.outer_state_hash, cert.update_hash):
                if s.get(t.Blob, digest) is None:
                    raise RejectedInput(f"blob {digest[:12]} was not uploaded", "missing_payload")
            vkey = bytes.fromhex(spec.validators[idx]["bls"])
            if not self.bls.verify(vkey, cert.signing_root(), bytes.fromhex(res.attestation)):
                raise RejectedInput("BLS attestation does not verify", "bad_signature")
            certified_digest = digest_of(cert.to_body())
            s.add(t.RoundResultRow(run_id=res.run_id, round=res.round, validator=res.validator,
                                   certified_digest=certified_digest, body=signed.encode(),
                                   received_at=self.clock()))
            self._append(s, res.run_id, "round_result", signed.encode())
            s.flush()
            if rnd.status == RoundStatus.FINALIZED.value:
                certified = decode_canonical(rnd.certificate)["certified"]
                record_validator_faults(
                    s, spec, res.round, digest_of(certified),
                    lambda kind, body: self._ledger_event(s, res.run_id, kind, body))
                self._publish(staged)
                return {"status": "finalized", "certificate": False}
            reply = self._certify_if_agreed(s, spec, rnd, certified_digest)
            self._publish(staged)
            return reply

    def _certify_if_agreed(self, s: Session, spec: RunSpec, rnd: t.Round,
                           certified_digest: str) -> dict[str, Any]:
        """Finalize closed round ``rnd`` on the certified state ``certified_digest`` once a
        quorum of counted results agree on it and its shard sources follow the board.

        A validator whose shard a quorum proved faulty does not count (secure-averaging
        E.1, step 4): its result stays recorded, its attestation is left out. A state that
        recomputes a listed shard waits for that shard's ``shard_fault`` (the findings of a
        quorum, which may land after the results): certified earlier, it would rest on one
        checker's word."""
        faulted = shards.faulted_validators(s, spec, rnd.round) if spec.shards else set()
        agreeing = [
            result for result in (
                open_signed(decode_canonical(row.body, max_bytes=MAX_RESULT_BYTES),
                            RoundResult).message
                for row in s.execute(select(t.RoundResultRow).where(
                    t.RoundResultRow.run_id == rnd.run_id,
                    t.RoundResultRow.round == rnd.round,
                    t.RoundResultRow.certified_digest == certified_digest)).scalars().all())
            if spec.validator_index(result.validator) not in faulted
        ]
        if len(agreeing) < spec.quorum:
            return {"status": "closed", "certificate": False, "attestations": len(agreeing)}
        waiting = shards.sources_problem(s, spec, rnd.round,
                                         agreeing[0].certified_state.shards, faulted)
        if waiting is not None:
            return {"status": "closed", "certificate": False, "attestations": len(agreeing),
                    "waiting": waiting}
        self._finalize(s, spec, rnd, agreeing[0], agreeing)
        return {"status": "finalized", "certificate": True}

    def _certify_after_fault(self, s: Session, spec: RunSpec, rnd: t.Round) -> None:
        """After a ``shard_fault``: a closed round whose results waited for it may now
        finalize (each recorded certified state in turn, at most one can)."""
        digests = s.execute(select(t.RoundResultRow.certified_digest).where(
            t.RoundResultRow.run_id == rnd.run_id, t.RoundResultRow.round == rnd.round)
            .distinct()).scalars().all()
        for digest in sorted(digests):
            if rnd.status != RoundStatus.CLOSED.value:
                return
            self._certify_if_agreed(s, spec, rnd, digest)

    def _finalize(self, s: Session, spec: RunSpec, rnd: t.Round, res: RoundResult,
                  agreeing: list[RoundResult]) -> None:
        now = self.clock()
        by_index = sorted((spec.validator_index(a.validator) or 0, a) for a in agreeing)
        chosen = by_index[: spec.quorum]
        certificate = Certificate(
            certified=res.certified,
            signers=[i for i, _ in chosen],
            signature=bls.aggregate([bytes.fromhex(a.attestation) for _, a in chosen]).hex(),
        )
        cert = res.certified_state
        rnd.status = RoundStatus.FINALIZED.value
        rnd.finalized_at = now
        rnd.certificate = encode_canonical(certificate.to_json())
        rnd.eval_loss = cert.eval_loss
        scores = {sc["worker"]: sc for sc in res.scores}
        for v in res.verdicts:
            sc = scores.get(v["worker"], {})
            s.add(t.Verdict(
                run_id=res.run_id, round=res.round, worker=v["worker"], status=v["status"],
                reason=v["reason"], detail=v["detail"], spot_checked=v["spot_checked"],
                distance=v["distance"], samples=sc.get("samples", 0),
                quality=sc.get("quality", 0.0), score=sc.get("score", 0.0),
                reward=sc.get("reward", 0.0),
                checks=encode_canonical(v["checks"]).decode()))
        s.flush()

        def emit(kind: str, body: dict[str, Any]) -> None:
            self._ledger_event(s, res.run_id, kind, body)

        apply_worker_penalties(s, spec, res.round, res.verdicts, emit)
        record_validator_faults(s, spec, res.round, digest_of(res.certified), emit)
        self._ledger_event(s, res.run_id, "round_finalized", {
            "run_id": res.run_id, "round": res.round, "certificate": certificate.to_json()})
        # Bonds slashed and tickets voided for the round's proven faults, after its
        # certificate (ledger/membership.py): none under the open policy.
        membership.apply_slashes(s, spec, res.round, res.verdicts, emit)
        self._next_round(s, spec, cert.round, cert.model_hash, cert.outer_state_hash, now)

    def _next_round(self, s: Session, spec: RunSpec, r: int, base: str, outer: str | None,
                    now: float) -> None:
        """Open round ``r`` on ``base``, or finish the run when ``r`` reaches max_rounds."""
        if r >= spec.schedule["max_rounds"]:
            run = s.get(t.Run, spec.run_id)
            assert run is not None
            run.status = "finished"
            self._ledger_event(s, spec.run_id, "run_finished", {"run_id": spec.run_id,
                                                                "rounds": r})
        else:
            self._open_round(s, spec, r, base, outer, now)

    # ----------------------------------------------------------------- rejections

    def record_rejection(self, run_id: str, r: int | None, signer: str | None, endpoint: str,
                         reason: str, detail: str) -> None:
        with self.sessions.begin() as s:
            s.add(t.Rejection(run_id=run_id[:64], round=r, signer=signer, endpoint=endpoint,
                              reason=reason[:64], detail=detail[:500], at=self.clock()))
