"""The ledger's HTTP API (aiohttp): thin handlers over :class:`LedgerStore`.

Handlers decode, call the store on the single writer thread (reads go to a
small reader pool), and encode the reply. Every refusal is an
``application/problem+json`` body with a stable ``reason`` and is recorded in
the ``rejections`` table. Request bodies are bounded before they are read:
JSON bodies by ``client_max_size``, uploads part by part while streaming to
the blob store. specs/ledger-api.md lists the endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web
from veritrain.protocol.challenges import max_reveal_bytes
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import EncodingError, OversizedError, RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    BeaconShare,
    Registration,
    RoundResult,
    RunSpec,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    SecaggReveal,
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    Signed,
    Submission,
    max_shard_file_bytes,
    open_signed,
)
from veritrain.protocol.secagg import words_file_bytes

from . import queries
from .blobs import BlobStore
from .challenges import challenges_view
from .ingest import Incoming, SubmissionBatcher
from .ratelimit import LIMITS, RateLimits, charge_signer, ratelimit_middleware
from .store import LedgerStore
from .uploads import (
    BodyClock,
    UploadPolicy,
    body_clock,
    next_part,
    read_body,
    read_part_bytes,
    stream_to_blob,
)

log = logging.getLogger("veritrain.ledger")

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
    "phase_closed": 409,
    "not_expected": 403,
    "wrong_bucket": 403,
    "not_challenged": 403,
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
    # How slow a request body may arrive (uploads.py) and how long an idle or
    # half-sent request may hold a connection (aiohttp's keep-alive timeout).
    uploads: UploadPolicy = field(default_factory=UploadPolicy)
    keepalive_seconds: float = 30.0


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

    def __post_init__(self) -> None:
        self.batcher = SubmissionBatcher(self.store, self.writer)

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.writer, fn, *args)

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        def run() -> T:
            with self.store.sessions() as s:
                return fn(s, *args)

        return await asyncio.get_running_loop().run_in_executor(self.readers, run)


LEDGER = web.AppKey("ledger", Ledger)
SIGNER = web.RequestKey("signer", str)


def set_signer(request: web.Request, signer: str) -> None:
    """Note a write's verified signer and charge its rate-limit bucket (may raise 429)."""
    request[SIGNER] = signer
    charge_signer(request, signer)


def problem(status: int, reason: str, detail: str) -> web.Response:
    body = {"type": f"https://veritrain.dev/problems/{reason}", "title": reason,
            "status": status, "reason": reason, "detail": detail}
    return web.json_response(body, status=status, content_type="application/problem+json")


@web.middleware
async def problems_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn refusals into problem+json, record them, and never leak a traceback."""
    try:
        return await handler(request)
    except RejectedInput as exc:
        status = STATUS_BY_REASON.get(exc.reason, 400)
        ledger = request.app[LEDGER]
        run_id = request.match_info.get("run_id", "")
        round_txt = request.match_info.get("round", "")
        if request.method in ("GET", "HEAD"):
            return problem(status, exc.reason, str(exc))
        with contextlib.suppress(Exception):
            await ledger.write(
                ledger.store.record_rejection, run_id,
                int(round_txt) if round_txt.isdigit() else None,
                request.get(SIGNER), request.method + " " + (request.match_info.route.resource
                                                              .canonical if request.match_info.route.resource else request.path),
                exc.reason, str(exc))
        return problem(status, exc.reason, str(exc))
    except web.HTTPRequestEntityTooLarge as exc:
        return problem(413, "oversized", exc.text or "request body too large")
    except web.HTTPException as exc:
        if exc.status >= 400:
            return problem(exc.status, exc.reason.lower().replace(" ", "_"), exc.text or exc.reason)
        raise
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return problem(500, "internal_error", "internal error; the request changed nothing")


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


# ----------------------------------------------------------------------------- handlers

routes = web.RouteTableDef()


@routes.get("/v1/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/v1/ledger")
async def ledger_info(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    runs = await ledger.read(queries.list_runs)
    return web.json_response({"ledger_key": ledger.store.identity.public_key.hex(),
                              "runs": runs, "now": time.time()})


@routes.post("/v1/runs")
async def create_run(request: web.Request) -> web.Response:
    """Multipart: ``spec`` (signed RunSpec), ``dataset`` and ``genesis`` blobs."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    spec_raw = await part_bytes(request, reader, "spec", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(spec_raw), RunSpec)
    set_signer(request, signed.signer)
    spec = signed.message
    digest, size = await part_to_blob(request, reader, "dataset",
                                      ledger.config.max_dataset_bytes, spec.dataset_hash)
    await ledger.write(ledger.store.record_blob, digest, size, "dataset", spec.run_id)
    digest, size = await part_to_blob(request, reader, "genesis", MAX_MODEL_BYTES,
                                      spec.genesis_model_hash)
    await ledger.write(ledger.store.record_blob, digest, size, "model", spec.run_id)
    await ledger.write(ledger.store.create_run, signed)
    return web.json_response({"run_id": spec.run_id}, status=201)


