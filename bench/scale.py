"""Verified training at the size people train: what grows with the model, per parameter.

    .venv/bin/python bench/scale.py [--workers 2] [--validators 1] [--rounds 3] [--steps 4]
                                    [--audit-window 1]
                                    [--batch 4] [--n-layer 12] [--n-embd 768] [--n-head 12]
                                    [--seq-len 128] [--keep-every N] [--ab-runs 3]
    .venv/bin/python bench/scale.py --validator-only-workers 8 [--steps 4] [--batch 4] ...
    .venv/bin/python bench/scale.py --ab-only [--ab-runs 3] [--ab-threads 2] [--device cuda]

A real swarm at the ``scale`` reference size (charlm at GPT-2-small shape: 85.35M
parameters by default; ``--n-layer``/``--n-embd``/``--n-head``/``--seq-len`` go bigger on
a bigger machine): a ledger, validators and workers as separate ``veritrain`` processes
talking HTTP on loopback, each with one torch thread, the ``demo`` preset's rules
(k = 1, one challenged step per worker and round, the payload binding every round) for
``--rounds`` rounds. It reports

* per worker-round, the bytes each worker uploaded and downloaded by kind (payload,
  verification, model and update) and per parameter (the nodes' own client counts them:
  ``veritrain worker --stats``);
* the peak RSS of every role (VmHWM of each process) per parameter;
* the ledger's disk after each round (measured once its pruner has removed the files of
  the round that left the ``--audit-window``), and the last round's growth per parameter:
  the steady state once ``--rounds`` exceeds the window by 2 (the defaults: 3 rounds,
  window 1);
* seconds per phase of a round, from the ledger's records (train, close, verification,
  aggregation and certificate) and the share of a round a worker spends waiting;
* the worker's inner step against a plain PyTorch AdamW step of the same model, batch and
  thread count, measured in this run after the swarm, alternating: the worker's step is
  exactly what ``veritrain worker`` runs (``prepare_submission`` with its on-disk evidence,
  its default ``keep_every`` and its ``CommitPool``), the plain one a model,
  ``AdamW(foreach=False)`` and the loop.

The last line:

    scale: params=<n> worker_speed_vs_plain=<x> worker_rss_B_per_param=<x> validator_rss_B_per_param=<x> verify_upload_vs_payload=<x>x ledger_disk_B_per_param_round=<x>

``--validator-only-workers N`` measures the validator alone with N workers at full size,
where N worker processes would not fit in memory (8 at GPT-2-small size on a 24 GB
machine): this process trains the N workers' rounds one after the other (the
``prepare_submission`` a worker runs, keeping only the states its checks will open:
the round's beacon is known in advance, there being one validator), writes each
submission, payload and reveal to disk and frees it; then a ledger and a real
``veritrain validator`` process run one round while this process plays the workers over
HTTP (registers, submits, reveals when the beacon is fixed). No worker process is alive,
so the validator's VmHWM is what a validator needs for N workers. Its last line:

    scale_validator: params=<n> workers=<N> rounds=<r> validator_rss_B_per_param=<x> accepted=<k>/...

(``--rounds``, default 2: round 1 is the first with an outer state to read.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from veritrain.ledger.client import LedgerClient, LedgerRefused, publish_run
from veritrain.protocol.beacon import beacon_root, compute_beacon_seed
from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
from veritrain.protocol.codecs import ErrorFeedback
from veritrain.protocol.identity import Identity, write_key_file
from veritrain.protocol.messages import Registration, SpotReveal, sign
from veritrain.protocol.organiser import build_run
from veritrain.protocol.presets import run_preset
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import sha256_hex
from veritrain.protocol.training import CommitPool, deterministic_mode
from veritrain.workers.evidence import (
    DirStore,
    MemoryStore,
    RoundEvidence,
    default_keep_every,
    reveal_bytes,
)
from veritrain.workers.node import StepClock
from veritrain.workers.round import prepare_submission

from veritrain.local import LocalProcesses


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def scale_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The demo preset's rules on the charlm of the given shape."""
    settings = run_preset("demo")
    settings["task"] = {"name": "charlm", "preset": "demo", "params": {
        "seq_len": args.seq_len, "n_layer": args.n_layer, "n_head": args.n_head,
        "n_embd": args.n_embd, "eval_windows": 16, "eval_batch_size": 16}}
    settings["inner"].update(steps=args.steps, batch_size=args.batch, lr=3e-4, trail_every=1)
    settings["schedule"].update(round_seconds=3600.0, min_submissions=args.workers,
                                max_rounds=args.rounds)
    settings["verification"].update(reveal_seconds=1800.0)
    settings["limits"]["max_payload_bytes"] = 1 << 34
    return settings


