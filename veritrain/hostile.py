"""Hostile input against a live ledger: every kind of bad request, then random mutations.

:func:`attack_ledger` sets up a small synthetic run (two workers, round 0
finalized, round 1 open with one submission in), snapshots what the ledger
stores, then sends named hostile requests (malformed, oversized, NaN, deeply
nested, forged, replayed, stale, out of order, unregistered, slow bodies and
headers, a flood from one key) and a seeded batch of byte-level mutations of
valid requests. Each named case has the statuses it must get; no request may
get a 5xx; afterwards the chain, the submissions and the registrations must be
exactly as before (refusals only add rows to the rejections table) and the
ledger must still answer its health check.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from veritrain.ledger.audit import fetch_events
from veritrain.ledger.client import LedgerClient
from veritrain.protocol.beacon import beacon_seed_of, sealed_list_digest
from veritrain.protocol.encoding import encode_canonical
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import SpotReveal, sign

from .synthetic import (
    HONEST,
    SyntheticRun,
    beacon_share,
    build_results,
    make_synthetic_run,
    registration,
    synthetic_submission,
)

RUN_ID = "hostile"
PAYLOAD_BYTES = 2048
CLOSED = -1  # the connection was closed without an answer


@dataclass
class CaseResult:
    name: str
    statuses: list[int]
    expected: frozenset[int]

    @property
    def ok(self) -> bool:
        return all(s in self.expected for s in self.statuses)


@dataclass
class HostileReport:
    cases: list[CaseResult] = field(default_factory=list)
    mutations: int = 0
    mutation_statuses: Counter[int] = field(default_factory=Counter)
    server_errors: int = 0
    state_unchanged: bool = False
    alive: bool = False

    @property
    def inputs(self) -> int:
        return sum(len(c.statuses) for c in self.cases) + self.mutations

    @property
    def failed_cases(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.ok]

    @property
    def ok(self) -> bool:
        return (not self.failed_cases and self.server_errors == 0 and self.state_unchanged
                and self.alive)


def _multipart(parts: list[tuple[str, bytes]], boundary: str = "hostileboundary") -> bytes:
    out = b""
    for name, data in parts:
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n"
                "Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


MULTIPART = {"Content-Type": "multipart/form-data; boundary=hostileboundary"}
JSON = {"Content-Type": "application/json"}


class _Target:
    """The run under attack and raw HTTP helpers that report statuses, never raise."""

    def __init__(self, url: str, session: aiohttp.ClientSession, run: SyntheticRun,
                 workers: list[Identity]) -> None:
        self.url = url
        self.host, self.port = url.split("//")[1].split(":")
        self.session = session
        self.run = run
        self.a, self.b, self.patient = workers
        self.statuses: list[int] = []

    async def send(self, method: str, path: str, body: bytes | None = None,
                   headers: dict[str, str] | None = None) -> int:
        try:
            async with self.session.request(method, self.url + path, data=body,
                                            headers=headers) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError):
            status = CLOSED
        self.statuses.append(status)
        return status

    async def raw(self, head: bytes, body: bytes = b"", *, wait: float = 5.0,
                  trickle: float | None = None) -> int:
        """Write ``head`` and ``body`` on a fresh connection (``trickle``: the body one byte
        per that many seconds); the status answered, or CLOSED."""
        reader, writer = await asyncio.open_connection(self.host, int(self.port))
        writer.write(head)

        async def feed() -> None:
            if trickle is None:
                writer.write(body)
                return
            for i in range(len(body)):
                writer.write(body[i:i + 1])
                await writer.drain()
                await asyncio.sleep(trickle)

        feeder = asyncio.create_task(feed())
        try:
            line = await asyncio.wait_for(reader.readline(), wait)
            status = int(line.split()[1]) if line else CLOSED
        except (TimeoutError, ConnectionError, IndexError, ValueError):
            status = CLOSED
        feeder.cancel()
        writer.close()
        self.statuses.append(status)
        return status

    def reg(self, who: Identity) -> bytes:
        return registration(self.run, who).encode()

    def submission(self, who: Identity, payload: bytes, r: int = 1, **kw: Any) -> bytes:
        return synthetic_submission(self.run, who, payload, round_index=r, base=self.base,
                                    **kw).encode()

    def spot_reveal(self, who: Identity, data: bytes, r: int = 1,
                    signer: Identity | None = None) -> bytes:
        """``who``'s signed reveal of ``data`` for round ``r`` (signed by ``signer``)."""
        msg = SpotReveal(run_id=self.run.spec.run_id, round=r, worker=who.public_key.hex(),
                         submission_digest="00" * 32, reveal_hash=hashlib.sha256(data).hexdigest(),
                         reveal_bytes=len(data), created_at=1)
        return sign(signer or who, msg).encode()

    base: str = ""


