"""Who a validator counts as a worker of a round: the registered keys the chain admits
(protocol/membership.py), never the ledger's participant list alone."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from veritrain.protocol.membership import AdmissionPolicy, fold_rows
from veritrain.protocol.messages import RunSpec

log = logging.getLogger(__name__)


def admitted_of(spec: RunSpec, r: int, registered: Iterable[str], served: Any,
                faults: list[str] | None = None) -> set[str]:
    """Those of ``registered`` that the membership rows ``served`` (the ledger's
    ``GET /membership`` reply) admit in round ``r``; every row is checked (its signer is
    the key the run's policy gives its kind) and one that is not is skipped as a fault.
    Under the ``open`` policy every registered key."""
    if AdmissionPolicy.of_run(spec).open:
        return set(registered)
    rows = served.get("rows") if isinstance(served, dict) else None
    state = fold_rows(spec, rows if isinstance(rows, list) else [], faults)
    return state.admitted(registered, r)


async def admitted_workers(client: Any, spec: RunSpec, r: int, registered: set[str]
                           ) -> set[str]:
    """:func:`admitted_of` over the rows the ledger serves now (one request, none under
    the ``open`` policy)."""
    if AdmissionPolicy.of_run(spec).open:
        return registered
    served = await client.get_json(f"/v1/runs/{spec.run_id}/membership")
    faults: list[str] = []
    admitted = admitted_of(spec, r, registered, served, faults)
    for fault in faults:
        log.warning("round %d: membership row skipped: %s", r, fault)
    for worker in sorted(registered - admitted):
        log.info("round %d: %s is registered but not admitted by the chain", r, worker[:12])
    return admitted