# --- peak memory of processes ---------------------------------------------------------


class PeakRss:
    """Samples VmHWM (the kernel's own peak resident size) of named processes until they
    exit; the last value read before exit is the process's peak."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def watch(self, name: str, pid: int) -> None:
        self.pids[name] = pid

    def _loop(self) -> None:
        while not self._stop.wait(0.25):
            for name, pid in list(self.pids.items()):
                try:
                    text = Path(f"/proc/{pid}/status").read_text()
                except OSError:
                    continue
                for line in text.splitlines():
                    if line.startswith("VmHWM:"):
                        self.peaks[name] = max(self.peaks.get(name, 0),
                                               1024 * int(line.split()[1]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def du(path: Path) -> int:
    """Bytes of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- the swarm ------------------------------------------------------------------------


async def _round_view(url: str, run_id: str, r: int) -> dict[str, Any]:
    async with LedgerClient(url, retry_for=30.0) as client:
        base = f"/v1/runs/{run_id}/rounds/{r}"
        info = await client.get_json(base)
        checks = await client.get_json(f"{base}/challenges")
        subs = await client.get_json(f"/v1/runs/{run_id}/submissions?round={r}")
        return {"info": info, "checks": checks, "subs": subs}


def run_swarm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    organiser = Identity.generate("organiser")
    validators = [Identity.generate("validator") for _ in range(args.validators)]
    workers = [Identity.generate("worker") for _ in range(args.workers)]
    settings = scale_settings(args)
    started = time.monotonic()
    bundle = build_run(organiser, "scale-run", settings, [v.public for v in validators])
    numel = bundle.signed.message.num_params
    _log(f"run built: {numel:,} parameters in {time.monotonic() - started:.0f}s")
    procs = LocalProcesses(work / "logs")
    rss = PeakRss()
    disk: list[int] = []
    rounds: list[dict[str, Any]] = []
    try:
        url = procs.start_ledger(work / "ledger",
                                 extra=["--audit-window", str(args.audit_window)])
        rss.watch("ledger", procs.procs["ledger"].pid)
        asyncio.run(publish_run(url, bundle))
        for i, ident in enumerate(validators):
            key = work / f"validator-{i}.key"
            write_key_file(key, ident)
            proc = procs.start(f"validator-{i}", [
                "validator", "--ledger", url, "--key", str(key), "--run", "scale-run",
                "--state-dir", str(work / f"validator-{i}"),
                "--stats", str(work / f"validator-{i}.stats.json")])
            rss.watch(f"validator-{i}", proc.pid)
        for i, ident in enumerate(workers):
            key = work / f"worker-{i}.key"
            write_key_file(key, ident)
            extra = ["--keep-every", str(args.keep_every)] if args.keep_every else []
            proc = procs.start(f"worker-{i}", [
                "worker", "--ledger", url, "--key", str(key), "--run", "scale-run",
                "--state-dir", str(work / f"worker-{i}"), "--no-progress",
                "--stats", str(work / f"worker-{i}.stats.json"), *extra])
            rss.watch(f"worker-{i}", proc.pid)
        seen = -1
        deadline = time.monotonic() + args.timeout
        while True:
            info = asyncio.run(_current(url))
            if info["round"] != seen:
                if seen >= 0:
                    asyncio.run(_pruned_through(url, "scale-run", seen - args.audit_window))
                    disk.append(du(work / "ledger"))
                    rounds.append(asyncio.run(_round_view(url, "scale-run", seen)))
                    _log(f"round {seen} finalized at {time.monotonic() - started:.0f}s, "
                         f"ledger disk {disk[-1] / 1e9:.2f} GB")
                seen = info["round"]
            if info["run_status"] != "active":
                asyncio.run(_pruned_through(url, "scale-run", seen - args.audit_window))
                disk.append(du(work / "ledger"))
                rounds.append(asyncio.run(_round_view(url, "scale-run", seen)))
                _log(f"run finished at {time.monotonic() - started:.0f}s")
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the swarm did not finish in time; see " + str(work / "logs"))
            for name, proc in procs.procs.items():
                if proc.poll() is not None and proc.returncode != 0 and name != "ledger":
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see "
                                       f"{work / 'logs' / (name + '.log')}")
            time.sleep(1.0)
        for name, proc in procs.procs.items():
            if name != "ledger":
                proc.wait(timeout=600)
    finally:
        procs.stop_all()
        rss.stop()
    stats = {p.name.split(".")[0]: json.loads(p.read_text()) for p in work.glob("*.stats.json")}
    return {"numel": numel, "rss": rss.peaks, "disk": disk, "rounds": rounds, "stats": stats,
            "bundle": bundle}


