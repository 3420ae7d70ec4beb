"""The ledger's HTTP server (aiohttp): the app built from its route modules.

Route modules (node_api.py for the nodes, audit_api.py for auditors, web_page.py for
people) are thin handlers over :class:`LedgerStore`: they decode, call the store on the
single writer thread (reads go to a small reader pool), and encode the reply. Every
refusal is an ``application/problem+json`` body with a stable ``reason`` and, when its
signer sent it into an existing run, is recorded in the ``rejections`` table (bounded per
run, reason and hour; :func:`problems_middleware`); an unexpected error is logged and
answered 500 without details, a client that hangs up is logged as an abort. Every response
carries the security headers of :data:`SECURITY_HEADERS`. Beside the requests run the round ticker, the
checkpoint signer and the blob pruner (:class:`BackgroundPruner`, retention.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from sqlalchemy import select
from sqlalchemy.orm import Session
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity

from . import audit_api, membership_api, node_api, retention, web_page
from . import schema as t
from .api_base import (
    LEDGER,
    MAX_MESSAGE_BYTES,
    SIGNER,
    STATUS_BY_REASON,
    Ledger,
    LedgerConfig,
    problem,
)
from .blobs import BlobStore
from .guards import media_type_middleware
from .metrics import METRICS, Metrics, metrics_middleware
from .ratelimit import LIMITS, RateLimits, ratelimit_middleware
from .store import LedgerStore

__all__ = ["LEDGER", "PRUNER", "LedgerConfig", "make_app", "problems_middleware"]

log = logging.getLogger("veritrain.ledger")

#: On every response: nothing is sniffed, framed or sent a referrer.
SECURITY_HEADERS = {"X-Content-Type-Options": "nosniff", "X-Frame-Options": "DENY",
                    "Referrer-Policy": "no-referrer",
                    "Cross-Origin-Resource-Policy": "same-origin"}
#: The web pages load only their own script and style sheet (one inline width style).
PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
            "frame-ancestors 'none'")
#: Everything else (JSON, CSV, exports, metrics) is data, never a document.
DATA_CSP = "default-src 'none'; frame-ancestors 'none'; sandbox"


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    html = response.headers.get("Content-Type", "").startswith("text/html")
    response.headers.setdefault("Content-Security-Policy", PAGE_CSP if html else DATA_CSP)


def _member(s: Session, run_id: str, key: str) -> bool:
    run = s.get(t.Run, run_id)
    return run is not None and (run.organiser == key or s.execute(select(t.Participant.id).where(
        t.Participant.run_id == run_id, t.Participant.pubkey == key)).first() is not None)


def _endpoint(request: web.Request) -> str:
    resource = request.match_info.route.resource
    return request.method + " " + (resource.canonical if resource else request.path)


async def _record(request: web.Request, exc: RejectedInput) -> None:
    """Write a refusal as a row only when its signer sent it (a fresh message whose
    signature verified; never a copy of a stored one) and is a member of the run (its
    organiser, a validator or a registered worker: a throwaway key costs no row), at most
    ``rejection_rows_per_hour`` per run and reason; every refusal is counted in /metrics."""
    signer = request.get(SIGNER)
    run_id = request.match_info.get("run_id", "")
    if signer is None or not run_id or len(run_id) > 64:
        return
    ledger = request.app[LEDGER]
    if not await ledger.read(_member, run_id, signer):
        return
    if not ledger.rejection_budget.take(run_id, exc.reason):
        return
    round_txt = request.match_info.get("round", "")
    await ledger.write(ledger.store.record_rejection, run_id,
                       int(round_txt) if round_txt.isdigit() and len(round_txt) < 12 else None,
                       signer, _endpoint(request)[:64], exc.reason, str(exc))


@web.middleware
async def problems_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn refusals into problem+json, record them, and never leak a traceback."""
    try:
        return await handler(request)
    except RejectedInput as exc:
        status = STATUS_BY_REASON.get(exc.reason, 400)
        if request.method not in ("GET", "HEAD"):
            try:
                await _record(request, exc)
            except Exception:
                log.warning("could not record a refusal on %s", request.path, exc_info=True)
        return problem(status, exc.reason, str(exc))
    except web.HTTPRequestEntityTooLarge as exc:
        return problem(413, "oversized", exc.text or "request body too large")
    except web.HTTPException as exc:
        if exc.status >= 400:
            resp = problem(exc.status, exc.reason.lower().replace(" ", "_"),
                           exc.text or exc.reason)
            wait = getattr(exc, "wait", None)  # a rate limit's own wait (ratelimit.py)
            if isinstance(wait, float):
                resp.headers["Retry-After"] = str(max(1, math.ceil(min(wait, 3600))))
            return resp
        raise
    except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as exc:
        log.info("client aborted %s %s: %s", request.method, request.path, exc)
        return problem(400, "aborted", "the client closed the connection mid-request")
    except Exception:
        log.exception("internal error on %s %s", request.method, request.path)
        return problem(500, "internal_error", "internal error; the request changed nothing")


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
    ledger.verifier.shutdown(wait=True)
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
    app = web.Application(client_max_size=MAX_MESSAGE_BYTES, middlewares=[
        metrics_middleware, ratelimit_middleware, problems_middleware, media_type_middleware])
    app[LEDGER] = ledger
    app.on_response_prepare.append(_security_headers)
    if not config.retention.keep_blobs:
        app[PRUNER] = BackgroundPruner(ledger)
    app[METRICS] = Metrics()
    app[LIMITS] = RateLimits.build(config.ip_rate, config.ip_burst, config.key_rate,
                                   config.key_burst, config.bad_signature_rate,
                                   config.bad_signature_burst)
    app.add_routes(node_api.routes)
    app.add_routes(membership_api.routes)
    app.add_routes(audit_api.routes)
    app.add_routes(web_page.routes)
    app.cleanup_ctx.append(_collector)
    app.cleanup_ctx.append(_ticker)
    app.cleanup_ctx.append(_checkpoint_signer)
    app.cleanup_ctx.append(_pruner)  # stopped first: before the writer shuts down
    return app


