"""``veritrain audit recheck``: re-run a recorded spot check from the ledger's evidence.

Anyone can take a finalized round's verdict for one worker, fetch the stored
evidence (the signed submission, its payload, the worker's reveal, the round's
beacon and the certified base model) and recompute every recorded check (the
challenged segments and the payload binding), to see that the verdict, not just
its signature, holds.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from veritrain.ledger.client import LedgerClient, LedgerRefused, fetch_base_files, fetch_run
from veritrain.protocol.beacon import beacon_seed_of
from veritrain.protocol.messages import SpotReveal, Submission, open_signed
from veritrain.protocol.runtime import RunContext

from .spot_checks import check_reveal


async def recheck(client: LedgerClient, run_id: str | None, r: int, worker_prefix: str
                  ) -> list[dict[str, Any]]:
    """Each recorded check of the worker in round ``r`` beside its recomputation."""
    spec = await fetch_run(client, run_id, wait_for=0)
    run = RunContext.build(spec, bytes(await client.get_blob(spec.dataset_hash,
                                                             max_bytes=spec.dataset_bytes)))
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
    beacon = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}/beacon")
    seed = bytes.fromhex(beacon_seed_of(beacon["beacon"]))
    masked = spec.masked is not None
    payload = None if masked else await client.get_blob(signed.message.payload_hash,
                                                        max_bytes=signed.message.payload_bytes)
    view = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}/challenges")
    mine = next((c for c in view["challenges"] if c["worker"] == verdict["worker"]), None)
    reveal = None
    if mine is not None and mine["reveal"] is not None:
        envelope = open_signed(mine["reveal"]["envelope"], SpotReveal).message
        # A file that is gone is simply absent: the recomputation fails the same way.
        with contextlib.suppress(LedgerRefused):
            reveal = await client.get_blob(envelope.reveal_hash, max_bytes=envelope.reveal_bytes)
    segments = [c["segment"] for c in verdict["checks"] if c.get("kind", "step") == "step"]
    again = check_reveal(run, base_flat, signed.message, payload, segments, reveal, seed,
                         masked=masked) if verdict["checks"] else []
    return [{"recorded": recorded, "recomputed": res.to_json(),
             "agrees": res.ok == recorded["ok"]}
            for recorded, res in zip(verdict["checks"], again, strict=False)]


async def run_recheck(args: argparse.Namespace) -> int:
    if args.arg is None or not args.arg.isdigit() or not args.worker:
        raise SystemExit("usage: veritrain audit recheck ROUND --worker KEY_PREFIX")
    async with LedgerClient(args.ledger, retry_for=getattr(args, "retry_for", 10.0)) as client:
        rows = await recheck(client, args.run, int(args.arg), args.worker)
    for row in rows:
        rec, again = row["recorded"], row["recomputed"]
        what = "binding    " if rec.get("kind") == "binding" else f"segment {rec['segment']:>3}"
        print(f"{what}: recorded {'ok' if rec['ok'] else 'FAIL'} "
              f"(distance {rec['distance']}), recomputed {'ok' if again['ok'] else 'FAIL'} "
              f"(distance {again['distance']}) {'agrees' if row['agrees'] else 'DISAGREES'}"
              f"{': ' + again['note'] if again['note'] else ''}")
    if not rows:
        print("no segment checks were recorded for this worker in that round")
    return 0 if all(r["agrees"] for r in rows) else 1