async def _pruned_through(url: str, run_id: str, r: int, timeout: float = 60.0) -> None:
    """Wait until the ledger's pruner has recorded round ``r``'s files as gone (nothing to
    wait for while ``r`` < 0, inside the audit window), then for their deletion."""
    if r < 0:
        return
    deadline = time.monotonic() + timeout
    async with LedgerClient(url) as client:
        while time.monotonic() < deadline:
            page = await client.get_json(f"/v1/runs/{run_id}/pruned?limit=1000")
            if any(row["round"] == r for row in page["pruned"]):
                await asyncio.sleep(2.0)  # recorded first, then deleted
                return
            await asyncio.sleep(0.5)
    _log(f"round {r}: nothing pruned within {timeout:.0f}s")


async def _current(url: str) -> dict[str, Any]:
    async with LedgerClient(url, retry_for=30.0) as client:
        return await client.get_json("/v1/runs/scale-run/rounds/current")


# --- the validator alone, with many workers ------------------------------------------


def prepare_workers(run: RunContext, base: torch.Tensor, base_hash: str, r: int,
                    validator: Identity, workers: list[Identity], out: Path
                    ) -> dict[str, dict[str, Any]]:
    """Each worker's round ``r`` from ``base``, trained here one after the other: its signed
    submission, payload and (when checked) reveal written under ``out``; nothing kept in
    memory. (A fresh error feedback each round: the validator cannot tell.)"""
    out.mkdir(parents=True, exist_ok=True)
    seed = compute_beacon_seed([validator.sign_bls(beacon_root(run.spec.run_id, r))])
    policy = ChallengePolicy.of_run(run.spec)
    challenges = compute_challenges(seed, sorted(w.public_key.hex() for w in workers), policy)
    due = set(policy.checked_workers(challenges))
    k = run.inner.trail_every
    files: dict[str, dict[str, Any]] = {}
    for i, w in enumerate(workers):
        started = time.monotonic()
        me = w.public_key.hex()
        wanted = {run.inner.steps} | {s for j in challenges.get(me, [])
                                      for s in (j * k, (j + 1) * k)}
        evidence = RoundEvidence(MemoryStore(), run, r, me, keep=wanted.__contains__)
        prep = prepare_submission(run, w, r, base, base_hash, ErrorFeedback(run.numel),
                                  evidence=evidence)
        entry: dict[str, Any] = {"identity": w, "segments": challenges.get(me, []),
                                 "envelope": out / f"{i}.envelope", "payload": out / f"{i}.payload",
                                 "reveal": None}
        entry["envelope"].write_bytes(prep.signed.encode())
        entry["payload"].write_bytes(prep.payload)
        if me in due:
            data = reveal_bytes(evidence, seed, entry["segments"], prep.signed.message)
            if data is None:
                raise RuntimeError(f"worker {i} kept nothing to reveal")
            entry["reveal"] = out / f"{i}.reveal"
            entry["reveal"].write_bytes(data)
            entry["reveal_digest"] = sha256_hex(data)
            entry["reveal_bytes"] = len(data)
            del data
        entry["digest"] = prep.signed.digest
        files[me] = entry
        del prep, evidence
        _log(f"round {r}: worker {i} prepared in {time.monotonic() - started:.0f}s")
    return files


