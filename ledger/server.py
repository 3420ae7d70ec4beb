"""The ledger's HTTP server (aiohttp): the app built from its route modules.

Route modules (node_api.py for the nodes, audit_api.py for auditors, web_page.py for
people) are thin handlers over :class:`LedgerStore`: they decode, call the store on the
single writer thread (reads go to a small reader pool), and encode the reply. Every
refusal is an ``application/problem+json`` body with a stable ``reason`` and is recorded
in the ``rejections`` table (:func:`problems_middleware`); an unexpected error is logged
and answered 500 without details. Beside the requests run the round ticker, the
checkpoint signer and the blob pruner (:class:`BackgroundPruner`, retention.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity

from . import audit_api, node_api, retention, web_page
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
    app = web.Application(client_max_size=MAX_MESSAGE_BYTES, middlewares=[
        metrics_middleware, ratelimit_middleware, problems_middleware, media_type_middleware])
    app[LEDGER] = ledger
    if not config.retention.keep_blobs:
        app[PRUNER] = BackgroundPruner(ledger)
    app[METRICS] = Metrics()
    app[LIMITS] = RateLimits.build(config.ip_rate, config.ip_burst, config.key_rate,
                                   config.key_burst)
    app.add_routes(node_api.routes)
    app.add_routes(audit_api.routes)
    app.add_routes(web_page.routes)
    app.cleanup_ctx.append(_ticker)
    app.cleanup_ctx.append(_checkpoint_signer)
    app.cleanup_ctx.append(_pruner)  # stopped first: before the writer shuts down
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
