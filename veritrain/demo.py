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
input, so a cheater is caught the first round it is opened. A Byzantine worker
spoils its whole bucket, so the two cheaters need more than four buckets:
``--workers`` at least ``5 S``.

With ``--admission bond`` (or ``allowlist``) only admitted keys may work
(specs/scoring.md, "Admission"): the organiser, as the run's treasury, records a
bond of :data:`DEMO_BOND` units for each worker (or signs each a ticket) before it
starts, and a caught cheater's proven fault slashes half its bond, which leaves it
below the run's minimum: its key is out of the run, and so would be any new key
it registered without a new bond.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from veritrain.ledger.audit import fetch_and_verify, format_report
from veritrain.ledger.client import LedgerClient, publish_run
from veritrain.local import LocalProcesses, free_port
from veritrain.protocol.identity import Identity, write_key_file
from veritrain.protocol.messages import masked_withstands
from veritrain.protocol.organiser import build_run
from veritrain.protocol.presets import run_preset
from veritrain.protocol.runtime import RunContext
from veritrain.swarm import Swarm, SwarmResult

CHEATERS = ("free_rider", "sign_flip")
#: ``--admission bond``: each worker's bond, the run's minimum and the share a slash takes.
DEMO_BOND, DEMO_MIN_BOND, DEMO_SLASH_SHARE = 16, 10, 0.5
LABELS = {"clean": "veritrain, no cheaters",
          "cheaters": "veritrain, with the two cheaters (caught, left out)",
          "undefended": "no defence, the same two cheaters (plain mean, no checks)"}
STYLES: dict[str, dict[str, Any]] = {
    "clean": {"color": "tab:blue", "marker": "s", "markersize": 7, "linestyle": "--",
              "linewidth": 2.5, "alpha": 0.55},
    "cheaters": {"color": "tab:green", "marker": "o", "markersize": 4, "linewidth": 1.5},
    "undefended": {"color": "tab:red", "marker": "^", "markersize": 5, "linewidth": 1.8},
}


def _losses(report: dict[str, Any]) -> list[float]:
    """Eval loss of the certified model after each round, in order."""
    return [r["eval_loss"] for r in report["rounds"] if r["eval_loss"] is not None]


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
        return await fetch_and_verify(client, run_id)


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
                "--device", device, "--state-dir", str(out / "validator-state" / f"v{i}")]
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


async def _admit_workers(url: str, organiser: Identity, run_id: str,
                         workers: list[tuple[Path, Identity]], policy: str) -> str:
    """The organiser admits every worker of the demo: a bond deposit of :data:`DEMO_BOND`
    units each (as the run's treasury), or a ticket for the whole run each."""
    from veritrain.admission import admit, deposit

    for _, ident in workers:
        worker = ident.public_key.hex()
        if policy == "bond":
            await deposit(url, organiser, run_id, worker, DEMO_BOND, "demo")
        else:
            await admit(url, organiser, run_id, worker, until_round=None, revoke=False)
    if policy == "bond":
        return (f"the treasury bonded each of the {len(workers)} workers with {DEMO_BOND} "
                f"units (the run needs {DEMO_MIN_BOND}; a proven fault takes "
                f"{DEMO_SLASH_SHARE:.0%})")
    return f"the organiser signed each of the {len(workers)} workers a ticket for the run"


def bonds_line(row: dict[str, Any] | None) -> str:
    """What a worker's proven faults cost its bond, from the report's ``bond`` field."""
    bond = (row or {}).get("bond")
    if bond is None:
        return ""
    if not bond["slashes"]:
        return f"; bond {bond['bond']}, never slashed"
    cuts = ", ".join(f"{s['amount']} units in round {s['round']}" for s in bond["slashes"])
    state = "still admitted" if bond["admitted"] else "out of the run"
    return f"; slashed {cuts}: bond {bond['deposited']} -> {bond['bond']} ({state})"


def undefended_run(settings: dict[str, Any], workers: list[Identity], attacks: dict[int, str],
                   rounds: int, *, run_seed: str | None = None,
                   on_round: Callable[[int, float], None] | None = None) -> SwarmResult:
    """The same swarm with no defence: the in-process swarm (veritrain/swarm.py) with the
    same worker keys and run seed (so the same data), but the plain mean of every update,
    no spot checks, no probe filter and no norm filter, so the cheaters' updates are
    averaged in. A minute or so: one process, no HTTP. ``caught`` of the result is empty:
    nobody is checked."""
    plain = copy.deepcopy(settings)
    plain["aggregator"] = {"name": "mean", "params": {}}
    plain["verification"].update(challenges_per_worker=0.0, always_last=False,
                                 spot_checks_per_round=0, probe_examples=0, binding_chunks=0,
                                 norm_factor=1e6)  # the spec's cap: flags no plausible norm
    plain["schedule"]["max_rounds"] = rounds
    swarm = Swarm(plain, n_workers=len(workers), byzantine=attacks, seed="demo",
                  workers=workers, run_seed=run_seed)
    return swarm.train(rounds, on_round=None if on_round is None else (
        lambda r, outcome: on_round(r, outcome.eval_loss)))