async def play_workers(url: str, run_id: str, r: int, files: dict[str, dict[str, Any]]
                       ) -> None:
    """Register (round 0), submit, and reveal once the beacon is fixed, as workers would."""
    async with LedgerClient(url, retry_for=60.0) as client:
        if r == 0:
            for me, f in files.items():
                reg = Registration(run_id=run_id, round=0, participant=me, role="worker",
                                   created_at=int(time.time()))
                await client.post_message(f"/v1/runs/{run_id}/participants",
                                          sign(f["identity"], reg).to_wire())
        base = f"/v1/runs/{run_id}/rounds/{r}"
        while (await client.get_json(base))["status"] != "open":
            await asyncio.sleep(0.5)
        for f in files.values():
            await client.post_multipart(f"{base}/submissions", [
                ("envelope", f["envelope"].read_bytes(), "application/json"),
                ("payload", f["payload"], "application/octet-stream")], kind="payload")
        view = await client.get_json(f"{base}/challenges")
        while not view["fixed"]:
            await asyncio.sleep(0.5)
            view = await client.get_json(f"{base}/challenges")
        for c in view["challenges"]:
            f = files[c["worker"]]
            if not c["due"]:
                continue
            if f["reveal"] is None or list(c["segments"]) != list(f["segments"]):
                raise RuntimeError("the ledger's challenges differ from the ones prepared for")
            envelope = sign(f["identity"], SpotReveal(
                run_id=run_id, round=r, worker=c["worker"], submission_digest=f["digest"],
                reveal_hash=f["reveal_digest"], reveal_bytes=f["reveal_bytes"],
                created_at=int(time.time())))
            await client.post_multipart(f"{base}/reveals", [
                ("envelope", envelope.encode(), "application/json"),
                ("reveal", f["reveal"], "application/octet-stream")], kind="verification")


async def _certified_base(url: str, run: RunContext, r: int) -> tuple[torch.Tensor, str]:
    """Round ``r``'s base model and its hash, once round ``r - 1`` is finalized."""
    async with LedgerClient(url, retry_for=60.0) as client:
        while True:
            try:
                info = await client.get_json(f"/v1/runs/{run.spec.run_id}/rounds/{r}")
                break
            except LedgerRefused:
                await asyncio.sleep(1.0)
        data = await client.get_blob(info["base_model_hash"], max_bytes=run.max_model_bytes)
        return run.decode_model(bytes(data)), info["base_model_hash"]


