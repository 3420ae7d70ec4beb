"""Ledger benchmark: ingest, audit queries at 1M rows, offline verification.

One run is played on a SQLite file, round after round, with ``--workers``
registered workers each submitting once per round, until the chain holds
``--rows`` rows (a submission and its receipt are two rows). Measured:

* ``ingest``: signed submissions taken from their received bytes to committed
  rows: decode and Ed25519 verification on a process pool (all cores),
  admission rules, chain rows, the ledger's signed receipts and checkpoints,
  bulk-inserted per batch (:mod:`veritrain.ledger.ingest`). Reported as chain
  rows per second and submissions per second. For contrast, the one request
  per transaction path (``LedgerStore.accept_submission``) on a small run.
  Round finalization (beacon, validator result, certificate) is not timed.
* ``audit``: p50 and p99 latency of paged per-worker queries over HTTP on
  loopback (the worker history and the verdict list filtered by worker),
  with every row stored.
* ``verify``: the run's export file (``GET /v1/runs/{run}/export``) checked
  offline (``verify_export_file``: every hash and link, the ledger's
  checkpoints, the signatures no certificate covers, every certificate in
  batches, every verdict row), the file read in byte ranges on all cores:
  rows per second, file reading included. ``--full`` also times full mode
  (every Ed25519 signature, all cores).

The last line is the one the issue tracks::

    ledger: ingest_rows_per_s=<n> audit_p99_ms=<x> verify_rows_per_s=<n>

Run: ``.venv/bin/python bench/ledger.py [--rows 1000000] [--workers 10000] [--full]``
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import random
import resource
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from veritrain.ledger.audit import verify_export_file
from veritrain.ledger.ingest import Incoming, accept_batch, open_submissions
from veritrain.ledger.server import LedgerConfig, make_app
from veritrain.ledger.store import LedgerStore
from veritrain.protocol.beacon import (
    EVERY_WORKER_ADMITTED,
    beacon_root,
    beacon_seed_of,
    sealed_list_digest,
)
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    BeaconShare,
    CertifiedState,
    Registration,
    RoundResult,
    RunSpec,
    Submission,
    digest_of,
    sign,
)
from veritrain.protocol.presets import run_preset
from veritrain.protocol.rules import expected_samples, expected_trail_length
from veritrain.protocol.scoring import compute_scores, split_rewards

RUN = "bench-run"
BATCH = 1000


def _blob(store: LedgerStore, data: bytes, kind: str) -> str:
    digest = hashlib.sha256(data).hexdigest()
    store.record_blob(digest, len(data), kind, RUN)
    return digest


def _spec(organiser: Identity, validator: Identity, workers: int, rounds: int,
          dataset: str, genesis: str) -> RunSpec:
    settings = run_preset("tiny")
    return RunSpec.from_body({
        "run_id": RUN, "round": 0, "created_at": 1, "organiser": organiser.public_key.hex(),
        "seed": "ab" * 32, "task": {"name": "synthetic", "params": {}},
        "dataset_hash": dataset, "dataset_bytes": 7, "genesis_model_hash": genesis,
        "num_params": 10, "inner": settings["inner"], "outer": settings["outer"],
        "codec": settings["codec"], "aggregator": settings["aggregator"],
        "schedule": {"round_seconds": 86_400.0, "min_submissions": 1,
                     "max_rounds": rounds + 1},
        "verification": settings["verification"], "limits": {"max_payload_bytes": 4096},
        "rewards": settings["rewards"], "validators": [validator.public.to_json()],
        "quorum": 1})


def model_hash(r: int) -> str:
    return hashlib.sha256(f"bench model {r}".encode()).hexdigest()


# ----------------------------------------------------------------------------- envelopes
# Made in forked workers that inherit these globals.

_GEN: dict[str, Any] = {}


def _make_round(r: int) -> list[bytes]:
    spec: RunSpec = _GEN["spec"]
    out = []
    for seed in _GEN["seeds"]:
        w = Identity("worker", seed)
        payload = hashlib.sha256(seed + r.to_bytes(4, "big")).digest()
        body = {"run_id": RUN, "round": r, "worker": w.public_key.hex(),
                "base_model_hash": spec.genesis_model_hash if r == 0 else model_hash(r),
                "payload_hash": hashlib.sha256(payload).hexdigest(),
                "payload_bytes": len(payload), "codec": spec.codec,
                "samples": expected_samples(spec),
                "trail": ["7" * 64] * expected_trail_length(spec), "loss_first": 3.0,
                "loss_last": 2.0, "created_at": 1}
        if "ef_hash" in Submission.SCHEMA:
            body["ef_hash"] = "6" * 64
        out.append(sign(w, Submission(**body)).encode())
    return out


def make_envelopes(spec: RunSpec, seeds: list[bytes], rounds: int) -> list[list[bytes]]:
    _GEN.update(spec=spec, seeds=seeds)
    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(os.cpu_count() or 1, mp_context=ctx) as pool:
        return list(pool.map(_make_round, range(rounds)))


# ----------------------------------------------------------------------------- rounds


def setup(store: LedgerStore, workers: int, rounds: int) -> tuple[RunSpec, Identity,
                                                                   list[bytes]]:
    organiser, validator = Identity.generate("organiser"), Identity.generate("validator")
    dataset, genesis = _blob(store, b"dataset", "dataset"), _blob(store, b"genesis", "model")
    spec = _spec(organiser, validator, workers, rounds, dataset, genesis)
    store.create_run(sign(organiser, spec))
    seeds = [hashlib.sha256(b"bench worker %d" % i).digest() for i in range(workers)]
    from veritrain.ledger import schema as t

    with store.sessions.begin() as s:  # one transaction: registration is not measured
        for seed in seeds:
            w = Identity("worker", seed)
            reg = sign(w, Registration(run_id=RUN, round=0, participant=w.public_key.hex(),
                                       role="worker", created_at=1))
            s.add(t.Participant(run_id=RUN, pubkey=reg.signer, role="worker",
                                registered_at=1.0, registered_round=0,
                                registration=reg.encode()))
            store._append(s, RUN, "registration", reg.encode())
    return spec, validator, seeds


def finalize(store: LedgerStore, spec: RunSpec, validator: Identity, r: int,
             subs: list[tuple[str, str]]) -> None:
    """Beacon share and the validator's certified result (everyone honest)."""
    share = BeaconShare(run_id=RUN, round=r, validator=validator.public_key.hex(),
                        share=validator.sign_bls(beacon_root(RUN, r)).hex(),
                        sealed=sealed_list_digest([d for _, d in subs]),
                        participants=EVERY_WORKER_ADMITTED)
    seed = beacon_seed_of(store.post_beacon_share(sign(validator, share))["beacon"])
    subs = sorted(subs)
    verdicts = [{"worker": w, "submission_digest": d, "status": "accepted", "reason": "",
                 "detail": "", "spot_checked": False, "distance": None, "checks": []}
                for w, d in subs]
    n = expected_samples(spec)
    scores_map = compute_scores({w: n for w, _ in subs}, {w: 1.0 for w, _ in subs})
    rewards = split_rewards(scores_map, spec.rewards["per_round"])
    scores = [{"worker": w, "samples": n, "quality": 1.0, "score": scores_map[w],
               "reward": rewards[w]} for w, _ in subs]
    model = _blob(store, f"bench model {r + 1}".encode(), "model")
    assert model == model_hash(r + 1)
    fields = {"run_id": RUN, "round": r + 1, "model_hash": model,
              "outer_state_hash": _blob(store, f"outer {r + 1}".encode(), "outer_state"),
              "update_hash": _blob(store, f"update {r}".encode(), "update"),
              "verdicts_hash": digest_of(verdicts), "scores_hash": digest_of(scores),
              "eval_loss": 3.0 / (1 + r)}
    cert = CertifiedState.from_body({k: v for k, v in fields.items()
                                     if k in CertifiedState.SCHEMA})
    res = RoundResult(run_id=RUN, round=r, validator=validator.public_key.hex(),
                      base_model_hash=spec.genesis_model_hash if r == 0 else model_hash(r),
                      beacon_seed=seed, verdicts=verdicts, scores=scores,
                      certified=cert.to_body(),
                      attestation=validator.sign_bls(cert.signing_root()).hex())
    store.post_result(sign(validator, res))