@routes.get("/v1/runs/{run_id}")
async def get_run(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(queries.run_overview, request.match_info["run_id"]))


@routes.post("/v1/runs/{run_id}/participants")
async def register(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    signed = open_signed(await read_message(request), Registration)
    set_signer(request, signed.signer)
    if signed.message.run_id != request.match_info["run_id"]:
        raise RejectedInput("registration is for another run", "wrong_run")
    return web.json_response(await ledger.write(ledger.store.register, signed))


@routes.get("/v1/runs/{run_id}/rounds/current")
async def current_round(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        queries.round_info, request.match_info["run_id"], None, time.time()))


@routes.get("/v1/runs/{run_id}/rounds/{round}")
async def get_round(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        queries.round_summary, request.match_info["run_id"], path_round(request), time.time()))


@routes.post("/v1/runs/{run_id}/rounds/{round}/submissions")
async def submit(request: web.Request) -> web.Response:
    """Multipart: ``envelope`` (signed Submission), then ``payload`` (raw bytes; none in a
    masked run, where the worker reveals it only if spot-checked).

    201 with the ledger's signed receipt; 200 with the same receipt when this exact
    envelope is already recorded (the payload is then not read); 409 ``duplicate``
    when the worker already submitted a different one for the round."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    env_raw = await part_bytes(request, reader, "envelope", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(env_raw), Submission)
    set_signer(request, signed.signer)
    sub = signed.message
    if sub.run_id != request.match_info["run_id"] or sub.round != path_round(request):
        raise RejectedInput("envelope run or round differs from the URL", "wrong_round")
    # A retry of a recorded submission (its reply was lost) gets the same receipt, 200.
    if (done := await ledger.read(ledger.store.recorded_receipt, signed)) is not None:
        return web.json_response(done.to_wire())
    try:
        await ledger.write(ledger.store.precheck_submission, signed)
        spec = await ledger.read(lambda s: ledger.store.get_spec(s, sub.run_id))
        if spec.masked is not None:  # the payload stays with the worker (spec E.2)
            incoming = Incoming(signed, sub.payload_hash, sub.payload_bytes, raw=env_raw,
                                stored=False)
        else:
            digest, size = await part_to_blob(request, reader, "payload", sub.payload_bytes,
                                              sub.payload_hash)
            incoming = Incoming(signed, digest, size, raw=env_raw)
        receipt = await ledger.batcher.accept(incoming)
    except RejectedInput:
        # A twin of this envelope sent concurrently may have been recorded since the check
        # above (as a duplicate, or closing the round): it still gets that receipt, 200.
        if (done := await ledger.read(ledger.store.recorded_receipt, signed)) is not None:
            return web.json_response(done.to_wire())
        raise
    return web.json_response(receipt.to_wire(), status=201)


@routes.get("/v1/runs/{run_id}/rounds/{round}/submissions")
async def sealed_submissions(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    envelopes = await asyncio.get_running_loop().run_in_executor(
        ledger.readers, ledger.store.sealed_submissions, request.match_info["run_id"],
        path_round(request))
    return web.json_response({"submissions": [decode_canonical(e) for e in envelopes]})


@routes.post("/v1/runs/{run_id}/rounds/{round}/results")
async def post_result(request: web.Request) -> web.Response:
    """Multipart: ``result`` (signed RoundResult), ``model`` and ``outer_state`` blobs."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    raw = await part_bytes(request, reader, "result", 16 * MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(raw, max_bytes=16 * MAX_MESSAGE_BYTES), RoundResult)
    set_signer(request, signed.signer)
    res = signed.message
    if res.run_id != request.match_info["run_id"] or res.round != path_round(request):
        raise RejectedInput("result run or round differs from the URL", "wrong_round")
    await ledger.read(lambda s: ledger.store.get_spec(s, res.run_id))
    cert = res.certified_state
    for name, expected, kind in (("model", cert.model_hash, "model"),
                                 ("outer_state", cert.outer_state_hash, "outer_state"),
                                 ("update", cert.update_hash, "update")):
        digest, size = await part_to_blob(request, reader, name, MAX_MODEL_BYTES, expected)
        await ledger.write(ledger.store.record_blob, digest, size, kind, res.run_id)
    return web.json_response(await ledger.write(ledger.store.post_result, signed), status=201)