def run_validator_only(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    n = args.validator_only_workers
    args.workers = n
    organiser = Identity.generate("organiser")
    validator = Identity.generate("validator")
    workers = [Identity.generate("worker") for _ in range(n)]
    bundle = build_run(organiser, "scale-run", scale_settings(args), [validator.public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    _log(f"run built: {run.numel:,} parameters; {n} workers, {args.rounds} round(s)")
    procs = LocalProcesses(work / "logs")
    rss = PeakRss()
    started = time.monotonic()
    results: list[list[dict[str, Any]]] = []
    try:
        url = procs.start_ledger(work / "ledger",
                                 extra=["--audit-window", str(args.audit_window)])
        asyncio.run(publish_run(url, bundle))
        key = work / "validator-0.key"
        write_key_file(key, validator)
        proc = procs.start("validator-0", [
            "validator", "--ledger", url, "--key", str(key), "--run", "scale-run",
            "--state-dir", str(work / "validator-0"),
            "--stats", str(work / "validator-0.stats.json")])
        rss.watch("validator-0", proc.pid)
        deadline = time.monotonic() + args.timeout
        for r in range(args.rounds):
            base, base_hash = ((run.decode_model(bundle.genesis), run.spec.genesis_model_hash)
                               if r == 0 else asyncio.run(_certified_base(url, run, r)))
            files = prepare_workers(run, base, base_hash, r, validator, workers,
                                    work / f"prepared-{r}")
            del base
            asyncio.run(play_workers(url, "scale-run", r, files))
            shutil.rmtree(work / f"prepared-{r}", ignore_errors=True)
        while proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the validator did not finish in time; see "
                                   + str(work / "logs"))
            time.sleep(1.0)
        if proc.returncode != 0:
            raise RuntimeError(f"the validator exited with {proc.returncode}; see "
                               f"{work / 'logs' / 'validator-0.log'}")
        results = [asyncio.run(_results(url, "scale-run", r)) for r in range(args.rounds)]
    finally:
        procs.stop_all()
        rss.stop()
    _log(f"validator done in {time.monotonic() - started:.0f}s")
    verdicts = [res[0]["body"]["verdicts"] if res else [] for res in results]
    stats = json.loads((work / "validator-0.stats.json").read_text())
    return {"numel": run.numel, "rss": rss.peaks, "verdicts": verdicts, "stats": stats}


async def _results(url: str, run_id: str, r: int) -> list[dict[str, Any]]:
    async with LedgerClient(url, retry_for=30.0) as client:
        return (await client.get_json(f"/v1/runs/{run_id}/rounds/{r}/results"))["results"]


def report_validator_only(out: dict[str, Any], args: argparse.Namespace) -> str:
    numel, n = out["numel"], args.validator_only_workers
    peak = out["rss"].get("validator-0", 0)
    print(f"\n== scale, the validator alone: {numel:,} parameters, {n} workers (prepared "
          f"beforehand, no worker process alive), {args.rounds} round(s), H={args.steps}, "
          f"batch {args.batch}x{args.seq_len} ==")
    print(f"validator peak RSS (VmHWM): {peak / 1e9:.2f} GB = {peak / numel:.1f} B/param")
    accepted = []
    for r, verdicts in enumerate(out["verdicts"]):
        accepted.append(sum(1 for v in verdicts if v["status"] == "accepted"))
        reasons = sorted({v["reason"] for v in verdicts if v["reason"]})
        print(f"round {r}: {accepted[-1]} of {len(verdicts)} accepted"
              + (f" (rejected: {', '.join(reasons)})" if reasons else ""))
    for rnd in out["stats"]["rounds"]:
        print(f"  round {rnd['round']}: " + ", ".join(
            f"{k[:-2]} {v:.0f}s" for k, v in rnd.items() if k.endswith("_s")))
    down = out["stats"]["traffic"]["down"]
    rounds = max(len(out["stats"]["rounds"]), 1)
    print("  download per round: " + ", ".join(
        f"{k} {v / rounds / numel:.3f}" for k, v in sorted(down.items())) + " B/param")
    return (f"scale_validator: params={numel} workers={n} rounds={args.rounds} "
            f"validator_rss_B_per_param={peak / numel:.1f} "
            f"accepted={'/'.join(str(a) for a in accepted)}")


# --- the worker's step against a plain step -------------------------------------------


def plain_steps(run: RunContext, rows: torch.Tensor, device: str = "cpu") -> list[float]:
    """A plain PyTorch loop on the same model and rows, on ``device``, with the same
    deterministic kernels the worker trains with: per-step seconds (on CUDA, from a
    synchronized start to a synchronized end)."""
    dev = torch.device(device)
    model = run.task.make_model().to(dev)
    model.train()
    params = list(model.parameters())
    cfg = run.inner
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=False, fused=False)
    out = []

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with deterministic_mode(dev):
        for row in rows:
            sync()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            run.task.loss(model, run.task.make_batch(run.dataset, row, device=dev)).backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=False)
            opt.step()
            sync()
            out.append(time.perf_counter() - start)
    return out


def worker_steps(run: RunContext, identity: Identity, base: torch.Tensor, work: Path,
                 pool: CommitPool, keep_every: int | None, device: str = "cpu"
                 ) -> list[float]:
    """What ``veritrain worker`` runs for a round (its on-disk evidence and hashing thread):
    per-step seconds."""
    store = DirStore(work / "ab-evidence")
    evidence = RoundEvidence(store, run, 0, identity.public_key.hex(),
                             keep_every=keep_every or default_keep_every(run))
    clock = StepClock(lambda *_: None)
    prepare_submission(run, identity, 0, base, run.spec.genesis_model_hash,
                       ErrorFeedback(run.numel), evidence=evidence, pool=pool, progress=clock,
                       device=device)
    store.clear()
    return clock.durations


def speed_ab(bundle: Any, work: Path, runs: int, threads: int, keep_every: int | None,
             device: str = "cpu") -> dict[str, list[float]]:
    torch.set_num_threads(threads)
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    identity = Identity.generate("worker")
    rows = run.assignment(0, identity.public_key.hex())
    out: dict[str, list[float]] = {"plain": [], "worker": []}
    with CommitPool.for_device(device) as pool:  # what a worker node builds
        for i in range(runs):
            for name in ("plain", "worker") if i % 2 == 0 else ("worker", "plain"):
                # What earlier runs (and the swarm) left for the kernel to write back is
                # written now, not during the next run's steps: each run pays for its own
                # writes (a worker's land on disk while its round waits for the validator).
                os.sync()
                steps = (plain_steps(run, rows, device) if name == "plain"
                         else worker_steps(run, identity, base, work, pool, keep_every,
                                           device))
                out[name] += steps[1:]  # the first step warms up (and builds the model)
                _log(f"  A/B {name} run {i}: median step {statistics.median(steps[1:]):.2f}s")
    return out


