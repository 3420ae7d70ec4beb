"""Ledger tables (SQLAlchemy 2 typed models).

The ``events`` table is the append-only, hash-chained log that an auditor
verifies; the other tables are indexed views of the same facts for queries.
Every write goes through :mod:`veritrain.ledger.store`, which appends the
event and updates the views in one transaction.
"""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    cast,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.sql.elements import ColumnElement


class StoredBytes(TypeDecorator[bytes]):
    """A binary column that reads back as ``bytes`` whatever the database holds in it.

    SQLite keeps any value in any column: ``UPDATE events SET body = replace(body, ...)``
    leaves TEXT where a BLOB was, which the driver returns as ``str`` (or fails to decode
    as UTF-8). Every SELECT of such a column reads ``CAST(col AS BLOB)`` instead, the
    stored bytes as they are, so a damaged row is served as what it holds and an audit
    names it (its hash no longer matches) rather than the server failing on it.
    PostgreSQL's ``bytea`` holds bytes only; the cast is a no-op there.
    """

    impl = LargeBinary
    cache_ok = True

    def column_expression(self, column: ColumnElement[bytes]) -> ColumnElement[bytes]:
        return cast(column, LargeBinary)


class Base(DeclarativeBase):
    pass


class Run(Base):
    __tablename__ = "runs"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    organiser: Mapped[str] = mapped_column(String(64))
    spec: Mapped[bytes] = mapped_column(StoredBytes)  # canonical signed RunSpec
    created_at: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(16), default="active")


