"""End to end with real processes over HTTP on loopback, at the tiny scale.

A ledger, a validator and four workers (two honest, a free rider and a sign
flipper) run as separate ``veritrain`` processes. Checked afterwards: eval
loss falls, both cheaters are caught by spot checks and score zero, no honest
worker is ever rejected, and the ledger's rows match what the nodes did
(every worker receipt is a stored submission, every submission got exactly
one verdict, the audit of the whole log passes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.ledger.client import LedgerClient, publish_run
from veritrain.protocol.identity import Identity, write_key_file
from veritrain.protocol.organiser import build_run
from veritrain.protocol.presets import run_preset

from veritrain.local import LocalProcesses, child_env, free_port

pytestmark = pytest.mark.slow

ROUNDS = 3


async def _wait(url: str, run_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    async with LedgerClient(url, retry_for=30.0) as client:
        while time.monotonic() < deadline:
            report = await client.get_json(f"/v1/runs/{run_id}/report")
            if report["status"] == "finished":
                ledger_key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
                audit = verify_events(await fetch_events(client, run_id), ledger_key)
                return {"report": report, "audit": audit}
            await asyncio.sleep(0.5)
    raise TimeoutError("run did not finish")


def key_files(tmp_path: Path, prefix: str, identities: list[Identity]) -> list[Identity]:
    """Write ``prefix-i.key`` for each identity (the names ``start_nodes`` reads)."""
    for i, ident in enumerate(identities):
        write_key_file(tmp_path / f"{prefix}-{i}.key", ident)
    return identities


def start_nodes(procs: LocalProcesses, tmp_path: Path, url: str, run_id: str,
                nodes: dict[str, list[str]]) -> None:
    """Start one ``veritrain`` process per node (``{name: [role, extra args...]}``, key
    file ``name.key``, a worker's state in ``state/name``) and wait until each waits for
    the run: every worker then registers before it exists and takes part from round 0."""
    for name, (role, *extra) in nodes.items():
        args = [role, "--ledger", url, "--key", str(tmp_path / f"{name}.key"), "--run", run_id]
        args += ["--state-dir", str(tmp_path / "state" / name)]
        if role == "worker":
            args += ["--no-progress"]
        procs.start(name, [*args, *extra])
    deadline = time.monotonic() + 300
    while not all("waiting for run" in (tmp_path / "logs" / f"{n}.log").read_text()
                  for n in nodes):
        assert time.monotonic() < deadline, "nodes did not start"
        time.sleep(0.2)


def test_tiny_run_end_to_end_with_cheaters(tmp_path: Path):
    keys = {}
    for name, role in [("validator", "validator"), ("honest-0", "worker"),
                       ("honest-1", "worker"), ("free_rider", "worker"),
                       ("sign_flip", "worker")]:
        ident = Identity.generate(role)
        write_key_file(tmp_path / f"{name}.key", ident)
        keys[name] = ident
    settings = run_preset("tiny")
    settings["verification"]["beacon"] = "threshold"  # 5.4a, the CLI's default
    settings["schedule"]["max_rounds"] = ROUNDS
    settings["verification"]["reveal_seconds"] = 5.0  # the free rider never reveals
    # The validator takes the workers' reveal receipts at its inbox (protocol.md 7.2).
    bundle = build_run(Identity.generate("organiser"), "e2e", settings, [dataclasses.replace(
        keys["validator"].public, inbox=f"http://127.0.0.1:{free_port()}")])
    procs = LocalProcesses(tmp_path / "logs")
    try:
        url = procs.start_ledger(tmp_path / "ledger")
        start_nodes(procs, tmp_path, url, "e2e", {
            "validator": ["validator"], "honest-0": ["worker"], "honest-1": ["worker"],
            "free_rider": ["worker", "--attack", "free_rider"],
            "sign_flip": ["worker", "--attack", "sign_flip"]})
        asyncio.run(publish_run(url, bundle))
        out = asyncio.run(_wait(url, "e2e", timeout=420))
        # Anyone can re-run the sign flipper's recorded check from the stored evidence.
        flipper = keys["sign_flip"].public_key.hex()
        first = next(w["rejected"][0]["round"] for w in out["report"]["workers"]
                     if w["worker"] == flipper)
        recheck = subprocess.run(
            [sys.executable, "-m", "veritrain.cli", "audit", "--ledger", url, "--run", "e2e",
             "recheck", str(first), "--worker", flipper[:16]],
            capture_output=True, text=True, timeout=300, env=child_env())
    finally:
        procs.stop_all()
    report, audit = out["report"], out["audit"]
    logs = "\n".join(p.read_text()[-2000:] for p in (tmp_path / "logs").glob("*.log"))

    losses = [r["eval_loss"] for r in report["rounds"]]
    assert len(losses) == ROUNDS and all(x is not None for x in losses), logs
    from veritrain.protocol.runtime import RunContext

    run = RunContext.build(bundle.signed.message, bundle.dataset)
    genesis_loss = run.evaluate(run.decode_model(bundle.genesis))
    assert losses[-1] < genesis_loss - 0.5, (genesis_loss, losses)

    db = sqlite3.connect(tmp_path / "ledger" / "ledger.sqlite")
    stored = {(w, r, d) for w, r, d in db.execute(
        "select worker, round, digest from submissions where run_id='e2e'")}
    rounds_of = {ident.public_key.hex(): sorted(r for w, r, _ in stored
                                                if w == ident.public_key.hex())
                 for ident in keys.values()}
    workers = {w["worker"]: w for w in report["workers"]}
    for name in ("free_rider", "sign_flip"):
        key = keys[name].public_key.hex()
        row = workers[key]
        # Caught in its very first round, then banned: nothing it sent was accepted.
        assert row["rejected"][0]["round"] == rounds_of[key][0], row
        # The free rider has no states to open and reveals nothing; the sign flipper's
        # payload does not encode its committed final state.
        assert row["rejected"][0]["reason"] == {"free_rider": "missing_reveal",
                                                "sign_flip": "spot_check_failed"}[name], row
        assert row["accepted"] == 0 and row["score"] == 0 and row["reward"] == 0
        assert row["banned_until_round"] >= ROUNDS - 1
    for name in ("honest-0", "honest-1"):
        key = keys[name].public_key.hex()
        row = workers[key]
        assert row["rejected"] == [], row
        assert row["accepted"] == len(rounds_of[key]) >= ROUNDS - 1, row
        assert row["score"] > 0

    assert recheck.returncode == 0, recheck.stdout + recheck.stderr
    assert "recorded FAIL" in recheck.stdout and "DISAGREES" not in recheck.stdout
    assert "payload does not encode the final state" in recheck.stdout

    assert audit.ok, audit.problem
    assert audit.certificates == ROUNDS

    # The ledger's rows match what the nodes did, and every honest reveal was receipted.
    receipts = set()
    revealed = set()
    for name, ident in keys.items():
        for path in (tmp_path / "state" / name / "e2e" / "receipts").glob("*.json"):
            if path.stem.isdigit():
                body = json.loads(path.read_text())["body"]
                receipts.add((ident.public_key.hex(), body["round"], body["submission_digest"]))
            elif name.startswith("honest") and path.name.endswith(".reveal.json"):
                body = json.loads(path.read_text())["body"]
                assert body["received_at"] <= body["deadline"]
                revealed.add((ident.public_key.hex(), body["round"]))
    assert receipts and receipts == stored
    honest_keys = {keys[n].public_key.hex() for n in keys if n.startswith("honest")}
    assert {(k, r) for k, r, _ in stored if k in honest_keys} <= revealed
    verdicts = list(db.execute("select worker, round from verdicts where run_id='e2e'"))
    assert sorted(verdicts) == sorted((w, r) for w, r, _ in stored)
    # Each receipted reveal also reached the validator's inbox, past the ledger, and
    # nothing else did (the free rider revealed nothing).
    kept = tmp_path / "state" / "validator" / "reveal-receipts-e2e.jsonl"
    handed = {(c["envelope"]["body"]["worker"], c["envelope"]["body"]["round"])
              for c in map(json.loads, kept.read_text().splitlines())}
    assert {(k, r) for k, r in revealed if r >= ROUNDS - 4} <= handed, (handed, revealed)
    assert keys["free_rider"].public_key.hex() not in {k for k, _ in handed}


def test_sharded_run_end_to_end_catches_a_validator_that_shifts_its_shard(tmp_path: Path):
    """Three validator processes aggregate one shard each; the last shifts its shard by
    0.1% every round. The other two catch and recompute it every round, a quorum records
    the fault, and every round is certified on the honest aggregate."""
    from fakes import validator_identities

    validators = key_files(tmp_path, "validator", validator_identities(3))
    key_files(tmp_path, "worker", [Identity.generate("worker") for _ in range(3)])
    settings = run_preset("tiny")
    settings["verification"]["beacon"] = "threshold"  # 5.4a, the CLI's default
    settings["schedule"]["max_rounds"] = 2
    settings["aggregator"]["shards"] = 3
    bundle = build_run(Identity.generate("organiser"), "e2e-shards", settings,
                       [v.public for v in validators])
    procs = LocalProcesses(tmp_path / "logs")
    try:
        url = procs.start_ledger(tmp_path / "ledger")
        start_nodes(procs, tmp_path, url, "e2e-shards", {
            **{f"validator-{i}": ["validator", *(["--attack", "shard_shift"] if i == 2 else [])]
               for i in range(3)},
            **{f"worker-{i}": ["worker"] for i in range(3)}})
        asyncio.run(publish_run(url, bundle))
        out = asyncio.run(_wait(url, "e2e-shards", timeout=420))

        async def shards() -> list[dict]:
            async with LedgerClient(url) as client:
                return [await client.get_json(f"/v1/runs/e2e-shards/rounds/{r}/shards")
                        for r in range(2)]

        views = asyncio.run(shards())
    finally:
        procs.stop_all()
    logs = "\n".join(p.read_text()[-2000:] for p in (tmp_path / "logs").glob("*.log"))
    report, audit = out["report"], out["audit"]
    assert [r["eval_loss"] is not None for r in report["rounds"]] == [True, True], logs
    assert all(w["rejected"] == [] for w in report["workers"]), report["workers"]
    for view in views:
        assert view["faulty_shards"] == [2], view
        reporters = {f["body"]["validator"] for f in view["findings"] if f["body"]["faulty"]}
        assert reporters == {validators[0].public_key.hex(), validators[1].public_key.hex()}
        assert len(view["results"]) == 3 and view["check"] is not None
    assert audit.ok, audit.problem
    assert audit.certificates == 2


def test_masked_run_end_to_end_unmasks_buckets_through_a_dropout(tmp_path: Path):
    """Three validator processes and four worker processes in one masked bucket (t = 1);
    one worker drops out of the board after dealing, every round. Each round the bucket
    unmasks from the three survivors, the dropout alone is rejected (``dropped_out``),
    no payload of an unopened worker ever reaches the ledger, and the audit passes."""
    from fakes import validator_identities

    validators = key_files(tmp_path, "validator", validator_identities(3))
    workers = key_files(tmp_path, "worker", [Identity.generate("worker") for _ in range(4)])
    settings = run_preset("tiny")
    settings["verification"]["beacon"] = "threshold"  # 5.4a, the CLI's default
    settings["schedule"]["max_rounds"] = 2
    settings["aggregator"]["params"].pop("bucket_size", None)
    settings["aggregator"]["masked"] = {"bucket_size": 4, "max_dropouts": 1,
                                        "clip_norm": 100.0, "phase_seconds": 20.0}
    settings["verification"]["probe_examples"] = 0
    settings["verification"]["spot_checks_per_round"] = 1
    # All four in before a round seals: a worker that registers late would otherwise
    # find round 0 sealed over the early ones (every registered worker had submitted).
    settings["schedule"]["min_submissions"] = 4
    bundle = build_run(Identity.generate("organiser"), "e2e-masked", settings,
                       [v.public for v in validators])
    dropout = workers[3].public_key.hex()
    procs = LocalProcesses(tmp_path / "logs")
    try:
        url = procs.start_ledger(tmp_path / "ledger")
        start_nodes(procs, tmp_path, url, "e2e-masked", {
            **{f"validator-{i}": ["validator"] for i in range(3)},
            **{f"worker-{i}": ["worker", *(["--attack", "drop_after_deal"] if i == 3 else [])]
               for i in range(4)}})
        asyncio.run(publish_run(url, bundle))
        out = asyncio.run(_wait(url, "e2e-masked", timeout=420))

        async def boards() -> tuple[list[dict], list[dict], dict[str, int]]:
            async with LedgerClient(url) as client:
                views = [await client.get_json(f"/v1/runs/e2e-masked/rounds/{r}/secagg")
                         for r in range(2)]
                subs = [await client.get_json(f"/v1/runs/e2e-masked/rounds/{r}/submissions")
                        for r in range(2)]
                opened = {o["body"]["worker"] for v in views for o in v["posts"]["opening"]}
                status = {}
                async with aiohttp.ClientSession() as session:
                    for s in subs:
                        for wire in s["submissions"]:
                            body = wire["body"]
                            if body["worker"] not in opened and body["worker"] != dropout:
                                async with session.get(
                                        f"{url}/v1/blobs/{body['payload_hash']}") as resp:
                                    status[body["payload_hash"]] = resp.status
                return views, subs, status

        views, subs, blob_status = asyncio.run(boards())
    finally:
        procs.stop_all()
    logs = "\n".join(p.read_text()[-2000:] for p in (tmp_path / "logs").glob("*.log"))
    report, audit = out["report"], out["audit"]
    assert [r["eval_loss"] is not None for r in report["rounds"]] == [True, True], logs
    for w in report["workers"]:
        if w["worker"] == dropout:  # in every round it reached the board in
            assert w["rejected"] and {x["reason"] for x in w["rejected"]} == {"dropped_out"}, w
        else:
            assert w["rejected"] == [], w
    dealt = 0
    for view in views:
        (bucket,) = view["buckets"]
        honest = [k for k in bucket["assigned"] if k != dropout]
        assert bucket["live"] and bucket["survivors"] == honest, view["buckets"]
        assert view["complete"] and len(view["posts"]["reveal"]) == len(honest)
        if dropout in bucket["assigned"]:
            dealt += 1
            assert dropout in bucket["dealers"]
    assert dealt >= 1
    assert blob_status and set(blob_status.values()) == {404}, blob_status
    assert audit.ok, audit.problem
    assert audit.certificates == 2


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "veritrain.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=child_env())


def test_bond_run_end_to_end_refuses_unbonded_keys_and_slashes_a_cheater(tmp_path: Path):
    """A ``bond`` run driven by the CLI over HTTP: the treasury's deposits admit three
    workers; an unbonded key is refused with ``not_admitted`` and nothing stored; the sign
    flipper is caught, slashed (the report shows the slash and the reduced bond), and the
    same party's replacement key is refused; the audit of the chain passes."""
    keys = {}
    for name, role in [("organiser", "organiser"), ("validator", "validator"),
                       ("honest-0", "worker"), ("honest-1", "worker"), ("sign_flip", "worker"),
                       ("unbonded", "worker"), ("replacement", "worker")]:
        ident = Identity.generate(role)
        write_key_file(tmp_path / f"{name}.key", ident)
        (tmp_path / f"{name}.key.pub.json").write_text(json.dumps(
            {"role": role, **ident.public.to_json()}))
        keys[name] = ident
    hexkey = {name: ident.public_key.hex() for name, ident in keys.items()}
    run_id = "bond-e2e"
    procs = LocalProcesses(tmp_path / "logs")
    try:
        url = procs.start_ledger(tmp_path / "ledger")
        created = _cli("run", "create", "--ledger", url, "--key", str(tmp_path / "organiser.key"),
                       "--run-id", run_id, "--preset", "tiny", "--rounds", str(ROUNDS),
                       "--min-submissions", "2", "--validator",
                       str(tmp_path / "validator.key.pub.json"), "--admission", "bond",
                       "--min-bond", "10", "--slash-share", "0.5")
        assert created.returncode == 0, created.stderr
        # Only the treasury's deposits count: a worker paying itself is refused, one line.
        self_paid = _cli("bond", "deposit", "--ledger", url, "--run", run_id, "--key",
                         str(tmp_path / "unbonded.key"), "--worker", hexkey["unbonded"],
                         "--amount", "50")
        assert self_paid.returncode == 1 and len(self_paid.stderr.splitlines()) == 1
        assert "not the treasury" in self_paid.stderr, self_paid.stderr
        for name in ("honest-0", "honest-1", "sign_flip"):
            paid = _cli("bond", "deposit", "--ledger", url, "--run", run_id, "--key",
                        str(tmp_path / "organiser.key"), "--worker",
                        str(tmp_path / f"{name}.key.pub.json"), "--amount", "16",
                        "--reference", f"invoice {name}")
            assert paid.returncode == 0 and "bond 16" in paid.stdout, paid.stderr
        for name, extra in (("validator", []), ("honest-0", []), ("honest-1", []),
                            ("sign_flip", ["--attack", "sign_flip"])):
            role = "validator" if name == "validator" else "worker"
            args = [role, "--ledger", url, "--key", str(tmp_path / f"{name}.key"), "--run",
                    run_id, *extra]
            args += ["--state-dir", str(tmp_path / "state" / name)]
            if role == "worker":
                args += ["--no-progress"]
            procs.start(name, args)
        unbonded = _cli("worker", "--ledger", url, "--key", str(tmp_path / "unbonded.key"),
                        "--run", run_id, "--no-progress", "--retry-for", "10", "--state-dir",
                        str(tmp_path / "state" / "unbonded"))
        out = asyncio.run(_wait(url, run_id, timeout=420))
        replacement = _cli("worker", "--ledger", url, "--key",
                           str(tmp_path / "replacement.key"), "--run", run_id, "--no-progress",
                           "--retry-for", "10", "--state-dir",
                           str(tmp_path / "state" / "replacement"))
        report_table = _cli("audit", "--ledger", url, "--run", run_id, "report")
        worker_table = _cli("audit", "--ledger", url, "--run", run_id, "worker",
                            hexkey["sign_flip"][:16])
    finally:
        procs.stop_all()
    logs = "\n".join(p.read_text()[-2000:] for p in (tmp_path / "logs").glob("*.log"))
    for refused in (unbonded, replacement):
        assert refused.returncode == 1, refused.stdout + refused.stderr
        line = refused.stderr.strip().splitlines()[-1]
        assert line.startswith("veritrain worker: ") and "(not_admitted)" in line, line
        assert "bond of 0 units" in line, line
    report, audit = out["report"], out["audit"]
    assert report["admission"]["policy"] == "bond"
    workers = {w["worker"]: w for w in report["workers"]}
    # Refused at the door: neither the unbonded key nor the replacement is a participant.
    assert hexkey["unbonded"] not in workers and hexkey["replacement"] not in workers
    cheat = workers[hexkey["sign_flip"]]
    caught = cheat["rejected"][0]
    assert caught["reason"] == "spot_check_failed", (cheat, logs)
    assert cheat["bond"]["slashes"] == [{"round": caught["round"], "amount": 8}]
    assert cheat["bond"]["bond"] == 8 and not cheat["bond"]["admitted"]
    for name in ("honest-0", "honest-1"):
        row = workers[hexkey[name]]
        assert row["rejected"] == [] and row["accepted"] >= ROUNDS - 1, (row, logs)
        assert row["bond"]["bond"] == 16 and row["bond"]["slashes"] == []
    assert audit.ok, audit.problem
    # The tables say it too.
    assert report_table.returncode == 0, report_table.stderr
    line = next(x for x in report_table.stdout.splitlines()
                if x.startswith(hexkey["sign_flip"][:12]) and "-8" in x)
    assert line.split()[1:4] == ["8", "16", "8"], line
    assert worker_table.returncode == 0, worker_table.stderr
    assert f"round {caught['round']}: slashed 8 units" in worker_table.stdout
