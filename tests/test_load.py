"""Load and hostile input against a real ledger process on loopback (small scale in CI;
bench/faults.py runs 200 workers)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from veritrain.hostile import CLOSED, attack_ledger
from veritrain.load import LoadPlan, run_load
from veritrain.local import LocalProcesses

pytestmark = pytest.mark.slow


def test_concurrent_workers_with_a_ledger_kill_lose_and_duplicate_nothing(tmp_path: Path):
    plan = LoadPlan(workers=30, rounds=2, payload_bytes=32 * 1024, resend_fraction=0.2,
                    crash_round=1, crash_after=0.5)
    report = run_load(tmp_path, plan)

    assert report.crashes == 1
    assert report.receipts == report.stored == plan.workers * plan.rounds
    assert report.lost == report.duplicated == report.failed == report.corrupted == 0
    assert report.resent == report.resent_same_receipt == 6 * plan.rounds
    assert report.audit_ok, report.audit_problem
    assert len(report.latencies_ms) == plan.workers and report.p99_ms > 0
    assert report.ok


def test_invalid_hostile_requests_get_clear_refusals_and_change_nothing(tmp_path: Path):
    procs = LocalProcesses(tmp_path / "logs")
    try:
        url = procs.start_ledger(tmp_path / "ledger", extra=[
            "--upload-idle", "1", "--upload-min-rate", "4000", "--keepalive", "2"])
        report = asyncio.run(attack_ledger(url, mutations=60, seed=1))
    finally:
        procs.stop_all()

    assert report.failed_cases == [], [(c.name, c.statuses) for c in report.failed_cases]
    by_name = {c.name: c.statuses for c in report.cases}
    assert by_name["body that stalls"] == [408]
    assert by_name["body that trickles"] == [408]
    assert by_name["headers that never finish"] == [CLOSED]
    assert 429 in by_name["flood from one key"] and by_name["flood from one key"][-1] == 200
    assert report.server_errors == 0 and report.alive
    assert report.state_unchanged
    assert report.mutations == 60 and report.inputs > 100
