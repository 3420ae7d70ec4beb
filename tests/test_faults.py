"""Crashes with real processes: kill -9 a worker, the validator and the ledger mid-run.

Each is restarted; the run still finishes, no accepted submission is lost,
nothing is counted twice, and the whole log still audits.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time
from pathlib import Path

import pytest
from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.protocol.client import LedgerClient
from veritrain.protocol.identity import Identity, write_key_file
from veritrain.protocol.organiser import build_run, publish_run
from veritrain.protocol.presets import run_preset

from veritrain.local import LocalProcesses, free_port

pytestmark = pytest.mark.slow

ROUNDS = 4


async def _status(url: str) -> dict:
    async with LedgerClient(url, retry_for=60.0) as client:
        return await client.get_json("/v1/runs/faults/rounds/current")


def _wait_for(url: str, predicate, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = asyncio.run(_status(url))
        if predicate(info):
            return info
        time.sleep(0.3)
    raise TimeoutError(what)


def _log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


def test_kill_and_restart_every_role(tmp_path: Path):
    keys = {"validator": Identity.generate("validator")}
    keys.update({f"w{i}": Identity.generate("worker") for i in range(3)})
    for name, ident in keys.items():
        write_key_file(tmp_path / f"{name}.key", ident)
    settings = run_preset("tiny")
    settings["schedule"]["max_rounds"] = ROUNDS
    bundle = build_run(Identity.generate("organiser"), "faults", settings,
                       [keys["validator"].public])
    port = free_port()
    logs = tmp_path / "logs"
    procs = LocalProcesses(logs)

    def start(name: str) -> None:
        if name == "validator":
            args = ["validator", "--ledger", url, "--key", str(tmp_path / "validator.key"),
                    "--run", "faults"]
        else:
            args = ["worker", "--ledger", url, "--key", str(tmp_path / f"{name}.key"),
                    "--run", "faults", "--no-progress", "--state-dir", str(tmp_path / name)]
        procs.start(name, args)

    try:
        url = procs.start_ledger(tmp_path / "ledger", port=port)
        for name in ["validator", "w0", "w1", "w2"]:
            start(name)
        deadline = time.monotonic() + 300
        while not all(_log_has(logs / f"{n}.log", "waiting for run")
                      for n in ["validator", "w0", "w1", "w2"]):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        asyncio.run(publish_run(url, bundle))

        # 1. A worker dies right after submitting round 0 and comes back.
        _wait_for(url, lambda i: i["round"] >= 1 or i["submissions"] >= 1, 300, "round 0")
        procs.kill("w0", signal.SIGKILL)
        start("w0")
        # 2. The validator dies while it works on a closed round, and comes back.
        _wait_for(url, lambda i: i["round"] >= 1 and i["status"] == "closed", 300,
                  "a closed round")
        procs.kill("validator", signal.SIGKILL)
        start("validator")
        # 3. The ledger dies mid-run and restarts on the same data and port.
        _wait_for(url, lambda i: i["round"] >= 2, 300, "round 2")
        procs.kill("ledger", signal.SIGKILL)
        time.sleep(1.0)
        procs.start_ledger(tmp_path / "ledger", port=port)
        info = _wait_for(url, lambda i: i["run_status"] == "finished", 420, "the run to finish")
        assert info["round"] == ROUNDS - 1
        audit = asyncio.run(_audit(url))
    finally:
        procs.stop_all()

    assert audit.ok, audit.problem
    db = sqlite3.connect(tmp_path / "ledger" / "ledger.sqlite")
    subs = list(db.execute("select worker, round from submissions where run_id='faults'"))
    assert len(subs) == len(set(subs)), "a submission was counted twice"
    verdicts = list(db.execute("select worker, round, status from verdicts where run_id='faults'"))
    assert sorted((w, r) for w, r, _ in verdicts) == sorted(subs)
    assert all(status == "accepted" for _, _, status in verdicts), verdicts
    # Every worker's receipts are in the ledger: nothing accepted was lost.
    for name in ["w0", "w1", "w2"]:
        worker = keys[name].public_key.hex()
        receipts = {int(p.stem) for p in (tmp_path / name / "faults" / "receipts").glob("*.json")}
        stored = {r for w, r in subs if w == worker}
        assert receipts <= stored
    results = list(db.execute("select round, count(*) from round_results where run_id='faults' "
                              "group by round"))
    assert all(count == 1 for _, count in results) and len(results) == ROUNDS


async def _audit(url: str):
    async with LedgerClient(url, retry_for=30.0) as client:
        key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
        return verify_events(await fetch_events(client, "faults"), key)