class Participant(Base):
    __tablename__ = "participants"
    __table_args__ = (UniqueConstraint("run_id", "pubkey"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id"))
    pubkey: Mapped[str] = mapped_column(String(64))
    role: Mapped[str] = mapped_column(String(16))
    registered_at: Mapped[float] = mapped_column(Float)
    registered_round: Mapped[int] = mapped_column(Integer)
    banned_until_round: Mapped[int] = mapped_column(Integer, default=-1)
    registration: Mapped[bytes | None] = mapped_column(StoredBytes, nullable=True)


class Round(Base):
    __tablename__ = "rounds"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id"), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[str] = mapped_column(String(16))
    base_model_hash: Mapped[str] = mapped_column(String(64))
    outer_state_hash: Mapped[str | None] = mapped_column(String(64), nullable=True)
    opened_at: Mapped[float] = mapped_column(Float)
    deadline: Mapped[float] = mapped_column(Float)
    extensions: Mapped[int] = mapped_column(Integer, default=0)
    closed_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finalized_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    certificate: Mapped[bytes | None] = mapped_column(StoredBytes, nullable=True)
    beacon: Mapped[bytes | None] = mapped_column(StoredBytes, nullable=True)
    reveal_deadline: Mapped[float | None] = mapped_column(Float, nullable=True)
    eval_loss: Mapped[float | None] = mapped_column(Float, nullable=True)


class Submission(Base):
    __tablename__ = "submissions"
    __table_args__ = (
        UniqueConstraint("run_id", "round", "worker"),
        Index("ix_submissions_worker", "run_id", "worker", "round"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id"))
    round: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(64))  # unique: it names (run, round, worker)
    envelope: Mapped[bytes] = mapped_column(StoredBytes)  # canonical signed Submission
    payload_hash: Mapped[str] = mapped_column(String(64))
    payload_bytes: Mapped[int] = mapped_column(BigInteger)
    samples: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[float] = mapped_column(Float)
    receipt: Mapped[bytes] = mapped_column(StoredBytes)  # canonical signed Receipt


class BeaconShareRow(Base):
    __tablename__ = "beacon_shares"
    __table_args__ = (UniqueConstraint("run_id", "round", "validator_index"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id"))
    round: Mapped[int] = mapped_column(Integer)
    validator_index: Mapped[int] = mapped_column(Integer)
    share: Mapped[str] = mapped_column(String(192))
    #: The signed BeaconShare (None for shares stored before migration 0007).
    envelope: Mapped[bytes | None] = mapped_column(StoredBytes, nullable=True)


class RoundResultRow(Base):
    __tablename__ = "round_results"
    __table_args__ = (UniqueConstraint("run_id", "round", "validator"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id"))
    round: Mapped[int] = mapped_column(Integer)
    validator: Mapped[str] = mapped_column(String(64))
    certified_digest: Mapped[str] = mapped_column(String(64))
    body: Mapped[bytes] = mapped_column(StoredBytes)  # canonical signed RoundResult
    received_at: Mapped[float] = mapped_column(Float)


class Verdict(Base):
    __tablename__ = "verdicts"
    __table_args__ = (
        UniqueConstraint("run_id", "round", "worker"),
        Index("ix_verdicts_worker", "run_id", "worker", "round"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id"))
    round: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text)
    spot_checked: Mapped[bool] = mapped_column(default=False)
    distance: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples: Mapped[int] = mapped_column(BigInteger, default=0)
    quality: Mapped[float] = mapped_column(Float, default=0.0)
    score: Mapped[float] = mapped_column(Float, default=0.0)
    reward: Mapped[float] = mapped_column(Float, default=0.0)
    checks: Mapped[str] = mapped_column(Text, default="[]")  # segment checks with evidence hashes


class Rejection(Base):
    """A write the ledger refused at its door (bad signature, late, duplicate, ...)."""

    __tablename__ = "rejections"
    __table_args__ = (
        Index("ix_rejections_run_round", "run_id", "round"),
        Index("ix_rejections_signer", "run_id", "signer"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64))
    round: Mapped[int | None] = mapped_column(Integer, nullable=True)
    signer: Mapped[str | None] = mapped_column(String(64), nullable=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text)
    at: Mapped[float] = mapped_column(Float)


class Blob(Base):
    __tablename__ = "blobs"
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    kind: Mapped[str] = mapped_column(String(16))
    run_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    sealed_round: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)


class Event(Base):
    """Append-only, hash-chained log: hash = sha256(prev_hash || seq || kind || body)."""

    __tablename__ = "events"
    __table_args__ = (UniqueConstraint("run_id", "seq"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64))
    seq: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(32))
    body: Mapped[bytes] = mapped_column(StoredBytes)
    prev_hash: Mapped[str] = mapped_column(String(64))
    hash: Mapped[str] = mapped_column(String(64))  # unique: it commits to (run, seq)


class Checkpoint(Base):
    """The ledger's Ed25519 signature over the chain head ``(run_id, seq, hash)``.

    One signature vouches for row ``seq`` and, through the hash chain, for every
    row before it (specs/protocol.md, section 9). Append-only like ``events``.
    """

    __tablename__ = "checkpoints"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    hash: Mapped[str] = mapped_column(String(64))
    signature: Mapped[str] = mapped_column(String(128))
    signed_at: Mapped[float] = mapped_column(Float)


class ChallengeRow(Base):
    """A worker's checks of a round, fixed with the round's beacon: its challenged
    segments, and whether a reveal is due at all (a masked run's unopened workers have none)."""

    __tablename__ = "challenges"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    worker: Mapped[str] = mapped_column(String(64), primary_key=True)
    segments: Mapped[str] = mapped_column(Text)  # canonical JSON list of segment indices
    due: Mapped[bool] = mapped_column(Boolean, default=True)
    max_bytes: Mapped[int] = mapped_column(BigInteger, default=0)  # bound on its reveal file


class SpotRevealRow(Base):
    """A worker's signed reveal of a round (its file is a blob) and the ledger's receipt."""

    __tablename__ = "spot_reveals"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    worker: Mapped[str] = mapped_column(String(64), primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))  # of the signed envelope
    envelope: Mapped[bytes] = mapped_column(LargeBinary)  # canonical signed SpotReveal
    reveal_hash: Mapped[str] = mapped_column(String(64))
    size: Mapped[int] = mapped_column(BigInteger)
    received_at: Mapped[float] = mapped_column(Float)
    receipt: Mapped[bytes] = mapped_column(LargeBinary)  # canonical signed RevealReceipt


class Penalty(Base):
    """A sanction taken back from a worker (e.g. its unvested rewards after a failed check)."""

    __tablename__ = "penalties"
    __table_args__ = (Index("ix_penalties_worker", "run_id", "worker", "round"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64))
    round: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16))
    amount: Mapped[float] = mapped_column(Float)
    source_round: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text)


class ValidatorFault(Base):
    """A validator's result that differs from the round's certificate."""

    __tablename__ = "validator_faults"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    round: Mapped[int] = mapped_column(Integer, primary_key=True)
    validator: Mapped[str] = mapped_column(String(64), primary_key=True)
    result_digest: Mapped[str] = mapped_column(String(64))
    certified_digest: Mapped[str] = mapped_column(String(64))


class ShardMessage(Base):
    """A sharded round's exchange between validators (specs/secure-averaging.md E).

    ``kind`` is ``result`` (one per validator: its shard), ``check_share`` (one per
    validator: its BLS share over the published results), ``finding`` (one per
    reporter and disputed shard), or the ledger's own ``list_fixed`` and
    ``check_fixed`` (``validator_index`` -1). ``body`` is the canonical signed
    envelope, or for the ledger's rows the canonical JSON it fixed.
    """

    __tablename__ = "shard_messages"
    __table_args__ = (UniqueConstraint("run_id", "round", "kind", "validator_index", "shard"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64))
    round: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    validator_index: Mapped[int] = mapped_column(Integer)
    shard: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64))
    body: Mapped[bytes] = mapped_column(StoredBytes)
    received_at: Mapped[float] = mapped_column(Float)


