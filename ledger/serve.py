"""Running the ledger server process."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
from pathlib import Path

from aiohttp import web
from veritrain.protocol.identity import load_or_create_key

from .server import LedgerConfig, make_app

log = logging.getLogger("veritrain.ledger")


def default_db_url(data_dir: Path) -> str:
    return f"sqlite:///{(data_dir / 'ledger.sqlite').resolve()}"


async def serve(config: LedgerConfig, host: str, port: int, ready_file: Path | None) -> None:
    """Serve until SIGINT/SIGTERM; with port 0 the OS picks one, written to ``ready_file``."""
    identity = load_or_create_key(config.data_dir / "ledger.key", "ledger")
    runner = web.AppRunner(make_app(config, identity), access_log=None,
                           keepalive_timeout=config.keepalive_seconds)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1] if runner.addresses else port
    url = f"http://{host}:{bound}"
    log.info("ledger %s listening on %s (database %s)", identity.public_key.hex()[:12], url,
             config.db_url)
    policy = config.retention
    log.info("blob retention: %s", "every blob kept (--keep-blobs)" if policy.keep_blobs else
             f"reveal files and superseded models go {policy.audit_window} finalized round(s) "
             "after their round; the chain, payloads, updates and failed checks' evidence stay")
    if ready_file is not None:
        tmp = ready_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": url, "ledger_key": identity.public_key.hex()}))
        tmp.replace(ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
