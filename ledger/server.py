"""The ledger's HTTP server (aiohttp): the app built from its route modules.

Route modules (node_api.py for the nodes, audit_api.py for auditors, web_page.py for
people) are thin handlers over :class:`LedgerStore`: they decode, call the store on the
single writer thread (reads go to a small reader pool), and encode the reply. Every
refusal is an ``application/problem+json`` body with a stable ``reason`` and is recorded
in the ``rejections`` table (:func:`problems_middleware`); an unexpected error is logged
and answered 500 without details.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity

from . import audit_api, node_api, web_page
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

__all__ = ["LEDGER", "LedgerConfig", "make_app", "problems_middleware"]

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
    app[METRICS] = Metrics()
    app[LIMITS] = RateLimits.build(config.ip_rate, config.ip_burst, config.key_rate,
                                   config.key_burst)
    app.add_routes(node_api.routes)
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