async def _setup(url: str) -> tuple[SyntheticRun, list[Identity], str, bytes]:
    """Round 0 finalized, round 1 open with worker a's submission in (b and c have not
    submitted; c is kept for the flood check)."""
    validator = Identity.generate("validator")
    run = make_synthetic_run(RUN_ID, [validator],
                             schedule={"round_seconds": 3600.0, "min_submissions": 1,
                                       "max_rounds": 10},
                             limits={"max_payload_bytes": PAYLOAD_BYTES})
    a, b, c3 = (Identity.generate("worker") for _ in range(3))
    async with LedgerClient(url, retry_for=30.0) as c:
        await c.post_multipart("/v1/runs", [
            ("spec", run.signed.encode(), "application/json"),
            ("dataset", run.dataset, "application/octet-stream"),
            ("genesis", run.genesis, "application/octet-stream")])
        for w in (a, b, c3):
            await c.post_message(f"/v1/runs/{RUN_ID}/participants", registration(run, w).to_wire())
        subs = {}
        for w in (a, b, c3):
            payload = f"round 0 payload of {w.public_key.hex()}".encode()
            signed = synthetic_submission(run, w, payload)
            await c.post_multipart(f"/v1/runs/{RUN_ID}/rounds/0/submissions", [
                ("envelope", signed.encode(), "application/json"),
                ("payload", payload, "application/octet-stream")])
            subs[w.public_key.hex()] = signed.digest
        beacon = await c.post_message(f"/v1/runs/{RUN_ID}/rounds/0/beacon", beacon_share(
            run, validator, 0, sealed_list_digest(list(subs.values()))).to_wire())
        results, blobs = build_results(run, 0, run.spec.genesis_model_hash,
                                       beacon_seed_of(beacon["beacon"]), subs,
                                       dict.fromkeys(subs, HONEST))
        await c.post_multipart(f"/v1/runs/{RUN_ID}/rounds/0/results", [
            ("result", results[0].encode(), "application/json"),
            *((n, blobs[n], "application/octet-stream") for n in ("model", "outer_state",
                                                                  "update"))])
        base = results[0].message.certified["model_hash"]
        payload = b"a" * 1000
        signed = synthetic_submission(run, a, payload, round_index=1, base=base)
        await c.post_multipart(f"/v1/runs/{RUN_ID}/rounds/1/submissions", [
            ("envelope", signed.encode(), "application/json"),
            ("payload", payload, "application/octet-stream")])
    return run, [a, b, c3], base, payload


async def _snapshot(url: str) -> tuple[Any, ...]:
    async with LedgerClient(url, retry_for=30.0) as c:
        events = [(e.seq, e.hash) for e in await fetch_events(c, RUN_ID)]
        subs = (await c.get_json(f"/v1/runs/{RUN_ID}/submissions?limit=1000"))["submissions"]
        parts = await c.get_json(f"/v1/runs/{RUN_ID}/participants")
        return events, subs, json.dumps(parts, sort_keys=True)


