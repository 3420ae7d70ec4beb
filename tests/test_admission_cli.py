"""``veritrain admit`` and ``veritrain bond withdraw`` as an organiser and a worker run them:
the CLI in its own process against a ledger process on loopback.

What each command signs is checked from the membership rows the ledger then serves,
folded by the same rules validators and the audit use (protocol/membership.py); what it
refuses ends the command with one line and posts nothing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from veritrain.ledger.client import LedgerClient
from veritrain.protocol.identity import Identity, write_key_file
from veritrain.protocol.membership import fold_rows
from veritrain.protocol.messages import RunSpec, open_signed

from veritrain.local import LocalProcesses, child_env

pytestmark = pytest.mark.slow


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "veritrain.cli", *args], capture_output=True,
                          text=True, timeout=120, env=child_env())


def _keys(tmp_path: Path, *names: str) -> dict[str, str]:
    """Key files ``NAME.key`` and ``NAME.key.pub.json``; the hex public keys by name."""
    out = {}
    for name in names:
        role = name if name in ("organiser", "validator") else "worker"
        ident = Identity.generate(role)
        write_key_file(tmp_path / f"{name}.key", ident)
        (tmp_path / f"{name}.key.pub.json").write_text(json.dumps(
            {"role": role, **ident.public.to_json()}))
        out[name] = ident.public_key.hex()
    return out


def _served(url: str, run_id: str) -> tuple[RunSpec, list[dict[str, Any]]]:
    async def fetch() -> tuple[RunSpec, list[dict[str, Any]]]:
        async with LedgerClient(url, retry_for=10.0) as client:
            spec = open_signed((await client.get_json(f"/v1/runs/{run_id}"))["spec"],
                               RunSpec).message
            rows = (await client.get_json(f"/v1/runs/{run_id}/membership"))["rows"]
            return spec, rows
    return asyncio.run(fetch())


def _refused(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture()
def ledger(tmp_path: Path):
    procs = LocalProcesses(tmp_path / "logs")
    try:
        yield procs.start_ledger(tmp_path / "ledger")
    finally:
        procs.stop_all()


def test_admit_issues_and_revokes_tickets_an_allowlist_run_then_counts(tmp_path, ledger):
    keys = _keys(tmp_path, "organiser", "validator", "issuer", "stranger", "w1", "w2")
    run_id = "admit-cli"
    created = _cli("run", "create", "--ledger", ledger, "--key", str(tmp_path / "organiser.key"),
                   "--run-id", run_id, "--preset", "tiny", "--rounds", "4", "--validator",
                   str(tmp_path / "validator.key.pub.json"), "--admission", "allowlist",
                   "--issuer", str(tmp_path / "issuer.key.pub.json"))
    assert created.returncode == 0, created.stderr

    def admit(key: str, worker: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return _cli("admit", "--ledger", ledger, "--run", run_id, "--key",
                    str(tmp_path / f"{key}.key"), "--worker", worker, *extra)

    _refused(admit("stranger", keys["w1"]), "neither the organiser", "nor one of its ticket")
    _refused(admit("organiser", keys["w1"], "--until-round", "0"), "--until-round 0",
             "not after round 0")
    _refused(_cli("bond", "deposit", "--ledger", ledger, "--run", run_id, "--key",
                  str(tmp_path / "organiser.key"), "--worker", keys["w1"], "--amount", "5"),
             "admits workers by allowlist", "is for bond runs")
    assert _served(ledger, run_id)[1] == []  # nothing refused was posted

    by_organiser = admit("organiser", str(tmp_path / "w1.key.pub.json"))
    assert by_organiser.returncode == 0, by_organiser.stderr
    assert f"admitted {keys['w1'][:12]} for rounds 0-3" in by_organiser.stdout
    by_issuer = admit("issuer", keys["w2"], "--until-round", "2")
    assert by_issuer.returncode == 0, by_issuer.stderr
    assert f"admitted {keys['w2'][:12]} for rounds 0-1" in by_issuer.stdout
    spec, rows = _served(ledger, run_id)
    state = fold_rows(spec, rows)
    assert state.admitted([keys["w1"], keys["w2"], keys["stranger"]], 0) == {keys["w1"],
                                                                            keys["w2"]}
    assert state.admitted([keys["w1"], keys["w2"]], 2) == {keys["w1"]}  # w2's ticket expired

    revoked = admit("organiser", keys["w1"], "--revoke")
    assert revoked.returncode == 0, revoked.stderr
    assert f"revoked every ticket of {keys['w1'][:12]} from round 0" in revoked.stdout
    spec, rows = _served(ledger, run_id)
    assert len(rows) == 3
    state = fold_rows(spec, rows)
    assert state.admitted([keys["w1"], keys["w2"]], 0) == {keys["w2"]}
    assert "revoked" in (state.admission_problem(keys["w1"], 0) or "")

    # The revoked key is refused at the door, with the reason, and is not a participant.
    refused = _cli("worker", "--ledger", ledger, "--key", str(tmp_path / "w1.key"), "--run",
                   run_id, "--no-progress", "--retry-for", "10", "--state-dir",
                   str(tmp_path / "state-w1"))
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "(not_admitted)" in refused.stderr.strip().splitlines()[-1], refused.stderr


def test_bond_withdraw_waits_out_the_unbonding_period_and_lowers_the_bond(tmp_path, ledger):
    keys = _keys(tmp_path, "organiser", "validator", "w1", "w2")
    run_id = "withdraw-cli"
    created = _cli("run", "create", "--ledger", ledger, "--key", str(tmp_path / "organiser.key"),
                   "--run-id", run_id, "--preset", "tiny", "--rounds", "6", "--validator",
                   str(tmp_path / "validator.key.pub.json"), "--admission", "bond",
                   "--min-bond", "10", "--unbonding-rounds", "2")
    assert created.returncode == 0, created.stderr
    paid = _cli("bond", "deposit", "--ledger", ledger, "--run", run_id, "--key",
                str(tmp_path / "organiser.key"), "--worker", keys["w1"], "--amount", "16")
    assert paid.returncode == 0 and "bond 16 (the run needs 10)" in paid.stdout, paid.stderr

    def withdraw(key: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return _cli("bond", "withdraw", "--ledger", ledger, "--run", run_id, "--key",
                    str(tmp_path / f"{key}.key"), *extra)

    _refused(withdraw("w1", "--round", "1"), "2 round(s) ahead", "round 2, not 1")
    _refused(withdraw("w2"), f"{keys['w2'][:12]} has no bond")
    _refused(withdraw("w1", "--amount", "0"), "--amount counts units")
    assert len(_served(ledger, run_id)[1]) == 1  # the deposit only

    part = withdraw("w1", "--amount", "6")
    assert part.returncode == 0, part.stderr
    assert "withdrawal of 6 units" in part.stdout and "effective from round 2" in part.stdout
    spec, rows = _served(ledger, run_id)
    state = fold_rows(spec, rows)
    assert [state.balance(keys["w1"], r) for r in range(4)] == [16, 16, 10, 10]
    assert state.admitted([keys["w1"]], 3) == {keys["w1"]}  # 10 still meets the minimum

    # More than the bond holds is refused by the ledger (posted, checked, not stored).
    _refused(withdraw("w1", "--amount", "11"), "withdrawal of 11 units from a bond of 10")
    rest = withdraw("w1")  # the whole remaining bond, at the earliest round
    assert rest.returncode == 0, rest.stderr
    assert "withdrawal of 10 units" in rest.stdout
    spec, rows = _served(ledger, run_id)
    assert len(rows) == 3
    state = fold_rows(spec, rows)
    assert state.balance(keys["w1"], 1) == 16 and state.balance(keys["w1"], 2) == 0
    assert state.admitted([keys["w1"]], 1) == {keys["w1"]}
    assert state.admitted([keys["w1"]], 2) == set()
