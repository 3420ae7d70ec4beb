"""The endpoints nodes use: create a run, register, submit, post beacon shares, round
results, shard and masked-board messages, reveals, and the reads they poll (rounds,
challenges, blobs). Thin handlers: decode, call the store on the single writer thread
(reads on the reader pool), encode the reply (specs/ledger-api.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.errors import EncodingError, RejectedInput
from veritrain.protocol.messages import (
    BeaconShare,
    OpeningsShare,
    Registration,
    RoundResult,
    RunSpec,
    SecaggDeal,
    SecaggKeys,
    SecaggMasked,
    SecaggOpening,
    SecaggReveal,
    SecaggView,
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

from . import openings, queries, retention
from .api_base import (
    LEDGER,
    MAX_MESSAGE_BYTES,
    MAX_MODEL_BYTES,
    Ledger,
    clock_of,
    int_param,
    part_bytes,
    part_to_staged,
    path_round,
    read_message,
    replayed,
    set_signer,
    verify_bls,
)
from .blobs import StagedBlob
from .challenges import challenges_view
from .ingest import Incoming
from .store import Conflict

routes = web.RouteTableDef()
T = TypeVar("T")

#: Blob downloads are attacker-chosen bytes: never sniffed, never rendered as a page.
BLOB_HEADERS = {"Content-Type": "application/octet-stream",
                "Cache-Control": "public, max-age=31536000, immutable",
                "X-Content-Type-Options": "nosniff",
                "Content-Security-Policy": "default-src 'none'; sandbox",
                "Content-Disposition": "attachment"}


async def _on_reader(ledger: Ledger, fn: Callable[..., T], *args: Any) -> T:
    """A read-only check on the reader pool (never the writer that orders rows)."""
    return await asyncio.get_running_loop().run_in_executor(ledger.readers, fn, *args)


def _discard(staged: list[StagedBlob]) -> None:
    for blob in staged:
        blob.discard()


def _same_url(request: web.Request, msg: Any, what: str) -> None:
    """The message's run and round are the URL's (checked before its signer is charged or
    named: a copy sent to another URL is nobody's write)."""
    if msg.run_id != request.match_info["run_id"] or (
            "round" in request.match_info and msg.round != path_round(request)):
        raise RejectedInput(f"{what} run or round differs from the URL", "wrong_round")


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
    """Multipart: ``spec`` (signed RunSpec), ``dataset`` and ``genesis`` blobs.

    Cheap checks first (shape, the validator cap, an existing run id: 409 before any
    proof of possession is verified, and nobody is charged), then the proofs of possession
    (once per key, on the verifier thread), then the files, staged and published only
    with the run."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    spec_raw = await part_bytes(request, reader, "spec", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(spec_raw), RunSpec)
    spec = signed.message
    await ledger.read(ledger.store.precheck_run, signed)
    set_signer(request, signed.signer)
    left = ledger.config.organiser_quota_bytes - await ledger.read(
        ledger.store.organiser_bytes, spec.organiser)
    if left <= 0:
        raise RejectedInput("this organiser key stores its quota of run data already",
                            "oversized")
    await clock_of(request).paused(ledger.verify(ledger.store.verify_possessions, spec))
    staged: list[StagedBlob] = []
    try:
        staged.append(await part_to_staged(
            request, reader, "dataset", min(ledger.config.max_dataset_bytes, left),
            spec.dataset_hash, "dataset", spec.run_id))
        staged.append(await part_to_staged(
            request, reader, "genesis", max(1, min(MAX_MODEL_BYTES, left - staged[0].size)),
            spec.genesis_model_hash, "model", spec.run_id))
        await ledger.write(ledger.store.create_run, signed, tuple(staged))
    finally:
        _discard(staged)
    return web.json_response({"run_id": spec.run_id}, status=201)


@routes.get("/v1/runs/{run_id}")
async def get_run(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(queries.run_overview, request.match_info["run_id"]))


@routes.post("/v1/runs/{run_id}/participants")
async def register(request: web.Request) -> web.Response:
    """A registration; a resend of a stored one is answered from the store."""
    ledger = request.app[LEDGER]
    signed = open_signed(await read_message(request), Registration)
    if signed.message.run_id != request.match_info["run_id"]:
        raise RejectedInput("registration is for another run", "wrong_run")
    known = None
    if signed.signer == signed.message.participant:
        known = await ledger.read(ledger.store.registered, signed)
    if known is not None:
        reply, exact = known
        if exact:
            replayed(request, signed.signer)
        else:
            set_signer(request, signed.signer)
        return web.json_response(reply)
    set_signer(request, signed.signer)
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
    when the worker already submitted a different one for the round. The payload is
    staged and published only with the submission."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    env_raw = await part_bytes(request, reader, "envelope", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(env_raw), Submission)
    sub = signed.message
    _same_url(request, sub, "envelope")
    # A retry of a recorded submission (its reply was lost) gets the same receipt, 200.
    if (done := await ledger.read(ledger.store.recorded_receipt, signed)) is not None:
        replayed(request, signed.signer)
        return web.json_response(done.to_wire())
    set_signer(request, signed.signer)
    staged: list[StagedBlob] = []
    try:
        await _on_reader(ledger, ledger.store.precheck_submission, signed)
        spec = await ledger.read(lambda s: ledger.store.get_spec(s, sub.run_id))
        if spec.masked is not None:  # the payload stays with the worker (spec E.2)
            incoming = Incoming(signed, sub.payload_hash, sub.payload_bytes, raw=env_raw,
                                stored=False)
        else:
            staged.append(await part_to_staged(request, reader, "payload", sub.payload_bytes,
                                               sub.payload_hash, "payload", sub.run_id,
                                               sub.round))
            incoming = Incoming(signed, staged[0].digest, staged[0].size, raw=env_raw,
                                staged=staged[0])
        receipt = await ledger.batcher.accept(incoming)
    except RejectedInput:
        # A twin of this envelope sent concurrently may have been recorded since the check
        # above (as a duplicate, or closing the round): it still gets that receipt, 200.
        if (done := await ledger.read(ledger.store.recorded_receipt, signed)) is not None:
            return web.json_response(done.to_wire())
        raise
    finally:
        _discard(staged)
    return web.json_response(receipt.to_wire(), status=201)


@routes.get("/v1/runs/{run_id}/rounds/{round}/submissions")
async def sealed_submissions(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    envelopes, excluded = await asyncio.get_running_loop().run_in_executor(
        ledger.readers, ledger.store.sealed_submissions, request.match_info["run_id"],
        path_round(request))
    return web.json_response({"submissions": [decode_canonical(e) for e in envelopes],
                              "excluded": excluded})


@routes.post("/v1/runs/{run_id}/rounds/{round}/results")
async def post_result(request: web.Request) -> web.Response:
    """Multipart: ``result`` (signed RoundResult), ``model``, ``outer_state`` and ``update``.

    A resend of the stored result is answered 409 ``duplicate`` from the store; every
    cheap check runs before the BLS attestation is verified (on the verifier thread), and
    that before any file is read; the files are staged and published only with the
    result."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    raw = await part_bytes(request, reader, "result", 16 * MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(raw, max_bytes=16 * MAX_MESSAGE_BYTES), RoundResult)
    res = signed.message
    _same_url(request, res, "result")
    if await ledger.read(ledger.store.stored_result, signed):
        replayed(request, signed.signer)
        raise Conflict("this validator already posted this result for this round")
    set_signer(request, signed.signer)
    await ledger.read(ledger.store.precheck_result, signed)
    if not await verify_bls(request, signed.signer, ledger.store.result_verifies, signed,
                            paused=True):
        raise RejectedInput("BLS attestation does not verify", "bad_signature")
    cert = res.certified_state
    staged: list[StagedBlob] = []
    try:
        for name, expected, kind in (("model", cert.model_hash, "model"),
                                     ("outer_state", cert.outer_state_hash, "outer_state"),
                                     ("update", cert.update_hash, "update")):
            staged.append(await part_to_staged(request, reader, name, MAX_MODEL_BYTES,
                                               expected, kind, res.run_id))
        reply = await ledger.write(ledger.store.post_result, signed, tuple(staged))
    finally:
        _discard(staged)
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
    """Workers' registrations, paged (``offset``, ``limit`` <= 1000, ``next_offset``)."""
    ledger = request.app[LEDGER]
    offset = int_param(request, "offset", 0) or 0
    limit = int_param(request, "limit", queries.MAX_PAGE) or queries.MAX_PAGE
    return web.json_response(await ledger.read(queries.participants,
                                               request.match_info["run_id"], offset, limit))


@routes.post("/v1/runs/{run_id}/rounds/{round}/beacon")
async def post_beacon_share(request: web.Request) -> web.Response:
    """A validator's beacon share: a resend of the stored one is answered from the store;
    the BLS share is verified (on the verifier thread) only after every cheap check."""
    ledger = request.app[LEDGER]
    signed = open_signed(await read_message(request), BeaconShare)
    _same_url(request, signed.message, "share")
    try:
        resent, _ = await ledger.read(ledger.store.precheck_beacon_share, signed)
    except RejectedInput:
        set_signer(request, signed.signer)  # a fresh message: its signer sent it
        raise
    if resent is not None:
        replayed(request, signed.signer)
        return web.json_response(resent)
    set_signer(request, signed.signer)
    if not await verify_bls(request, signed.signer, ledger.store.beacon_share_verifies, signed):
        raise RejectedInput("beacon share does not verify", "bad_signature")
    return web.json_response(await ledger.write(ledger.store.post_beacon_share, signed))


@routes.get("/v1/runs/{run_id}/rounds/{round}/beacon")
async def get_beacon(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        queries.beacon, request.match_info["run_id"], path_round(request)))


