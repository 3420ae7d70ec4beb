"""The ledger's part in the DKG and the threshold beacon: a bulletin board, nothing more.

The ledger stores and serves the DKG's signed posts (it refuses those that do not open
or are not signed by the validator they name: that only saves space, every validator
checks every post again) and, per round, collects partial signatures, checks each
against its validator's public share and fixes the beacon once ``quorum`` verified:
``{"signature": group signature, "signers": [...]}``. Nobody takes the fixed beacon on
its word: ``dkg.verify_threshold_beacon`` checks the signature against the group key,
and it is the same whichever quorum signed (specs/protocol.md 5.4a).
:class:`DkgBoard` keeps a board in memory (tests); the functions below keep it in the
``dkg_posts`` table for ``LedgerStore`` and its HTTP routes, with the phase deadlines.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session
from veritrain.protocol import dkg
from veritrain.protocol.board import open_member_post
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import RunSpec, Signed

from . import schema as t

_DKG_KINDS: dict[str, tuple[type[Any], str]] = {
    "dkg_keys": (dkg.DkgKeys, "validator"),
    "dkg_deal": (dkg.DkgDeal, "dealer"),
    "dkg_complaint": (dkg.DkgComplaint, "validator"),
    "dkg_justification": (dkg.DkgJustification, "dealer"),
    "dkg_result": (dkg.DkgResult, "validator"),
}


class DkgBoard:
    """One run's DKG posts and threshold beacons."""

    def __init__(self, spec: RunSpec) -> None:
        self.spec = spec
        self.members = {v["ed25519"] for v in spec.validators}
        self.index = {v["ed25519"]: k for k, v in enumerate(spec.validators)}
        self.posts: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in _DKG_KINDS}
        self.result: dkg.DkgResult | None = None
        self.partials: dict[int, dict[int, dict[str, Any]]] = {}
        self.beacons: dict[int, dict[str, Any]] = {}

    def post(self, wire: Any) -> None:
        """Store a DKG post (by its digest); ``BoardFault`` if it does not open or is not
        its validator's own."""
        kind = wire.get("kind") if isinstance(wire, dict) else None
        if kind not in _DKG_KINDS:
            raise dkg.DkgFault(f"not a DKG post: {kind!r}")
        cls, field = _DKG_KINDS[kind]
        signed = open_member_post(wire, cls, member_field=field, members=self.members,
                                  run_id=self.spec.run_id, round_index=0)
        self.posts[kind][signed.digest] = signed.to_wire()

    def served(self, kind: str) -> list[dict[str, Any]]:
        return list(self.posts[kind].values())

    def fix_group(self) -> dkg.DkgResult:
        """The run's group key: the result a quorum of validators signed (DkgFault if none)."""
        self.result = dkg.group_result_of(self.spec.validators, self.spec.quorum,
                                          self.spec.run_id, self.served("dkg_result"))
        return self.result

    def post_partial(self, wire: Any, *, sealed: str, participants: str
                     ) -> dict[str, Any] | None:
        """A validator's partial for the round named in it, against the round's sealed list
        and participant view digests; refused (DkgFault / BoardFault with the reason) when it does not verify
        against its public share, so a bad partial never blocks the round. Returns the
        fixed beacon once ``quorum`` good partials are in."""
        if self.result is None:
            raise dkg.DkgFault("the run has no group key yet")
        r = wire.get("body", {}).get("round") if isinstance(wire, dict) else None
        if type(r) is not int:
            raise dkg.DkgFault("a partial without a round")
        signed = open_member_post(wire, dkg.BeaconPartial, member_field="validator",
                                  members=self.members, run_id=self.spec.run_id,
                                  round_index=r, sealed=sealed, participants=participants)
        j = self.index[signed.message.validator]
        root = dkg.threshold_beacon_root(self.spec.run_id, r, sealed, participants)
        if not dkg.partial_verifies(self.result.public_shares[j], root,
                                    bytes.fromhex(signed.message.partial)):
            raise dkg.DkgFault(f"validator {j}'s partial signature does not verify against its "
                               "public key share")
        if r in self.beacons:
            return self.beacons[r]
        got = self.partials.setdefault(r, {})
        got[j] = signed.to_wire()
        if len(got) >= self.spec.quorum:
            chosen = dict(sorted(got.items())[: self.spec.quorum])
            sig = dkg.combine({k: bytes.fromhex(w["body"]["partial"]) for k, w in chosen.items()},
                              self.spec.quorum)
            self.beacons[r] = {"signature": sig.hex(), "signers": sorted(chosen)}
            return self.beacons[r]
        return None


# --------------------------------------------------------------------------- SQL board

#: The DKG's phases in order (each a kind of board post).
PHASES = tuple(_DKG_KINDS)
GROUP, PARTIAL = "dkg_group", "beacon_partial"


class PhaseClosed(RejectedInput):
    """A DKG post to a phase that has not opened yet or has closed."""

    reason = "phase_closed"


