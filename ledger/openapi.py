"""The ledger API's OpenAPI 3.1 document: built here, served at /openapi.json,
checked in as specs/openapi.json (``python -m veritrain.ledger.openapi > specs/openapi.json``).

A test compares the document with the routes the server really has and with
the checked-in copy, and schemathesis checks the answers against it.
"""

from __future__ import annotations

import copy
import json
import sys
from functools import cache
from typing import Any

HEX64 = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
RUN_ID = {"type": "string", "pattern": "^[a-z0-9][a-z0-9-]{2,63}$"}
NUM = {"type": "number"}
INT = {"type": "integer"}
STR = {"type": "string"}
BOOL = {"type": "boolean"}
OBJ = {"type": "object"}


def nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "object", "required": sorted(required),
            "properties": {**required, **(optional or {})}}


def arr(items: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": items}


def ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


SCHEMAS: dict[str, Any] = {
    "Problem": obj({"type": STR, "title": STR, "status": INT, "reason": STR, "detail": STR}),
    "Signed": obj({"kind": STR, "body": OBJ, "signer": HEX64,
                   "signature": {"type": "string", "pattern": "^[0-9a-f]{128}$"}}),
    "Page": obj({"offset": INT, "limit": INT, "next_offset": nullable(INT)}),
    "Verdict": obj({"round": INT, "worker": STR, "status": STR, "reason": STR, "detail": STR,
                    "spot_checked": BOOL, "distance": nullable(NUM), "samples": INT,
                    "quality": NUM, "score": NUM, "reward": NUM}),
    "WorkerTotals": obj({"worker": STR, "registered_round": INT, "banned_until_round": INT,
                         "rounds": INT, "accepted": INT, "rejected": INT, "excluded": INT,
                         "spot_checked": INT,
                         "samples": INT, "score": NUM, "reward": NUM, "penalties": INT}),
    "SubmissionRow": obj({"round": INT, "worker": STR, "digest": HEX64, "payload_hash": HEX64,
                          "payload_bytes": INT, "samples": INT, "received_at": NUM}),
    "PrunedBlob": obj({"sha256": HEX64, "kind": {"type": "string",
                                                  "enum": ["reveal", "model", "outer_state"]},
                       "round": INT, "worker": nullable(HEX64), "size": INT, "pruned_at": NUM,
                       "policy": STR}),
    "Rejection": obj({"round": nullable(INT), "signer": nullable(STR), "endpoint": STR,
                      "reason": STR, "detail": STR, "at": NUM}),
    "Event": obj({"seq": INT, "kind": STR, "prev_hash": HEX64, "hash": HEX64,
                  "checkpoint": nullable(STR), "body": STR}),
    "Round": obj({"run_id": STR, "run_status": STR, "round": INT, "status": STR,
                  "base_model_hash": HEX64, "outer_state_hash": nullable(HEX64),
                  "base_certificate": nullable(OBJ), "opened_at": NUM, "deadline": NUM,
                  "extensions": INT, "closed_at": nullable(NUM), "finalized_at": nullable(NUM),
                  "submissions": INT, "certificate": nullable(OBJ), "eval_loss": nullable(NUM),
                  "now": NUM}),
}


def _page(name: str, item: str) -> dict[str, Any]:
    return {"allOf": [ref("Page"), obj({"run_id": STR, name: arr(ref(item))})]}


SCHEMAS["VerdictPage"] = _page("verdicts", "Verdict")
SCHEMAS["WorkerTotalsPage"] = _page("workers", "WorkerTotals")
SCHEMAS["SubmissionPage"] = _page("submissions", "SubmissionRow")
SCHEMAS["PrunedPage"] = _page("pruned", "PrunedBlob")

RUN = {"name": "run_id", "in": "path", "required": True, "schema": STR}
ROUND = {"name": "round", "in": "path", "required": True,
         "schema": {"type": "string", "pattern": "^[0-9]{1,12}$"}}
WORKER_PATH = {"name": "worker", "in": "path", "required": True, "schema": STR}
DIGEST = {"name": "digest", "in": "path", "required": True, "schema": HEX64}


def q(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema,
            "description": description}


PAGING = [q("offset", {"type": "integer", "minimum": 0, "maximum": 10**12}, "rows to skip"),
          q("limit", {"type": "integer", "minimum": 1, "maximum": 1000},
            "rows per page (at most 1000)")]
F_WORKER = q("worker", {"type": "string", "pattern": "^[0-9a-f]{1,64}$"}, "worker key (hex)")
F_ROUND = q("round", {"type": "integer", "minimum": 0, "maximum": 10**12}, "round number")
F_STATUS = q("status", {"type": "string", "enum": ["accepted", "rejected", "excluded"]},
             "verdict status")


def problems(*codes: int) -> dict[str, Any]:
    out = {}
    for code in (400, 429, *codes):
        out[str(code)] = {"description": "refused (problem details)",
                          "content": {"application/problem+json": {"schema": ref("Problem")}}}
    return out


def ok(schema: dict[str, Any], description: str = "OK", status: int = 200,
       media: str = "application/json") -> dict[str, Any]:
    return {str(status): {"description": description, "content": {media: {"schema": schema}}}}


def op(summary: str, params: list[dict[str, Any]], responses: dict[str, Any],
       body: dict[str, Any] | None = None, tag: str = "audit") -> dict[str, Any]:
    """Every operation may answer 400 (bad parameters) and 429 (rate limited); one
    with a body also 408 (body too slow), 413 (too large) and 415 (wrong media type)."""
    extra = problems(408, 413, 415) if body is not None else problems()
    out: dict[str, Any] = {"summary": summary, "tags": [tag], "parameters": params,
                           "responses": {**extra, **responses}}
    if body is not None:
        out["requestBody"] = body
    return out


def json_body(description: str) -> dict[str, Any]:
    return {"required": True, "description": description,
            "content": {"application/json": {"schema": ref("Signed")}}}


def multipart(parts: dict[str, str]) -> dict[str, Any]:
    props = {name: {"type": "string", "format": "binary", "description": text}
             for name, text in parts.items()}
    return {"required": True, "description": "parts in this order: " + ", ".join(parts),
            "content": {"multipart/form-data": {"schema": {
                "type": "object", "required": list(parts), "properties": props}}}}


def _paths() -> dict[str, Any]:
    run = "/v1/runs/{run_id}"
    rnd = run + "/rounds/{round}"
    html = {"200": {"description": "HTML page", "content": {"text/html": {"schema": STR}}}}
    csv = {"description": "CSV, one header line", "content": {"text/csv": {"schema": STR}}}
    return {
        "/v1/health": {"get": op("liveness", [], ok(obj({"status": STR})), tag="service")},
        "/v1/ledger": {"get": op("the ledger's key, its runs and its clock", [], ok(obj({
            "ledger_key": HEX64, "runs": arr(OBJ), "now": NUM})), tag="service")},
        "/v1/runs": {"post": op(
            "create a run (signed RunSpec, dataset and genesis blobs)", [],
            {"201": ok(obj({"run_id": STR}), "created", 201)["201"], **problems(401, 409, 413)},
            multipart({"spec": "signed RunSpec (canonical JSON)", "dataset": "dataset blob",
                       "genesis": "genesis model file"}), tag="write")},
        run: {"get": op("the signed run spec, its status and current round", [RUN],
                        {**ok(obj({"spec": OBJ, "status": STR, "current_round": nullable(INT)})),
                         **problems(404)})},
        run + "/participants": {
            "get": op("workers' signed registrations and ban state, paged", [RUN, *PAGING],
                      ok(obj({"run_id": STR, "participants": arr(OBJ), "offset": INT,
                              "limit": INT, "next_offset": nullable(INT)}))),
            "post": op("register (idempotent)", [RUN], {**ok(obj({
                "participant": STR, "role": STR, "registered_round": INT, "new": BOOL})),
                **problems(401, 404, 413)}, json_body("signed Registration"), tag="write")},
        run + "/membership": {
            "get": op("the admission policy and the membership rows (tickets, revocations, "
                      "bond deposits and withdrawals, slashes) after seq, in chain order",
                      [RUN, q("after", {"type": "integer", "minimum": -1, "maximum": 10**12},
                              "last seq already read (default -1)"),
                       q("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "rows")],
                      {**ok(obj({"run_id": STR, "admission": OBJ,
                                 "first_unclosed_round": INT, "rows": arr(OBJ),
                                 "next_after": nullable(INT)})),
                       **problems(404)}),
            "post": op("post a signed admission ticket, revocation, bond deposit or "
                       "withdrawal (idempotent)", [RUN], {**ok(obj({
                           "kind": STR, "digest": HEX64, "sequence": INT, "new": BOOL})),
                           **problems(401, 403, 404, 409, 413)},
                       json_body("signed membership message"), tag="write")},
        run + "/rounds/current": {"get": op("the latest round", [RUN],
                                            {**ok(ref("Round")), **problems(404)})},
        rnd: {"get": op("one round with its verdicts and door rejections", [RUN, ROUND],
                        {**ok({"allOf": [ref("Round"), obj({"verdicts": arr(OBJ),
                                                            "rejections": arr(OBJ)})]}),
                         **problems(404)})},
        rnd + "/submissions": {
            "get": op("the sealed submission list of a closed round", [RUN, ROUND],
                      {**ok(obj({"submissions": arr(ref("Signed")), "excluded": OBJ})),
                       **problems(404, 409)}),
            "post": op("submit (signed Submission, then its payload)", [RUN, ROUND],
                       {"201": ok(ref("Signed"), "the ledger's signed receipt", 201)["201"],
                        "200": ok(ref("Signed"), "this envelope was already recorded: "
                                  "the same receipt")["200"],
                        **problems(401, 403, 404, 409, 413)},
                       multipart({"envelope": "signed Submission", "payload": "payload bytes"}),
                       tag="write")},
        rnd + "/beacon": {
            "get": op("the round's fixed beacon, or null, with its signers' signed shares "
                      "(each names the sealed list its validator saw)", [RUN, ROUND],
                      {**ok(obj({"run_id": STR, "round": INT, "beacon": nullable(OBJ),
                                 "envelopes": arr(OBJ)})),
                       **problems(404)}),
            "post": op("a validator's beacon share (after close, naming the round's sealed "
                       "list; a replay changes nothing)",
                       [RUN, ROUND], {**ok(obj({"beacon": nullable(OBJ)},
                                               {"shares": INT, "envelopes": arr(OBJ)})),
                                      **problems(401, 403, 404, 409, 413)},
                       json_body("signed BeaconShare"), tag="write")},
        run + "/dkg": {
            "get": op("a threshold-beacon run's DKG board: phases with deadlines, every post "
                      "by kind, the group key a quorum of validators signed, or null",
                      [RUN], {**ok(obj({"run_id": STR, "now": NUM, "phases": arr(OBJ),
                                        "phase": nullable(STR), "failed": BOOL,
                                        "group": nullable(OBJ), "posts": OBJ})),
                              **problems(404)}),
            "post": op("a validator's signed DKG post (keys, deal, complaint, justification, "
                       "result) to the open phase (a replay changes nothing)", [RUN],
                       {"201": ok(obj({"kind": STR, "already": BOOL}, {"group": BOOL}),
                                  "recorded", 201)["201"],
                        **problems(401, 403, 404, 409, 413)},
                       json_body("signed DkgKeys, DkgDeal, DkgComplaint, DkgJustification "
                                 "or DkgResult"), tag="write")},
        rnd + "/partials": {
            "get": op("a threshold-beacon round's fixed group signature, or null, and every "
                      "partial signature stored", [RUN, ROUND],
                      {**ok(obj({"run_id": STR, "round": INT, "beacon": nullable(OBJ),
                                 "partials": arr(OBJ)})), **problems(404)}),
            "post": op("a validator's partial signature (after close, naming the round's "
                       "sealed list; checked against its public key share)", [RUN, ROUND],
                       {**ok(obj({"run_id": STR, "round": INT, "beacon": nullable(OBJ),
                                  "partials": arr(OBJ)})),
                        **problems(401, 403, 404, 409, 413)},
                       json_body("signed BeaconPartial"), tag="write")},
        rnd + "/results": {
            "get": op("every validator's signed result", [RUN, ROUND],
                      ok(obj({"results": arr(ref("Signed"))}))),
            "post": op("a validator's signed result with the new model and outer state",
                       [RUN, ROUND], {"201": ok(obj({"status": STR, "certificate": BOOL}),
                                                "recorded", 201)["201"],
                                      **problems(401, 403, 404, 409, 413)},
                       multipart({"result": "signed RoundResult", "model": "model file",
                                  "outer_state": "outer optimizer state file",
                                  "update": "the aggregated update"}), tag="write")},
        rnd + "/shards": {
            "get": op("a sharded round: shard results, the fixed list and check seed, findings "
                      "and the shards a quorum found faulty", [RUN, ROUND],
                      {**ok(obj({"run_id": STR, "round": INT, "shards": INT, "quorum": INT,
                                 "results": arr(ref("Signed")), "list": nullable(arr(OBJ)),
                                 "check": nullable(OBJ), "check_shares": arr(ref("Signed")),
                                 "findings": arr(ref("Signed")), "faulty_shards": arr(INT)})),
                       **problems(404)}),
            "post": op("a validator's shard result (after the beacon, before the list is fixed)",
                       [RUN, ROUND], {"201": ok(obj({"shard": INT, "result_digest": HEX64,
                                                     "already": BOOL}), "recorded", 201)["201"],
                                      **problems(400, 401, 403, 404, 409, 413)},
                       multipart({"publication": "signed ShardPublication",
                                  "result": "the shard result file (safetensors)"}),
                       tag="write")},
        rnd + "/shards/check": {
            "post": op("a validator's BLS share over the published shard results: the first "
                       "fixes the list, a quorum the check seed", [RUN, ROUND],
                       {**ok(obj({"results": arr(OBJ), "check": nullable(OBJ), "shares": INT})),
                        **problems(400, 401, 403, 404, 409, 413)},
                       json_body("signed ShardCheckShare"), tag="write")},
        rnd + "/shards/findings": {
            "post": op("a validator's settled dispute over another validator's shard",
                       [RUN, ROUND], {"201": ok(obj({"already": BOOL}), "recorded", 201)["201"],
                                      **problems(400, 401, 403, 404, 409, 413)},
                       json_body("signed ShardFindingReport"), tag="write")},
        rnd + "/secagg": {
            "get": op("a masked round's board: buckets, phases (opened, deadline, closed, "
                      "expected senders) and posts", [RUN, ROUND, q(
                          "bucket", {"type": "integer", "minimum": 0, "maximum": 10**6},
                          "only this bucket's state and posts")],
                      {**ok(obj({"run_id": STR, "round": INT, "now": NUM, "started_at": NUM,
                                 "phases": arr(OBJ), "complete": BOOL, "buckets": arr(OBJ),
                                 "posts": OBJ, "openings": obj({
                                     "inputs": nullable(arr({"type": "array"})),
                                     "masked": nullable(STR), "shares": arr(OBJ),
                                     "fixed": nullable(OBJ)})})), **problems(404, 409)})},
        rnd + "/secagg/openings": {
            "post": op("a validator's share of the round's openings seed (once the masked "
                       "inputs are committed, over the board's own inputs digest); the share "
                       "that makes a quorum fixes the seed and the round's checks",
                       [RUN, ROUND], {**ok(OBJ, "recorded", 201),
                                      **problems(400, 401, 403, 404, 409, 413)},
                       json_body("signed OpeningsShare"), tag="write")},
        rnd + "/secagg/masked": {
            "post": op("a bucket member's masked input (while the masked phase is open)",
                       [RUN, ROUND], {"201": ok(obj({"kind": STR, "already": BOOL}), "recorded",
                                                201)["201"],
                                      **problems(400, 401, 403, 404, 409, 413)},
                       multipart({"envelope": "signed SecaggMasked",
                                  "words": "the masked words, 4 D bytes (uint32 LE)"}),
                       tag="write")},
        rnd + "/secagg/{kind}": {
            "post": op("a key advert, deal, reveal (kind keys, deal, reveal: while that phase "
                       "is open) or a spot-checked worker's opening", [RUN, ROUND, {
                           "name": "kind", "in": "path", "required": True,
                           "schema": {"type": "string",
                                      "enum": ["keys", "deal", "reveal", "opening"]}}],
                       {"201": ok(obj({"kind": STR, "already": BOOL}), "recorded", 201)["201"],
                        **problems(400, 401, 403, 404, 409, 413)},
                       json_body("signed SecaggKeys, SecaggDeal, SecaggReveal or SecaggOpening"),
                       tag="write")},
        rnd + "/challenges": {"get": op(
            "the round's checks per worker, with each signed reveal and its receipt",
            [RUN, ROUND],
            {**ok(obj({"run_id": STR, "round": INT, "fixed": BOOL,
                       "reveal_deadline": nullable(NUM), "now": NUM, "challenges": arr(OBJ),
                       "complete": BOOL})), **problems(404)})},
        rnd + "/reveals": {"post": op(
            "a worker's reveal for the round's checks (signed SpotReveal, then the file); "
            "one per worker, before the reveal deadline", [RUN, ROUND],
            {"201": ok(ref("Signed"), "the ledger's signed RevealReceipt", 201)["201"],
             "200": ok(ref("Signed"), "this envelope was already recorded: the same "
                       "receipt")["200"],
             **problems(401, 403, 404, 409, 413)},
            multipart({"envelope": "signed SpotReveal", "reveal": "the reveal file"}),
            tag="write")},
        "/v1/blobs/{digest}": {"get": op(
            "a content-addressed blob (sealed payloads: 403; deleted by the retention "
            "policy: 410, reason pruned)",
            [DIGEST], {"200": {"description": "the blob", "content": {
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                **problems(403, 404, 410)})},
        run + "/workers/{worker}": {"get": op(
            "one worker's submissions, verdicts, penalties and totals",
            [RUN, WORKER_PATH, *PAGING],
            {**ok(obj({"run_id": STR, "worker": STR, "role": STR, "registered_round": INT,
                       "banned_until_round": INT, "submissions": arr(OBJ),
                       "verdicts": arr(OBJ), "penalties": arr(OBJ), "totals": OBJ,
                       "offset": INT, "limit": INT})),
             **problems(404)})},
        run + "/report": {"get": op("the run at a glance", [RUN], {**ok(obj({
            "run_id": STR, "status": STR, "rounds": arr(OBJ), "workers": arr(OBJ),
            "rejections": arr(OBJ)})), **problems(404)})},
        run + "/events": {"get": op(
            "hash-chain rows after seq (with checkpoint signatures)",
            [RUN, q("after", {"type": "integer", "minimum": -1, "maximum": 10**12},
                    "last seq already read (default -1)"),
             q("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "rows")],
            ok(obj({"run_id": STR, "events": arr(ref("Event"))})))},
        run + "/rejections": {"get": op(
            "writes refused at the door",
            [RUN, F_ROUND, q("signer", STR, "signer key"), q("reason", STR, "reason code"),
             *PAGING], ok(obj({"run_id": STR, "rejections": arr(ref("Rejection")),
                               "offset": INT, "limit": INT})))},
        run + "/verdicts": {"get": op("verdicts with scores and rewards, paged",
                                      [RUN, F_WORKER, F_ROUND, F_STATUS, *PAGING],
                                      {**ok(ref("VerdictPage")), **problems(404)})},
        run + "/verdicts.csv": {"get": op("every matching verdict as CSV",
                                          [RUN, F_WORKER, F_ROUND, F_STATUS],
                                          {"200": csv, **problems(404)})},
        run + "/verdicts.json": {"get": op("every matching verdict as a JSON array",
                                           [RUN, F_WORKER, F_ROUND, F_STATUS],
                                           {**ok(arr(ref("Verdict"))), **problems(404)})},
        run + "/scores": {"get": op("per-worker totals over the run, paged",
                                    [RUN, F_WORKER, *PAGING],
                                    {**ok(ref("WorkerTotalsPage")), **problems(404)})},
        run + "/scores.csv": {"get": op("per-worker totals as CSV", [RUN, F_WORKER],
                                        {"200": csv, **problems(404)})},
        run + "/scores.json": {"get": op("per-worker totals as a JSON array", [RUN, F_WORKER],
                                         {**ok(arr(ref("WorkerTotals"))), **problems(404)})},
        run + "/submissions": {"get": op("submissions recorded, paged",
                                         [RUN, F_WORKER, F_ROUND, *PAGING],
                                         {**ok(ref("SubmissionPage")), **problems(404)})},
        run + "/pruned": {"get": op(
            "the blobs the ledger's retention policy deleted (their hashes stay in the chain), "
            "by round, paged", [RUN, *PAGING], {**ok(ref("PrunedPage")), **problems(404)})},
        run + "/export": {"get": op(
            "the signed history as JSON lines, for offline `audit verify --export`", [RUN],
            {"200": {"description": "header, events, verdicts, end line",
                     "content": {"application/x-ndjson": {"schema": STR}}}, **problems(404)})},
        "/metrics": {"get": op("Prometheus metrics", [], {"200": {
            "description": "text exposition format 0.0.4",
            "content": {"text/plain": {"schema": STR}}}}, tag="service")},
        "/openapi.json": {"get": op("this document", [], ok(OBJ), tag="service")},
        "/": {"get": op("web page: the runs", [], html, tag="web")},
        "/runs/{run_id}": {"get": op("web page: one run at a glance", [RUN],
                                     {**html, **problems(404)}, tag="web")},
        "/runs/{run_id}/rounds/{round}": {"get": op(
            "web page: one round, its verdicts with reasons and evidence, 100 a page",
            [RUN, ROUND, PAGING[0]], {**html, **problems(404)}, tag="web")},
        "/runs/{run_id}/workers/{worker}": {"get": op(
            "web page: one worker round by round, with its penalties, 100 rounds a page",
            [RUN, {**WORKER_PATH, "schema": {"type": "string", "pattern": "^[0-9a-f]{64}$"}},
             PAGING[0]], {**html, **problems(404)}, tag="web")},
        "/static/{name}": {"get": op("the web page's static files",
                                     [{"name": "name", "in": "path", "required": True,
                                       "schema": STR}],
                                     {"200": {"description": "a file", "content": {
                                         "text/css": {"schema": STR},
                                         "text/javascript": {"schema": STR}}},
                                      **problems(404)}, tag="web")},
    }


@cache
def _document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {"title": "veritrain ledger API", "version": "1",
                 "description": "Append-only, hash-chained accounting of a veritrain run. "
                 "Reads are public; writes take signed messages (specs/protocol.md). Refusals "
                 "are application/problem+json. See specs/ledger-api.md."},
        "paths": _paths(),
        "components": {"schemas": SCHEMAS},
    }


def build_document() -> dict[str, Any]:
    """A fresh copy of the document (callers may change it)."""
    return copy.deepcopy(_document())


def documented_operations(doc: dict[str, Any] | None = None) -> set[tuple[str, str]]:
    doc = doc or _document()
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item}


def request_media(method: str, path: str) -> str | None:
    """The body media type an operation takes (None: no body or any)."""
    item = _document()["paths"].get(path, {}).get(method.lower(), {})
    content = item.get("requestBody", {}).get("content", {})
    return next(iter(content), None)


if __name__ == "__main__":
    json.dump(build_document(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