def ingest_round(store: LedgerStore, pool: ProcessPoolExecutor, raws: list[bytes]
                 ) -> tuple[float, list[tuple[str, str]]]:
    """Seconds spent taking one round's envelopes in, and the (worker, digest) accepted."""
    start = time.perf_counter()
    chunks = [raws[k:k + BATCH] for k in range(0, len(raws), BATCH)]
    accepted: list[tuple[str, str]] = []
    opened = pool.map(open_submissions, chunks)  # verification runs ahead of the writer
    for chunk, signed_list in zip(chunks, opened, strict=True):
        items = []
        for raw, signed in zip(chunk, signed_list, strict=True):
            if isinstance(signed, Exception):
                raise signed
            m = signed.message
            items.append(Incoming(signed, m.payload_hash, m.payload_bytes, raw))
        for item, out in zip(items, accept_batch(store, items), strict=True):
            if isinstance(out, Exception):
                raise out
            accepted.append((item.signed.message.worker, hashlib.sha256(item.raw or b"")
                             .hexdigest()))
    return time.perf_counter() - start, accepted


def single_path_rate(tmp: Path, n: int) -> float:
    """Submissions per second through accept_submission, one transaction each."""
    store = LedgerStore(f"sqlite:///{tmp / 'single.sqlite'}", Identity.generate("ledger"))
    spec, _, seeds = setup(store, n + 1, 1)
    raws = make_envelopes(spec, seeds[:n], 1)[0]
    start = time.perf_counter()
    for raw in raws:
        signed = open_submissions([raw])[0]
        assert not isinstance(signed, Exception)
        store.accept_submission(signed, signed.message.payload_hash,
                                signed.message.payload_bytes)
    rate = n / (time.perf_counter() - start)
    store.engine.dispose()
    return rate


