"""Request bodies bounded in size and in slowness.

Every body the ledger reads (JSON messages, multipart parts, reveals) goes
through one :class:`BodyClock` per request. Size: a part or body larger than its
limit is refused as soon as the limit is crossed, before the rest is read.
Slowness: no read may wait longer than ``idle_seconds``, and after a grace
period the average rate must stay above a floor,

    received(t) >= min_bytes_per_s * (t - start - grace_seconds),

so a client that trickles bytes to hold a connection, a writer slot or a blob
temp file open is cut off with ``upload_timeout`` (HTTP 408) and whatever it
had sent is discarded. (Slow *headers* are bounded by the server's keep-alive
timeout, which aiohttp also applies to a request that has not arrived whole.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import BodyPartReader, web
from veritrain.protocol.errors import EncodingError, OversizedError, RejectedInput

from .blobs import BlobStore, StagedBlob

T = TypeVar("T")

CHUNK_BYTES = 1 << 16


class UploadTimeout(RejectedInput):
    reason = "upload_timeout"


@dataclass(frozen=True)
class UploadPolicy:
    """How slow a body may arrive (defaults: a 128 kbit/s uplink passes with room)."""

    idle_seconds: float = 30.0
    grace_seconds: float = 10.0
    min_bytes_per_s: float = 16384.0

    def __post_init__(self) -> None:
        if self.idle_seconds <= 0 or self.grace_seconds < 0 or self.min_bytes_per_s <= 0:
            raise ValueError("upload limits must be positive")


class BodyClock:
    """Times every read of one request's body against an :class:`UploadPolicy`."""

    def __init__(self, policy: UploadPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._clock = clock
        self.started = clock()
        self.received = 0

    def time_left(self) -> float:
        """Seconds the next read may take: the idle limit or the rate floor, whichever is first."""
        p = self.policy
        floor_deadline = self.started + p.grace_seconds + self.received / p.min_bytes_per_s
        return min(p.idle_seconds, floor_deadline - self._clock())

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """Await one read of the body; :class:`UploadTimeout` when it is too slow,
        :class:`EncodingError` when the body does not parse."""
        left = self.time_left()
        try:
            if left <= 0:
                raise TimeoutError
            async with asyncio.timeout(left):
                return await awaitable
        except RejectedInput:
            raise
        except ValueError as exc:  # aiohttp's multipart parser refuses a broken body so
            raise EncodingError(f"malformed request body: {exc}") from None
        except TimeoutError:
            if asyncio.iscoroutine(awaitable):
                awaitable.close()
            raise UploadTimeout(
                f"request body too slow: {self.received} bytes in "
                f"{self._clock() - self.started:.1f}s (at least "
                f"{self.policy.min_bytes_per_s:.0f} B/s after {self.policy.grace_seconds:.0f}s, "
                f"no pause over {self.policy.idle_seconds:.0f}s)") from None

    async def paused(self, awaitable: Awaitable[T]) -> T:
        """Await the ledger's own work between two reads (a verification): its time is
        not held against the client's rate."""
        began = self._clock()
        try:
            return await awaitable
        finally:
            self.started += self._clock() - began

    async def chunk(self, read: Callable[[int], Awaitable[bytes]]) -> bytes:
        data = await self.wait(read(CHUNK_BYTES))
        self.received += len(data)
        return data


BODY_CLOCK = web.RequestKey("body_clock", BodyClock)


def body_clock(request: web.Request, policy: UploadPolicy) -> BodyClock:
    """The request's clock, started at its first body read."""
    clock = request.get(BODY_CLOCK)
    if clock is None:
        clock = request[BODY_CLOCK] = BodyClock(policy)
    return clock


async def read_body(request: web.Request, clock: BodyClock, limit: int) -> bytes:
    """A whole (non-multipart) body of at most ``limit`` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise OversizedError(f"body exceeds {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while chunk := await clock.chunk(request.content.read):
        size += len(chunk)
        if size > limit:
            raise OversizedError(f"body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def next_part(reader: Any, name: str, clock: BodyClock) -> BodyPartReader:
    """The next multipart part, which must be called ``name``."""
    part = await clock.wait(reader.next())
    if part is None or not isinstance(part, BodyPartReader) or part.name != name:
        raise EncodingError(f"expected multipart part {name!r}")
    return part


async def read_part_bytes(part: BodyPartReader, clock: BodyClock, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while chunk := await clock.chunk(part.read_chunk):
        size += len(chunk)
        if size > limit:
            raise OversizedError(f"part {part.name!r} exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def stream_to_blob(blobs: BlobStore, read: Callable[[int], Awaitable[bytes]],
                         clock: BodyClock, limit: int, expected: str | None) -> tuple[str, int]:
    """Stream a body or part into the blob store (constant memory); (digest, size).

    Nothing becomes visible unless the whole content arrived and hashes to ``expected``.
    """
    writer = blobs.writer(limit)
    try:
        while chunk := await clock.chunk(read):
            writer.write(chunk)
        return writer.commit(expected), writer.size
    except BaseException:
        writer.abort()
        raise


async def stream_to_staged(blobs: BlobStore, read: Callable[[int], Awaitable[bytes]],
                           clock: BodyClock, limit: int, expected: str | None) -> StagedBlob:
    """Stream a part into the temporary area (constant memory) and check its hash; the
    file becomes visible only when the message naming it is accepted (BlobStore.publish),
    and is deleted when the upload is cut short or does not match."""
    writer = blobs.writer(limit)
    try:
        while chunk := await clock.chunk(read):
            writer.write(chunk)
        return writer.stage(expected)
    except BaseException:
        writer.abort()
        raise