# --- report ---------------------------------------------------------------------------


def _per_round_traffic(stats: dict[str, Any], numel: int) -> dict[str, float]:
    """Mean bytes per worker-round by direction and kind, per parameter."""
    totals: dict[str, float] = {}
    worker_rounds = 0
    for name, st in stats.items():
        if not name.startswith("worker"):
            continue
        worker_rounds += len(st["rounds"])
        for direction in ("up", "down"):
            for kind, n in st["traffic"][direction].items():
                key = f"{direction}:{kind}"
                totals[key] = totals.get(key, 0) + n
    return {k: v / max(worker_rounds, 1) / numel for k, v in sorted(totals.items())}


def _phases(rounds: list[dict[str, Any]]) -> list[dict[str, float]]:
    out = []
    for view in rounds:
        info = view["info"]
        subs = [s["received_at"] for s in view["subs"].get("submissions", [])]
        reveals = [c["reveal"]["receipt"]["body"]["received_at"]
                   for c in view["checks"]["challenges"] if c["reveal"] is not None]
        opened, closed, done = info["opened_at"], info["closed_at"], info["finalized_at"]
        if None in (opened, closed, done) or not subs:
            continue
        last_sub = max(subs)
        last_reveal = max(reveals) if reveals else closed
        out.append({"round": info["round"], "train": last_sub - opened,
                    "close": closed - last_sub, "verification": last_reveal - closed,
                    "aggregation_and_certificate": done - last_reveal,
                    "total": done - opened})
    return out