def caught_labels(caught: dict[str, Any]) -> list[tuple[int, float, str]]:
    """(x, height as a fraction of the axes, text) of each "caught" label: one label per
    round (the cheaters caught in it named together), staggered downwards so no two
    overlap."""
    by_x: dict[int, list[str]] = {}
    for name, c in caught.items():
        if c["caught_in_round"] is not None:
            by_x.setdefault(c["caught_in_round"] + 1, []).append(name.replace("_", " "))
    return [(x, 0.96 - 0.09 * k, f"{' and '.join(names)} caught in round {x - 1}")
            for k, (x, names) in enumerate(sorted(by_x.items()))]


def _plot(path: Path, curves: list[tuple[str, list[float], dict[str, Any]]],
          caught: dict[str, Any]) -> None:
    """The eval loss curves (x = rounds completed, from the genesis model at 0) and where
    each cheater was caught."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.4), dpi=110)
    for label, losses, style in curves:
        ax.plot(range(len(losses)), losses, label=label, **style)
    for x, height, text in caught_labels(caught):
        ax.axvline(x, color="grey", linewidth=0.8, linestyle=":")
        ax.annotate(text, xy=(x, height), xycoords=("data", "axes fraction"),
                    xytext=(6, 0), textcoords="offset points", va="top", ha="left",
                    fontsize=8.5, color="dimgrey",
                    bbox={"boxstyle": "round,pad=0.25", "fc": "white", "ec": "lightgrey"})
    ax.set_xlabel("rounds completed")
    ax.set_ylabel("eval loss (nats/byte)")
    ax.set_title("veritrain demo: charlm eval loss, the same two cheaters with and without "
                 "veritrain", fontsize=10)
    ax.grid(alpha=0.3)
    # Below the axes, where no curve or label can be.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False,
              fontsize=8.5)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def summarize(report: dict[str, Any], workers: list[tuple[Path, Identity]],
              attacks: dict[int, str]) -> dict[str, Any]:
    """Who was caught and when, whether any honest worker was rejected."""
    by_key = {w["worker"]: w for w in report["workers"]}
    caught: dict[str, Any] = {}
    honest_rejections: list[dict[str, Any]] = []
    honest_slashes: list[dict[str, Any]] = []
    honest_excluded: list[dict[str, Any]] = []
    for i, (_, ident) in enumerate(workers):
        row = by_key.get(ident.public_key.hex())
        rejected = row["rejected"] if row else []
        if i not in attacks and row is not None:
            honest_excluded += [{"worker": ident.public_key.hex()[:12], **x}
                                for x in row.get("excluded", [])]
        if i in attacks:
            caught[attacks[i]] = {
                "worker": ident.public_key.hex()[:12],
                "caught_in_round": rejected[0]["round"] if rejected else None,
                "reason": rejected[0]["reason"] if rejected else None,
                "score": row["score"] if row else 0.0,
                "bond": (row or {}).get("bond"),
            }
        elif rejected:
            honest_rejections.append({"worker": ident.public_key.hex()[:12], **rejected[0]})
        elif row is not None and row.get("bond") and row["bond"]["slashes"]:
            honest_slashes.append({"worker": ident.public_key.hex()[:12],
                                   "slashes": row["bond"]["slashes"]})
    return {"cheaters": caught, "honest_rejections": honest_rejections,
            "honest_slashes": honest_slashes, "honest_excluded": honest_excluded}


def run_demo(args: argparse.Namespace) -> int:
    """The demo; its options are checked before anything is written (``--out`` is emptied
    only then)."""
    n_workers = args.workers
    if n_workers < 3:
        raise SystemExit("the demo needs at least 3 workers (two of them cheat)")
    attacks = {n_workers - 2: CHEATERS[0], n_workers - 1: CHEATERS[1]}
    settings = run_preset(args.preset)
    settings["schedule"]["max_rounds"] = args.rounds
    settings["verification"]["beacon"] = args.beacon
    shard_cheater = None
    if args.sharded:
        if args.validators < 3:
            raise SystemExit("--sharded needs at least 3 validators (a quorum of honest "
                             "checkers besides any one publisher)")
        settings["aggregator"]["shards"] = args.validators
        if args.shard_checkers:
            settings["aggregator"]["shard_checkers"] = args.shard_checkers
        shard_cheater = args.validators - 1 if args.shard_cheater else None
    elif args.shard_cheater or args.shard_checkers:
        raise SystemExit("--shard-cheater and --shard-checkers need --sharded")
    if args.masked_buckets:
        if args.sharded:
            raise SystemExit("--masked-buckets does not combine with --sharded yet")
        if args.masked_buckets < 2 or n_workers < max(4, args.masked_buckets):
            raise SystemExit("--masked-buckets needs buckets of at least 2, that many workers "
                             "and two honest workers besides the cheaters")
        if not masked_withstands(len(attacks), n_workers, args.masked_buckets):
            need = args.masked_buckets * (2 * len(attacks) + 1)
            raise SystemExit(
                f"{n_workers} workers make {n_workers // args.masked_buckets} masked buckets "
                f"of {args.masked_buckets}, and {len(attacks)} cheaters could spoil half of "
                f"them: masked buckets withstand f Byzantine workers only in more than 2f "
                f"buckets, here --workers {need} or more (specs/secure-averaging.md E.2, "
                "Breakdown)")
        # The run declares the share of workers it must withstand: the two cheaters.
        settings["verification"]["byzantine_share"] = len(attacks) / n_workers
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
    if args.admission != "open":
        from veritrain.admission import admission_settings

        settings["admission"] = admission_settings(
            args.admission, min_bond=DEMO_MIN_BOND if args.admission == "bond" else None,
            slash_share=DEMO_SLASH_SHARE if args.admission == "bond" else None,
            unbonding_rounds=None, treasury=None, issuers=[])
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    organiser = Identity.generate("organiser")
    validators = _keys(out, "validator", args.validators)
    workers = _keys(out, "worker", n_workers)
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
        for label, run_attacks in plan:
            # Each validator takes workers' reveal receipts at its own inbox (protocol.md
            # 7.2), a fresh port per run: the last run's validators may still be exiting.
            vpub = [dataclasses.replace(ident.public, inbox=f"http://127.0.0.1:{free_port()}")
                    for _, ident in validators]
            run_id = f"demo-{label}"
            honest_only = [w for i, w in enumerate(workers) if i not in attacks]
            swarm = workers if run_attacks else honest_only
            bundle = build_run(organiser, run_id, settings, vpub, seed=seed)
            asyncio.run(publish_run(url, bundle))
            print(f"\nrun {run_id}: {bundle.signed.message.num_params} parameters, "
                  f"{len(swarm)} workers")
            if args.admission != "open":
                print("  " + asyncio.run(_admit_workers(url, organiser, run_id, swarm,
                                                        args.admission)))
            reports[label] = _run_swarm(procs, url, run_id, validators, swarm, run_attacks,
                                        out / label, args.device, timeout=1800,
                                        shard_cheater=shard_cheater)
        cheat = reports["cheaters"]
        print("\n" + format_report(cheat))
        summary = summarize(cheat, workers, attacks)
        audit = asyncio.run(_audit(url, "demo-cheaters"))
        final = {k: _losses(v)[-1] for k, v in reports.items()}
        run = RunContext.build(bundle.signed.message, bundle.dataset)
        genesis_loss = run.evaluate(run.decode_model(bundle.genesis))
        curves = [(LABELS[k], [genesis_loss] + _losses(v), STYLES[k])
                  for k, v in reports.items()]
        if "clean" in reports and _losses(reports["clean"]) == _losses(cheat):
            curves[-1] = (LABELS["cheaters"].replace(")", "): the same model as without "
                                                     "them, on the clean curve"),
                          *curves[-1][1:])
        if not args.no_undefended:
            print("\nthe same workers, data and cheaters with no defence (in-process: plain "
                  "mean of every update, no spot checks, no filters)")
            undefended = undefended_run(
                settings, [ident for _, ident in workers], attacks, args.rounds, run_seed=seed,
                on_round=lambda r, loss: print(
                    f"  [undefended] round {r}: eval loss {loss:.4f}, all {n_workers} "
                    "updates averaged, cheaters' included", flush=True)).eval_loss
            final["undefended"] = undefended[-1]
            curves.append((LABELS["undefended"], [genesis_loss] + undefended,
                           STYLES["undefended"]))
        _plot(out / "eval_loss.png", curves, summary["cheaters"])
        print("\nsummary")
        for name, c in summary["cheaters"].items():
            status = (f"caught in round {c['caught_in_round']} ({c['reason']})"
                      if c["caught_in_round"] is not None else "NOT caught")
            print(f"  {name:<11} {c['worker']}: {status}, total score {c['score']:.0f}"
                  f"{bonds_line(c)}")
        print(f"  honest workers rejected: {len(summary['honest_rejections'])}"
              + (f", slashed: {len(summary['honest_slashes'])}" if args.admission == "bond"
                 else ""))
        if summary["honest_excluded"]:
            reasons = sorted({x["reason"] for x in summary["honest_excluded"]})
            print(f"  honest updates excluded (not blamed, paid): "
                  f"{len(summary['honest_excluded'])} ({', '.join(reasons)})")
        slashed_ok = args.admission != "bond" or (
            not summary["honest_slashes"]
            and all(c["bond"] and c["bond"]["slashes"] and not c["bond"]["admitted"]
                    for c in summary["cheaters"].values()))
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
        if "undefended" in final:
            versus = (f" ({final['undefended'] / final['clean'] - 1:+.2%} vs clean)"
                      if "clean" in final else "")
            print(f"  with no defence the same cheaters end at {final['undefended']:.4f}"
                  f"{versus}")
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
              and not summary["honest_rejections"] and audit.ok and shard_ok and slashed_ok
              and (gap is None or gap <= 0.05))
        return 0 if ok else 1
    finally:
        procs.stop_all()
