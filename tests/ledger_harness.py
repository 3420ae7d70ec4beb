"""An in-process ledger on a loopback port with a real SQLite file, for API tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from fakes import FakeRun
from veritrain.ledger.server import LEDGER, LedgerConfig, make_app
from veritrain.protocol.encoding import encode_canonical
from veritrain.protocol.identity import Identity


class Api:
    def __init__(self, server: TestServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.session = session
        self.url = str(server.make_url("")).rstrip("/")

    @property
    def store(self) -> Any:
        return self.server.app[LEDGER].store

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as resp:
            return resp.status, await resp.json(content_type=None)

    async def post_json(self, path: str, wire: Any) -> tuple[int, Any]:
        async with self.session.post(self.url + path, data=encode_canonical(wire)) as resp:
            return resp.status, await resp.json(content_type=None)

    async def post_parts(self, path: str, parts: list[tuple[str, bytes]]) -> tuple[int, Any]:
        with aiohttp.MultipartWriter("form-data") as mp:
            for name, data in parts:
                part = mp.append(data, {"Content-Type": "application/octet-stream"})
                part.set_content_disposition("form-data", name=name)
            async with self.session.post(self.url + path, data=mp) as resp:
                return resp.status, await resp.json(content_type=None)

    async def create_run(self, run: FakeRun) -> tuple[int, Any]:
        return await self.post_parts("/v1/runs", [("spec", run.signed.encode()),
                                                  ("dataset", run.dataset),
                                                  ("genesis", run.genesis)])

    async def register(self, run: FakeRun, worker: Identity) -> tuple[int, Any]:
        from veritrain.protocol.messages import Registration, sign

        reg = Registration(run_id=run.spec.run_id, round=0, participant=worker.public_key.hex(),
                           role="worker", created_at=1)
        return await self.post_json(f"/v1/runs/{run.spec.run_id}/participants",
                                    sign(worker, reg).to_wire())

    async def submit(self, signed: Any, payload: bytes, *, run_id: str | None = None,
                     round_index: int | None = None) -> tuple[int, Any]:
        msg = signed.message
        path = (f"/v1/runs/{run_id or msg.run_id}/rounds/"
                f"{msg.round if round_index is None else round_index}/submissions")
        return await self.post_parts(path, [("envelope", signed.encode()), ("payload", payload)])


def run_api(tmp_path: Path, scenario: Callable[[Api], Awaitable[Any]], *,
            tick_seconds: float = 0.05, db_url: str | None = None,
            identity: Identity | None = None, **config: Any) -> Any:
    """Run ``scenario`` against a fresh ledger app served on loopback.

    ``db_url`` picks the database (default: a SQLite file in ``tmp_path``); other
    keywords are :class:`LedgerConfig` fields (rate limits, for example).
    """

    async def main() -> Any:
        cfg = LedgerConfig(data_dir=tmp_path / "ledger",
                           db_url=db_url or f"sqlite:///{tmp_path / 'ledger.sqlite'}",
                           tick_seconds=tick_seconds, **config)
        server = TestServer(make_app(cfg, identity or Identity.generate("ledger")),
                            host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                return await scenario(Api(server, session))
        finally:
            await server.close()

    return asyncio.run(main())
