"""Masked buckets: the ledger's part (specs/secure-averaging.md E.2).

The ledger is the workers' bulletin board for a masked round. When the
round's beacon is fixed it deals the sealed submitters into buckets
(``start``); from then on it takes, phase by phase, each member's key advert,
deal (share commitments and sealed shares), masked input (with its words
file), signed view and reveal, refusing a post to a phase that is not open, from
a sender that phase does not wait for, or that contradicts the board (a key of low
order, a deal for other holders than the bucket's advertisers, a masked input, view
or reveal naming other members, dealers or survivors than the board's, a reveal
without k survivors' signatures on its view). Spot-checked workers post their mask
opening. Workers and validators check all of it again: an honest ledger's refusals
keep the board clean, a lying one is caught by the signed views.

It never sees an update and checks no cryptography beyond the envelope's
signature: the validators do that when they unmask, and blame by the
commitments. What it fixes, for everyone alike, is who is in which bucket, who
dealt and who survived.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import (
    RunSpec,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    SecaggReveal,
    SecaggView,
    Signed,
)
from veritrain.protocol.secagg import (
    BucketState,
    Phase,
    bucket_threshold,
    open_phase,
    phase_schedule,
    round_buckets,
    usable_x25519,
    view_digest,
    view_signers,
    words_file_bytes,
)

from . import schema as t

#: kind on the board -> message class; the phases in order, then the openings.
KINDS: dict[str, type] = {"keys": SecaggKeys, "deal": SecaggDeal, "masked": SecaggMasked,
                          "view": SecaggView, "reveal": SecaggReveal, "opening": SecaggOpening}
SENDER_FIELD = {"keys": "worker", "deal": "dealer", "masked": "worker", "view": "worker",
                "reveal": "holder", "opening": "worker"}
Accepted = tuple[dict[str, Any], bool]


class PhaseClosed(RejectedInput):
    """A post to a phase that has not opened yet or has closed."""

    reason = "phase_closed"


class RoundFinalized(RejectedInput):
    reason = "round_finalized"


def _rows(s: Session, run_id: str, r: int, kind: str | None = None) -> list[t.SecaggMessage]:
    q = select(t.SecaggMessage).where(t.SecaggMessage.run_id == run_id,
                                      t.SecaggMessage.round == r)
    if kind is not None:
        q = q.where(t.SecaggMessage.kind == kind)
    return list(s.execute(q.order_by(t.SecaggMessage.id)).scalars())


def start_round(s: Session, spec: RunSpec, r: int, seed: bytes, workers: list[str],
                now: float) -> dict[str, Any]:
    """Deal the sealed submitters into the round's buckets; the phases start now."""
    masked = spec.masked
    assert masked is not None
    body = {"round": r, "buckets": round_buckets(seed, workers, masked["bucket_size"]),
            "started_at": now}
    s.add(t.SecaggMessage(run_id=spec.run_id, round=r, kind="start", sender="", bucket=-1,
                          digest="", body=encode_canonical(body), received_at=now))
    s.flush()
    return body


class Board:
    """One masked round's board as stored: the buckets, the posts and the schedule."""

    def __init__(self, s: Session, spec: RunSpec, r: int, now: float) -> None:
        masked = spec.masked
        if masked is None:
            raise RejectedInput(f"run {spec.run_id} does not mask its updates", "not_masked")
        self.spec, self.round, self.now = spec, r, now
        rows = _rows(s, spec.run_id, r)
        start = [row for row in rows if row.kind == "start"]
        if not start:
            raise RejectedInput(f"round {r}'s buckets are dealt once its beacon is fixed",
                                "wrong_state")
        body = decode_canonical(start[0].body)
        self.buckets: list[list[str]] = body["buckets"]
        self.started_at: float = body["started_at"]
        self.bucket_of = {w: b for b, members in enumerate(self.buckets) for w in members}
        self.posts: dict[str, dict[str, t.SecaggMessage]] = {k: {} for k in KINDS}
        #: The round's other rows: the openings seed's shares and record (ledger/openings.py).
        self.extra: list[t.SecaggMessage] = []
        for row in rows:
            if row.kind in self.posts:
                self.posts[row.kind][row.sender] = row
            elif row.kind != "start":
                self.extra.append(row)
        received = {k: {w: (row.bucket, row.received_at) for w, row in self.posts[k].items()}
                    for k in ("keys", "deal", "masked", "view", "reveal")}
        self.phases: list[Phase]
        self.states: list[BucketState]
        self.phases, self.states = phase_schedule(
            self.started_at, masked["phase_seconds"], self.buckets, received, now,
            max_dropouts=masked["max_dropouts"])

    def wire(self, kind: str, bucket: int | None = None) -> list[dict[str, Any]]:
        return [decode_canonical(row.body) for row in self.posts[kind].values()
                if bucket is None or row.bucket == bucket]

    def view(self, bucket: int | None = None) -> dict[str, Any]:
        """What the API serves: buckets, phases and posts (of one bucket if given)."""
        states = [st for st in self.states if bucket is None or st.index == bucket]
        return {
            "run_id": self.spec.run_id, "round": self.round, "now": self.now,
            "started_at": self.started_at,
            "phases": [p.to_json() for p in self.phases],
            "complete": (len(self.phases) == len(KINDS) - 1
                         and self.phases[-1].closed_at is not None),
            "buckets": [{"index": st.index, "assigned": list(st.assigned),
                         "members": None if st.members is None else list(st.members),
                         "dealers": None if st.dealers is None else list(st.dealers),
                         "survivors": None if st.survivors is None else list(st.survivors),
                         "signers": None if st.signers is None else list(st.signers),
                         "live": st.live} for st in states],
            "posts": {kind: self.wire(kind, bucket) for kind in KINDS},
        }


