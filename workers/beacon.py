"""A worker's check of a round's fixed beacon: it takes nothing on the ledger's word.

Both kinds of beacon (specs/protocol.md 5.4 and 5.4a) give the seed only after the
worker has checked it against the signed run spec and the sealed list it was served:
a quorum-of-shares beacon against the validators' BLS keys and the signers' envelopes;
a threshold beacon against the group key a quorum of the run's validators signed in
the DkgResults served (``dkg.group_result_of``, each post opened against the spec's
validators), as the group's BLS signature over (run, r, sealed list).
"""

from __future__ import annotations

import asyncio
from typing import Any

from veritrain.ledger.client import LedgerClient
from veritrain.protocol import dkg
from veritrain.protocol.beacon import verify_fixed_beacon
from veritrain.protocol.messages import RunSpec


async def verified_seed(client: LedgerClient, spec: RunSpec, r: int, served: dict[str, Any],
                        sealed: str) -> bytes:
    """The seed of round r from ``served`` (the ``/beacon`` reply, its beacon fixed) once it
    checks out for the sealed list digest ``sealed``; RejectedInput otherwise."""
    if not spec.threshold_beacon:
        return await asyncio.to_thread(
            verify_fixed_beacon, spec.validators, spec.quorum, spec.run_id, r,
            served["beacon"], sealed=sealed, envelopes=served.get("envelopes"))
    results = (await client.get_json(f"/v1/runs/{spec.run_id}/dkg"))["posts"]["dkg_result"]

    def check() -> bytes:
        group = dkg.group_result_of(spec.validators, spec.quorum, spec.run_id, results)
        return dkg.verify_threshold_beacon(group.group_key, spec.run_id, r, served["beacon"],
                                           sealed=sealed)

    return await asyncio.to_thread(check)