@routes.get("/v1/runs/{run_id}/dkg")
async def get_dkg(request: web.Request) -> web.Response:
    """A threshold-beacon run's DKG board: the phases, every post by kind, the group
    (specs/protocol.md 5.4a); ``?posts=none``: the same without the posts, for polling."""
    ledger = request.app[LEDGER]
    posts = request.query.get("posts", "all")
    if posts not in ("all", "none"):
        raise EncodingError("query parameter posts must be all or none")
    return web.json_response(await ledger.read(ledger.store.dkg_view,
                                               request.match_info["run_id"], posts == "all"))


@routes.post("/v1/runs/{run_id}/dkg")
async def post_dkg(request: web.Request) -> web.Response:
    """A validator's DKG post (keys, deal, complaint, justification, result), opened
    against the run's validator set and taken while its phase is open."""
    ledger = request.app[LEDGER]
    wire = await read_message(request)
    body = wire.get("body") if isinstance(wire, dict) else None
    if not isinstance(body, dict) or body.get("run_id") != request.match_info["run_id"]:
        raise RejectedInput("DKG post run differs from the URL", "wrong_round")
    return web.json_response(await ledger.write(ledger.store.post_dkg, wire), status=201)


@routes.post("/v1/runs/{run_id}/rounds/{round}/partials")
async def post_beacon_partial(request: web.Request) -> web.Response:
    """A validator's partial signature of a closed round's threshold beacon: opened
    against the run's validator set, checked against its public key share (verifier
    thread) before the writer stores it."""
    ledger = request.app[LEDGER]
    signed = await ledger.read(ledger.store.open_partial, request.match_info["run_id"],
                               path_round(request), await read_message(request))
    resent = await _on_reader(ledger, ledger.store.resent_partial, signed)
    if resent is not None:  # a public partial copied: no pairing, not the key's budget
        replayed(request, signed.signer)
        return web.json_response(resent)
    set_signer(request, signed.signer)
    if not await verify_bls(request, signed.signer, ledger.store.partial_verifies, signed):
        raise RejectedInput("the partial signature does not verify against the validator's "
                            "public key share", "bad_signature")
    return web.json_response(await ledger.write(ledger.store.post_beacon_partial, signed))


