"""Churn, crashes, load and hostile input: what the ledger and the nodes survive.

    .venv/bin/python bench/faults.py [--workers 200] [--rounds 3] [--payload-kib 256]
                                     [--mutations 500] [--no-drill]

Three scenarios, each against real ``veritrain`` processes on loopback:

* **load** (:mod:`veritrain.load`): ``--workers`` simulated workers, each its own
  HTTP client and key, submit signed payloads of ``--payload-kib`` concurrently to
  one ledger for ``--rounds`` rounds; 10% re-send as if the reply were lost; in
  round 1 the ledger is killed with SIGKILL once half the receipts are in and
  restarted on the same data while the workers retry. Checked through the public
  API: receipts without a stored submission (lost), (worker, round) stored twice
  (duplicated), stored payload hashes and a sample of payload bytes (corrupted),
  the whole chain audited. Submit latency p50/p99 over the rounds without a
  crash; the ledger's peak resident memory against the bytes uploaded.
* **hostile** (:mod:`veritrain.hostile`): named bad requests of every kind and
  ``--mutations`` seeded byte-level mutations of valid requests against a ledger
  with its default rate limits (upload and keep-alive limits shortened to 5 s so
  the slow-client cases take seconds); no 5xx, stored state unchanged.
* **crash drill** (:mod:`veritrain.crashdrill`): a tiny training run with real
  worker, validator and ledger processes; each is killed with SIGKILL mid-run and
  restarted; the run must finish with nothing lost or counted twice.

The last line is the one the issue tracks::

    faults: workers=<n> lost=0 duplicated=0 submit_p99_ms=<x> crashes_survived=<k>/<n> hostile_inputs=<n> server_errors=0
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from veritrain.crashdrill import crash_drill
from veritrain.hostile import attack_ledger
from veritrain.load import LoadPlan, run_load
from veritrain.local import LocalProcesses


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f} MiB"


def hostile(work: Path, mutations: int) -> object:
    procs = LocalProcesses(work / "logs")
    try:
        url = procs.start_ledger(work / "ledger", extra=["--upload-idle", "5", "--keepalive",
                                                         "5"])
        return asyncio.run(attack_ledger(url, mutations=mutations))
    finally:
        procs.stop_all()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--payload-kib", type=int, default=256)
    ap.add_argument("--mutations", type=int, default=500)
    ap.add_argument("--no-drill", action="store_true", help="skip the training crash drill")
    args = ap.parse_args()

    def say(msg: str) -> None:
        print(f"  {msg}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="veritrain-faults-") as tmp:
        root = Path(tmp)
        print(f"== load: {args.workers} workers x {args.rounds} rounds, "
              f"{args.payload_kib} KiB payloads, ledger SIGKILL in round 1 ==", flush=True)
        plan = LoadPlan(workers=args.workers, rounds=args.rounds,
                        payload_bytes=args.payload_kib * 1024,
                        crash_round=1 if args.rounds > 1 else None)
        load = run_load(root / "load", plan, progress=say)
        per_round = args.workers * plan.payload_bytes
        print(f"{'submissions with a receipt':<44}{load.receipts:>10}")
        print(f"{'stored submissions':<44}{load.stored:>10}")
        print(f"{'lost / duplicated / corrupted / failed':<44}"
              f"{f'{load.lost} / {load.duplicated} / {load.corrupted} / {load.failed}':>10}")
        print(f"{'re-sent after a lost reply, same receipt':<44}"
              f"{f'{load.resent_same_receipt}/{load.resent}':>10}")
        print(f"{'submit latency p50 / p99 (no crash)':<44}"
              f"{f'{load.p50_ms:.0f} / {load.p99_ms:.0f} ms':>10}")
        crash_lat = sorted(load.crash_round_latencies_ms)
        if crash_lat:
            print(f"{'submit latency max (crash round, retries)':<44}"
                  f"{f'{crash_lat[-1]:.0f} ms':>10}")
        print(f"{'ledger RSS at start / peak under load':<44}"
              f"{f'{_mib(load.ledger_start_rss_bytes)} / {_mib(load.ledger_peak_rss_bytes)}':>10}")
        print(f"{'bytes uploaded per round / in all':<44}"
              f"{f'{_mib(per_round)} / {_mib(load.uploaded_bytes)}':>10}")
        print(f"{'audit of the whole chain':<44}{'ok' if load.audit_ok else load.audit_problem:>10}")
        print(f"{'seconds':<44}{load.seconds:>10.1f}")

        print(f"\n== hostile input: named cases + {args.mutations} mutations ==", flush=True)
        started = time.monotonic()
        bad = hostile(root / "hostile", args.mutations)
        for case in bad.cases:
            shown = sorted(set(case.statuses))
            print(f"{'ok ' if case.ok else 'BAD'} {case.name:<58} {len(case.statuses):>3}x "
                  f"{shown} (expected {sorted(case.expected)})")
        print(f"mutations: {bad.mutations}, statuses {dict(sorted(bad.mutation_statuses.items()))}")
        print(f"state unchanged: {bad.state_unchanged}; alive after: {bad.alive}; "
              f"{time.monotonic() - started:.1f}s")

        drill = None
        if not args.no_drill:
            print("\n== crash drill: kill -9 a worker, the validator, the ledger ==", flush=True)
            started = time.monotonic()
            drill = crash_drill(root / "drill", progress=say)
            print(f"crashes: {', '.join(drill.crashes)}; run finished: {drill.finished} "
                  f"(round {drill.final_round}); submissions {len(drill.submissions)}, lost "
                  f"{drill.lost}, duplicated {drill.duplicated}; audit "
                  f"{'ok' if drill.audit and drill.audit.ok else drill.audit}; "
                  f"{time.monotonic() - started:.1f}s")

    crashes = load.crashes + (len(drill.crashes) if drill else 0)
    survived = (load.crashes if load.ok else 0) + (len(drill.crashes) if drill and drill.ok
                                                   else 0)
    lost = load.lost + load.failed + load.corrupted + (drill.lost if drill else 0)
    duplicated = load.duplicated + (drill.duplicated if drill else 0)
    print(f"faults: workers={args.workers} lost={lost} duplicated={duplicated} "
          f"submit_p99_ms={load.p99_ms:.0f} crashes_survived={survived}/{crashes} "
          f"hostile_inputs={bad.inputs} server_errors={bad.server_errors}")
    ok = load.ok and bad.ok and (drill is None or drill.ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
