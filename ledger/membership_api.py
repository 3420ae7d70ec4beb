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
from .api_base import LEDGER, int_param, read_message, replayed, set_signer
from .queries import MAX_PAGE

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


def _page(s: Session, store: Any, run_id: str, after: int, limit: int) -> dict[str, Any]:
    spec = store.get_spec(s, run_id)
    rows = membership.rows_served(s, run_id, after, limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    return {"run_id": run_id, "admission": spec.admission or {"policy": "open"},
            "first_unclosed_round": membership.first_unclosed_round(s, run_id),
            "rows": rows, "next_after": rows[-1]["seq"] if more else None}


@routes.get("/v1/runs/{run_id}/membership")
async def get_membership(request: web.Request) -> web.Response:
    """The run's policy and its membership rows (``seq``, ``kind``, ``body``) in chain
    order, paged: those with ``seq`` > ``after`` (default -1), at most ``limit`` (<= 1000,
    the default), and ``next_after`` (null on the last page)."""
    ledger = request.app[LEDGER]
    store = ledger.store
    after = int_param(request, "after", -1)
    limit = int_param(request, "limit", MAX_PAGE)
    assert after is not None and limit is not None
    return web.json_response(await ledger.read(
        _page, store, request.match_info["run_id"], max(-1, after), max(1, min(limit, MAX_PAGE))))