#: Temporary upload files untouched this long are leftovers (uploads write at least every
#: idle limit; a staged file waits for one writer transaction).
TMP_MAX_AGE_SECONDS = 600.0


async def _collector(app: web.Application) -> AsyncIterator[None]:
    """At start, before any request: delete published files no blob row names (a crash
    between publishing and commit; refused uploads an older version kept). Then, every
    minute, the temporary files of uploads cut short that nothing deleted."""
    ledger = app[LEDGER]

    def referenced(batch: list[str]) -> set[str]:
        with ledger.store.sessions() as s:
            return set(s.execute(select(t.Blob.sha256).where(t.Blob.sha256.in_(batch)))
                       .scalars())

    gone = await ledger.write(ledger.blobs.collect_unreferenced, referenced)
    if gone:
        log.info("collected %d blob files no row names", gone)

    async def loop() -> None:
        while True:
            await asyncio.sleep(60.0)
            try:
                await asyncio.to_thread(ledger.blobs.sweep_tmp, TMP_MAX_AGE_SECONDS)
            except Exception:
                log.exception("sweeping upload leftovers failed")

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


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


class BackgroundPruner:
    """The server's pruning: a pass at start and after each finalized round (node_api sets
    ``ledger.finalized``), off the request path. The plan is read on a reader thread (only
    the rounds that left the window since the last pass), each batch of at most
    ``retention.BATCH`` files is recorded in one short writer transaction and then deleted on
    a thread of its own; the log says what went and what stays on disk."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        self.policy: retention.RetentionPolicy = ledger.config.retention
        self.done: dict[str, int] = {}
        self.passes = 0
        self._busy = False

    async def run_forever(self) -> None:
        event = self.ledger.finalized
        event.set()  # catch up at start (and apply a changed window)
        while True:
            await event.wait()
            event.clear()
            self._busy = True
            try:
                await self.run_pass()
            except Exception:
                log.exception("pruning blobs failed; the next finalized round tries again")
            finally:
                self._busy = False

    async def run_pass(self) -> retention.PruneReport:
        ledger = self.ledger
        todo = await ledger.read(
            lambda s: retention.plan(s, ledger.blobs, self.policy, done=self.done))
        freed = recorded = 0
        for batch in retention.batches(todo.candidates):
            recorded += await ledger.write(retention.record_batch, ledger.store.sessions,
                                           batch, self.policy, ledger.store.clock())
            freed += await asyncio.to_thread(retention.delete_files, ledger.blobs, batch)
        self.done.update(todo.through)
        self.passes += 1
        report = retention.PruneReport(self.policy, todo.candidates, freed, recorded,
                                       await ledger.read(retention.usage))
        if todo.candidates:
            for line in report.lines():
                log.info("pruned: %s", line)
        return report

    async def settle(self, timeout: float = 30.0) -> None:
        """Wait until no pass is due or running (tests)."""
        deadline = time.monotonic() + timeout
        while self.ledger.finalized.is_set() or self._busy:
            if time.monotonic() > deadline:
                raise TimeoutError("the pruner did not settle")
            await asyncio.sleep(0.02)


#: The app's background pruner (absent with ``--keep-blobs``).
PRUNER = web.AppKey("pruner", BackgroundPruner)


async def _pruner(app: web.Application) -> AsyncIterator[None]:
    """Delete the blob files the retention policy lets go, after each finalized round
    (retention.py); nothing with ``--keep-blobs``."""
    pruner = app.get(PRUNER)
    if pruner is None:
        yield
        return
    task = asyncio.create_task(pruner.run_forever())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
