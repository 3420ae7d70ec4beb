"""Read endpoints for auditors: paged and filtered lists, CSV and JSON exports, the
event log, a worker's history, the run report, rejections, the blobs the retention policy
pruned, the signed export file, /metrics and the OpenAPI document (specs/ledger-api.md).

All reads are public. Whole-table exports stream: rows are read in batches on
a thread of their own while earlier batches are sent.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web
from sqlalchemy.orm import Session
from veritrain.protocol.errors import EncodingError

from . import lists, queries, retention
from .api_base import LEDGER, Ledger, int_param
from .export import export_lines
from .metrics import CONTENT_TYPE, METRICS, db_gauges, render
from .openapi import build_document
from .ratelimit import LIMITS
from .store import begin_snapshot

routes = web.RouteTableDef()
CHUNK_ROWS = 500


def _hex_key(request: web.Request, name: str) -> str | None:
    value = request.query.get(name)
    if value is not None and (len(value) > 64 or not value.isalnum()):
        raise EncodingError(f"query parameter {name} must be a hex key")
    return value


def verdict_filter(request: web.Request) -> lists.VerdictFilter:
    status = request.query.get("status")
    if status is not None and status not in lists.VERDICT_STATUSES:
        raise EncodingError(f"status must be one of {', '.join(lists.VERDICT_STATUSES)}")
    r = int_param(request, "round")
    if r is not None and r < 0:
        raise EncodingError("round must be a non-negative integer")
    return lists.VerdictFilter(worker=_hex_key(request, "worker"), round=r, status=status)


def paging(request: web.Request) -> tuple[int, int]:
    offset = int_param(request, "offset", 0) or 0
    limit = int_param(request, "limit", 100) or 100
    if offset < 0 or limit < 1:
        raise EncodingError("offset must be >= 0 and limit >= 1")
    return lists.page_bounds(offset, limit)


async def stream(request: web.Request, make: Callable[[Session], Iterator[bytes]],
                 content_type: str, filename: str) -> web.StreamResponse:
    """Stream ``make(session)``'s chunks, produced on one thread that owns the session.

    Errors raised before the first chunk (an unknown run) still become problem+json.
    """
    ledger: Ledger = request.app[LEDGER]
    loop = asyncio.get_running_loop()
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-export")
    session = ledger.store.sessions()
    stop = threading.Event()

    def start() -> Iterator[bytes]:
        begin_snapshot(session)  # the whole export is one committed state
        return iter(make(session))

    def next_chunk(it: Iterator[bytes]) -> bytes:
        parts: list[bytes] = []
        for part in it:
            parts.append(part)
            if len(parts) >= CHUNK_ROWS or stop.is_set():
                break
        return b"".join(parts)

    try:
        it = await loop.run_in_executor(thread, start)
        chunk = await loop.run_in_executor(thread, next_chunk, it)
        resp = web.StreamResponse(headers={
            "Content-Type": content_type,
            "Content-Disposition": f'attachment; filename="{filename}"'})
        await resp.prepare(request)
        while chunk:
            await resp.write(chunk)
            chunk = await loop.run_in_executor(thread, next_chunk, it)
        await resp.write_eof()
        return resp
    finally:
        stop.set()
        await loop.run_in_executor(thread, session.close)
        thread.shutdown(wait=False)


def _csv_rows(header: Iterable[str], rows: Iterable[dict[str, Any]]) -> Iterator[bytes]:
    cols = list(header)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(cols)
    yield buf.getvalue().encode()
    for row in rows:
        buf.seek(0)
        buf.truncate()
        writer.writerow(["" if row[c] is None else row[c] for c in cols])
        yield buf.getvalue().encode()


def _json_array(rows: Iterable[dict[str, Any]]) -> Iterator[bytes]:
    yield b"["
    first = True
    for row in rows:
        yield (b"" if first else b",") + json.dumps(row, separators=(",", ":")).encode()
        first = False
    yield b"]\n"


# ----------------------------------------------------------------------------- lists


@routes.get("/v1/runs/{run_id}/verdicts")
async def verdicts(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    f, (offset, limit) = verdict_filter(request), paging(request)
    return web.json_response(await ledger.read(
        lists.verdicts_page, request.match_info["run_id"], f, offset, limit))


@routes.get("/v1/runs/{run_id}/verdicts.csv")
async def verdicts_csv(request: web.Request) -> web.StreamResponse:
    run_id, f = request.match_info["run_id"], verdict_filter(request)
    return await stream(request, lambda s: _csv_rows(
        lists.VERDICT_COLUMNS, lists.iter_verdicts(s, run_id, f)),
        "text/csv; charset=utf-8", f"{run_id}-verdicts.csv")


@routes.get("/v1/runs/{run_id}/verdicts.json")
async def verdicts_json(request: web.Request) -> web.StreamResponse:
    run_id, f = request.match_info["run_id"], verdict_filter(request)
    return await stream(request, lambda s: _json_array(lists.iter_verdicts(s, run_id, f)),
                        "application/json", f"{run_id}-verdicts.json")


@routes.get("/v1/runs/{run_id}/scores")
async def scores(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    worker, (offset, limit) = _hex_key(request, "worker"), paging(request)
    return web.json_response(await ledger.read(
        lists.totals_page, request.match_info["run_id"], worker, offset, limit))


@routes.get("/v1/runs/{run_id}/scores.csv")
async def scores_csv(request: web.Request) -> web.StreamResponse:
    run_id, worker = request.match_info["run_id"], _hex_key(request, "worker")
    return await stream(request, lambda s: _csv_rows(
        lists.TOTAL_COLUMNS, lists.iter_totals(s, run_id, worker)),
        "text/csv; charset=utf-8", f"{run_id}-scores.csv")


@routes.get("/v1/runs/{run_id}/scores.json")
async def scores_json(request: web.Request) -> web.StreamResponse:
    run_id, worker = request.match_info["run_id"], _hex_key(request, "worker")
    return await stream(request, lambda s: _json_array(lists.iter_totals(s, run_id, worker)),
                        "application/json", f"{run_id}-scores.json")


@routes.get("/v1/runs/{run_id}/submissions")
async def submissions(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    worker, (offset, limit) = _hex_key(request, "worker"), paging(request)
    r = int_param(request, "round")
    if r is not None and r < 0:
        raise EncodingError("round must be a non-negative integer")
    return web.json_response(await ledger.read(
        lists.submissions_page, request.match_info["run_id"], worker, r, offset, limit))


@routes.get("/v1/runs/{run_id}/pruned")
async def pruned(request: web.Request) -> web.Response:
    """The blobs the retention policy deleted (retention.py): gone by policy, not lost."""
    ledger = request.app[LEDGER]
    offset, limit = paging(request)
    return web.json_response(await ledger.read(
        retention.pruned_page, request.match_info["run_id"], offset, limit))


@routes.get("/v1/runs/{run_id}/export")
async def export(request: web.Request) -> web.StreamResponse:
    """The run's signed history as JSON lines (export.py), up to its latest checkpoint."""
    ledger: Ledger = request.app[LEDGER]
    run_id, key = request.match_info["run_id"], ledger.store.identity.public_key.hex()
    return await stream(request, lambda s: export_lines(s, run_id, key),
                        "application/x-ndjson", f"{run_id}.ledger.jsonl")


# ----------------------------------------------------------------------------- service


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    ledger = request.app[LEDGER]
    gauges = await ledger.read(db_gauges)
    limits = request.app.get(LIMITS)
    text = render(request.app[METRICS], gauges, limits.refused if limits else {})
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(build_document())


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