@routes.get("/v1/runs/{run_id}/rounds/{round}/partials")
async def get_beacon_partials(request: web.Request) -> web.Response:
    """A round's fixed threshold beacon (or null) and every partial stored for it."""
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        ledger.store.threshold_beacon_state, request.match_info["run_id"],
        path_round(request)))


async def _board_resend(request: web.Request, ledger: Ledger, table: str, kind: str,
                        signed: Signed[Any]) -> bool:
    """A sharded or masked round's board post: True for an exact copy of a stored post
    (charged to the sender's address with the key, never to the key's own budget: a third
    party replaying a validator's or worker's public post does not silence it); otherwise
    its signer sent it and is charged. The URL is checked first either way."""
    _same_url(request, signed.message, "message")
    if await _on_reader(ledger, ledger.store.stored_board_post, table, kind, signed):
        replayed(request, signed.signer)
        return True
    set_signer(request, signed.signer)
    return False


@routes.post("/v1/runs/{run_id}/rounds/{round}/shards")
async def post_shard_result(request: web.Request) -> web.Response:
    """Multipart: ``publication`` (signed ShardPublication) then ``result`` (its tensor file,
    staged and published only with the publication)."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    raw = await part_bytes(request, reader, "publication", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(raw), ShardPublication)
    msg = signed.message
    if await _board_resend(request, ledger, "shard", "result", signed):
        return web.json_response({"shard": msg.shard, "result_digest": msg.result_digest,
                                  "already": True}, status=201)
    spec = await ledger.read(lambda s: ledger.store.get_spec(s, msg.run_id))
    if spec.validator_index(signed.signer) is None or not spec.shards:
        raise RejectedInput("only a validator of a sharded run publishes shard results",
                            "unknown_validator")
    limit = max_shard_file_bytes(spec.num_params, spec.shards)
    resent = await _on_reader(ledger, ledger.store.precheck_shard_result, signed)
    if resent is not None:
        return web.json_response(resent, status=201)
    staged: list[StagedBlob] = []
    try:
        staged.append(await part_to_staged(request, reader, "result", limit, msg.result_hash,
                                           "shard", msg.run_id))
        if staged[0].size != msg.result_bytes:
            raise RejectedInput(f"result file is {staged[0].size} bytes, the publication says "
                                f"{msg.result_bytes}", "malformed")
        reply = await ledger.write(ledger.store.post_shard_result, signed, tuple(staged))
    finally:
        _discard(staged)
    return web.json_response(reply, status=201)


@routes.post("/v1/runs/{run_id}/rounds/{round}/shards/check")
async def post_shard_check_share(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    signed = open_signed(await read_message(request), ShardCheckShare)
    if await _board_resend(request, ledger, "shard", "check_share", signed):
        return web.json_response({"already": True})  # its BLS share is not verified again
    pairing = await _on_reader(ledger, ledger.store.precheck_shard_check_share, signed)
    if not await verify_bls(request, signed.signer, ledger.store.bls.verify, *pairing):
        raise RejectedInput("shard check share does not verify", "bad_signature")
    return web.json_response(await ledger.write(ledger.store.post_shard_check_share, signed))


@routes.post("/v1/runs/{run_id}/rounds/{round}/shards/findings")
async def post_shard_finding(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    signed = open_signed(await read_message(request), ShardFindingReport)
    if await _board_resend(request, ledger, "shard", "finding", signed):
        return web.json_response({"already": True}, status=201)
    return web.json_response(await ledger.write(ledger.store.post_shard_finding, signed),
                             status=201)


@routes.get("/v1/runs/{run_id}/rounds/{round}/shards")
async def get_round_shards(request: web.Request) -> web.Response:
    """The round's shard results, the fixed list and check seed, findings and faults."""
    ledger = request.app[LEDGER]
    return web.json_response(await ledger.read(
        ledger.store.round_shards, request.match_info["run_id"], path_round(request)))