@routes.get("/v1/runs/{run_id}/rounds/{round}/results")
async def get_results(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        queries.round_results, request.match_info["run_id"], path_round(request)))


@routes.get("/v1/runs/{run_id}/participants")
async def get_participants(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(queries.participants,
                                               request.match_info["run_id"]))


@routes.post("/v1/runs/{run_id}/rounds/{round}/beacon")
async def post_beacon_share(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    signed = open_signed(await read_message(request), BeaconShare)
    set_signer(request, signed.signer)
    msg = signed.message
    if msg.run_id != request.match_info["run_id"] or msg.round != path_round(request):
        raise RejectedInput("share run or round differs from the URL", "wrong_round")
    return web.json_response(await ledger.write(ledger.store.post_beacon_share, signed))


@routes.get("/v1/runs/{run_id}/rounds/{round}/beacon")
async def get_beacon(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        queries.beacon, request.match_info["run_id"], path_round(request)))


def _shard_message(request: web.Request, signed: Signed[Any]) -> None:
    set_signer(request, signed.signer)
    msg = signed.message
    if msg.run_id != request.match_info["run_id"] or msg.round != path_round(request):
        raise RejectedInput("message run or round differs from the URL", "wrong_round")


@routes.post("/v1/runs/{run_id}/rounds/{round}/shards")
async def post_shard_result(request: web.Request) -> web.Response:
    """Multipart: ``publication`` (signed ShardPublication) then ``result`` (its tensor file)."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    raw = await part_bytes(request, reader, "publication", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(raw), ShardPublication)
    _shard_message(request, signed)
    msg = signed.message
    spec = await ledger.read(lambda s: ledger.store.get_spec(s, msg.run_id))
    if spec.validator_index(signed.signer) is None or not spec.shards:
        raise RejectedInput("only a validator of a sharded run publishes shard results",
                            "unknown_validator")
    limit = max_shard_file_bytes(spec.num_params, spec.shards)
    resent = await ledger.write(ledger.store.precheck_shard_result, signed)
    if resent is not None:
        return web.json_response(resent, status=201)
    digest, size = await part_to_blob(request, reader, "result", limit, msg.result_hash)
    if size != msg.result_bytes:
        raise RejectedInput(f"result file is {size} bytes, the publication says "
                            f"{msg.result_bytes}", "malformed")
    await ledger.write(ledger.store.record_blob, digest, size, "shard", msg.run_id)
    return web.json_response(await ledger.write(ledger.store.post_shard_result, signed),
                             status=201)


@routes.post("/v1/runs/{run_id}/rounds/{round}/shards/check")
async def post_shard_check_share(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    signed = open_signed(await read_message(request), ShardCheckShare)
    _shard_message(request, signed)
    return web.json_response(await ledger.write(ledger.store.post_shard_check_share, signed))


@routes.post("/v1/runs/{run_id}/rounds/{round}/shards/findings")
async def post_shard_finding(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    signed = open_signed(await read_message(request), ShardFindingReport)
    _shard_message(request, signed)
    return web.json_response(await ledger.write(ledger.store.post_shard_finding, signed),
                             status=201)


@routes.get("/v1/runs/{run_id}/rounds/{round}/shards")
async def get_round_shards(request: web.Request) -> web.Response:
    """The round's shard results, the fixed list and check seed, findings and faults."""
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        ledger.store.round_shards, request.match_info["run_id"], path_round(request)))


