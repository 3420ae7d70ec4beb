"""Load on one ledger: many simulated workers submitting at once over loopback.

Each simulated worker is a separate HTTP client with its own key; it
registers, then every round signs a submission over random payload bytes and
posts it with the same retrying client the real worker uses. The driver plays
the run's validator (real BLS beacon share and attested result) so that rounds
finalize and the next one opens. Optionally the ledger process is killed with
SIGKILL mid-round and restarted on the same data and port while the workers
keep retrying, and some workers re-send a submission as if its reply had been
lost (they must get the very same receipt back).

Afterwards the driver checks, through the public API only, that every receipt
a worker holds names a stored submission (``lost``), that no (worker, round) is
stored twice (``duplicated``), that stored payloads are byte for byte what was
sent, and that the whole chain audits; it reports p50/p99 submit latency and
the ledger's peak resident memory against the bytes uploaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.ledger.client import LedgerClient
from veritrain.protocol.beacon import beacon_seed_of, sealed_list_digest_of
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Receipt, open_signed

from .local import LocalProcesses, free_port
from .synthetic import (
    HONEST,
    SyntheticRun,
    beacon_share,
    build_results,
    make_synthetic_run,
    registration,
    synthetic_submission,
)

RUN_ID = "load"


@dataclass(frozen=True)
class LoadPlan:
    workers: int = 200
    rounds: int = 3
    payload_bytes: int = 256 * 1024
    #: Share of workers that re-send a submission as if the reply had been lost.
    resend_fraction: float = 0.1
    #: Round in which the ledger is killed with SIGKILL and restarted (None: never),
    #: once this share of that round's receipts are in.
    crash_round: int | None = 1
    crash_after: float = 0.5
    seed: int = 0


@dataclass
class LoadReport:
    plan: LoadPlan
    receipts: int = 0
    stored: int = 0
    lost: int = 0
    duplicated: int = 0
    failed: int = 0
    corrupted: int = 0
    resent: int = 0
    resent_same_receipt: int = 0
    crashes: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    crash_round_latencies_ms: list[float] = field(default_factory=list)
    uploaded_bytes: int = 0
    ledger_start_rss_bytes: int | None = None
    ledger_peak_rss_bytes: int | None = None
    audit_ok: bool = False
    audit_problem: str | None = None
    seconds: float = 0.0

    @staticmethod
    def _pct(values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        if len(values) == 1:
            return values[0]
        return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]

    @property
    def p50_ms(self) -> float:
        return self._pct(self.latencies_ms, 50)

    @property
    def p99_ms(self) -> float:
        return self._pct(self.latencies_ms, 99)

    @property
    def ok(self) -> bool:
        return (self.audit_ok and self.lost == 0 and self.duplicated == 0 and self.failed == 0
                and self.corrupted == 0 and self.resent == self.resent_same_receipt)


class LedgerProcess:
    """``veritrain ledger serve`` on a fixed loopback port that survives a SIGKILL restart."""

    def __init__(self, procs: LocalProcesses, data_dir: Path, extra: list[str]) -> None:
        self.procs = procs
        self.data_dir = data_dir
        self.extra = extra
        self.port = free_port()
        self.url = ""
        self._peak_rss = 0
        self.start_rss: int | None = None  # resident memory once listening, before any load

    def start(self) -> str:
        self.url = self.procs.start_ledger(self.data_dir, port=self.port, extra=self.extra)
        if self.start_rss is None:
            self.start_rss = self.peak_rss_bytes()
        return self.url

    def peak_rss_bytes(self) -> int | None:
        """The largest resident set of any incarnation so far (Linux ``VmHWM``)."""
        proc = self.procs.procs.get("ledger")
        if proc is not None and proc.poll() is None:
            try:
                for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        self._peak_rss = max(self._peak_rss, int(line.split()[1]) * 1024)
            except OSError:
                return None
        return self._peak_rss or None

    def crash_and_restart(self) -> None:
        self.peak_rss_bytes()
        self.procs.kill("ledger", signal.SIGKILL)
        self.start()


async def _submit(client: LedgerClient, run: SyntheticRun, worker: Identity, payload: bytes,
                  r: int, base: str, ledger_key: bytes) -> tuple[str, float, dict[str, Any]]:
    signed = synthetic_submission(run, worker, payload, round_index=r, base=base)
    started = time.monotonic()
    wire = await client.post_multipart(
        f"/v1/runs/{run.spec.run_id}/rounds/{r}/submissions",
        [("envelope", signed.encode(), "application/json"),
         ("payload", payload, "application/octet-stream")])
    elapsed_ms = (time.monotonic() - started) * 1000
    receipt = open_signed(wire, Receipt)
    if receipt.signer != ledger_key.hex() or receipt.message.submission_digest != signed.digest:
        raise RuntimeError("a receipt not signed by the ledger or naming another submission")
    return signed.digest, elapsed_ms, wire


async def _finalize(client: LedgerClient, run: SyntheticRun, r: int, base: str,
                    subs: dict[str, str]) -> str:
    """Play the validator for closed round ``r``: beacon share, then the attested result."""
    path = f"/v1/runs/{run.spec.run_id}/rounds/{r}"
    deadline = time.monotonic() + 120
    while (await client.get_json(path))["status"] != "closed":
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {r} did not close with every submission in")
        await asyncio.sleep(0.1)
    validator = run.validators[0]
    sealed = sealed_list_digest_of((await client.get_json(path + "/submissions"))["submissions"])
    beacon = await client.post_message(path + "/beacon",
                                       beacon_share(run, validator, r, sealed).to_wire())
    results, blobs = build_results(run, r, base, beacon_seed_of(beacon["beacon"]), subs,
                                   dict.fromkeys(subs, HONEST))
    await client.post_multipart(path + "/results", [
        ("result", results[0].encode(), "application/json"),
        *((name, blobs[name], "application/octet-stream")
          for name in ("model", "outer_state", "update"))])
    return results[0].message.certified["model_hash"]


async def _stored_submissions(client: LedgerClient, run_id: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        page = await client.get_json(f"/v1/runs/{run_id}/submissions?offset={offset}&limit=1000")
        rows.extend(page["submissions"])
        offset = page["next_offset"]
    return rows


async def drive_load(ledger: LedgerProcess, plan: LoadPlan,
                     progress: Callable[[str], None] = lambda _: None) -> LoadReport:
    """Run ``plan`` against a started ledger; see the module docstring for what is checked."""
    rng = random.Random(plan.seed)
    report = LoadReport(plan)
    started = time.monotonic()
    validator = Identity.generate("validator")
    run = make_synthetic_run(
        RUN_ID, [validator],
        schedule={"round_seconds": 3600.0, "min_submissions": 1, "max_rounds": plan.rounds},
        limits={"max_payload_bytes": plan.payload_bytes})
    workers = [Identity.generate("worker") for _ in range(plan.workers)]
    resenders = set(rng.sample(range(plan.workers), round(plan.resend_fraction * plan.workers)))
    sent: dict[tuple[str, int], tuple[str, str]] = {}  # (worker, round) -> (digest, payload hash)
    held: dict[tuple[str, int], str] = {}  # receipts the workers hold: -> digest
    clients = [LedgerClient(ledger.url, retry_for=120.0, timeout=60.0, backoff_max=2.0)
               for _ in workers]
    admin = LedgerClient(ledger.url, retry_for=120.0)
    try:
        for c in (admin, *clients):
            await c.__aenter__()
        ledger_key = bytes.fromhex((await admin.get_json("/v1/ledger"))["ledger_key"])
        await admin.post_multipart("/v1/runs", [
            ("spec", run.signed.encode(), "application/json"),
            ("dataset", run.dataset, "application/octet-stream"),
            ("genesis", run.genesis, "application/octet-stream")])
        await asyncio.gather(*(c.post_message(f"/v1/runs/{RUN_ID}/participants",
                                              registration(run, w).to_wire())
                               for c, w in zip(clients, workers, strict=True)))
        async def play_round(r: int, base: str) -> str:
            payloads = [os.urandom(plan.payload_bytes) for _ in workers]
            crash_at = round(plan.crash_after * plan.workers) if plan.crash_round == r else None
            enough_in = asyncio.Event()
            receipts_in = 0

            async def one(i: int) -> None:
                nonlocal receipts_in
                key = workers[i].public_key.hex()
                sent[(key, r)] = ("", hashlib.sha256(payloads[i]).hexdigest())
                try:
                    digest, ms, wire = await _submit(clients[i], run, workers[i], payloads[i], r,
                                                     base, ledger_key)
                except Exception as exc:  # counted: a worker that never got its receipt
                    progress(f"worker {i} round {r} failed: {exc}")
                    report.failed += 1
                    return
                sent[(key, r)] = (digest, sent[(key, r)][1])
                held[(key, r)] = digest
                report.uploaded_bytes += len(payloads[i])
                (report.crash_round_latencies_ms if crash_at is not None
                 else report.latencies_ms).append(ms)
                receipts_in += 1
                if crash_at is not None and receipts_in >= crash_at:
                    enough_in.set()
                if i in resenders:
                    report.resent += 1
                    again = await _submit(clients[i], run, workers[i], payloads[i], r, base,
                                          ledger_key)
                    report.resent_same_receipt += again[2] == wire

            async def crasher() -> None:
                if crash_at is None:
                    return
                await enough_in.wait()
                await asyncio.to_thread(ledger.crash_and_restart)
                report.crashes += 1
                progress(f"round {r}: ledger killed with SIGKILL after {receipts_in} receipts "
                         "and restarted")

            await asyncio.gather(crasher(), *(one(i) for i in range(plan.workers)))
            ledger.peak_rss_bytes()
            subs = {k: held[(k, r)] for k in (w.public_key.hex() for w in workers)
                    if (k, r) in held}
            progress(f"round {r}: {len(subs)} receipts")
            return await _finalize(admin, run, r, base, subs)

        base = run.spec.genesis_model_hash
        for r in range(plan.rounds):
            base = await play_round(r, base)

        stored = await _stored_submissions(admin, RUN_ID)
        report.receipts = len(held)
        report.stored = len(stored)
        by_slot: dict[tuple[str, int], list[str]] = {}
        for row in stored:
            by_slot.setdefault((row["worker"], row["round"]), []).append(row["digest"])
        report.duplicated = sum(len(v) - 1 for v in by_slot.values())
        report.lost = sum(1 for slot, digest in held.items() if digest not in by_slot.get(slot, []))
        report.corrupted = sum(
            1 for row in stored
            if sent.get((row["worker"], row["round"]), ("", ""))[1] != row["payload_hash"])
        for row in rng.sample(stored, min(20, len(stored))):
            blob = await admin.get_blob(row["payload_hash"], max_bytes=plan.payload_bytes)
            report.corrupted += hashlib.sha256(blob).hexdigest() != row["payload_hash"]
        audit = verify_events(await fetch_events(admin, RUN_ID), ledger_key)
        report.audit_ok, report.audit_problem = audit.ok, audit.problem
        report.ledger_peak_rss_bytes = ledger.peak_rss_bytes()
        report.ledger_start_rss_bytes = ledger.start_rss
    finally:
        for c in (admin, *clients):
            await c.__aexit__(None, None, None)
    report.seconds = time.monotonic() - started
    return report


def run_load(work_dir: Path, plan: LoadPlan,
             progress: Callable[[str], None] = lambda _: None) -> LoadReport:
    """Start a ledger process under ``work_dir`` (per-address rate limit off: every simulated
    worker shares 127.0.0.1), drive ``plan`` against it, and stop it."""
    procs = LocalProcesses(work_dir / "logs")
    ledger = LedgerProcess(procs, work_dir / "ledger", ["--ip-rate", "0"])
    try:
        ledger.start()
        return asyncio.run(drive_load(ledger, plan, progress))
    finally:
        procs.stop_all()
