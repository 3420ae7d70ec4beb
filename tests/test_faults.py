"""Crashes with real processes: kill -9 a worker, the validator and the ledger mid-run.

Each is restarted; the run still finishes, no accepted submission is lost,
nothing is counted twice, and the whole log still audits.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from veritrain.crashdrill import crash_drill

pytestmark = pytest.mark.slow


def test_kill_and_restart_every_role(tmp_path: Path):
    report = crash_drill(tmp_path, rounds=4)

    assert report.crashes == ["w0", "validator", "ledger"]
    assert report.finished and report.final_round == 3
    assert report.audit is not None and report.audit.ok, report.audit
    assert report.duplicated == 0, "a submission was counted twice"
    assert sorted((w, r) for w, r, _ in report.verdicts) == sorted(report.submissions)
    assert all(status == "accepted" for _, _, status in report.verdicts), report.verdicts
    # Every worker's receipts are in the ledger: nothing accepted was lost.
    assert report.lost == 0
    assert all(report.receipts.values()), report.receipts
    assert report.results_per_round == {r: 1 for r in range(4)}
    assert report.ok