SECAGG_KINDS = {"keys": SecaggKeys, "deal": SecaggDeal, "reveal": SecaggReveal,
                "opening": SecaggOpening, "view": SecaggView}


@routes.post("/v1/runs/{run_id}/rounds/{round}/secagg/masked")
async def post_secagg_masked(request: web.Request) -> web.Response:
    """Multipart: ``envelope`` (signed SecaggMasked) then ``words`` (4 D bytes, uint32 LE,
    staged and published only with the post)."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    raw = await part_bytes(request, reader, "envelope", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(raw), SecaggMasked)
    if await _board_resend(request, ledger, "secagg", "masked", signed):
        return web.json_response({"kind": "masked", "already": True}, status=201)
    msg = signed.message
    spec = await ledger.read(lambda s: ledger.store.get_spec(s, msg.run_id))
    if spec.masked is None:
        raise RejectedInput(f"run {spec.run_id} does not mask its updates", "not_masked")
    limit = words_file_bytes(spec.num_params)
    if msg.words_bytes != limit:
        raise RejectedInput(f"a masked input of this run is {limit} bytes", "malformed")
    if await _on_reader(ledger, ledger.store.precheck_secagg, "masked", signed):
        return web.json_response({"kind": "masked", "already": True}, status=201)
    staged: list[StagedBlob] = []
    try:
        staged.append(await part_to_staged(request, reader, "words", limit, msg.words_hash,
                                           "masked", msg.run_id))
        if staged[0].size != limit:
            raise RejectedInput(f"words file is {staged[0].size} bytes, not {limit}",
                                "malformed")
        reply = await ledger.write(ledger.store.post_secagg, "masked", signed, tuple(staged))
    finally:
        _discard(staged)
    return web.json_response(reply, status=201)


@routes.post("/v1/runs/{run_id}/rounds/{round}/secagg/openings")
async def post_openings_share(request: web.Request) -> web.Response:
    """A validator's share of a masked round's openings seed (protocol/openings.py): taken
    once the masked inputs are committed, over the board's own inputs digest only."""
    ledger = request.app[LEDGER]
    signed = open_signed(await read_message(request), OpeningsShare)
    if await _board_resend(request, ledger, "secagg", openings.SHARE, signed):
        return web.json_response({"kind": openings.SHARE, "already": True}, status=201)
    pairing = await _on_reader(ledger, ledger.store.precheck_openings_share, signed)
    if pairing is not None and not await verify_bls(request, signed.signer,
                                                    ledger.store.bls.verify, *pairing):
        raise RejectedInput("the openings share does not verify", "bad_signature")
    return web.json_response(await ledger.write(ledger.store.post_openings_share, signed),
                             status=201)


