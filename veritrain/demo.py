"""``veritrain demo``: the whole protocol on one machine, with cheaters.

Starts a ledger, validators and workers as separate processes talking HTTP on
loopback. Two runs with the same seed and the same honest workers: a clean
one, and one where the last two workers cheat (a free rider that submits
noise without training, and a sign flipper). The report compares them.

With ``--sharded`` the validators split the aggregation into one coordinate
shard each and check one another's shards; ``--shard-cheater`` makes the last
validator publish its shard shifted by 0.1% every round, which the others must
catch, record and recompute (specs/secure-averaging.md A).

With ``--masked-buckets S`` workers hide their updates in masked buckets of S
(specs/secure-averaging.md B, E.2): validators unmask only bucket sums, and
the half of the workers the beacon spot-checks each round open their masked
input, so a cheater is caught the first round it is opened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from veritrain.ledger.audit import fetch_events, format_report, verify_events
from veritrain.ledger.client import LedgerClient, publish_run
from veritrain.local import LocalProcesses
from veritrain.protocol.identity import Identity, write_key_file
from veritrain.protocol.organiser import build_run
from veritrain.protocol.presets import run_preset
from veritrain.protocol.runtime import RunContext

CHEATERS = ("free_rider", "sign_flip")


def _keys(out: Path, role: str, count: int) -> list[tuple[Path, Identity]]:
    keys = []
    for i in range(count):
        path = out / "keys" / f"{role}-{i}.key"
        ident = Identity.generate(role)
        write_key_file(path, ident)
        keys.append((path, ident))
    return keys


async def _wait_finished(url: str, run_id: str, timeout: float, label: str) -> dict[str, Any]:
    shown = -1
    deadline = time.monotonic() + timeout
    async with LedgerClient(url, retry_for=30.0) as client:
        while time.monotonic() < deadline:
            report = await client.get_json(f"/v1/runs/{run_id}/report")
            for r in report["rounds"]:
                if r["eval_loss"] is not None and r["round"] > shown:
                    shown = r["round"]
                    signers = ",".join(str(i) for i in r.get("certified_by") or [])
                    print(f"  [{label}] round {r['round']}: eval loss {r['eval_loss']:.4f}, "
                          f"{r['accepted']} accepted, {r['rejected']} rejected; model "
                          f"{(r.get('model_hash') or '')[:12]} certified by validators "
                          f"{signers}", flush=True)
            if report["status"] == "finished":
                return report
            await asyncio.sleep(0.5)
    raise TimeoutError(f"run {run_id} did not finish within {timeout:.0f}s")


async def _audit(url: str, run_id: str) -> Any:
    async with LedgerClient(url, retry_for=30.0) as client:
        ledger_key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
        return verify_events(await fetch_events(client, run_id), ledger_key)


async def _shard_faults(url: str, run_id: str, rounds: int) -> dict[int, list[int]]:
    """Round -> the shards a quorum of validators found faulty (sharded runs)."""
    async with LedgerClient(url, retry_for=30.0) as client:
        return {r: (await client.get_json(f"/v1/runs/{run_id}/rounds/{r}/shards"))[
            "faulty_shards"] for r in range(rounds)}


async def _masked_rounds(url: str, run_id: str, rounds: int) -> dict[int, dict[str, Any]]:
    """Round -> how many buckets it dealt and unmasked, and which workers were opened."""
    out: dict[int, dict[str, Any]] = {}
    async with LedgerClient(url, retry_for=30.0) as client:
        for r in range(rounds):
            view = await client.get_json(f"/v1/runs/{run_id}/rounds/{r}/secagg")
            out[r] = {"buckets": len(view["buckets"]),
                      "live": sum(1 for b in view["buckets"] if b["live"]),
                      "opened": sorted(o["body"]["worker"][:12] for o in view["posts"]["opening"])}
    return out


def _run_swarm(procs: LocalProcesses, url: str, run_id: str, validators: list[tuple[Path, Identity]],
               workers: list[tuple[Path, Identity]], attacks: dict[int, str], out: Path,
               device: str, timeout: float, shard_cheater: int | None = None) -> dict[str, Any]:
    for i, (path, _) in enumerate(validators):
        args = ["validator", "--ledger", url, "--key", str(path), "--run", run_id,
                "--device", device]
        if i == shard_cheater:
            args += ["--attack", "shard_shift"]
        procs.start(f"{run_id}-validator-{i}", args)
    for i, (path, _) in enumerate(workers):
        args = ["worker", "--ledger", url, "--key", str(path), "--run", run_id, "--device",
                device, "--no-progress", "--state-dir", str(out / "worker-state" / f"w{i}")]
        if i in attacks:
            args += ["--attack", attacks[i]]
        procs.start(f"{run_id}-worker-{i}", args)
    return asyncio.run(_wait_finished(url, run_id, timeout, run_id))


def _plot(path: Path, runs: dict[str, dict[str, Any]], genesis_loss: float,
          caught: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, report in runs.items():
        pts = [(0, genesis_loss)] + [(r["round"] + 1, r["eval_loss"]) for r in report["rounds"]
                                     if r["eval_loss"] is not None]
        clean = label.startswith("clean")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label,
                marker="s" if clean else "o", markersize=7 if clean else 4,
                linestyle="--" if clean else "-", linewidth=2.5 if clean else 1.5,
                alpha=0.6 if clean else 1.0)
    for name, c in caught.items():
        if c["caught_in_round"] is not None:
            x = c["caught_in_round"] + 1
            ax.axvline(x, color="grey", linewidth=0.8, linestyle=":")
            ax.annotate(f"{name} caught", (x, ax.get_ylim()[1]), rotation=90, fontsize=8,
                        va="top", ha="right", color="grey")
    ax.set_xlabel("rounds completed")
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_title("veritrain demo: charlm eval loss per round")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summarize(report: dict[str, Any], workers: list[tuple[Path, Identity]],
              attacks: dict[int, str]) -> dict[str, Any]:
    """Who was caught and when, whether any honest worker was rejected."""
    by_key = {w["worker"]: w for w in report["workers"]}
    caught: dict[str, Any] = {}
    honest_rejections = []
    for i, (_, ident) in enumerate(workers):
        row = by_key.get(ident.public_key.hex())
        rejected = row["rejected"] if row else []
        if i in attacks:
            caught[attacks[i]] = {
                "worker": ident.public_key.hex()[:12],
                "caught_in_round": rejected[0]["round"] if rejected else None,
                "reason": rejected[0]["reason"] if rejected else None,
                "score": row["score"] if row else 0.0,
            }
        elif rejected:
            honest_rejections.append({"worker": ident.public_key.hex()[:12], **rejected[0]})
    return {"cheaters": caught, "honest_rejections": honest_rejections}


def run_demo(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    n_workers = args.workers
    if n_workers < 3:
        raise SystemExit("the demo needs at least 3 workers (two of them cheat)")
    attacks = {n_workers - 2: CHEATERS[0], n_workers - 1: CHEATERS[1]}
    organiser = Identity.generate("organiser")
    validators = _keys(out, "validator", args.validators)
    workers = _keys(out, "worker", n_workers)
    settings = run_preset(args.preset)
    settings["schedule"]["max_rounds"] = args.rounds
    shard_cheater = None
    if args.sharded:
        if args.validators < 3:
            raise SystemExit("--sharded needs at least 3 validators (a quorum of honest "
                             "checkers besides any one publisher)")
        settings["aggregator"]["shards"] = args.validators
        shard_cheater = args.validators - 1 if args.shard_cheater else None
    elif args.shard_cheater:
        raise SystemExit("--shard-cheater needs --sharded")
    if args.masked_buckets:
        if args.sharded:
            raise SystemExit("--masked-buckets does not combine with --sharded yet")
        if args.masked_buckets < 2 or n_workers < max(4, args.masked_buckets):
            raise SystemExit("--masked-buckets needs buckets of at least 2, that many workers "
                             "and two honest workers besides the cheaters")
        settings["aggregator"]["params"].pop("bucket_size", None)
        settings["aggregator"]["masked"] = {
            "bucket_size": args.masked_buckets,
            "max_dropouts": (args.masked_buckets + 1) // 2 - 1,
            # Round-0 updates of this preset have norm ~5.6: clip well above, so honest
            # updates pass unclipped and the fixed-point step is still ~1e-8.
            "clip_norm": 20.0, "phase_seconds": 20.0}
        # Validators see only bucket sums: no probe filter, and the deterrent is the
        # opened half of the workers each round (spec E.2).
        settings["verification"]["probe_examples"] = 0
        settings["verification"]["spot_checks_per_round"] = max(1, n_workers // 2)
        # A round seals with a bucket's worth of submitters (or every honest one): an
        # early worker never finds itself alone (unmaskable) because the rest registered
        # late, and banned cheaters do not hold the rounds open.
        settings["schedule"]["min_submissions"] = min(args.masked_buckets, n_workers - 2)
    seed = secrets.token_hex(32)  # one seed for both runs: same data for the same workers
    masking = (f", updates hidden in masked buckets of {args.masked_buckets}"
               if args.masked_buckets else "")
    print(f"veritrain demo: {n_workers} workers ({', '.join(CHEATERS)} among them){masking}, "
          f"{args.validators} validator(s){' aggregating one shard each' if args.sharded else ''}"
          f"{' (the last one shifts its shard)' if shard_cheater is not None else ''}, "
          f"{args.rounds} rounds of charlm ({args.preset})")
    procs = LocalProcesses(out / "logs")
    started = time.monotonic()
    try:
        url = procs.start_ledger(out / "ledger")
        print(f"ledger listening on {url} (SQLite file {out / 'ledger' / 'ledger.sqlite'})")
        reports: dict[str, dict[str, Any]] = {}
        plan = [("clean", {}), ("cheaters", attacks)]
        if args.no_clean_run:
            plan = plan[1:]
        vpub = [ident.public for _, ident in validators]
        for label, run_attacks in plan:
            run_id = f"demo-{label}"
            honest_only = [w for i, w in enumerate(workers) if i not in attacks]
            swarm = workers if run_attacks else honest_only
            bundle = build_run(organiser, run_id, settings, vpub, seed=seed)
            asyncio.run(publish_run(url, bundle))
            print(f"\nrun {run_id}: {bundle.signed.message.num_params} parameters, "
                  f"{len(swarm)} workers")
            reports[label] = _run_swarm(procs, url, run_id, validators, swarm, run_attacks,
                                        out / label, args.device, timeout=1800,
                                        shard_cheater=shard_cheater)
        cheat = reports["cheaters"]
        print("\n" + format_report(cheat))
        summary = summarize(cheat, workers, attacks)
        audit = asyncio.run(_audit(url, "demo-cheaters"))
        final = {k: [r["eval_loss"] for r in v["rounds"] if r["eval_loss"] is not None][-1]
                 for k, v in reports.items()}
        run = RunContext.build(bundle.signed.message, bundle.dataset)
        _plot(out / "eval_loss.png",
              {("with cheaters" if k == "cheaters" else "clean (no cheaters)"): v
               for k, v in reports.items()},
              genesis_loss=run.evaluate(run.decode_model(bundle.genesis)),
              caught=summary["cheaters"])
        print("\nsummary")
        for name, c in summary["cheaters"].items():
            status = (f"caught in round {c['caught_in_round']} ({c['reason']})"
                      if c["caught_in_round"] is not None else "NOT caught")
            print(f"  {name:<11} {c['worker']}: {status}, total score {c['score']:.0f}")
        print(f"  honest workers rejected: {len(summary['honest_rejections'])}")
        shard_ok = True
        if args.masked_buckets:
            board = asyncio.run(_masked_rounds(url, "demo-cheaters", args.rounds))
            summary["masked"] = board
            opened = {name: [r for r, b in board.items() if c["worker"] in b["opened"]]
                      for name, c in summary["cheaters"].items()}
            for name, c in summary["cheaters"].items():
                if c["caught_in_round"] is None and not opened[name]:
                    c["never_opened"] = True
            live = sum(b["live"] for b in board.values())
            total = sum(b["buckets"] for b in board.values())
            openings = sum(len(b["opened"]) for b in board.values())
            print(f"  masked buckets: {live} of {total} unmasked; validators saw no single "
                  f"update but the {openings} opened ones over {args.rounds} rounds")
            for name, rounds in opened.items():
                print(f"  {name} opened in rounds {rounds or 'none'}")
        if args.sharded:
            faults = asyncio.run(_shard_faults(url, "demo-cheaters", args.rounds))
            caught = [r for r, shards in faults.items() if shard_cheater in shards]
            wrong = [r for r, shards in faults.items() if set(shards) - {shard_cheater}]
            summary["shard_faults"] = {str(r): v for r, v in faults.items()}
            if shard_cheater is not None:
                print(f"  shard shifter (validator {shard_cheater}): caught and recomputed in "
                      f"{len(caught)} of {args.rounds} rounds")
            print(f"  honest shards found faulty: {len(wrong)}")
            shard_ok = not wrong and (shard_cheater is None or len(caught) == args.rounds)
        gap = None
        if "clean" in final:
            gap = final["cheaters"] / final["clean"] - 1
            print(f"  final eval loss: {final['cheaters']:.4f} with cheaters vs "
                  f"{final['clean']:.4f} clean ({gap:+.2%})")
            if final["cheaters"] == final["clean"]:
                print("    (identical: no cheating update ever reached the aggregate, so the "
                      "model is bit for bit the clean run's)")
        print(f"  audit: {'OK' if audit.ok else 'FAILED'} ({audit.rows} rows, "
              f"{audit.signatures} signatures, {audit.certificates} certificates)")
        print(f"  plot: {out / 'eval_loss.png'}; report: {out / 'report.json'}")
        print(f"  browse the ledger again: veritrain ledger serve --data-dir {out / 'ledger'}")
        print(f"  took {time.monotonic() - started:.0f}s")
        (out / "report.json").write_text(json.dumps(
            {"reports": reports, "summary": summary, "final_eval_loss": final,
             "audit_ok": audit.ok}, indent=1))
        ok = (all(c["caught_in_round"] is not None or c.get("never_opened")
                  for c in summary["cheaters"].values())
              and not summary["honest_rejections"] and audit.ok and shard_ok
              and (gap is None or gap <= 0.05))
        return 0 if ok else 1
    finally:
        procs.stop_all()
