"""Token-bucket rate limits: per client IP for every request, per signer key for writes.

A bucket holds up to ``burst`` tokens and refills at ``rate`` per second; a
request takes one token or is refused with HTTP 429 (``rate_limited``,
``Retry-After``). The per-IP check runs before anything is read; the per-key
check runs once a write's signature has verified, it is for this URL's run and
round, and it is not an exact copy of a stored message: only the key's holder
can send such a message, so nobody can drain another key's bucket, and a flood
from one key cannot starve the others. Copies of stored (public) messages are
answered from the store and charged to a bucket of their (key, address) pair
instead (scope ``replay``), so a replayer throttles only itself. Refusals are
counted in /metrics, not written to the database. The number of tracked clients
is bounded (least recently seen forgotten first).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web


class TokenBuckets:
    def __init__(self, rate: float, burst: float, *, max_keys: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate < 0 or burst < 1:
            raise ValueError("rate must be >= 0 and burst >= 1")
        self.rate, self.burst, self.max_keys, self.clock = rate, burst, max_keys, clock
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()

    def _refilled(self, key: str) -> list[float]:
        """``key``'s bucket [tokens, as of], refilled up to now."""
        now = self.clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = [self.burst, now]
            if len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
            bucket[0] = min(self.burst, bucket[0] + (now - bucket[1]) * self.rate)
            bucket[1] = now
        return bucket

    def _until(self, tokens: float, cost: float) -> float:
        return math.inf if self.rate == 0 else (cost - tokens) / self.rate

    def take(self, key: str, cost: float = 1.0) -> float:
        """0.0 if ``key`` may go ahead (a token is spent), else seconds until it may."""
        bucket = self._refilled(key)
        if bucket[0] >= cost:
            bucket[0] -= cost
            return 0.0
        return self._until(bucket[0], cost)

    def wait(self, key: str, cost: float = 1.0) -> float:
        """Like :meth:`take`, spending nothing: 0.0 if ``key`` holds ``cost`` tokens now."""
        bucket = self._refilled(key)
        return 0.0 if bucket[0] >= cost else self._until(bucket[0], cost)


@dataclass
class RateLimits:
    """``None`` disables a limit."""

    per_ip: TokenBuckets | None
    per_key: TokenBuckets | None
    refused: dict[str, int]
    per_replay: TokenBuckets | None = None
    #: Per signer key, the BLS signatures that did not verify (each cost the verifier
    #: thread a pairing): spent on a failure, checked before every pairing.
    per_bad_signature: TokenBuckets | None = None

    @classmethod
    def build(cls, ip_rate: float, ip_burst: float, key_rate: float,
              key_burst: float, bad_signature_rate: float = 0.0,
              bad_signature_burst: float = 0.0) -> RateLimits:
        return cls(TokenBuckets(ip_rate, ip_burst) if ip_rate > 0 else None,
                   TokenBuckets(key_rate, key_burst) if key_rate > 0 else None,
                   {"ip": 0, "key": 0, "replay": 0, "bad_signature": 0},
                   TokenBuckets(key_rate, key_burst) if key_rate > 0 else None,
                   TokenBuckets(bad_signature_rate, bad_signature_burst)
                   if bad_signature_burst >= 1 else None)


LIMITS = web.AppKey("rate_limits", RateLimits)


def too_many(scope: str, wait: float) -> web.Response:
    detail = f"too many requests from this {scope}; retry in {wait:.1f}s"
    body = {"type": "https://veritrain.dev/problems/rate_limited", "title": "rate_limited",
            "status": 429, "reason": "rate_limited", "detail": detail}
    return web.json_response(body, status=429, content_type="application/problem+json",
                             headers={"Retry-After": str(max(1, math.ceil(min(wait, 3600))))})


class KeyRateLimited(web.HTTPTooManyRequests):
    """Raised inside a handler when a verified signer is over one of its budgets."""

    def __init__(self, wait: float, what: str = "too many writes from this key") -> None:
        when = "retry later" if math.isinf(wait) else f"retry in {wait:.1f}s"
        super().__init__(reason="Rate Limited", text=f"{what}; {when}")
        self.wait = wait


def _limit(request: web.Request, scope: str, key: str, *, spend: bool = True,
           what: str = "too many writes from this key") -> None:
    """Take a token of ``key`` in the ``scope`` buckets (or, ``spend`` False, only check
    one is there); 429 (``KeyRateLimited``) when there is none."""
    limits = request.app.get(LIMITS)
    buckets = None if limits is None else {
        "key": limits.per_key, "replay": limits.per_replay,
        "bad_signature": limits.per_bad_signature}[scope]
    if limits is None or buckets is None:
        return
    wait = buckets.take(key) if spend else buckets.wait(key)
    if wait > 0:
        limits.refused[scope] += 1
        raise KeyRateLimited(wait, what)


def charge_signer(request: web.Request, signer: str) -> None:
    _limit(request, "key", signer)


def charge_replay(request: web.Request, signer: str) -> None:
    """Charge a copy of a stored message to its (key, address) pair, never to the key."""
    _limit(request, "replay", signer + "@" + (request.remote or "?"))


def refuse_bad_signer(request: web.Request, signer: str) -> None:
    """429 before any pairing for a signer whose BLS signatures failed to verify more
    often than its budget allows (``charge_bad_signature``)."""
    _limit(request, "bad_signature", signer, spend=False,
           what="too many signatures from this key did not verify")


class KeyTurns:
    """One ``asyncio.Lock`` per key while a request of it holds or waits for its turn
    (then forgotten): a key's pairings are checked, run and charged one at a time, so
    concurrent forged requests cannot all pass the check before the first is charged."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def turn(self, key: str) -> AsyncIterator[None]:
        lock, users = self._held.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._held[key]

    def __len__(self) -> int:
        return len(self._held)


def charge_bad_signature(request: web.Request, signer: str) -> None:
    """Spend one of ``signer``'s failed-verification tokens."""
    limits = request.app.get(LIMITS)
    if limits is not None and limits.per_bad_signature is not None:
        limits.per_bad_signature.take(signer)


@web.middleware
async def ratelimit_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    limits = request.app.get(LIMITS)
    if limits is not None and limits.per_ip is not None:
        wait = limits.per_ip.take(request.remote or "?")
        if wait > 0:
            limits.refused["ip"] += 1
            return too_many("address", wait)
    resp = await handler(request)
    if resp.status == 429 and "Retry-After" not in resp.headers and not resp.prepared:
        resp.headers["Retry-After"] = "1"
    return resp
