"""The ledger API's client (aiohttp), with retries and backoff, and what every node
needs to follow a run through it.

Transient failures (connection refused or reset, timeouts, 429, 5xx) are
retried with exponential backoff and jitter until ``retry_for`` seconds have
passed; refusals (other 4xx) raise :class:`LedgerRefused` at once with the
problem's ``reason``. A blob the ledger's retention policy deleted (410 ``pruned``)
raises :class:`BlobPruned`, a ``RejectedInput`` carrying the ledger's explanation, so
that ``veritrain audit recheck`` of a round whose reveal is gone ends in that one line
rather than recomputing without the file. Downloaded blobs are checked against their
content hash and a size bound before they are returned. A node never adopts a run spec
without the organiser's signature (:func:`fetch_run`), nor a base model without
the certificate that vouches for it (:func:`fetch_base_files`; the genesis
model is vouched for by the signed spec itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import random
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
from veritrain.protocol.certificates import certified_base, verify_certificate
from veritrain.protocol.encoding import encode_canonical
from veritrain.protocol.errors import OversizedError, PayloadError, RejectedInput
from veritrain.protocol.messages import CertifiedState, RunSpec, open_signed

from .blobs import BlobPruned

if TYPE_CHECKING:
    from veritrain.protocol.organiser import RunBundle

log = logging.getLogger("veritrain.client")

T = TypeVar("T")


class LedgerRefused(Exception):
    """The ledger answered with a client error: retrying will not help."""

    def __init__(self, status: int, reason: str, detail: str, what: str = "") -> None:
        super().__init__(status, reason, detail)
        self.status = status
        self.reason = reason
        self.detail = detail
        self.what = what  # the request refused, e.g. "GET /v1/runs/x/report"

    def __str__(self) -> str:
        return f"{self.what + ': ' if self.what else ''}{self.status} {self.reason}: {self.detail}"


class LedgerUnavailable(Exception):
    """The ledger stayed unreachable (or kept failing) for the whole retry budget."""

    def __init__(self, url: str, what: str, cause: str, seconds: float) -> None:
        super().__init__(f"{what}: no answer from the ledger at {url} for {seconds:.0f}s "
                         f"({cause})")
        self.url = url
        self.what = what
        self.cause = cause
        self.seconds = seconds


class _Transient(Exception):
    pass


@dataclass
class Traffic:
    """Bytes a node sent and received through its client, by what they carried.

    Kinds a node uses: ``payload`` (a worker's submission), ``verification`` (its reveal),
    ``model`` (base models, outer states and broadcast updates it downloads),
    ``results`` (a validator's round result and model files), ``payloads`` and
    ``reveals`` (what a validator downloads to judge), ``control`` (JSON reads and
    messages). Bodies are counted as sent and received, without HTTP headers."""

    up: dict[str, int] = field(default_factory=dict)
    down: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, *, up: int = 0, down: int = 0) -> None:
        if up:
            self.up[kind] = self.up.get(kind, 0) + up
        if down:
            self.down[kind] = self.down.get(kind, 0) + down

    def to_json(self) -> dict[str, dict[str, int]]:
        return {"up": dict(self.up), "down": dict(self.down)}


def _cause(exc: BaseException) -> str:
    """Why a request failed, in a few words ("connection refused", "timed out")."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        if isinstance(os_error, socket.gaierror):
            return f"cannot resolve {exc.host}: {os_error.strerror}"
        if os_error.errno:
            return os.strerror(os_error.errno).lower()
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__


class LedgerClient:
    def __init__(self, base_url: str, *, retry_for: float = 300.0, timeout: float = 120.0,
                 backoff_max: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry_for = retry_for
        self.backoff_max = backoff_max
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=10)
        self._session: aiohttp.ClientSession | None = None
        self.traffic = Traffic()

    async def __aenter__(self) -> LedgerClient:
        self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use LedgerClient as an async context manager")
        return self._session

    async def _retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        deadline = time.monotonic() + self.retry_for
        delay = 0.2
        while True:
            try:
                return await attempt()
            except LedgerRefused as exc:
                exc.what = exc.what or what
                raise
            except (TimeoutError, aiohttp.ClientConnectionError, _Transient) as exc:
                if time.monotonic() + delay > deadline:
                    raise LedgerUnavailable(self.base_url, what, _cause(exc),
                                            self.retry_for) from exc
                log.warning("%s failed (%s); retrying in %.1fs", what, exc, delay)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self.backoff_max)

    @staticmethod
    async def _check(resp: aiohttp.ClientResponse) -> None:
        if resp.status < 400:
            return
        text = await resp.text()
        if resp.status == 429 or resp.status >= 500:
            raise _Transient(f"it answered HTTP {resp.status}")
        try:
            body = json.loads(text)
            reason, detail = str(body.get("reason")), str(body.get("detail"))
        except (ValueError, AttributeError):
            raise LedgerRefused(resp.status, "http_error", text[:200]) from None
        if resp.status == 410 and reason == "pruned":
            # Not a refusal to work around: the file is gone by the ledger's retention
            # policy, and whoever needed it (audit recheck) says so and stops.
            raise BlobPruned(detail)
        raise LedgerRefused(resp.status, reason, detail)

    async def get_json(self, path: str) -> Any:
        async def attempt() -> Any:
            async with self.session.get(self.base_url + path) as resp:
                await self._check(resp)
                body = await resp.read()
                self.traffic.add("control", down=len(body))
                return json.loads(body)

        return await self._retrying(f"GET {path}", attempt)

    async def post_message(self, path: str, wire: Any) -> Any:
        body = encode_canonical(wire)

        async def attempt() -> Any:
            async with self.session.post(self.base_url + path, data=body,
                                         headers={"Content-Type": "application/json"}) as resp:
                await self._check(resp)
                reply = await resp.read()
                self.traffic.add("control", up=len(body), down=len(reply))
                return json.loads(reply)

        return await self._retrying(f"POST {path}", attempt)

    async def post_multipart(self, path: str, parts: list[tuple[str, bytes | Path, str]],
                             *, kind: str = "control") -> Any:
        """POST named parts in order: (name, bytes or a file to stream, content type); their
        bytes count as ``kind`` in :attr:`traffic`."""

        async def attempt() -> Any:
            with contextlib.ExitStack() as files, aiohttp.MultipartWriter("form-data") as mp:
                for name, data, ctype in parts:
                    body = files.enter_context(open(data, "rb")) if isinstance(data, Path) \
                        else data
                    part = mp.append(body, {"Content-Type": ctype})
                    part.set_content_disposition("form-data", name=name)
                async with self.session.post(self.base_url + path, data=mp) as resp:
                    await self._check(resp)
                    reply = await resp.read()
                    self.traffic.add(kind, up=sum(
                        d.stat().st_size if isinstance(d, Path) else len(d) for _, d, _ in parts),
                        down=len(reply))
                    return json.loads(reply)

        return await self._retrying(f"POST {path}", attempt)

    async def get_blob(self, digest: str, *, max_bytes: int, kind: str = "model") -> bytearray:
        """Download a content-addressed blob, refusing oversized or mismatched content; its
        bytes count as ``kind`` in :attr:`traffic`."""

        async def attempt() -> bytearray:
            async with self.session.get(f"{self.base_url}/v1/blobs/{digest}") as resp:
                await self._check(resp)
                if resp.content_length is not None and resp.content_length > max_bytes:
                    raise OversizedError(f"blob {digest[:12]} is larger than {max_bytes} bytes")
                h = hashlib.sha256()
                # One buffer of the announced size (a blob of a model's size is not held
                # twice); a body that does not say grows a buffer instead.
                buf = bytearray(resp.content_length or 0)
                size = 0
                async for chunk in resp.content.iter_chunked(1 << 20):
                    end = size + len(chunk)
                    if end > max_bytes:
                        raise OversizedError(f"blob {digest[:12]} exceeds {max_bytes} bytes")
                    h.update(chunk)
                    if end <= len(buf):
                        buf[size:end] = chunk
                    else:
                        buf[size:] = chunk
                    size = end
                if size != len(buf):
                    del buf[size:]
                if h.hexdigest() != digest:
                    raise PayloadError(f"blob {digest[:12]} does not match its content hash")
                self.traffic.add(kind, down=size)
                return buf

        return await self._retrying(f"GET blob {digest[:12]}", attempt)


async def fetch_run(client: LedgerClient, run_id: str | None, *, poll_seconds: float = 1.0,
                    wait_for: float = 3600.0) -> RunSpec:
    """The run's spec, with the organiser's signature checked.

    A node started before the organiser created the run waits for it (up to
    ``wait_for`` seconds): for the named run, or for the ledger's only active
    run when none is named.
    """
    deadline = time.monotonic() + wait_for
    announced = False
    while True:
        chosen = run_id
        if chosen is None:
            runs = (await client.get_json("/v1/ledger"))["runs"]
            active = [r["run_id"] for r in runs if r["status"] == "active"]
            if len(active) > 1:
                raise SystemExit(f"ledger has {len(active)} active runs; pass --run")
            chosen = active[0] if active else None
        if chosen is not None:
            try:
                overview = await client.get_json(f"/v1/runs/{chosen}")
                break
            except LedgerRefused as exc:
                if exc.reason != "not_found":
                    raise
        if time.monotonic() > deadline:
            raise SystemExit(f"no run {run_id or '(any)'} appeared on the ledger")
        if not announced:
            log.info("waiting for run %s to be created", run_id or "(any)")
            announced = True
        await asyncio.sleep(poll_seconds)
    signed = open_signed(overview["spec"], RunSpec)
    if signed.signer != signed.message.organiser:
        raise RejectedInput("run spec is not signed by its organiser", "bad_signature")
    return signed.message


async def fetch_base_files(client: LedgerClient, spec: RunSpec, info: dict[str, Any], *,
                           max_model_bytes: int, newest_certified: int = 0
                           ) -> tuple[bytes, bytes | None]:
    """A round's base model file and outer-state file (None in round 0), downloaded by the
    hashes its certificate vouches for (:func:`certified_base`; no older base than the
    ``newest_certified`` round the caller saw)."""
    model_hash, outer_hash = certified_base(spec, info, newest_certified=newest_certified)
    model = await client.get_blob(model_hash, max_bytes=max_model_bytes)
    if outer_hash is None:
        return model, None
    return model, await client.get_blob(outer_hash, max_bytes=2 * max_model_bytes)


async def fetch_participants(client: LedgerClient, run_id: str, *, page: int = 1000
                             ) -> list[dict[str, Any]]:
    """Every worker row ``GET /v1/runs/{run}/participants`` serves, page by page (``page``
    rows a request, following ``next_offset``): a run may have up to 10,000 workers a
    round, ten pages of the API's largest."""
    rows: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        got = await client.get_json(
            f"/v1/runs/{run_id}/participants?offset={offset}&limit={page}")
        rows.extend(got["participants"])
        nxt = got.get("next_offset")
        if nxt is not None and (not isinstance(nxt, int) or nxt <= offset):
            raise RejectedInput("the participant list's next page goes backwards", "malformed")
        offset = nxt
    return rows


async def fetch_membership(client: LedgerClient, run_id: str, *, page: int = 1000
                           ) -> dict[str, Any]:
    """``GET /v1/runs/{run}/membership`` with every row, page by page (``page`` rows a
    request, following ``next_after``): the last page's policy and first unclosed round,
    the rows of all pages in chain order. RejectedInput ``malformed`` for a page that
    is not a list of rows after the one asked for, or whose next page goes backwards."""
    rows: list[dict[str, Any]] = []
    after: int | None = -1
    served: dict[str, Any] = {}
    while after is not None:
        served = await client.get_json(
            f"/v1/runs/{run_id}/membership?after={after}&limit={page}")
        got = served.get("rows") if isinstance(served, dict) else None
        if not isinstance(got, list):
            raise RejectedInput("the membership page holds no list of rows", "malformed")
        for row in got:
            seq = row.get("seq") if isinstance(row, dict) else None
            if type(seq) is not int or seq <= (rows[-1]["seq"] if rows else after):
                raise RejectedInput("the membership rows are not in chain order after the "
                                    "page asked for", "malformed")
            rows.append(row)
        nxt = served.get("next_after")
        if nxt is not None and (type(nxt) is not int or not got or nxt != got[-1]["seq"]):
            raise RejectedInput("the membership list's next page does not follow its last "
                                "row", "malformed")
        after = nxt
    return {**served, "rows": rows}


async def last_certified_model(client: LedgerClient, run_id: str, *, max_model_bytes: int
                               ) -> tuple[RunSpec, bytes, CertifiedState]:
    """The newest model a quorum of ``run_id``'s validators certified: its certificate
    checked against that run's signed validator set (never the ledger's word), the file
    downloaded by the certified hash. RejectedInput when no round was finalized yet."""
    spec = await fetch_run(client, run_id, wait_for=0.0)
    overview = await client.get_json(f"/v1/runs/{run_id}")
    current = overview.get("current_round")
    if not isinstance(current, int):
        raise RejectedInput(f"run {run_id} has no rounds", "not_found")
    for r in (current, current - 1):
        if r < 0:
            break
        info = await client.get_json(f"/v1/runs/{run_id}/rounds/{r}")
        if info.get("certificate") is None:
            continue
        state = verify_certificate(info["certificate"], spec, base_of_round=r + 1)
        model = await client.get_blob(state.model_hash, max_bytes=max_model_bytes)
        return spec, bytes(model), state
    raise RejectedInput(f"run {run_id} has no certified model yet", "wrong_state")


async def publish_run(ledger_url: str, bundle: RunBundle) -> dict[str, Any]:
    """Upload the spec, dataset and genesis model to the ledger (one multipart request)."""
    async with LedgerClient(ledger_url, retry_for=60.0) as client:
        return await client.post_multipart(
            "/v1/runs",
            [("spec", bundle.signed.encode(), "application/json"),
             ("dataset", bundle.dataset, "application/octet-stream"),
             ("genesis", bundle.genesis, "application/octet-stream")])