# ----------------------------------------------------------------------------- audit


async def audit_latencies(url: str, identity: Identity, workers: list[str], queries: int,
                          export_to: Path) -> list[float]:
    config = LedgerConfig(data_dir=export_to.parent / "server", db_url=url, ip_rate=0,
                          key_rate=0, tick_seconds=3600)
    server = TestServer(make_app(config, identity), host="127.0.0.1")
    await server.start_server()
    base = str(server.make_url("")).rstrip("/")
    rng = random.Random(7)
    out: list[float] = []
    try:
        async with aiohttp.ClientSession() as session:
            for k in range(queries):
                w = rng.choice(workers)
                path = (f"/v1/runs/{RUN}/workers/{w}?offset={rng.randrange(0, 40)}&limit=20"
                        if k % 2 else
                        f"/v1/runs/{RUN}/verdicts?worker={w}&offset={rng.randrange(0, 40)}"
                        "&limit=20")
                t0 = time.perf_counter()
                async with session.get(base + path) as resp:
                    await resp.read()
                    assert resp.status == 200, path
                out.append(time.perf_counter() - t0)
            async with session.get(f"{base}/v1/runs/{RUN}/export") as resp:
                with export_to.open("wb") as fh:
                    async for chunk in resp.content.iter_chunked(1 << 20):
                        fh.write(chunk)
    finally:
        await server.close()
    return out


