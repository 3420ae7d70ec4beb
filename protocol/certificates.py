"""Checking quorum certificates: the only way a node adopts a model.

A certificate is ``{"certified": CertifiedState body, "signers": [validator
indices], "signature": aggregate BLS signature}``. It is valid when the
signers are distinct indices of the run's validator set, at least ``quorum``
of them, and one FastAggregateVerify over their (proof-of-possession checked)
keys accepts the signature on the certified state's signing root.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import bls
from . import fields as f
from .errors import RejectedInput
from .messages import CertifiedState, RunSpec
from .statefile import json_saver, load_json_state

CERTIFICATE = f.record(
    {
        "certified": lambda v, p: CertifiedState.from_body(v).to_body(),
        "signers": f.list_of(f.integer(0, 255), 256),
        "signature": f.BLS_SIGNATURE,
    }
)


class InvalidCertificate(RejectedInput):
    reason = "invalid_certificate"


def verify_certificate(cert: Any, spec: RunSpec, *, base_of_round: int) -> CertifiedState:
    """The certified state if ``cert`` is a valid quorum certificate for that round."""
    checked = CERTIFICATE(cert, "certificate")
    state = CertifiedState.from_body(checked["certified"])
    signers = checked["signers"]
    if state.run_id != spec.run_id or state.round != base_of_round:
        raise InvalidCertificate(f"certificate is for {state.run_id} round {state.round}")
    if len(set(signers)) != len(signers):
        raise InvalidCertificate("certificate repeats a signer")
    if any(i >= len(spec.validators) for i in signers):
        raise InvalidCertificate("certificate names a signer outside the validator set")
    if len(signers) < spec.quorum:
        raise InvalidCertificate(f"{len(signers)} signers, the quorum is {spec.quorum}")
    pubs = [bytes.fromhex(spec.validators[i]["bls"]) for i in signers]
    if not bls.fast_aggregate_verify(pubs, state.signing_root(),
                                     bytes.fromhex(checked["signature"])):
        raise InvalidCertificate("aggregate signature does not verify")
    return state


def shard_sources_problem(num_shards: int, sources: list[dict[str, Any]] | None,
                          listed: list[str | None] | None, proven_faulty: set[int]
                          ) -> str | None:
    """Why a certified state's shard sources do not follow the board, or None.

    A sharded run's certified state takes each shard from the fixed list (``result`` =
    its entry, never a shard in ``proven_faulty``: a quorum of findings called it faulty)
    or from a recomputation of a shard the list left empty or a quorum proved faulty
    (``result`` null); a run that does not shard (``num_shards`` 0) names no sources. The
    ledger holds a certificate back until this holds, and the audit checks it again
    (specs/secure-averaging.md E.1, step 4)."""
    if not num_shards:
        return None if sources is None else "certified shard sources in a run that does not shard"
    if sources is None or [x["shard"] for x in sources] != list(range(num_shards)):
        return "the certified state does not name each shard's source"
    entries = listed or [None] * num_shards
    for x in sources:
        k = x["shard"]
        if x["result"] is not None and (x["result"] != entries[k] or k in proven_faulty):
            return (f"shard {k} certified from a result the fixed list does not name, or "
                    "one a quorum proved faulty")
        if x["result"] is None and entries[k] is not None and k not in proven_faulty:
            return f"shard {k} recomputed although listed and never proven faulty"
    return None


def base_round(info: dict[str, Any]) -> int:
    """The certified round of a served round's base: ``CertifiedState.round`` of its base
    certificate, 0 for the genesis model (checked by :func:`certified_base`)."""
    cert = info.get("base_certificate")
    return 0 if info["round"] == 0 or cert is None else int(cert["certified"]["round"])


def certified_base(spec: RunSpec, info: dict[str, Any], *, newest_certified: int = 0
                   ) -> tuple[str, str | None]:
    """(model hash, outer-state hash) of a round's base as its certificate vouches for them.

    ``info`` is the round as the ledger serves it (``round``, ``base_model_hash``,
    ``outer_state_hash``, ``base_certificate``). Round 0 starts from the signed spec's
    genesis model with zero outer momentum (no outer-state file). ``newest_certified`` is
    the newest certified round this node has seen (:func:`base_round` of the bases it
    took): a base older than that is a rollback (``invalid_base``), whatever the ledger
    serves as the newest certificate before the round.
    """
    r, cert = info["round"], info.get("base_certificate")
    if r == 0 or cert is None:  # round 0, or every round before it was voided
        if newest_certified > 0:
            raise RejectedInput(f"round {r} starts from the genesis model, but this node saw "
                                f"round {newest_certified} certified: a rollback",
                                "invalid_base")
        if info["base_model_hash"] != spec.genesis_model_hash or info.get(
                "outer_state_hash") is not None:
            raise RejectedInput(f"round {r} starts from neither the genesis model nor a "
                                "certified one", "invalid_base")
        return spec.genesis_model_hash, None
    # The newest certificate before round r: round r-1's, or an earlier one's when the
    # rounds between were voided (specs/protocol.md 6; the audit checks each void).
    try:
        certified_round = CertifiedState.from_body(cert["certified"]).round
    except (KeyError, TypeError) as exc:
        raise InvalidCertificate(f"malformed base certificate: {exc}") from None
    if not 1 <= certified_round <= r:
        raise InvalidCertificate(f"round {r}'s base certificate is for round {certified_round}")
    if certified_round < newest_certified:
        raise RejectedInput(f"round {r}'s base is round {certified_round}'s certified model, "
                            f"but this node saw round {newest_certified} certified: a rollback",
                            "invalid_base")
    state = verify_certificate(cert, spec, base_of_round=certified_round)
    if (state.model_hash, state.outer_state_hash) != (
            info["base_model_hash"], info["outer_state_hash"]):
        raise RejectedInput("round's base differs from its certificate", "invalid_base")
    return state.model_hash, state.outer_state_hash


#: Where a node with a state directory keeps its :class:`CertifiedMark`.
CERTIFIED_MARK_FILE = "certified-mark.json"


class CertifiedMark:
    """The newest certified round (:func:`base_round`) a node took a base from, per run:
    what :func:`certified_base` holds the ledger to (``newest_certified``), so it cannot
    roll the node back to an older model, after a restart too when kept in a file.

    Sans I/O, as ``board.SignedOnce``: ``save`` gets the new state whenever a mark rises;
    :meth:`in_file` keeps it in a JSON file."""

    def __init__(self, state: dict[str, int] | None = None,
                 save: Callable[[dict[str, int]], None] | None = None) -> None:
        self.state: dict[str, int] = dict(state or {})
        self._save = save

    def of(self, run_id: str) -> int:
        """The mark for ``run_id`` (0: nothing certified seen yet)."""
        return self.state.get(run_id, 0)

    def raise_to(self, run_id: str, round_index: int) -> None:
        """Raise the mark to ``round_index`` (never lowers it), saving before returning."""
        if round_index > self.of(run_id):
            self.state[run_id] = round_index
            if self._save is not None:
                self._save(dict(self.state))

    @classmethod
    def in_file(cls, path: Path | None) -> CertifiedMark:
        """A mark kept in the JSON file ``path`` (read now, rewritten atomically when it
        rises); in memory only when ``path`` is None."""
        if path is None:
            return cls()
        state = load_json_state(path, lambda s: all(
            isinstance(k, str) and type(v) is int and v >= 0 for k, v in s.items()),
            "a certified-round mark")
        return cls(state, json_saver(path))