def _phase_post(board: Board, kind: str, sender: str, bucket: int) -> BucketState:
    phase = open_phase(board.phases, kind)
    if phase is None:
        raise PhaseClosed(f"the {kind} phase of round {board.round} is not open")
    if sender not in phase.expected:
        raise RejectedInput(f"the {kind} phase does not wait for {sender[:12]}", "not_expected")
    if board.bucket_of.get(sender) != bucket:
        raise RejectedInput(f"{sender[:12]} is not in bucket {bucket}", "wrong_bucket")
    return board.states[bucket]


def _check_deal(st: BucketState, msg: SecaggDeal) -> None:
    members = list(st.members or ())
    if (len(msg.seed_share_commitments) != len(members)
            or len(msg.key_share_commitments) != len(members)):
        raise RejectedInput("one seed and one key commitment per bucket member", "malformed")
    if [x["holder"] for x in msg.sealed] != members:
        raise RejectedInput("sealed shares must go to the bucket's members, in order",
                            "malformed")


def _check_keys(msg: SecaggKeys) -> None:
    if not (usable_x25519(msg.enc_public) and usable_x25519(msg.mask_public)):
        raise RejectedInput("an X25519 key of low order agrees no secret", "malformed")


def _check_masked(spec: RunSpec, r: int, st: BucketState, msg: SecaggMasked) -> None:
    if msg.words_bytes != words_file_bytes(spec.num_params):
        raise RejectedInput(f"a masked input is {words_file_bytes(spec.num_params)} bytes",
                            "malformed")
    if msg.dealers_digest != view_digest(spec.run_id, r, st.index, st.members or (),
                                         st.dealers or ()):
        raise RejectedInput("a masked input names other members or dealers than the board's",
                            "malformed")


def _same_view(st: BucketState, msg: SecaggView | SecaggReveal) -> None:
    if (msg.members, msg.dealers, msg.survivors) != (list(st.members or ()),
                                                     list(st.dealers or ()),
                                                     list(st.survivors or ())):
        raise RejectedInput("the view differs from the board's members, dealers or survivors",
                            "malformed")


def _check_reveal(spec: RunSpec, st: BucketState, msg: SecaggReveal) -> None:
    survivors = list(st.survivors or ())
    _same_view(st, msg)
    masked = spec.masked
    assert masked is not None
    k = bucket_threshold(masked["max_dropouts"], len(st.assigned))
    if len(view_signers(msg)) < k or len(msg.view_signatures) > len(survivors):
        raise RejectedInput(f"a reveal carries k = {k} survivors' signatures on its view, "
                            "each once", "malformed")
    dropped = set(st.dealers or ()) - set(survivors)
    seed = [x["dealer"] for x in msg.seed_shares]
    key = [x["dealer"] for x in msg.key_shares]
    if (len(set(seed)) != len(seed) or len(set(key)) != len(key)
            or not set(seed) <= set(survivors) or not set(key) <= dropped):
        raise RejectedInput("seed shares of survivors and key shares of dropped dealers only, "
                            "each once", "malformed")


def accept_post(s: Session, spec: RunSpec, rnd: t.Round, kind: str, signed: Signed[Any],
                now: float, *, opened: set[str] | None = None, store: bool = True) -> Accepted:
    """Store one board post; idempotent for an exact resend. ``opened``: the workers the
    round's challenges spot-check (only they post an ``opening``); ``store=False`` runs
    every check and writes nothing (the reply says whether it would be new)."""
    msg = signed.message
    sender = getattr(msg, SENDER_FIELD[kind])
    if signed.signer != sender:
        raise RejectedInput(f"a {kind} post is signed by its sender", "bad_signature")
    if rnd.finalized_at is not None:
        raise RoundFinalized(f"round {rnd.round} is finalized")
    board = Board(s, spec, rnd.round, now)
    stored = board.posts[kind].get(sender)
    if stored is not None:
        if stored.digest == signed.digest:
            return {"kind": kind, "already": True}, False
        raise RejectedInput(f"{sender[:12]} already posted another {kind}", "duplicate")
    if kind == "opening":
        if sender not in board.posts["masked"] or board.bucket_of.get(sender) != msg.bucket:
            raise RejectedInput("an opening follows its sender's masked input", "wrong_state")
        if opened is None or sender not in opened:
            raise RejectedInput(f"{sender[:12]} is not spot-checked this round",
                                "not_challenged")
    else:
        st = _phase_post(board, kind, sender, msg.bucket)
        if kind == "keys":
            _check_keys(msg)
        elif kind == "deal":
            _check_deal(st, msg)
        elif kind == "masked":
            _check_masked(spec, rnd.round, st, msg)
        elif kind == "view":
            _same_view(st, msg)
        elif kind == "reveal":
            _check_reveal(spec, st, msg)
    if not store:
        return {"kind": kind, "already": False}, True
    s.add(t.SecaggMessage(run_id=spec.run_id, round=rnd.round, kind=kind, sender=sender,
                          bucket=msg.bucket, digest=signed.digest, body=signed.encode(),
                          received_at=now))
    s.flush()
    return {"kind": kind, "already": False}, True
