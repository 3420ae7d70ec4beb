"""``veritrain audit recheck``: re-run a recorded spot check from the ledger's evidence.

Anyone can take a finalized round's verdict for one worker, fetch the stored
evidence (the signed submission, its payload, the revealed states and
residual, the certified base model) and recompute every recorded segment
check, to see that the verdict, not just its signature, holds.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from veritrain.ledger.client import LedgerClient, LedgerRefused, fetch_base_files, fetch_run
from veritrain.protocol.challenges import max_reveal_bytes
from veritrain.protocol.messages import Submission, open_signed
from veritrain.protocol.runtime import RunContext

from .segments import check_segment


async def recheck(client: LedgerClient, run_id: str | None, r: int, worker_prefix: str
                  ) -> list[dict[str, Any]]:
    """Each recorded check of the worker in round ``r`` beside its recomputation."""
    spec = await fetch_run(client, run_id, wait_for=0)
    run = RunContext.build(spec, await client.get_blob(spec.dataset_hash,
                                                       max_bytes=spec.dataset_bytes))
    summary = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}")
    verdicts = [v for v in summary["verdicts"] if v["worker"].startswith(worker_prefix)]
    if len(verdicts) != 1:
        raise SystemExit(f"{len(verdicts)} verdicts in round {r} match {worker_prefix!r}; "
                         "`veritrain audit round R` lists them")
    verdict = verdicts[0]
    base_flat, _ = run.decode_base(*await fetch_base_files(
        client, run.spec, summary, max_model_bytes=run.max_model_bytes))
    sealed = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}/submissions")
    signed = next((s for s in (open_signed(w, Submission) for w in sealed["submissions"])
                   if s.message.worker == verdict["worker"]), None)
    if signed is None:
        raise SystemExit(f"round {r} has a verdict for {verdict['worker'][:12]} but the ledger "
                         "serves no sealed submission of it")
    payload = await client.get_blob(signed.message.payload_hash,
                                    max_bytes=signed.message.payload_bytes)
    rows = []
    for recorded in verdict["checks"]:
        evidence: dict[str, bytes] = {}
        for digest in (recorded["start"], recorded["end"], recorded["ef"]):
            if digest is None:
                continue
            # A file never revealed is simply absent: the recomputation fails the same way.
            with contextlib.suppress(LedgerRefused):
                evidence[digest] = await client.get_blob(digest,
                                                         max_bytes=max_reveal_bytes(run.numel))
        again = check_segment(run, base_flat, signed.message, payload, recorded["segment"],
                              evidence).to_json()
        rows.append({"recorded": recorded, "recomputed": again,
                     "agrees": again["ok"] == recorded["ok"]})
    return rows


async def run_recheck(args: argparse.Namespace) -> int:
    if args.arg is None or not args.arg.isdigit() or not args.worker:
        raise SystemExit("usage: veritrain audit recheck ROUND --worker KEY_PREFIX")
    async with LedgerClient(args.ledger, retry_for=getattr(args, "retry_for", 10.0)) as client:
        rows = await recheck(client, args.run, int(args.arg), args.worker)
    for row in rows:
        rec, again = row["recorded"], row["recomputed"]
        print(f"segment {rec['segment']:>3}: recorded {'ok' if rec['ok'] else 'FAIL'} "
              f"(distance {rec['distance']}), recomputed {'ok' if again['ok'] else 'FAIL'} "
              f"(distance {again['distance']}) {'agrees' if row['agrees'] else 'DISAGREES'}"
              f"{': ' + again['note'] if again['note'] else ''}")
    if not rows:
        print("no segment checks were recorded for this worker in that round")
    return 0 if all(r["agrees"] for r in rows) else 1