def _cases(t: _Target, a_payload: bytes) -> list[tuple[str, frozenset[int],
                                                      Callable[[], Awaitable[Any]]]]:
    a, b = t.a, t.b
    reg_path = f"/v1/runs/{RUN_ID}/participants"
    sub_path = f"/v1/runs/{RUN_ID}/rounds/1/submissions"
    stranger = Identity.generate("worker")
    good_b = b"b" * 500

    def wire_of(raw: bytes) -> dict[str, Any]:
        return json.loads(raw)

    forged = wire_of(t.reg(b))
    forged["signer"] = stranger.public_key.hex()
    unsigned = wire_of(t.reg(b))
    unsigned.pop("signature", None)
    tampered_sub = wire_of(t.submission(b, good_b))
    tampered_sub["body"]["loss_last"] = 0.25
    nested = b"[" * 5000 + b"]" * 5000
    big = 2 << 20
    http_post = (f"POST {reg_path} HTTP/1.1\r\nHost: {t.host}\r\nContent-Type: application/json"
                 "\r\nConnection: close\r\n").encode()
    slow_body = _multipart([("envelope", t.submission(b, good_b)), ("payload", good_b)])
    s = t.send
    c400, c401, c403, c404, c405, c408, c409, c413, c415 = (
        frozenset({x}) for x in (400, 401, 403, 404, 405, 408, 409, 413, 415))
    return [
        ("truncated JSON", c400, lambda: s("POST", reg_path, b'{"body": {', JSON)),
        ("not JSON at all", c400, lambda: s("POST", reg_path, b"\xff\xfe\x00garbage", JSON)),
        ("NaN in JSON", c400, lambda: s("POST", reg_path, b'{"body": NaN}', JSON)),
        ("Infinity in JSON", c400, lambda: s("POST", reg_path, b'{"x": Infinity}', JSON)),
        ("JSON nested 5000 deep", c400, lambda: s("POST", reg_path, nested, JSON)),
        ("duplicate JSON keys", c400, lambda: s("POST", reg_path, b'{"a": 1, "a": 2}', JSON)),
        ("2 MiB declared, body never sent", c413 | {CLOSED},
         lambda: t.raw(http_post + f"Content-Length: {big}\r\n\r\n".encode(), wait=5.0)),
        ("2 MiB JSON body", c413 | {CLOSED},
         lambda: s("POST", reg_path, b"[" + b"1," * (big // 2) + b"1]", JSON)),
        ("unsigned registration", c400,
         lambda: s("POST", reg_path, encode_canonical(unsigned), JSON)),
        ("signature by another key", c401,
         lambda: s("POST", reg_path, encode_canonical(forged), JSON)),
        ("replayed registration (answers new=false, writes nothing)", frozenset({200}),
         lambda: s("POST", reg_path, t.reg(a), JSON)),
        ("registration for another run", c400,
         lambda: s("POST", f"/v1/runs/{RUN_ID}x/participants", t.reg(b), JSON)),
        ("submission from an unregistered key", c403,
         lambda: s("POST", sub_path, _multipart([("envelope", t.submission(stranger, good_b)),
                                                 ("payload", good_b)]), MULTIPART)),
        ("submission with a tampered body", c401,
         lambda: s("POST", sub_path, _multipart([("envelope", encode_canonical(tampered_sub)),
                                                 ("payload", good_b)]), MULTIPART)),
        ("replayed submission (the same receipt, writes nothing)", frozenset({200}),
         lambda: s("POST", sub_path, _multipart([("envelope", t.submission(a, a_payload)),
                                                 ("payload", a_payload)]), MULTIPART)),
        ("a second, different submission", c409,
         lambda: s("POST", sub_path, _multipart([("envelope", t.submission(a, good_b)),
                                                 ("payload", good_b)]), MULTIPART)),
        ("stale round (finalized)", c400 | c409,
         lambda: s("POST", f"/v1/runs/{RUN_ID}/rounds/0/submissions",
                   _multipart([("envelope", t.submission(b, good_b, r=0)),
                               ("payload", good_b)]), MULTIPART)),
        ("future round", c400,
         lambda: s("POST", f"/v1/runs/{RUN_ID}/rounds/7/submissions",
                   _multipart([("envelope", t.submission(b, good_b, r=7)),
                               ("payload", good_b)]), MULTIPART)),
        ("payload differs from its declared hash", c400,
         lambda: s("POST", sub_path, _multipart([("envelope", t.submission(b, good_b)),
                                                 ("payload", good_b[:-1] + b"c")]), MULTIPART)),
        ("payload longer than declared", c413,
         lambda: s("POST", sub_path, _multipart([("envelope", t.submission(b, good_b)),
                                                 ("payload", good_b + b"b")]), MULTIPART)),
        ("payload over the run's limit", c400 | c413,
         lambda: s("POST", sub_path, _multipart([
             ("envelope", t.submission(b, b"b" * (PAYLOAD_BYTES + 1))),
             ("payload", b"b" * (PAYLOAD_BYTES + 1))]), MULTIPART)),
        ("parts out of order", c400,
         lambda: s("POST", sub_path, _multipart([("payload", good_b),
                                                 ("envelope", t.submission(b, good_b))]),
                   MULTIPART)),
        ("JSON where multipart is due", c415,
         lambda: s("POST", sub_path, t.submission(b, good_b), JSON)),
        ("beacon share from a worker key", c400 | c401 | c403,
         lambda: s("POST", f"/v1/runs/{RUN_ID}/rounds/1/beacon",
                   encode_canonical(forged), JSON)),
        ("reveal nobody asked for (round still open)", c400 | c403 | c404 | c409,
         lambda: s("POST", f"/v1/runs/{RUN_ID}/rounds/1/reveals", _multipart([
             ("envelope", t.spot_reveal(a, b"x")), ("reveal", b"x")]), MULTIPART)),
        ("reveal signed by another key than its worker", c400 | c401 | c403,
         lambda: s("POST", f"/v1/runs/{RUN_ID}/rounds/1/reveals", _multipart([
             ("envelope", t.spot_reveal(a, b"x", signer=b)), ("reveal", b"x")]), MULTIPART)),
        ("reveal of a finalized round", c400 | c403 | c409,
         lambda: s("POST", f"/v1/runs/{RUN_ID}/rounds/0/reveals", _multipart([
             ("envelope", t.spot_reveal(a, b"x", r=0)), ("reveal", b"x")]), MULTIPART)),
        ("blob named by a path", c400 | c404, lambda: s("GET", "/v1/blobs/..%2Fledger.key")),
        ("sealed payload of an open round", c403,
         lambda: s("GET", f"/v1/blobs/{hashlib.sha256(a_payload).hexdigest()}")),
        ("negative limit", c400, lambda: s("GET", f"/v1/runs/{RUN_ID}/verdicts?limit=-5")),
        ("non-numeric offset", c400, lambda: s("GET", f"/v1/runs/{RUN_ID}/verdicts?offset=x")),
        ("round number too long", c400,
         lambda: s("GET", f"/v1/runs/{RUN_ID}/rounds/{'9' * 40}")),
        ("unknown run", c404, lambda: s("GET", "/v1/runs/no-such-run")),
        ("method not allowed", c405, lambda: s("DELETE", f"/v1/runs/{RUN_ID}")),
        ("header over 8 KiB", frozenset({400, 431, CLOSED}),
         lambda: t.raw(f"GET /v1/health HTTP/1.1\r\nHost: x\r\nX-Big: {'a' * 20000}\r\n\r\n"
                       .encode())),
        ("body that stalls", c408 | {CLOSED},
         lambda: t.raw(f"POST {sub_path} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       f"{MULTIPART['Content-Type']}\r\nContent-Length: {len(slow_body)}\r\n"
                       "Connection: close\r\n\r\n".encode() + slow_body[:200], wait=60.0)),
        ("body that trickles", c408 | {CLOSED},
         lambda: t.raw(f"POST {sub_path} HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       f"{MULTIPART['Content-Type']}\r\nContent-Length: {len(slow_body)}\r\n"
                       "Connection: close\r\n\r\n".encode(), slow_body, wait=60.0,
                       trickle=0.5)),
        ("headers that never finish", frozenset({CLOSED, 408}),
         lambda: t.raw(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n", wait=60.0)),
    ]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    """One random byte-level mutation: flip, delete, insert, truncate or repeat a slice."""
    if not data:
        return bytes([rng.randrange(256)])
    i = rng.randrange(len(data))
    kind = rng.randrange(5)
    if kind == 0:
        return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1:]
    if kind == 1:
        return data[:i] + data[i + rng.randrange(1, 64):]
    if kind == 2:
        return data[:i] + rng.randbytes(rng.randrange(1, 64)) + data[i:]
    if kind == 3:
        return data[:i]
    j = min(len(data), i + rng.randrange(1, 256))
    return data[:j] + data[i:j] * rng.randrange(2, 50) + data[j:]


async def _flood(t: _Target, key_burst: int) -> CaseResult:
    """Many writes from one key at once: some refused 429, another key still served at once."""
    path = f"/v1/runs/{RUN_ID}/participants"
    replies = await asyncio.gather(*(t.send("POST", path, t.reg(t.a), JSON)
                                     for _ in range(3 * key_burst)))
    started = time.monotonic()
    other = await t.send("POST", path, t.reg(t.patient), JSON)
    patient_ok = other == 200 and time.monotonic() - started < 5.0
    limited = replies.count(429) >= key_burst
    statuses = [*replies, other if patient_ok and limited else 599]
    return CaseResult("flood from one key", statuses, frozenset({200, 429}))


async def attack_ledger(url: str, *, mutations: int = 300, seed: int = 0,
                        key_burst: int = 20) -> HostileReport:
    """Set up, snapshot, attack, and check; see the module docstring."""
    report = HostileReport()
    run, workers, base, a_payload = await _setup(url)
    before = await _snapshot(url)
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=90)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t = _Target(url, session, run, workers)
        b = t.b
        t.base = base
        for name, expected, send in _cases(t, a_payload):
            t.statuses = []
            await send()
            report.cases.append(CaseResult(name, list(t.statuses), expected))
        t.statuses = []
        seeds = [
            ("POST", f"/v1/runs/{RUN_ID}/participants", t.reg(b), JSON),
            # The envelope declares another payload, so no mutation can be accepted and
            # the payload streaming path is still exercised.
            ("POST", f"/v1/runs/{RUN_ID}/rounds/1/submissions",
             _multipart([("envelope", t.submission(b, b"m" * 300)), ("payload", b"n" * 300)]),
             MULTIPART),
            ("POST", f"/v1/runs/{RUN_ID}/rounds/1/beacon", t.reg(b), JSON),
            ("POST", "/v1/runs", _multipart([("spec", run.signed.encode()),
                                             ("dataset", run.dataset),
                                             ("genesis", run.genesis)]), MULTIPART),
        ]
        for _ in range(mutations):
            method, path, body, headers = rng.choice(seeds)
            status = await t.send(method, path, _mutate(rng, body), headers)
            report.mutations += 1
            report.mutation_statuses[status] += 1
        report.cases.append(await _flood(t, key_burst))
        statuses = [s for c in report.cases for s in c.statuses]
        report.server_errors = sum(1 for s in [*statuses, *report.mutation_statuses.elements()]
                                   if s >= 500)
        report.alive = await t.send("GET", "/v1/health") == 200
    after = await _snapshot(url)
    # The flood's replays and the mutated re-registrations must not add anything.
    report.state_unchanged = after == before
    return report
