"""The endpoints nodes use: create a run, register, submit, post beacon shares, round
results, shard and masked-board messages, reveals, and the reads they poll (rounds,
challenges, blobs). Thin handlers: decode, call the store on the single writer thread
(reads on the reader pool), encode the reply (specs/ledger-api.md).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.errors import EncodingError, RejectedInput
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
    SpotReveal,
    Submission,
    max_shard_file_bytes,
    open_signed,
)
from veritrain.protocol.secagg import words_file_bytes

from . import queries, retention
from .api_base import (
    LEDGER,
    MAX_MESSAGE_BYTES,
    MAX_MODEL_BYTES,
    part_bytes,
    part_to_blob,
    path_round,
    read_message,
    set_signer,
)
from .challenges import challenges_view
from .ingest import Incoming

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
    reply = await ledger.write(ledger.store.post_result, signed)
    if reply.get("certificate"):
        ledger.finalized.set()  # the pruner's turn (retention.py), off this request's path
    return web.json_response(reply, status=201)


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
    try:
        reply = await ledger.write(ledger.store.post_shard_result, signed)
    except RejectedInput:
        # Another publication of this shard won the race since the precheck: no file stays
        # that no stored publication names.
        if await ledger.write(ledger.store.forget_unclaimed_shard_file, msg.run_id, digest):
            ledger.blobs.remove(digest)
        raise
    return web.json_response(reply, status=201)


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


@routes.post("/v1/runs/{run_id}/rounds/{round}/reveals")
async def post_reveal(request: web.Request) -> web.Response:
    """Multipart: ``envelope`` (signed SpotReveal) then ``reveal`` (the reveal file).

    201 with the ledger's signed RevealReceipt; 200 with the same receipt when this exact
    envelope is already recorded (the file is then not read). Everything that can refuse
    it is checked before the file is read."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    raw = await part_bytes(request, reader, "envelope", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(raw), SpotReveal)
    set_signer(request, signed.signer)
    msg = signed.message
    if msg.run_id != request.match_info["run_id"] or msg.round != path_round(request):
        raise RejectedInput("reveal run or round differs from the URL", "wrong_round")
    if (done := await ledger.write(ledger.store.precheck_spot_reveal, signed)) is not None:
        return web.json_response(done.to_wire())
    digest, size = await part_to_blob(request, reader, "reveal", msg.reveal_bytes,
                                      msg.reveal_hash)
    receipt = await ledger.write(ledger.store.accept_spot_reveal, signed, digest, size)
    return web.json_response(receipt.to_wire(), status=201)


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
        # Gone by policy (410, recorded) or lost (404): the two are never confused.
        pruned = await ledger.read(retention.pruned_row, digest)
        if pruned is not None:
            raise retention.gone(pruned)
        raise RejectedInput(f"blob {digest} is recorded but its file is missing", "not_found")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream",
                                           "Cache-Control": "public, max-age=31536000, immutable"})