@routes.post("/v1/runs/{run_id}/rounds/{round}/secagg/{kind}")
async def post_secagg(request: web.Request) -> web.Response:
    """A key advert, deal, reveal or opening on a masked round's board."""
    ledger = request.app[LEDGER]
    kind = request.match_info["kind"]
    if kind not in SECAGG_KINDS:
        raise RejectedInput(f"no board post kind {kind!r}", "not_found")
    signed = open_signed(await read_message(request), SECAGG_KINDS[kind])
    if await _board_resend(request, ledger, "secagg", kind, signed):
        return web.json_response({"kind": kind, "already": True}, status=201)
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
    it is checked before the file is read; the file is staged and published only with
    the reveal."""
    ledger = request.app[LEDGER]
    reader = await request.multipart()
    raw = await part_bytes(request, reader, "envelope", MAX_MESSAGE_BYTES)
    signed = open_signed(decode_canonical(raw), SpotReveal)
    msg = signed.message
    _same_url(request, msg, "reveal")
    try:
        done = await _on_reader(ledger, ledger.store.precheck_spot_reveal, signed)
    except RejectedInput:
        set_signer(request, signed.signer)  # a fresh message: its signer sent it
        raise
    if done is not None:
        replayed(request, signed.signer)
        return web.json_response(done.to_wire())
    set_signer(request, signed.signer)
    staged: list[StagedBlob] = []
    try:
        staged.append(await part_to_staged(request, reader, "reveal", msg.reveal_bytes,
                                           msg.reveal_hash, "reveal", msg.run_id))
        receipt = await ledger.write(ledger.store.accept_spot_reveal, signed, staged[0].digest,
                                     staged[0].size, tuple(staged))
    finally:
        _discard(staged)
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
    return web.FileResponse(path, headers=BLOB_HEADERS)


