"""When the ledger signs its chain: checkpoints instead of a signature per row.

A checkpoint is the ledger's Ed25519 signature over a run's chain head
(:func:`veritrain.ledger.chain.checkpoint_signing_root`). The store notes every
appended row in its session; just before the transaction commits, the
:class:`Checkpointer` signs the head of each run it touched when

* the transaction wrote a round boundary (run spec, round closed, round
  finalized, run finished), or
* at least ``every_rows`` rows were appended since the last checkpoint, or
* the last checkpoint is at least ``every_seconds`` old.

Rows committed in between are covered by the next checkpoint, which the
server's ticker signs within about ``every_seconds`` (:meth:`sign_pending`).
So an auditor verifies one signature per checkpoint, not one per row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import event, func, select
from sqlalchemy.orm import Session, sessionmaker
from veritrain.protocol.identity import Identity

from . import schema as t
from .chain import checkpoint_signing_root

BOUNDARY_KINDS = frozenset({"run_spec", "round_closed", "round_finalized", "round_voided",
                            "run_finished", "run_failed"})
HEADS = "veritrain_chain_heads"
BOUNDARIES = "veritrain_chain_boundaries"


def chain_head(s: Session, run_id: str) -> tuple[int, str] | None:
    """The session's view of a run's last row: (seq, hash), cached while the transaction lasts."""
    heads: dict[str, tuple[int, str]] = s.info.setdefault(HEADS, {})
    head = heads.get(run_id)
    if head is None:
        row = s.execute(select(t.Event.seq, t.Event.hash).where(t.Event.run_id == run_id)
                        .order_by(t.Event.seq.desc()).limit(1)).first()
        if row is None:
            return None
        head = heads[run_id] = (row[0], row[1])
    return head


def note_append(s: Session, run_id: str, seq: int, digest: str, kind: str) -> None:
    s.info.setdefault(HEADS, {})[run_id] = (seq, digest)
    touched: dict[str, bool] = s.info.setdefault(BOUNDARIES, {})
    touched[run_id] = touched.get(run_id, False) or kind in BOUNDARY_KINDS


def _forget(s: Session, *_: Any) -> None:
    s.info.pop(HEADS, None)
    s.info.pop(BOUNDARIES, None)


class Checkpointer:
    def __init__(self, identity: Identity, clock: Callable[[], float], *,
                 every_rows: int = 1000, every_seconds: float = 1.0) -> None:
        self.identity = identity
        self.clock = clock
        self.every_rows = every_rows
        self.every_seconds = every_seconds

    def install(self, sessions: sessionmaker[Session]) -> None:
        event.listen(sessions, "before_commit", self._before_commit)
        event.listen(sessions, "after_commit", _forget)
        event.listen(sessions, "after_soft_rollback", _forget)

    def sign(self, s: Session, run_id: str, seq: int, digest: str) -> t.Checkpoint:
        row = t.Checkpoint(
            run_id=run_id, seq=seq, hash=digest, signed_at=self.clock(),
            signature=self.identity.sign_ed25519(checkpoint_signing_root(run_id, seq, digest))
            .hex())
        s.add(row)
        return row

    def _before_commit(self, s: Session) -> None:
        touched: dict[str, bool] = s.info.get(BOUNDARIES, {})
        if not touched:
            return
        heads: dict[str, tuple[int, str]] = s.info[HEADS]
        now = self.clock()
        for run_id, boundary in touched.items():
            seq, digest = heads[run_id]
            last = s.execute(select(t.Checkpoint.seq, t.Checkpoint.signed_at).where(
                t.Checkpoint.run_id == run_id).order_by(t.Checkpoint.seq.desc()).limit(1)).first()
            if (boundary or last is None or seq - last[0] >= self.every_rows
                    or now - last[1] >= self.every_seconds):
                self.sign(s, run_id, seq, digest)
        s.info.pop(BOUNDARIES, None)

    def sign_pending(self, sessions: sessionmaker[Session]) -> int:
        """Sign the head of every run whose last rows no checkpoint covers yet."""
        signed = 0
        with sessions.begin() as s:
            last_event = (select(t.Event.run_id, func.max(t.Event.seq).label("seq"))
                          .group_by(t.Event.run_id).subquery())
            last_cp = (select(t.Checkpoint.run_id, func.max(t.Checkpoint.seq).label("seq"))
                       .group_by(t.Checkpoint.run_id).subquery())
            pending = s.execute(
                select(last_event.c.run_id, last_event.c.seq)
                .outerjoin(last_cp, last_cp.c.run_id == last_event.c.run_id)
                .where((last_cp.c.seq.is_(None)) | (last_cp.c.seq < last_event.c.seq))).all()
            for run_id, seq in pending:
                digest = s.execute(select(t.Event.hash).where(
                    t.Event.run_id == run_id, t.Event.seq == seq)).scalar_one()
                self.sign(s, run_id, seq, digest)
                signed += 1
        return signed
