"""Auditing a run: terminal views of the ledger and full verification of its log.

``verify_events`` checks, without trusting the server: the hash chain and the
ledger's signature on every row, the organiser's signature on the run spec,
the writer's signature on every signed row, and every certificate against
the validator set. It reports the first row that fails.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from veritrain.protocol.certificates import verify_certificate
from veritrain.protocol.client import LedgerClient
from veritrain.protocol.encoding import decode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import (
    BeaconShare,
    Receipt,
    Registration,
    RoundResult,
    RunSpec,
    Submission,
    open_signed,
)

from .chain import ChainRow, verify_chain

SIGNED_KINDS = {
    "run_spec": RunSpec,
    "registration": Registration,
    "submission": Submission,
    "receipt": Receipt,
    "round_result": RoundResult,
    "beacon_share": BeaconShare,
}


@dataclass
class AuditResult:
    rows: int = 0
    signatures: int = 0
    certificates: int = 0
    first_bad_seq: int | None = None
    problem: str | None = None
    kinds: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.first_bad_seq is None


def verify_events(rows: Iterable[ChainRow], ledger_key: bytes) -> AuditResult:
    """Verify a run's whole event log; stops at the first bad row."""
    rows = list(rows)
    out = AuditResult(rows=len(rows))
    chain_problem = verify_chain(rows, ledger_key)
    spec: RunSpec | None = None
    for row in rows:
        if chain_problem is not None and row.seq >= chain_problem.seq:
            out.first_bad_seq, out.problem = chain_problem.seq, chain_problem.problem
            return out
        out.kinds[row.kind] = out.kinds.get(row.kind, 0) + 1
        try:
            body = decode_canonical(row.body, max_bytes=1 << 26)
            cls = SIGNED_KINDS.get(row.kind)
            if cls is not None:
                signed = open_signed(body, cls)
                out.signatures += 1
                if cls is RunSpec:
                    if signed.signer != signed.message.organiser:
                        raise RejectedInput("run spec not signed by its organiser")
                    spec = signed.message
                elif cls is Receipt and signed.signer != ledger_key.hex():
                    raise RejectedInput("receipt not signed by this ledger")
            elif row.kind == "round_finalized":
                if spec is None:
                    raise RejectedInput("certificate before the run spec")
                verify_certificate(body["certificate"], spec,
                                   base_of_round=body["certificate"]["certified"]["round"])
                out.certificates += 1
        except (RejectedInput, KeyError, TypeError) as exc:
            out.first_bad_seq, out.problem = row.seq, f"{row.kind}: {exc}"
            return out
    if chain_problem is not None:
        out.first_bad_seq, out.problem = chain_problem.seq, chain_problem.problem
    return out


async def fetch_events(client: LedgerClient, run_id: str) -> list[ChainRow]:
    rows: list[ChainRow] = []
    after = -1
    while True:
        page = await client.get_json(f"/v1/runs/{run_id}/events?after={after}&limit=1000")
        for e in page["events"]:
            rows.append(ChainRow(seq=e["seq"], run_id=run_id, kind=e["kind"],
                                 body=e["body"].encode("ascii"), prev_hash=e["prev_hash"],
                                 hash=e["hash"], ledger_signature=e["ledger_signature"]))
        if len(page["events"]) < 1000:
            return rows
        after = rows[-1].seq


def format_report(report: dict[str, Any]) -> str:
    lines = [f"run {report['run_id']} ({report['status']})", "",
             "round  status     eval_loss  accepted  rejected"]
    for r in report["rounds"]:
        loss = f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-"
        lines.append(f"{r['round']:>5}  {r['status']:<9}  {loss:>9}  {r['accepted']:>8}  "
                     f"{r['rejected']:>8}")
    lines += ["", "worker        accepted  rejected  spot-checked     score    reward  banned"]
    for w in report["workers"]:
        banned = f"until r{w['banned_until_round']}" if w["banned_until_round"] >= 0 else ""
        lines.append(f"{w['worker'][:12]}  {w['accepted']:>8}  {len(w['rejected']):>8}  "
                     f"{w['spot_checked']:>12}  {w['score']:>8.0f}  {w['reward']:>8.2f}  {banned}")
        for rej in w["rejected"]:
            lines.append(f"    round {rej['round']}: {rej['reason']} ({rej['detail']})")
    if report["rejections"]:
        lines += ["", "refused at the ledger's door:"]
        grouped: dict[tuple[str, str], list[Any]] = {}
        for x in report["rejections"]:
            grouped.setdefault(((x["signer"] or "?")[:12], x["reason"]), []).append(x)
        for (who, reason), xs in grouped.items():
            rounds = sorted({x["round"] for x in xs if x["round"] is not None})
            where = f"rounds {rounds[0]}-{rounds[-1]}" if len(rounds) > 1 else (
                f"round {rounds[0]}" if rounds else "no round")
            lines.append(f"    {who} {reason} x{len(xs)} ({where}): {xs[0]['detail']}")
    return "\n".join(lines)


async def _pick_run(client: LedgerClient, run_id: str | None) -> str:
    if run_id:
        return run_id
    runs = (await client.get_json("/v1/ledger"))["runs"]
    if len(runs) != 1:
        raise SystemExit(f"ledger has {len(runs)} runs; pass --run")
    return str(runs[0]["run_id"])


async def run_audit(args: argparse.Namespace) -> int:
    async with LedgerClient(args.ledger, retry_for=10.0) as client:
        run_id = await _pick_run(client, args.run)
        if args.what == "verify":
            ledger_key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
            result = verify_events(await fetch_events(client, run_id), ledger_key)
            if args.json:
                print(json.dumps(result.__dict__ | {"ok": result.ok}))
            elif result.ok:
                print(f"OK: {result.rows} rows chained and signed, {result.signatures} writer "
                      f"signatures, {result.certificates} certificates verified")
            else:
                print(f"FAILED at row {result.first_bad_seq}: {result.problem}")
            return 0 if result.ok else 1
        if args.what == "report":
            data = await client.get_json(f"/v1/runs/{run_id}/report")
            print(json.dumps(data, indent=1) if args.json else format_report(data))
            return 0
        if args.what == "round":
            if args.arg is None or not args.arg.isdigit():
                raise SystemExit("audit round needs a round number")
            data = await client.get_json(f"/v1/runs/{run_id}/rounds/{args.arg}")
            print(json.dumps(data, indent=1))
            return 0
        report = await client.get_json(f"/v1/runs/{run_id}/report")
        matches = [w["worker"] for w in report["workers"] if w["worker"].startswith(args.arg or "")]
        if len(matches) != 1:
            raise SystemExit(f"{len(matches)} workers match {args.arg!r}")
        data = await client.get_json(f"/v1/runs/{run_id}/workers/{matches[0]}")
        print(json.dumps(data, indent=1))
        return 0