def report(swarm: dict[str, Any], ab: dict[str, list[float]], args: argparse.Namespace) -> str:
    numel = swarm["numel"]
    print(f"\n== scale: {numel:,} parameters, {args.workers} workers, {args.validators} "
          f"validator(s), {args.rounds} rounds, H={args.steps}, batch {args.batch}x"
          f"{args.seq_len} ==")
    traffic = _per_round_traffic(swarm["stats"], numel)
    print("\nper worker-round, bytes per parameter (the worker's client counts its bodies):")
    for key, value in traffic.items():
        print(f"  {key:<22} {value:8.4f} B/param  ({value * numel / 1e6:9.1f} MB)")
    payload = traffic.get("up:payload", 0.0)
    verify = traffic.get("up:verification", 0.0)
    ratio = verify / payload if payload else float("inf")
    print(f"  verification upload / payload upload: {ratio:.2f}x "
          f"({verify:.3f} vs {payload:.3f} B/param; fp32 pseudo-gradient: 4 B/param)")
    for name, st in sorted(swarm["stats"].items()):
        if name.startswith("validator"):
            down = st["traffic"]["down"]
            print(f"  {name} per round: download "
                  + ", ".join(f"{k} {v / max(len(st['rounds']), 1) / numel:.3f}"
                              for k, v in sorted(down.items())) + " B/param")
    print("\npeak RSS (VmHWM) per role:")
    rss = swarm["rss"]
    for name, peak in sorted(rss.items()):
        print(f"  {name:<14} {peak / 1e9:6.2f} GB  {peak / numel:6.1f} B/param")
    worker_rss = max((v for k, v in rss.items() if k.startswith("worker")), default=0) / numel
    validator_rss = max((v for k, v in rss.items() if k.startswith("validator")), default=0
                        ) / numel
    disk = swarm["disk"]
    print("\nledger disk after each round: " + ", ".join(f"{d / 1e9:.2f} GB" for d in disk))
    steady = (disk[-1] - disk[-2]) if len(disk) >= 2 else disk[-1]
    disk_per_round = steady / numel
    pruning = (f"the ledger prunes reveals and superseded models {args.audit_window} "
               f"finalized round(s) later" if len(disk) > args.audit_window + 1 else
               f"no round has left the audit window of {args.audit_window} yet: not a "
               f"steady state")
    print(f"  growth in the last round: {steady / 1e9:.2f} GB = {disk_per_round:.1f} B/param "
          f"({pruning})")
    print("\nseconds per phase of a round (ledger times):")
    for ph in _phases(swarm["rounds"]):
        print("  round {round}: ".format(**ph) + ", ".join(
            f"{k} {v:.0f}" for k, v in ph.items() if k != "round"))
    waits = []
    for name, st in swarm["stats"].items():
        if name.startswith("worker"):
            for rnd in st["rounds"]:
                total = next((p["total"] for p in _phases(swarm["rounds"])
                              if p["round"] == rnd["round"]), None)
                if total:
                    waits.append(1 - rnd["train_s"] / total)
    if waits:
        print(f"  share of a round a worker waits (not training): median "
              f"{statistics.median(waits):.0%}")
    for name, st in sorted(swarm["stats"].items()):
        if name.startswith("validator"):
            for rnd in st["rounds"]:
                print(f"  {name} round {rnd['round']}: " + ", ".join(
                    f"{k[:-2]} {v:.0f}s" for k, v in rnd.items() if k.endswith("_s")))
    plain, ours = statistics.median(ab["plain"]), statistics.median(ab["worker"])
    speed = plain / ours
    print(f"\ninner step, {args.ab_threads} thread(s), batch {args.batch}x{args.seq_len}: plain "
          f"PyTorch median {plain:.2f}s ({len(ab['plain'])} steps), the worker's median "
          f"{ours:.2f}s ({len(ab['worker'])} steps): overhead "
          f"{1e9 * (ours - plain) / numel:.1f} ns/param/step, speed {speed:.3f} of plain")
    return (f"scale: params={numel} worker_speed_vs_plain={speed:.3f} "
            f"worker_rss_B_per_param={worker_rss:.1f} "
            f"validator_rss_B_per_param={validator_rss:.1f} "
            f"verify_upload_vs_payload={ratio:.2f}x "
            f"ledger_disk_B_per_param_round={disk_per_round:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--validators", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--audit-window", type=int, default=1, metavar="ROUNDS",
                        help="the ledger's --audit-window: reveals and superseded models go "
                             "this many finalized rounds later (disk in steady state)")
    parser.add_argument("--steps", type=int, default=4, help="inner steps H (k = 1)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per inner step")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--keep-every", type=int, default=None,
                        help="workers keep every N-th state whole (default: the node's, "
                             "every 8th)")
    parser.add_argument("--ab-runs", type=int, default=3,
                        help="alternating runs of plain and worker steps")
    parser.add_argument("--ab-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--device", default="cpu",
                        help="with --ab-only: the device both inner steps run on (cuda: the "
                             "worker's hashing threads work beside the GPU)")
    parser.add_argument("--ab-only", action="store_true",
                        help="only the A/B of the inner step (no swarm): re-measure the speed "
                             "on a quiet machine")
    parser.add_argument("--validator-only-workers", type=int, default=0, metavar="N",
                        help="measure the validator alone with N workers prepared here "
                             "beforehand (no swarm, no A/B)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="veritrain-scale-"))
    started = time.monotonic()
    try:
        if args.validator_only_workers:
            line = report_validator_only(run_validator_only(args, work), args)
            print(f"\n(total {time.monotonic() - started:.0f}s)")
            print(line)
            return 0
        if args.ab_only:
            bundle = build_run(Identity.generate("organiser"), "scale-run", scale_settings(args),
                               [Identity.generate("validator").public])
            ab = speed_ab(bundle, work, args.ab_runs, args.ab_threads, args.keep_every,
                          args.device)
            plain, ours = statistics.median(ab["plain"]), statistics.median(ab["worker"])
            numel = bundle.signed.message.num_params
            print(f"\ninner step on {args.device}, {args.ab_threads} thread(s), batch "
                  f"{args.batch}x{args.seq_len}: plain median {plain:.3f}s, the worker's "
                  f"{ours:.3f}s ({len(ab['plain'])} steps each): overhead "
                  f"{1e9 * (ours - plain) / numel:.2f} ns/param/step")
            print(f"scale_ab: device={args.device} params={numel} "
                  f"worker_speed_vs_plain={plain / ours:.3f}")
            return 0
        swarm = run_swarm(args, work)
        _log(f"swarm done in {time.monotonic() - started:.0f}s; A/B of the inner step")
        ab = speed_ab(swarm["bundle"], work, args.ab_runs, args.ab_threads, args.keep_every)
        line = report(swarm, ab, args)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n(total {time.monotonic() - started:.0f}s)")
    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
