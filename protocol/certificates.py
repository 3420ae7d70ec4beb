"""Checking quorum certificates: the only way a node adopts a model.

A certificate is ``{"certified": CertifiedState body, "signers": [validator
indices], "signature": aggregate BLS signature}``. It is valid when the
signers are distinct indices of the run's validator set, at least ``quorum``
of them, and one FastAggregateVerify over their (proof-of-possession checked)
keys accepts the signature on the certified state's signing root.
"""

from __future__ import annotations

from typing import Any

from . import bls
from . import fields as f
from .errors import RejectedInput
from .messages import CertifiedState, RunSpec

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


def certified_base(spec: RunSpec, info: dict[str, Any]) -> tuple[str, str | None]:
    """(model hash, outer-state hash) of a round's base as its certificate vouches for them.

    ``info`` is the round as the ledger serves it (``round``, ``base_model_hash``,
    ``outer_state_hash``, ``base_certificate``). Round 0 starts from the signed spec's
    genesis model with zero outer momentum (no outer-state file).
    """
    r = info["round"]
    if r == 0:
        if info["base_model_hash"] != spec.genesis_model_hash:
            raise RejectedInput("round 0 does not start from the genesis model", "invalid_base")
        return spec.genesis_model_hash, None
    state = verify_certificate(info["base_certificate"], spec, base_of_round=r)
    if (state.model_hash, state.outer_state_hash) != (
            info["base_model_hash"], info["outer_state_hash"]):
        raise RejectedInput("round's base differs from its certificate", "invalid_base")
    return state.model_hash, state.outer_state_hash
