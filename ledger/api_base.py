"""What every route module of the ledger API shares.

The app's state under typed keys (:data:`LEDGER`, the verified signer of a write
under :data:`SIGNER`), refusals as ``application/problem+json`` with a stable
``reason`` and its HTTP status, and the helpers that parse paths and queries and
read bounded request bodies. The route modules (node_api.py, audit_api.py,
web_page.py) import this module and nothing of each other; server.py builds the
app from all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import EncodingError

from .admission import RejectionBudget
from .blobs import BlobStore, StagedBlob
from .ingest import SubmissionBatcher
from .ratelimit import (
    KeyTurns,
    charge_bad_signature,
    charge_replay,
    charge_signer,
    refuse_bad_signer,
)
from .retention import RetentionPolicy
from .store import LedgerStore
from .uploads import (
    BodyClock,
    UploadPolicy,
    body_clock,
    next_part,
    read_body,
    read_part_bytes,
    stream_to_blob,
    stream_to_staged,
)

T = TypeVar("T")

MAX_MESSAGE_BYTES = 1 << 20
MAX_MODEL_BYTES = 1 << 32
STATUS_BY_REASON = {
    "not_found": 404,
    "duplicate": 409,
    "wrong_state": 409,
    "oversized": 413,
    "bad_signature": 401,
    "unknown_worker": 403,
    "not_admitted": 403,
    "unknown_validator": 403,
    "banned": 403,
    "sealed": 403,
    "upload_timeout": 408,
    "shard_list_fixed": 409,
    "round_finalized": 409,
    "not_sharded": 409,
    "wrong_shard": 403,
    "not_masked": 409,
    "wrong_sealed_list": 409,
    "wrong_participants": 409,
    "wrong_masked": 409,
    "phase_closed": 409,
    "not_expected": 403,
    "wrong_bucket": 403,
    "not_challenged": 403,
    "reveal_late": 409,
    "blob_sealed": 409,
    "wrong_submission": 409,
    "pruned": 410,
}


@dataclass
class LedgerConfig:
    data_dir: Path
    db_url: str
    tick_seconds: float = 0.2
    max_dataset_bytes: int = 1 << 30
    # Token buckets (ratelimit.py): requests per second and burst; a rate of 0 disables.
    ip_rate: float = 200.0
    ip_burst: float = 400.0
    key_rate: float = 5.0
    key_burst: float = 20.0
    # BLS signatures that do not verify, per signer key (ratelimit.py): each costs the
    # single verifier thread a pairing (~0.3 s), and an honest node never sends one. A
    # burst below 1 disables the limit.
    bad_signature_rate: float = 1 / 60
    bad_signature_burst: float = 5.0
    # How slow a request body may arrive (uploads.py) and how long an idle or
    # half-sent request may hold a connection (aiohttp's keep-alive timeout).
    uploads: UploadPolicy = field(default_factory=UploadPolicy)
    keepalive_seconds: float = 30.0
    # Which blob files go once their round is old enough (retention.py); default: the
    # reveal files and superseded models of rounds with 2 finalized rounds after them.
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    # What strangers may cost (admission.py, specs/threat-model.md): the validators a run
    # may name (each one's BLS proof of possession is verified once), the bytes of the
    # runs (dataset and genesis) one organiser key may store, and the refusals of one run,
    # reason and hour that become rows (the rest are counted in /metrics only).
    max_validators: int = 64
    organiser_quota_bytes: int = 8 << 30
    rejection_rows_per_hour: int = 100


@dataclass
class Ledger:
    """Shared state of one ledger server."""

    store: LedgerStore
    blobs: BlobStore
    config: LedgerConfig
    writer: ThreadPoolExecutor
    readers: ThreadPoolExecutor
    #: Submissions that arrive while the writer is busy share its next transaction.
    batcher: SubmissionBatcher = field(init=False)
    #: Set when a round is finalized: the background pruner (retention.py) waits on it.
    finalized: asyncio.Event = field(default_factory=asyncio.Event)
    #: BLS verifications run here, one at a time, off the writer (admission.py).
    verifier: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="ledger-verify"))
    #: A key's BLS checks take turns (verify_bls), so its failures are charged in order.
    pairing_turns: KeyTurns = field(default_factory=KeyTurns)
    #: Which refusals become rows (the rest are only counted).
    rejection_budget: RejectionBudget = field(init=False)

    def __post_init__(self) -> None:
        self.batcher = SubmissionBatcher(self.store, self.writer)
        self.rejection_budget = RejectionBudget(self.config.rejection_rows_per_hour)
        self.store.max_validators = self.config.max_validators
        self.store.blobs = self.blobs

    async def verify(self, fn: Callable[..., T], *args: Any) -> T:
        """Run an expensive verification (BLS) on the verifier thread, off the writer."""
        return await asyncio.get_running_loop().run_in_executor(self.verifier, fn, *args)

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.writer, fn, *args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        def run() -> T:
            with self.store.snapshot() as s:
                return fn(s, *args)

        return await asyncio.get_running_loop().run_in_executor(self.readers, run)


LEDGER = web.AppKey("ledger", Ledger)
SIGNER = web.RequestKey("signer", str)


def set_signer(request: web.Request, signer: str) -> None:
    """Note a write's verified signer and charge its rate-limit bucket (may raise 429).

    Called only for a message that its signer must have sent: signed, for this URL's run
    and round, and not an exact copy of a stored (public) message. A refusal names the
    signer (a ``rejections`` row) only after this."""
    request[SIGNER] = signer
    charge_signer(request, signer)


async def verify_bls(request: web.Request, signer: str, check: Callable[..., bool],
                     *args: Any, paused: bool = False) -> bool:
    """``check(*args)``, the BLS verification of a message ``signer`` sent (``set_signer``
    passed), on the verifier thread; ``paused``: the request body's clock stops meanwhile.

    The ledger verifies pairings one at a time, so a key whose signatures keep failing
    would hold every validator's share behind its own: a failure spends one of the key's
    ``bad_signature`` tokens, and a key with none left is refused (429) before its
    pairing. An honest node's signatures verify, so it never spends one."""
    ledger = request.app[LEDGER]

    async def in_turn() -> bool:
        async with ledger.pairing_turns.turn(signer):  # checked and charged in turn, per key
            refuse_bad_signer(request, signer)
            ok = await ledger.verify(check, *args)
            if not ok:
                charge_bad_signature(request, signer)
            return ok

    return await (clock_of(request).paused(in_turn()) if paused else in_turn())


