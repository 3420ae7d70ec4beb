"""Who a validator counts as a worker of a round: the registered keys the chain admits
(protocol/membership.py), never the ledger's participant list alone; and whether the
round was closed as the schedule says (protocol/schedule.py ``close_problem``)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from veritrain.ledger.client import fetch_membership, fetch_participants
from veritrain.protocol.beacon import bans_round
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.membership import AdmissionPolicy, fold_rows
from veritrain.protocol.messages import Registration, RunSpec, open_signed
from veritrain.protocol.schedule import close_problem

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
    served = await fetch_membership(client, spec.run_id)
    faults: list[str] = []
    admitted = admitted_of(spec, r, registered, served, faults)
    for fault in faults:
        log.warning("round %d: membership row skipped: %s", r, fault)
    for worker in sorted(registered - admitted):
        log.info("round %d: %s is registered but not admitted by the chain", r, worker[:12])
    return admitted


@dataclass
class ParticipantView:
    """What a validator judges a round's sealed list against: the workers the chain admits
    (``registered``), those a ban covers (``banned``), and when (ledger time) each validly
    registered worker registered, admitted or not (the schedule counts them all)."""

    registered: set[str] = field(default_factory=set)
    banned: set[str] = field(default_factory=set)
    registered_at: dict[str, float] = field(default_factory=dict)

    def active_at(self, when: float) -> set[str]:
        """The workers the ledger's schedule counts as active at time ``when``."""
        return {w for w, t in self.registered_at.items() if t < when and w not in self.banned}


async def fetch_participant_view(client: Any, spec: RunSpec, r: int) -> ParticipantView:
    """Round ``r``'s participant view from every page of the ledger's list: a row counts
    only with the worker's own signed registration for this run; admission from the
    chain's membership rows (``admitted_workers``)."""
    view = ParticipantView()
    for row in await fetch_participants(client, spec.run_id):
        try:
            signed = open_signed(row["registration"], Registration)
        except RejectedInput:
            continue
        reg = signed.message
        if signed.signer != reg.participant or reg.run_id != spec.run_id:
            continue
        at = row.get("registered_at")
        view.registered_at[reg.participant] = at if isinstance(at, int | float) else 0.0
        if bans_round(row["banned_until_round"], spec.verification["ban_rounds"], r):
            view.banned.add(reg.participant)
    view.registered = await admitted_workers(client, spec, r, set(view.registered_at))
    return view


def check_close(view: ParticipantView, info: dict[str, Any], sealed_workers: Iterable[str], *,
                seen_closed_at: float, min_submissions: int, round_seconds: float,
                slack: float) -> str | None:
    """``close_problem`` for the round ``info`` (the ledger's round view) with the active
    workers of ``view`` at its close: None when the close is the schedule's."""
    closed_at = info.get("closed_at")
    return close_problem(
        opened_at=float(info["opened_at"]), deadline=float(info["deadline"]),
        extensions=int(info.get("extensions") or 0),
        closed_at=None if closed_at is None else float(closed_at),
        round_seconds=round_seconds, min_submissions=min_submissions,
        sealed=set(sealed_workers),
        active_at_close=view.active_at(float(closed_at)) if closed_at is not None else (),
        seen_closed_at=seen_closed_at, slack=slack)
