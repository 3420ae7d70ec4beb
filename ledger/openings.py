"""A masked round's openings seed: the ledger's part (protocol/openings.py).

Once every bucket's masked phase has closed, validators post ``OpeningsShare``s over the
digest of the committed masked inputs. The ledger takes a share only over its own board's
inputs (``wrong_masked`` otherwise, so validators shown different boards never make one
seed) and only with a signature that verifies (a partial under the validator's public key
share in a threshold-beacon run, its BLS key otherwise); the first quorum fixes the seed,
and the store then fixes the round's checks from it. Rows live on the round's board
(``secagg_messages``: kind ``openings_share`` per validator, ``openings_fixed`` once).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session
from veritrain.protocol import bls, dkg
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import OpeningsShare, RunSpec, Signed
from veritrain.protocol.openings import (
    committed_inputs,
    inputs_digest,
    openings_root,
    seed_of_shares,
    seed_of_signature,
)

from . import schema as t
from .admission import BlsVerify
from .secagg import Board, PhaseClosed, RoundFinalized

SHARE, FIXED = "openings_share", "openings_fixed"


class WrongMasked(RejectedInput):
    """A share over other committed masked inputs than this board's."""

    reason = "wrong_masked"


def board_inputs(board: Board) -> list[list[Any]] | None:
    """The committed inputs of ``board`` once its masked phase has closed, else None."""
    phases = {p.name: p for p in board.phases}
    masked = phases.get("masked")
    if masked is None or masked.closed_at is None:
        return None
    return committed_inputs((row.bucket, sender, row.digest)
                            for sender, row in board.posts["masked"].items())


def state(board: Board) -> dict[str, Any]:
    """What the board view serves: the inputs and their digest (once committed), the
    shares posted (signed wires) and the fixed seed's record (or None)."""
    inputs = board_inputs(board)
    rows = [row for row in board.extra if row.kind in (SHARE, FIXED)]
    fixed = next((decode_canonical(row.body) for row in rows if row.kind == FIXED), None)
    return {"inputs": inputs, "masked": None if inputs is None else inputs_digest(inputs),
            "shares": [decode_canonical(row.body) for row in rows if row.kind == SHARE],
            "fixed": fixed}


def check_share(s: Session, spec: RunSpec, rnd: t.Round, signed: Signed[OpeningsShare],
                now: float) -> tuple[Board, list[list[Any]], dict[str, Any] | None]:
    """A share's cheap checks (round not finalized, masked inputs committed, over the
    board's own inputs digest, no other share of its validator): raises the refusal;
    returns (the board, its committed inputs, the board's state for an exact resend else
    None)."""
    msg = signed.message
    if rnd.finalized_at is not None:
        raise RoundFinalized(f"round {rnd.round} is finalized")
    board = Board(s, spec, rnd.round, now)
    inputs = board_inputs(board)
    if inputs is None:
        raise PhaseClosed(f"round {rnd.round}'s masked inputs are not committed yet: its "
                          "openings are drawn after")
    digest = inputs_digest(inputs)
    if msg.masked != digest:
        raise WrongMasked(f"the share signs masked inputs {msg.masked[:12]}, the board's are "
                          f"{digest[:12]}")
    for row in board.extra:
        if row.kind == SHARE and row.sender == signed.signer:
            if row.digest == signed.digest:
                return board, inputs, state(board)
            raise RejectedInput(f"validator {msg.validator[:12]} already posted another "
                                "openings share", "duplicate")
    return board, inputs, None


def accept_share(s: Session, spec: RunSpec, rnd: t.Round, idx: int,
                 signed: Signed[OpeningsShare], public_key: str, now: float,
                 group: bool, verify: BlsVerify = bls.verify
                 ) -> tuple[dict[str, Any], bool, dict[str, Any] | None]:
    """Store validator ``idx``'s share (``public_key``: its public key share in a
    threshold run, ``group`` True, else its BLS key) once :func:`check_share` passed;
    fix the seed at the first quorum. ``verify`` is ``bls.verify`` or a cache of it (the
    store's, filled off the writer thread). Returns (reply, new, the fixed record when
    this share fixed it)."""
    msg = signed.message
    board, inputs, resent = check_share(s, spec, rnd, signed, now)
    if resent is not None:
        return resent, False, None
    digest = inputs_digest(inputs)
    sender = signed.signer
    if not verify(bytes.fromhex(public_key), openings_root(spec.run_id, rnd.round, digest),
                  bytes.fromhex(msg.share)):
        raise RejectedInput(f"validator {idx}'s openings share does not verify", "bad_signature")
    row = t.SecaggMessage(run_id=spec.run_id, round=rnd.round, kind=SHARE, sender=sender,
                          bucket=-1, digest=signed.digest, body=signed.encode(),
                          received_at=now)
    s.add(row)
    s.flush()
    board.extra.append(row)  # the board as stored now, without reading it again
    fixed = None
    if not any(row.kind == FIXED for row in board.extra):
        index = {v["ed25519"]: k for k, v in enumerate(spec.validators)}
        got = {index[row.sender]: decode_canonical(row.body)["body"]["share"]
               for row in board.extra if row.kind == SHARE and row.sender in index}
        if len(got) >= spec.quorum:
            chosen = dict(sorted(got.items())[: spec.quorum])
            if group:
                sig = dkg.combine({k: bytes.fromhex(v) for k, v in chosen.items()},
                                  spec.quorum)
                fixed = {"signature": sig.hex(), "signers": sorted(chosen),
                         "seed": seed_of_signature(sig).hex()}
            else:
                fixed = {"signers": sorted(chosen), "shares": [chosen[k] for k in sorted(chosen)],
                         "seed": seed_of_shares([bytes.fromhex(chosen[k])
                                                 for k in sorted(chosen)]).hex()}
            fixed = {"round": rnd.round, "masked": digest, "inputs": inputs, **fixed}
            row = t.SecaggMessage(run_id=spec.run_id, round=rnd.round, kind=FIXED, sender="",
                                  bucket=-1, digest="", body=encode_canonical(fixed),
                                  received_at=now)
            s.add(row)
            s.flush()
            board.extra.append(row)
    return state(board), True, fixed