def replayed(request: web.Request, signer: str) -> None:
    """An exact copy of a stored message: charged to the sender's address and that key
    together, never to the key's own budget (may raise 429)."""
    charge_replay(request, signer)


def problem(status: int, reason: str, detail: str) -> web.Response:
    body = {"type": f"https://veritrain.dev/problems/{reason}", "title": reason,
            "status": status, "reason": reason, "detail": detail}
    return web.json_response(body, status=status, content_type="application/problem+json")


def canonical_json(value: Any, status: int = 200) -> web.Response:
    return web.Response(body=encode_canonical(value), status=status,
                        content_type="application/json")


async def read_message(request: web.Request) -> Any:
    raw = await read_body(request, clock_of(request), MAX_MESSAGE_BYTES)
    return decode_canonical(raw, max_bytes=MAX_MESSAGE_BYTES)


def clock_of(request: web.Request) -> BodyClock:
    return body_clock(request, request.app[LEDGER].config.uploads)


async def part_bytes(request: web.Request, reader: Any, name: str, limit: int) -> bytes:
    clock = clock_of(request)
    return await read_part_bytes(await next_part(reader, name, clock), clock, limit)


async def part_to_staged(request: web.Request, reader: Any, name: str, limit: int,
                         expected: str | None, kind: str, run_id: str,
                         sealed_round: int | None = None) -> StagedBlob:
    """Stream part ``name`` to the temporary area; published only on acceptance."""
    clock = clock_of(request)
    part = await next_part(reader, name, clock)
    staged = await stream_to_staged(request.app[LEDGER].blobs, part.read_chunk, clock, limit,
                                    expected)
    staged.kind, staged.run_id, staged.sealed_round = kind, run_id, sealed_round
    return staged


async def part_to_blob(request: web.Request, reader: Any, name: str, limit: int,
                       expected: str | None) -> tuple[str, int]:
    clock = clock_of(request)
    part = await next_part(reader, name, clock)
    return await stream_to_blob(request.app[LEDGER].blobs, part.read_chunk, clock, limit,
                                expected)


def int_param(request: web.Request, name: str, default: int | None = None) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return default
    if not raw.lstrip("-").isdigit() or len(raw) > 18:
        raise EncodingError(f"query parameter {name} must be an integer")
    return int(raw)


def path_round(request: web.Request) -> int:
    raw = request.match_info["round"]
    if not raw.isdigit() or len(raw) > 12:
        raise EncodingError("round must be a non-negative integer")
    return int(raw)


