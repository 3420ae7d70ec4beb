"""Ledger state transitions over a SQLAlchemy session.

Each public method is one transaction: it checks its input, appends the
hash-chained event(s) and updates the query tables together, so a crash
leaves either all of a write or none of it. Methods are synchronous; the HTTP
server runs them on one writer thread, which also serializes the chain.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import create_engine, event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from veritrain.protocol import bls
from veritrain.protocol.beacon import beacon_root, beacon_seed_of, sealed_list_digest
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    BeaconShare,
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
from veritrain.protocol.rules import SubmissionContext, check_submission
from veritrain.protocol.schedule import Action, RoundStatus, RoundView, next_action

from . import migrate, secagg, shards
from . import schema as t
from .chain import GENESIS_HASH, compute_event_hash
from .challenges import check_reveal_allowed, fix_challenges
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
        self.checkpointer.install(self.sessions)
        self._specs: dict[bytes, RunSpec] = {}

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

    def create_run(self, signed: Signed[RunSpec]) -> None:
        spec = signed.message
        if signed.signer != spec.organiser:
            raise RejectedInput("run spec not signed by its organiser", "bad_signature")
        if spec.quorum > len(spec.validators) or not spec.validators:
            raise RejectedInput("quorum larger than the validator set", "malformed")
        if (problem := spec.sharding_problem() or spec.masking_problem()) is not None:
            raise RejectedInput(problem, "malformed")
        keys = [v["ed25519"] for v in spec.validators]
        if len(set(keys)) != len(keys) or len({v["bls"] for v in spec.validators}) != len(keys):
            raise RejectedInput("validator keys repeat", "malformed")
        for v in spec.validators:
            if not bls.verify_possession(bytes.fromhex(v["bls"]), bytes.fromhex(v["bls_pop"])):
                raise RejectedInput(
                    f"validator {v['ed25519'][:12]} has no valid BLS proof of possession",
                    "bad_signature",
                )
        now = self.clock()
        with self.sessions.begin() as s:
            if s.get(t.Run, spec.run_id) is not None:
                raise Conflict(f"run {spec.run_id!r} exists")
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
            if blob.sealed_round is None or blob.run_id is None:
                return True
            rnd = s.get(t.Round, (blob.run_id, blob.sealed_round))
            return rnd is not None and rnd.status != RoundStatus.OPEN.value

    # ----------------------------------------------------------------- participants

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
            current = self._current_round(s, reg.run_id)
            s.add(t.Participant(run_id=reg.run_id, pubkey=reg.participant, role=reg.role,
                                registered_at=self.clock(), registered_round=current.round,
                                registration=signed.encode()))
            self._append(s, reg.run_id, "registration", signed.encode())
            return {"participant": reg.participant, "role": reg.role,
                    "registered_round": current.round, "new": True}

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
        """Close or extend open rounds whose time has come; returns what it did."""
        now = self.clock()
        done: list[tuple[str, int, str]] = []
        with self.sessions.begin() as s:
            for rnd in s.execute(select(t.Round).where(
                    t.Round.status == RoundStatus.OPEN.value)).scalars().all():
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
        return done

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

    def sealed_submissions(self, run_id: str, r: int) -> list[bytes]:
        """The fixed submission list of a closed round, ordered by worker key."""
        with self.sessions() as s:
            rnd = self._round(s, run_id, r)
            if rnd.status == RoundStatus.OPEN.value:
                raise WrongState(f"round {r} is still open: submissions are sealed")
            return list(s.execute(select(t.Submission.envelope).where(
                t.Submission.run_id == run_id, t.Submission.round == r)
                .order_by(t.Submission.worker)).scalars().all())

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
        return idx, rnd

    def post_beacon_share(self, signed: Signed[BeaconShare]) -> dict[str, Any]:
        """Collect validators' beacon shares after close; fix the first quorum to arrive."""
        msg = signed.message
        with self.sessions.begin() as s:
            spec = self.get_spec(s, msg.run_id)
            idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, msg.validator,
                                                        msg.round, "beacon share")
            if not bls.verify(bytes.fromhex(spec.validators[idx]["bls"]),
                              beacon_root(msg.run_id, msg.round), bytes.fromhex(msg.share)):
                raise RejectedInput("beacon share does not verify", "bad_signature")
            sealed = sealed_list_digest(s.execute(select(t.Submission.digest).where(
                t.Submission.run_id == msg.run_id, t.Submission.round == msg.round)).scalars())
            if msg.sealed != sealed:
                raise RejectedInput("the share names another sealed list than the round's",
                                    "wrong_sealed_list")
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
            fixed = fix_challenges(s, spec, rnd, bytes.fromhex(beacon_seed_of(rnd.beacon)),
                                   self.clock())
            self._ledger_event(s, msg.run_id, "challenges_fixed", {
                "run_id": msg.run_id, "round": msg.round, "reveal_deadline": rnd.reveal_deadline,
                "challenges": fixed})
            if spec.masked is not None:
                workers = sorted(s.execute(select(t.Submission.worker).where(
                    t.Submission.run_id == msg.run_id, t.Submission.round == msg.round)).scalars())
                started = secagg.start_round(s, spec, msg.round,
                                             bytes.fromhex(beacon_seed_of(rnd.beacon)), workers,
                                             self.clock())
                self._ledger_event(s, msg.run_id, "secagg_started",
                                   {"run_id": msg.run_id, **started})
            return {"beacon": beacon,
                    "envelopes": beacon_envelopes(s, msg.run_id, msg.round, beacon)}

    # ----------------------------------------------------------------- sharded rounds

    def _shard_post(self, signed: Signed[Any], what: str, accept: Callable[..., Any],
                    chain_kind: str) -> dict[str, Any]:
        msg = signed.message
        with self.sessions.begin() as s:
            spec = self.get_spec(s, msg.run_id)
            idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, msg.validator,
                                                        msg.round, what)
            reply, new, events = accept(s, spec, idx, rnd, signed, self.clock())
            if new:
                self._append(s, msg.run_id, chain_kind, signed.encode())
            for ev in events:
                kind = ev.pop("kind")
                self._ledger_event(s, msg.run_id, kind, {"run_id": msg.run_id, **ev})
            return reply

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

    def post_shard_result(self, signed: Signed[ShardPublication]) -> dict[str, Any]:
        """A validator's shard result (its tensor file is stored already)."""
        return self._shard_post(signed, "shard result", shards.accept_result, "shard_result")

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

    def post_shard_check_share(self, signed: Signed[ShardCheckShare]) -> dict[str, Any]:
        """A BLS share over the published results; the first fixes the list, a quorum the seed."""
        return self._shard_post(signed, "shard check share", shards.accept_check_share,
                                "shard_check_share")

    def post_shard_finding(self, signed: Signed[ShardFindingReport]) -> dict[str, Any]:
        """A settled dispute over another validator's shard."""
        return self._shard_post(signed, "shard finding", shards.accept_finding, "shard_finding")

    # ----------------------------------------------------------------- masked rounds

    def post_secagg(self, kind: str, signed: Signed[Any]) -> dict[str, Any]:
        """A worker's post to a masked round's board (keys, deal, masked, reveal, opening)."""
        msg = signed.message
        with self.sessions.begin() as s:
            spec = self.get_spec(s, msg.run_id)
            rnd = self._round(s, msg.run_id, msg.round)
            opened = set(s.execute(select(t.ChallengeRow.worker).where(
                t.ChallengeRow.run_id == msg.run_id, t.ChallengeRow.round == msg.round)
            ).scalars()) if kind == "opening" else None
            reply, new = secagg.accept_post(s, spec, rnd, kind, signed, self.clock(),
                                            opened=opened)
            if new:
                self._append(s, msg.run_id, msg.KIND, signed.encode())
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
        return secagg.Board(s, spec, r, self.clock()).view(bucket)

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

    def accept_spot_reveal(self, signed: Signed[SpotReveal], digest: str, size: int
                           ) -> Signed[RevealReceipt]:
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
            return receipt

    # ----------------------------------------------------------------- results

    def post_result(self, signed: Signed[RoundResult]) -> dict[str, Any]:
        """Record one validator's result; finalize the round once a quorum agrees."""
        res = signed.message
        cert = res.certified_state
        with self.sessions.begin() as s:
            spec = self.get_spec(s, res.run_id)
            idx, rnd = self._closed_round_for_validator(s, spec, signed.signer, res.validator,
                                                        res.round, "result")
            if res.base_model_hash != rnd.base_model_hash or cert.round != res.round + 1:
                raise RejectedInput("result is for another base model or round", "wrong_round")
            if cert.verdicts_hash != digest_of(res.verdicts) or cert.scores_hash != digest_of(
                    res.scores):
                raise RejectedInput("verdict or score digest mismatch", "malformed")
            for digest in (cert.model_hash, cert.outer_state_hash, cert.update_hash):
                if s.get(t.Blob, digest) is None:
                    raise RejectedInput(f"blob {digest[:12]} was not uploaded", "missing_payload")
            vinfo = spec.validators[idx]
            vkey = bytes.fromhex(vinfo["bls"])
            if not bls.verify(vkey, cert.signing_root(), bytes.fromhex(res.attestation)):
                raise RejectedInput("BLS attestation does not verify", "bad_signature")
            if rnd.beacon is None or res.beacon_seed != beacon_seed_of(rnd.beacon):
                raise RejectedInput("result uses another beacon than the round's", "wrong_beacon")
            existing = s.execute(select(t.RoundResultRow).where(
                t.RoundResultRow.run_id == res.run_id, t.RoundResultRow.round == res.round,
                t.RoundResultRow.validator == res.validator)).scalar_one_or_none()
            if existing is not None:
                raise Conflict("this validator already posted a result for this round")
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
                return {"status": "finalized", "certificate": False}
            agreeing = [
                open_signed(decode_canonical(row.body, max_bytes=MAX_RESULT_BYTES),
                            RoundResult).message
                for row in s.execute(select(t.RoundResultRow).where(
                    t.RoundResultRow.run_id == res.run_id, t.RoundResultRow.round == res.round,
                    t.RoundResultRow.certified_digest == certified_digest)).scalars().all()
            ]
            if len(agreeing) < spec.quorum:
                return {"status": "closed", "certificate": False, "attestations": len(agreeing)}
            self._finalize(s, spec, rnd, res, agreeing)
            return {"status": "finalized", "certificate": True}

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
        if cert.round >= spec.schedule["max_rounds"]:
            run = s.get(t.Run, res.run_id)
            assert run is not None
            run.status = "finished"
            self._ledger_event(s, res.run_id, "run_finished", {
                "run_id": res.run_id, "rounds": cert.round})
        else:
            self._open_round(s, spec, cert.round, cert.model_hash, cert.outer_state_hash, now)

    # ----------------------------------------------------------------- rejections

    def record_rejection(self, run_id: str, r: int | None, signer: str | None, endpoint: str,
                         reason: str, detail: str) -> None:
        with self.sessions.begin() as s:
            s.add(t.Rejection(run_id=run_id[:64], round=r, signer=signer, endpoint=endpoint,
                              reason=reason[:64], detail=detail[:500], at=self.clock()))