def phase_seconds(spec: RunSpec) -> float:
    """How long a DKG phase waits for late validators: one round's time."""
    return float(spec.schedule["round_seconds"])


def _rows(s: Session, run_id: str, r: int, kinds: tuple[str, ...]) -> list[t.DkgPost]:
    return list(s.execute(select(t.DkgPost).where(
        t.DkgPost.run_id == run_id, t.DkgPost.round == r, t.DkgPost.kind.in_(kinds))
        .order_by(t.DkgPost.id)).scalars())


def schedule(spec: RunSpec, started_at: float, rows: list[t.DkgPost], now: float
             ) -> list[dict[str, Any]]:
    """The phases as the stored posts and the clock make them: phase k opens when phase
    k-1 closes (the first at run creation); it closes when every validator it waits for
    has posted (the justification phase waits for the accused dealers that dealt), or at
    its deadline once ``quorum`` posted (the justification phase: at its deadline). A
    phase still under ``quorum`` posts at its deadline closes ``short``: the DKG failed
    and no later phase opens, so a DKG ends within 5 x ``phase_seconds`` either way."""
    index = {v["ed25519"]: k for k, v in enumerate(spec.validators)}
    got: dict[str, dict[int, float]] = {k: {} for k in PHASES}
    accused: set[int] = set()
    for row in rows:
        if row.kind in got and row.sender in index:
            got[row.kind][index[row.sender]] = row.received_at
            if row.kind == "dkg_complaint":
                accused.update(decode_canonical(row.body)["body"]["accused"])
    everyone = set(range(len(spec.validators)))
    out: list[dict[str, Any]] = []
    opened: float | None = started_at
    for kind in PHASES:
        if opened is None:
            out.append({"kind": kind, "opened_at": None, "deadline": None, "closed_at": None,
                        "short": False})
            continue
        posted = got[kind]
        if kind == "dkg_justification":
            expected, need = accused & set(got["dkg_deal"]), 0
        else:
            expected, need = everyone, spec.quorum
        deadline = opened + phase_seconds(spec)
        closed: float | None = None
        short = False
        if expected <= set(posted):
            closed = max([opened, *(posted[j] for j in expected)])
        elif now >= deadline and len(posted) >= need:
            closed = max([deadline, *sorted(posted.values())[need - 1:need]])
        elif now >= deadline:
            closed, short = deadline, True
        out.append({"kind": kind, "opened_at": opened, "deadline": deadline,
                    "closed_at": closed, "short": short})
        opened = None if short else closed
    return out


def failure(phases: list[dict[str, Any]], group: dict[str, Any] | None) -> str | None:
    """Why the DKG failed (a phase closed under ``quorum`` posts, or the result phase closed
    with no result a quorum signed), or None while it runs or once the group is fixed."""
    if group is not None:
        return None
    for p in phases:
        if p.get("short"):
            return f"the {p['kind']} phase closed with fewer posts than the quorum"
    if phases[-1]["closed_at"] is not None:
        return "no DKG result was signed by a quorum of validators"
    return None


def open_phase(phases: list[dict[str, Any]]) -> str | None:
    return next((p["kind"] for p in phases
                 if p["opened_at"] is not None and p["closed_at"] is None), None)


def group_row(s: Session, run_id: str) -> dict[str, Any] | None:
    rows = _rows(s, run_id, 0, (GROUP,))
    return decode_canonical(rows[0].body) if rows else None


def failed(s: Session, spec: RunSpec, started_at: float, now: float) -> str | None:
    """:func:`failure` of the run's DKG as the stored posts and the clock make it (the
    ledger's tick asks every active threshold run: once the group is fixed, one indexed
    lookup, its body never decoded)."""
    if s.execute(select(t.DkgPost.id).where(
            t.DkgPost.run_id == spec.run_id, t.DkgPost.round == 0,
            t.DkgPost.kind == GROUP).limit(1)).first() is not None:
        return None
    return failure(schedule(spec, started_at, _rows(s, spec.run_id, 0, PHASES), now), None)


def group_result(s: Session, run_id: str) -> dkg.DkgResult | None:
    """The group the ledger fixed (from the results a quorum signed), or None."""
    group = group_row(s, run_id)
    if group is None:
        return None
    return dkg.DkgResult(run_id=run_id, round=0, validator="", qualified=group["qualified"],
                         deals=group["deals"], group_key=group["group_key"],
                         public_shares=group["public_shares"])


def view(s: Session, spec: RunSpec, started_at: float, now: float, *, posts: bool = True
         ) -> dict[str, Any]:
    """What ``GET /v1/runs/{run}/dkg`` serves: the phases, every post by kind (null with
    ``posts`` False: a poll waiting for a phase needs none), the group."""
    rows = _rows(s, spec.run_id, 0, PHASES)
    phases = schedule(spec, started_at, rows, now)
    group = group_row(s, spec.run_id)
    current = open_phase(phases)
    return {"run_id": spec.run_id, "now": now, "phases": phases, "phase": current,
            "failed": (why := failure(phases, group)) is not None, "failure": why,
            "group": group,
            "posts": {k: [decode_canonical(r.body) for r in rows if r.kind == k]
                      for k in PHASES} if posts else None}