def _children_cpu() -> float:
    """CPU seconds of finished child processes (the pools, once shut down)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000, help="chain rows to store")
    ap.add_argument("--workers", type=int, default=10_000, help="workers per round (<= 10000)")
    ap.add_argument("--queries", type=int, default=2000, help="audit queries to time")
    ap.add_argument("--single", type=int, default=500,
                    help="submissions for the one-per-transaction contrast")
    ap.add_argument("--full", action="store_true", help="also time full verification")
    ap.add_argument("--dir", help="work directory (default: a temporary one)")
    args = ap.parse_args(argv)
    tmp = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ledger-bench-"))
    tmp.mkdir(parents=True, exist_ok=True)
    rounds = max(1, -(-args.rows // (2 * args.workers)))
    cores = os.cpu_count() or 1
    print(f"ledger bench: {args.workers} workers x {rounds} rounds on SQLite in {tmp}, "
          f"{cores} cores", flush=True)

    url = f"sqlite:///{tmp / 'ledger.sqlite'}"
    store = LedgerStore(url, Identity.generate("ledger"))
    t0 = time.perf_counter()
    spec, validator, seeds = setup(store, args.workers, rounds)
    envelopes = make_envelopes(spec, seeds, rounds)
    print(f"  setup and signing {args.workers * rounds} envelopes: "
          f"{time.perf_counter() - t0:.0f}s", flush=True)

    ingest_s, finalize_s, submissions, ingest_cpu = 0.0, 0.0, 0, 0.0
    ctx = multiprocessing.get_context("fork")
    children_before = _children_cpu()
    with ProcessPoolExecutor(cores, mp_context=ctx) as pool:
        for r in range(rounds):
            cpu0 = time.process_time()
            secs, accepted = ingest_round(store, pool, envelopes[r])
            ingest_cpu += time.process_time() - cpu0
            envelopes[r] = []
            ingest_s += secs
            submissions += len(accepted)
            t1 = time.perf_counter()
            finalize(store, spec, validator, r, accepted)
            finalize_s += time.perf_counter() - t1
            if r % 5 == 4 or r == rounds - 1:
                print(f"  round {r + 1}/{rounds}: {submissions / ingest_s:,.0f} "
                      f"submissions/s so far", flush=True)
    ingest_cpu += _children_cpu() - children_before  # the verifying pool's share
    store.checkpointer.sign_pending(store.sessions)
    from sqlalchemy import func, select
    from veritrain.ledger import schema as t

    with store.sessions() as s:
        chain_rows = s.execute(select(func.count()).select_from(t.Event)).scalar_one()
        all_rows = sum(s.execute(select(func.count()).select_from(tbl)).scalar_one()
                       for tbl in (t.Event, t.Submission, t.Verdict, t.Participant,
                                   t.Checkpoint, t.Blob))
    ingest_rows = 2 * submissions
    identity = store.identity
    store.engine.dispose()
    single = single_path_rate(tmp, args.single) if args.single else float("nan")

    workers = [Identity("worker", seed).public_key.hex() for seed in seeds]
    export = tmp / "export.jsonl"
    lat = asyncio.run(audit_latencies(url, identity, workers, args.queries, export))
    t2, cpu2, kids2 = time.perf_counter(), time.process_time(), _children_cpu()
    result = verify_export_file(export)
    verify_s = time.perf_counter() - t2
    verify_main_cpu = time.process_time() - cpu2
    verify_cpu = verify_main_cpu + _children_cpu() - kids2
    if not result.ok:
        print(f"verification FAILED: {result.problem or result.bad_view_row}")
        return 1
    full_rate = float("nan")
    if args.full:
        t3 = time.perf_counter()
        full = verify_export_file(export, full=True)
        full_rate = result.rows / (time.perf_counter() - t3)
        assert full.ok

    ingest_rate = ingest_rows / ingest_s
    verify_rate = result.rows / verify_s
    load = os.getloadavg()[0]
    p50, p99 = pct(lat, 0.50) * 1e3, pct(lat, 0.99) * 1e3
    table = [
        ("chain rows stored", f"{chain_rows:,}", f"{all_rows:,} rows in all tables"),
        ("ingest, batched", f"{ingest_rate:,.0f} rows/s",
         f"{submissions / ingest_s:,.0f} submissions/s, signatures verified "
         f"(target >= 5,000 rows/s)"),
        ("ingest, CPU cost", f"{ingest_cpu / ingest_rows * 1e6:,.0f} us/row",
         f"all processes; {cores} idle cores would give ~"
         f"{cores * ingest_rows / ingest_cpu:,.0f} rows/s"),
        ("ingest, one per request", f"{2 * single:,.0f} rows/s",
         f"{single:,.0f} submissions/s (accept_submission, contrast)"),
        ("round finalization", f"{finalize_s / rounds:.2f} s/round", "not in the ingest rate"),
        ("audit query p50", f"{p50:.2f} ms", f"{len(lat)} paged per-worker queries, HTTP"),
        ("audit query p99", f"{p99:.2f} ms", "target <= 50 ms"),
        ("verify (fast), offline", f"{verify_rate:,.0f} rows/s",
         f"{result.checkpoints} checkpoints, {result.certificates} certificates, "
         f"{result.signatures} direct signatures (target >= 50,000 rows/s)"),
        ("verify (fast), CPU cost", f"{verify_cpu / result.rows * 1e6:,.1f} us/row",
         f"all processes; {cores} idle cores would give ~"
         f"{result.rows / max(verify_main_cpu, verify_cpu / cores):,.0f} rows/s"),
        ("machine load", f"{load:.1f}", f"1-minute load average at the end, {cores} cores"),
        ("verify (full), offline", "-" if not args.full else f"{full_rate:,.0f} rows/s",
         "every Ed25519 signature, all cores" if args.full else "run with --full"),
    ]
    width = max(len(a) for a, _, _ in table)
    print()
    for name, value, note in table:
        print(f"  {name:<{width}}  {value:>18}  {note}")
    print(f"ledger: ingest_rows_per_s={ingest_rate:.0f} audit_p99_ms={p99:.1f} "
          f"verify_rows_per_s={verify_rate:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
