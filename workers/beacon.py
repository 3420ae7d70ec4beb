"""A worker's check of a round's fixed beacon: it takes nothing on the ledger's word.

Both kinds of beacon (specs/protocol.md 5.4 and 5.4a) give the seed only after the
worker has checked it against the signed run spec and the sealed list it was served:
a quorum-of-shares beacon against the validators' BLS keys and the signers' envelopes;
a threshold beacon against the group key a quorum of the run's validators signed in
the DkgResults served (``dkg.group_result_of``, each post opened against the spec's
validators), as the group's BLS signature over (run, r, sealed list, participant view).
The participant view is the one the ledger serves with the sealed list: it counts only if
the validators signed its digest, and a worker it excludes knows the round will reject it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from veritrain.ledger.client import LedgerClient
from veritrain.protocol import dkg
from veritrain.protocol.beacon import (
    participants_digest,
    sealed_list_digest_of,
    verify_fixed_beacon,
)
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import RunSpec
from veritrain.protocol.openings import (
    inputs_digest,
    survivor_buckets,
    verified_inputs,
    verify_openings,
)


def round_inputs(sealed_reply: dict[str, Any], me: str) -> tuple[str, str]:
    """(sealed list digest, participant view digest) of the ledger's ``/submissions``
    reply for worker ``me``; RejectedInput ``excluded`` when the view the ledger serves
    excludes this worker (the worker holds its registration, so the ledger or the
    validators are wrong, and the round would reject it)."""
    excluded = sealed_reply.get("excluded")
    if not isinstance(excluded, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in excluded.items()):
        raise RejectedInput("the sealed list comes without a participant view", "malformed")
    if me in excluded:
        raise RejectedInput(f"the round's participant view excludes this worker "
                            f"({excluded[me]})", "excluded")
    return sealed_list_digest_of(sealed_reply["submissions"]), participants_digest(excluded)


async def verified_seed(client: LedgerClient, spec: RunSpec, r: int, served: dict[str, Any],
                        sealed: str, participants: str) -> bytes:
    """The seed of round r from ``served`` (the ``/beacon`` reply, its beacon fixed) once it
    checks out for the sealed list digest ``sealed`` and the participant view digest
    ``participants``; RejectedInput otherwise."""
    if not spec.threshold_beacon:
        return await asyncio.to_thread(
            verify_fixed_beacon, spec.validators, spec.quorum, spec.run_id, r,
            served["beacon"], sealed=sealed, participants=participants,
            envelopes=served.get("envelopes"))
    results = (await client.get_json(f"/v1/runs/{spec.run_id}/dkg"))["posts"]["dkg_result"]

    def check() -> bytes:
        group = dkg.group_result_of(spec.validators, spec.quorum, spec.run_id, results)
        return dkg.verify_threshold_beacon(group.group_key, spec.run_id, r, served["beacon"],
                                           sealed=sealed, participants=participants)

    return await asyncio.to_thread(check)


async def verified_openings(client: LedgerClient, spec: RunSpec, r: int, view: dict[str, Any]
                            ) -> tuple[bytes, list[list[str]]]:
    """A masked round's openings seed and the survivor sets it is drawn over, from the board
    ``view`` (``GET .../secagg``, its openings fixed): checked over the committed inputs
    this party verified itself (protocol/openings.py ``verified_inputs``), against the group
    key a quorum of validators signed, or the validators' BLS keys. RejectedInput
    ``invalid_openings`` otherwise."""
    inputs = verified_inputs(spec.run_id, r, view)
    results = ((await client.get_json(f"/v1/runs/{spec.run_id}/dkg"))["posts"]["dkg_result"]
               if spec.threshold_beacon else None)

    def check() -> bytes:
        group = (None if results is None else
                 dkg.group_result_of(spec.validators, spec.quorum, spec.run_id, results).group_key)
        return verify_openings(spec.validators, spec.quorum, group, spec.run_id, r,
                               view["openings"]["fixed"], inputs_digest(inputs))

    return await asyncio.to_thread(check), survivor_buckets(inputs)
