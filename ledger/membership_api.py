"""Admission endpoints (specs/ledger-api.md, "Admission"): post a signed admission
ticket, revocation, bond deposit or withdrawal; read a run's membership rows (what
validators fold to know who is admitted) and its workers' bonds."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from sqlalchemy.orm import Session
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.membership import MEMBERSHIP_MESSAGES, SIGNER_FIELD
from veritrain.protocol.messages import open_signed

from . import membership
from .api_base import LEDGER, read_message, replayed, set_signer

routes = web.RouteTableDef()


@routes.post("/v1/runs/{run_id}/membership")
async def post_membership(request: web.Request) -> web.Response:
    """One signed membership message; its kind says which (``admission_ticket``,
    ``admission_revocation``, ``bond_deposit``, ``bond_withdrawal``)."""
    ledger = request.app[LEDGER]
    wire = await read_message(request)
    kind = wire.get("kind") if isinstance(wire, dict) else None
    cls = MEMBERSHIP_MESSAGES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RejectedInput(f"not a membership message: {str(kind)[:40]!r}", "malformed")
    signed = open_signed(wire, cls)
    if signed.message.run_id != request.match_info["run_id"]:
        raise RejectedInput(f"a {kind} for another run", "wrong_run")
    if signed.signer != getattr(signed.message, SIGNER_FIELD[cls.KIND]):
        raise RejectedInput(f"a {kind} signed by another key than it names", "bad_signature")
    if await ledger.read(membership.stored, signed.message.run_id, signed):
        replayed(request, signed.signer)  # a public row copied: not the key's own budget
        return web.json_response({"kind": signed.message.KIND, "digest": signed.digest,
                                  "new": False})
    set_signer(request, signed.signer)
    return web.json_response(await ledger.write(ledger.store.post_membership, signed))


def _rows(s: Session, store: Any, run_id: str) -> dict[str, Any]:
    spec = store.get_spec(s, run_id)
    return {"run_id": run_id, "admission": spec.admission or {"policy": "open"},
            "first_unclosed_round": membership.first_unclosed_round(s, run_id),
            "rows": membership.rows_served(s, run_id)}


@routes.get("/v1/runs/{run_id}/membership")
async def get_membership(request: web.Request) -> web.Response:
    """The run's policy and every membership row (``seq``, ``kind``, ``body``)."""
    ledger = request.app[LEDGER]
    store = ledger.store
    return web.json_response(await ledger.read(
        lambda s: _rows(s, store, request.match_info["run_id"])))