def accept_post(s: Session, spec: RunSpec, wire: Any, started_at: float, now: float
                ) -> tuple[dict[str, Any], Signed[Any] | None, dict[str, Any] | None]:
    """Store one DKG post: opened against the run's validators (signature in its domain,
    signer = the validator it names, round 0), to the open phase, one per validator and
    phase (an exact resend is answered as stored). Returns (reply, the post if new, the
    group body if this post let the ledger fix the group)."""
    if not spec.threshold_beacon:
        raise RejectedInput(f"run {spec.run_id} uses the quorum-of-shares beacon",
                            "wrong_state")
    kind = wire.get("kind") if isinstance(wire, dict) else None
    if kind not in _DKG_KINDS:
        raise RejectedInput(f"not a DKG post: {kind!r}", "malformed")
    cls, field = _DKG_KINDS[kind]
    signed = open_member_post(wire, cls, member_field=field,
                              members={v["ed25519"] for v in spec.validators},
                              run_id=spec.run_id, round_index=0)
    sender = signed.signer
    stored = s.execute(select(t.DkgPost).where(
        t.DkgPost.run_id == spec.run_id, t.DkgPost.round == 0, t.DkgPost.kind == kind,
        t.DkgPost.sender == sender)).scalar_one_or_none()
    if stored is not None:
        if stored.digest == signed.digest:
            return {"kind": kind, "already": True}, None, None
        raise RejectedInput(f"{sender[:12]} already posted another {kind}", "duplicate")
    phase = open_phase(schedule(spec, started_at, _rows(s, spec.run_id, 0, PHASES), now))
    if phase != kind:
        raise PhaseClosed(f"the {kind} phase is not open (open: {phase})")
    s.add(t.DkgPost(run_id=spec.run_id, round=0, kind=kind, sender=sender,
                    digest=signed.digest, body=signed.encode(), received_at=now))
    s.flush()
    group = None
    if kind == "dkg_result" and group_row(s, spec.run_id) is None:
        group = _try_fix_group(s, spec, now)
    return {"kind": kind, "already": False, "group": group is not None}, signed, group


def _try_fix_group(s: Session, spec: RunSpec, now: float) -> dict[str, Any] | None:
    wires = [decode_canonical(r.body) for r in _rows(s, spec.run_id, 0, ("dkg_result",))]
    try:
        agreed = dkg.group_result_of(spec.validators, spec.quorum, spec.run_id, wires)
    except dkg.DkgFault:
        return None
    signed_it = [w for w in wires if (tuple(w["body"]["qualified"]), tuple(w["body"]["deals"]),
                                      w["body"]["group_key"],
                                      tuple(w["body"]["public_shares"])) == agreed.agreed()]
    body = {"group_key": agreed.group_key, "qualified": list(agreed.qualified),
            "deals": list(agreed.deals), "public_shares": list(agreed.public_shares),
            "results": signed_it}
    s.add(t.DkgPost(run_id=spec.run_id, round=0, kind=GROUP, sender="", digest="",
                    body=encode_canonical(body), received_at=now))
    s.flush()
    return body


def partials(s: Session, run_id: str, r: int) -> list[dict[str, Any]]:
    return [decode_canonical(row.body) for row in _rows(s, run_id, r, (PARTIAL,))]


def stored_partial(s: Session, run_id: str, r: int, sender: str) -> t.DkgPost | None:
    return s.execute(select(t.DkgPost).where(
        t.DkgPost.run_id == run_id, t.DkgPost.round == r, t.DkgPost.kind == PARTIAL,
        t.DkgPost.sender == sender)).scalar_one_or_none()


def store_partial(s: Session, signed: Signed[dkg.BeaconPartial], now: float) -> None:
    msg = signed.message
    s.add(t.DkgPost(run_id=msg.run_id, round=msg.round, kind=PARTIAL, sender=signed.signer,
                    digest=signed.digest, body=signed.encode(), received_at=now))
    s.flush()


def combine_stored(s: Session, spec: RunSpec, r: int) -> dict[str, Any] | None:
    """The fixed threshold beacon ``{"signature", "signers"}`` once ``quorum`` partials
    (each verified before it was stored) are in: the lowest-indexed quorum, which gives
    the same signature as any other."""
    index = {v["ed25519"]: k for k, v in enumerate(spec.validators)}
    got = {index[row.sender]: bytes.fromhex(decode_canonical(row.body)["body"]["partial"])
           for row in _rows(s, spec.run_id, r, (PARTIAL,)) if row.sender in index}
    if len(got) < spec.quorum:
        return None
    chosen = dict(sorted(got.items())[: spec.quorum])
    return {"signature": dkg.combine(chosen, spec.quorum).hex(), "signers": sorted(chosen)}