SECAGG_KINDS = {"keys": SecaggKeys, "deal": SecaggDeal, "reveal": SecaggReveal,
                "opening": SecaggOpening}


@routes.post("/v1/runs/{run_id}/rounds/{round}/secagg/masked")
async def post_secagg_masked(request: web.Request) -> web.Response:
    """Multipart: ``envelope`` (signed SecaggMasked) then ``words`` (4 D bytes, uint32 LE)."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    raw = await part_bytes(request, reader, "envelope", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(raw), SecaggMasked)
    _shard_message(request, signed)
    msg = signed.message
    spec = await ledger.read(lambda s: ledger.store.get_spec(s, msg.run_id))
    if spec.masked is None:
        raise RejectedInput(f"run {spec.run_id} does not mask its updates", "not_masked")
    limit = words_file_bytes(spec.num_params)
    if msg.words_bytes != limit:
        raise RejectedInput(f"a masked input of this run is {limit} bytes", "malformed")
    if await ledger.write(ledger.store.precheck_secagg, "masked", signed):
        return web.json_response({"kind": "masked", "already": True}, status=201)
    digest, size = await part_to_blob(request, reader, "words", limit, msg.words_hash)
    if size != limit:
        raise RejectedInput(f"words file is {size} bytes, not {limit}", "malformed")
    await ledger.write(ledger.store.record_blob, digest, size, "masked", msg.run_id)
    return web.json_response(await ledger.write(ledger.store.post_secagg, "masked", signed),
                             status=201)


@routes.post("/v1/runs/{run_id}/rounds/{round}/secagg/{kind}")
async def post_secagg(request: web.Request) -> web.Response:
    """A key advert, deal, reveal or opening on a masked round's board."""
    ledger = request.app[LEDGER]
    kind = request.match_info["kind"]
    if kind not in SECAGG_KINDS:
        raise RejectedInput(f"no board post kind {kind!r}", "not_found")
    signed = open_signed(await read_message(request), SECAGG_KINDS[kind])
    _shard_message(request, signed)
    return web.json_response(await ledger.write(ledger.store.post_secagg, kind, signed),
                             status=201)


@routes.get("/v1/runs/{run_id}/rounds/{round}/secagg")
async def get_round_secagg(request: web.Request) -> web.Response:
    """A masked round's buckets, phases and posts (``?bucket=k``: of one bucket)."""
    ledger = request.app[LEDGER]
    bucket = request.query.get("bucket")
    if bucket is not None and not bucket.isdigit():
        raise EncodingError("bucket is a non-negative integer")
    return web.json_response(await ledger.read(
        ledger.store.round_secagg, request.match_info["run_id"], path_round(request),
        None if bucket is None else int(bucket)))


@routes.get("/v1/runs/{run_id}/rounds/{round}/challenges")
async def get_challenges(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        challenges_view, request.match_info["run_id"], path_round(request), time.time()))


@routes.put("/v1/runs/{run_id}/rounds/{round}/reveals/{digest}")
async def put_reveal(request: web.Request) -> web.Response:
    """A challenged state or residual file; accepted only if some challenge needs its hash."""
    ledger = request.app[LEDGER]
    run_id, r, digest = request.match_info["run_id"], path_round(request), request.match_info["digest"]
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise EncodingError("reveals are named by lowercase sha256 hex")
    spec = await ledger.read(lambda s: ledger.store.get_spec(s, run_id))
    limit = max_reveal_bytes(spec.num_params)
    if request.content_length is not None and request.content_length > limit:
        raise OversizedError(f"a reveal is at most {limit} bytes")
    if await ledger.write(ledger.store.precheck_reveal, run_id, r, digest):
        return web.json_response(await ledger.write(ledger.store.accept_reveal, run_id, r,
                                                    digest, 0))
    _, size = await stream_to_blob(ledger.blobs, request.content.read, clock_of(request), limit,
                                   digest)
    return web.json_response(await ledger.write(ledger.store.accept_reveal, run_id, r, digest,
                                                size), status=201)