class SecaggMessage(Base):
    """A masked round's bulletin board (specs/secure-averaging.md E.2).

    ``kind`` is a phase's post (``keys``, ``deal``, ``masked``, ``reveal``: one per
    sender), a spot-checked worker's ``opening``, or the ledger's own ``start``
    row (``sender`` empty), written when the beacon fixes the buckets. ``body``
    is the canonical signed envelope, or for ``start`` the canonical JSON of the
    buckets; ``received_at`` is what the phase schedule is computed from.
    """

    __tablename__ = "secagg_messages"
    __table_args__ = (UniqueConstraint("run_id", "round", "kind", "sender"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64))
    round: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    sender: Mapped[str] = mapped_column(String(64))
    bucket: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(64))
    body: Mapped[bytes] = mapped_column(StoredBytes)
    received_at: Mapped[float] = mapped_column(Float)


class PrunedBlob(Base):
    """A blob file the retention policy deleted (specs/protocol.md 9.7).

    The chain keeps every hash; this row says the file behind one is gone by policy (which
    policy, when, and what it was: a reveal file of ``worker`` in ``round``, or the model or
    outer state that was the base of ``round``), so that anyone can tell a blob gone by
    policy from a blob lost. Written before the file is deleted; never removed.
    """

    __tablename__ = "pruned_blobs"
    __table_args__ = (
        Index("ix_pruned_blobs_sha256", "sha256"),
        Index("ix_pruned_blobs_round", "run_id", "round"),
    )
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    round: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str | None] = mapped_column(String(64), nullable=True)
    size: Mapped[int] = mapped_column(BigInteger)
    pruned_at: Mapped[float] = mapped_column(Float)
    policy: Mapped[str] = mapped_column(String(64))


class DkgPost(Base):
    """A threshold-beacon run's board (specs/protocol.md 5.4a): the DKG's signed posts
    (round 0; ``kind`` one of ``dkg_keys`` ... ``dkg_result``, one per validator), the
    ledger's ``dkg_group`` row (``sender`` empty; canonical JSON of the group key, public
    shares and the results a quorum signed) and each round's ``beacon_partial`` posts.
    ``received_at`` is what the DKG's phase schedule is computed from."""

    __tablename__ = "dkg_posts"
    __table_args__ = (UniqueConstraint("run_id", "round", "kind", "sender"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(String(64))
    round: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(24))
    sender: Mapped[str] = mapped_column(String(64))
    digest: Mapped[str] = mapped_column(String(64))
    body: Mapped[bytes] = mapped_column(StoredBytes)
    received_at: Mapped[float] = mapped_column(Float)
