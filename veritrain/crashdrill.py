"""Crash drill with real processes: kill -9 a worker, the validator and the ledger mid-run.

A tiny training run with one validator and three workers, each a separate
``veritrain`` process; a worker is killed right after its first submission, the
validator while it works on a closed round, the ledger mid-run; each is
restarted on the same state. The drill then reads the ledger's SQLite file and
the workers' receipt files to say what, if anything, was lost or counted twice.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.ledger.client import LedgerClient, publish_run
from veritrain.ledger.verify import AuditResult
from veritrain.protocol.identity import Identity, write_key_file
from veritrain.protocol.organiser import build_run
from veritrain.protocol.presets import run_preset

from .local import LocalProcesses, free_port

RUN_ID = "faults"


@dataclass
class DrillReport:
    rounds: int
    crashes: list[str] = field(default_factory=list)
    finished: bool = False
    final_round: int = -1
    submissions: list[tuple[str, int]] = field(default_factory=list)
    verdicts: list[tuple[str, int, str]] = field(default_factory=list)
    results_per_round: dict[int, int] = field(default_factory=dict)
    receipts: dict[str, set[int]] = field(default_factory=dict)
    audit: AuditResult | None = None

    @property
    def duplicated(self) -> int:
        return len(self.submissions) - len(set(self.submissions))

    @property
    def lost(self) -> int:
        """Receipts a worker holds with no stored submission behind them."""
        stored = set(self.submissions)
        return sum(1 for w, rounds in self.receipts.items() for r in rounds if (w, r) not in stored)

    @property
    def ok(self) -> bool:
        return (self.finished and self.final_round == self.rounds - 1 and self.lost == 0
                and self.duplicated == 0 and self.audit is not None and self.audit.ok
                and sorted((w, r) for w, r, _ in self.verdicts) == sorted(self.submissions)
                and all(s == "accepted" for _, _, s in self.verdicts)
                and sorted(self.results_per_round) == list(range(self.rounds))
                and all(n == 1 for n in self.results_per_round.values()))


async def _status(url: str) -> dict[str, Any]:
    async with LedgerClient(url, retry_for=60.0) as client:
        return await client.get_json(f"/v1/runs/{RUN_ID}/rounds/current")


def _wait_for(url: str, predicate: Callable[[dict[str, Any]], bool], timeout: float,
              what: str) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = asyncio.run(_status(url))
        if predicate(info):
            return info
        time.sleep(0.3)
    raise TimeoutError(what)


def _log_has(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


async def _audit(url: str) -> AuditResult:
    async with LedgerClient(url, retry_for=30.0) as client:
        key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
        return verify_events(await fetch_events(client, RUN_ID), key)


def crash_drill(work_dir: Path, rounds: int = 4,
                progress: Callable[[str], None] = lambda _: None) -> DrillReport:
    """Play the drill under ``work_dir`` and report what the ledger and workers hold."""
    keys = {"validator": Identity.generate("validator")}
    keys.update({f"w{i}": Identity.generate("worker") for i in range(3)})
    for name, ident in keys.items():
        write_key_file(work_dir / f"{name}.key", ident)
    settings = run_preset("tiny")
    settings["schedule"]["max_rounds"] = rounds
    bundle = build_run(Identity.generate("organiser"), RUN_ID, settings,
                       [keys["validator"].public])
    port = free_port()
    logs = work_dir / "logs"
    procs = LocalProcesses(logs)
    report = DrillReport(rounds)
    url = ""

    def start(name: str) -> None:
        if name == "validator":
            args = ["validator", "--ledger", url, "--key", str(work_dir / "validator.key"),
                    "--run", RUN_ID, "--state-dir", str(work_dir / "validator-state")]
        else:
            args = ["worker", "--ledger", url, "--key", str(work_dir / f"{name}.key"),
                    "--run", RUN_ID, "--no-progress", "--state-dir", str(work_dir / name)]
        procs.start(name, args)

    def crash(name: str, restart: Callable[[], Any]) -> None:
        procs.kill(name, signal.SIGKILL)
        restart()
        report.crashes.append(name)
        progress(f"killed the {name} with SIGKILL and restarted it")

    try:
        url = procs.start_ledger(work_dir / "ledger", port=port)
        for name in ["validator", "w0", "w1", "w2"]:
            start(name)
        deadline = time.monotonic() + 300
        while not all(_log_has(logs / f"{n}.log", "waiting for run")
                      for n in ["validator", "w0", "w1", "w2"]):
            if time.monotonic() > deadline:
                raise TimeoutError("the nodes did not start")
            time.sleep(0.2)
        asyncio.run(publish_run(url, bundle))

        # 1. A worker dies right after submitting round 0 and comes back.
        _wait_for(url, lambda i: i["round"] >= 1 or i["submissions"] >= 1, 300, "round 0")
        crash("w0", lambda: start("w0"))
        # 2. The validator dies while it works on a closed round, and comes back.
        _wait_for(url, lambda i: i["round"] >= 1 and i["status"] == "closed", 300,
                  "a closed round")
        crash("validator", lambda: start("validator"))
        # 3. The ledger dies mid-run and restarts on the same data and port.
        _wait_for(url, lambda i: i["round"] >= 2, 300, "round 2")

        def restart_ledger() -> None:
            time.sleep(1.0)
            procs.start_ledger(work_dir / "ledger", port=port)

        crash("ledger", restart_ledger)
        info = _wait_for(url, lambda i: i["run_status"] == "finished", 420, "the run to finish")
        report.finished, report.final_round = True, info["round"]
        report.audit = asyncio.run(_audit(url))
    finally:
        procs.stop_all()

    db = sqlite3.connect(work_dir / "ledger" / "ledger.sqlite")
    try:
        report.submissions = list(db.execute(
            "select worker, round from submissions where run_id=?", (RUN_ID,)))
        report.verdicts = list(db.execute(
            "select worker, round, status from verdicts where run_id=?", (RUN_ID,)))
        report.results_per_round = dict(db.execute(
            "select round, count(*) from round_results where run_id=? group by round",
            (RUN_ID,)))
    finally:
        db.close()
    for name in ["w0", "w1", "w2"]:
        receipts = work_dir / name / RUN_ID / "receipts"
        report.receipts[keys[name].public_key.hex()] = {int(p.stem)
                                                       for p in receipts.glob("*.json")
                                                       if p.stem.isdigit()}
    return report