@routes.get("/v1/blobs/{digest}")
async def get_blob(request: web.Request) -> web.StreamResponse:
    ledger = request.app[LEDGER]
    digest = request.match_info["digest"]
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise EncodingError("blob names are lowercase sha256 hex")
    visible = await asyncio.get_running_loop().run_in_executor(
        ledger.readers, ledger.store.blob_visible, digest)
    if not visible:
        raise RejectedInput("payload is sealed until its round closes", "sealed")
    path = ledger.blobs.path_for(digest)
    if not path.exists():
        raise RejectedInput(f"blob {digest} is recorded but its file is missing", "not_found")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream",
                                           "Cache-Control": "public, max-age=31536000, immutable"})


@routes.get("/v1/runs/{run_id}/workers/{worker}")
async def worker_history(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        lambda s: queries.worker_history(
            s, request.match_info["run_id"], request.match_info["worker"],
            offset=int_param(request, "offset", 0) or 0,
            limit=int_param(request, "limit", 100) or 100)))


@routes.get("/v1/runs/{run_id}/report")
async def run_report(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(queries.run_report, request.match_info["run_id"]))


@routes.get("/v1/runs/{run_id}/events")
async def events(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        queries.events_page, request.match_info["run_id"],
        int_param(request, "after", -1), int_param(request, "limit", 500)))


@routes.get("/v1/runs/{run_id}/rejections")
async def rejections(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        lambda s: queries.rejections_page(
            s, request.match_info["run_id"], round_index=int_param(request, "round"),
            signer=request.query.get("signer"), reason=request.query.get("reason"),
            offset=int_param(request, "offset", 0) or 0,
            limit=int_param(request, "limit", 100) or 100)))


# ----------------------------------------------------------------------------- app


async def _ticker(app: web.Application) -> AsyncIterator[None]:
    ledger = app[LEDGER]

    async def loop() -> None:
        while True:
            try:
                for run_id, r, action in await ledger.write(ledger.store.tick):
                    log.info("run %s round %d: %s", run_id, r, action)
            except Exception:
                log.exception("round tick failed")
            await asyncio.sleep(ledger.config.tick_seconds)

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    ledger.writer.shutdown(wait=True)
    ledger.readers.shutdown(wait=True)
    ledger.store.engine.dispose()


def make_app(config: LedgerConfig, identity: Identity) -> web.Application:
    """Build the ledger application (the store and blob directory live under ``data_dir``)."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(
        store=LedgerStore(config.db_url, identity),
        blobs=BlobStore(config.data_dir / "blobs"),
        config=config,
        writer=ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-writer"),
        readers=ThreadPoolExecutor(max_workers=4, thread_name_prefix="ledger-reader"),
    )
    from . import audit_api, web_page
    from .guards import media_type_middleware
    from .metrics import METRICS, Metrics, metrics_middleware

    app = web.Application(client_max_size=MAX_MESSAGE_BYTES, middlewares=[
        metrics_middleware, ratelimit_middleware, problems_middleware, media_type_middleware])
    app[LEDGER] = ledger
    app[METRICS] = Metrics()
    app[LIMITS] = RateLimits.build(config.ip_rate, config.ip_burst, config.key_rate,
                                   config.key_burst)
    app.add_routes(routes)
    app.add_routes(audit_api.routes)
    app.add_routes(web_page.routes)
    app.cleanup_ctx.append(_ticker)
    app.cleanup_ctx.append(_checkpoint_signer)
    return app


async def _checkpoint_signer(app: web.Application) -> AsyncIterator[None]:
    """Sign the chain heads that no commit-time checkpoint covered (checkpoints.py)."""
    ledger = app[LEDGER]
    checkpointer = ledger.store.checkpointer

    async def loop() -> None:
        while True:
            await asyncio.sleep(checkpointer.every_seconds)
            try:
                await ledger.write(checkpointer.sign_pending, ledger.store.sessions)
            except Exception:
                log.exception("checkpoint signing failed")

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    with contextlib.suppress(RuntimeError):  # the writer may already be shut down
        await ledger.write(checkpointer.sign_pending, ledger.store.sessions)
