import asyncio
import functools
import json
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from veritrain.protocol.identity import Identity

from veritrain.cli import build_parser
from veritrain.local import free_port

RUN = "cli-run"


def veritrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "veritrain.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", [
    ["keygen"], ["run", "create"], ["ledger", "serve"], ["ledger", "prune"], ["worker"],
    ["validator"], ["audit"], ["demo"], ["admit"], ["bond", "deposit"], ["bond", "withdraw"],
])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "usage: veritrain " + " ".join(command) in text
    assert len(text.splitlines()) > 4


def test_keygen_writes_private_key_and_public_identity(tmp_path):
    out = tmp_path / "v.key"
    result = veritrain("keygen", "--role", "validator", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    pub = json.loads((tmp_path / "v.key.pub.json").read_text())
    assert set(pub) == {"role", "ed25519", "bls", "bls_pop"}
    assert "seed" not in (tmp_path / "v.key.pub.json").read_text()
    again = veritrain("keygen", "--role", "validator", "--out", str(out))
    assert again.returncode != 0


# ----------------------------------------------------------------------------- failures
# Every failure a user can provoke ends in one line on stderr that says what failed and
# what to do, with a non-zero exit code; the traceback only with -v.


def one_line_failure(result: subprocess.CompletedProcess[str], command: str) -> str:
    """The failure's line, after checking that it is the only thing the command said."""
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"veritrain {command}: "), lines[0]
    assert result.stdout == ""
    return lines[0]


@functools.cache
def played_ledger() -> tuple[Path, Identity, str]:
    """A ledger database with four finalized rounds (honest workers, a free rider, a
    copier, a worker banned for a failed spot check) plus a late registration whose key
    starts with the same hex digit as another's; its ledger key; that digit."""
    from ledger_scenarios import (
        COPIER,
        FREE_RIDER,
        HONEST,
        SPOT_FAIL,
        make_store,
        play_run,
        quick_run,
        register,
    )

    tmp = Path(tempfile.mkdtemp(prefix="cli-ledger-"))
    store = make_store(f"sqlite:///{tmp / 'ledger.sqlite'}")
    played = play_run(store, quick_run(RUN), [HONEST, HONEST, FREE_RIDER, COPIER, SPOT_FAIL], 4)
    firsts = {key[0] for key in played.workers}
    late = Identity.generate("worker")
    while late.public_key.hex()[0] not in firsts:
        late = Identity.generate("worker")
    register(store, played.run, late)
    store.engine.dispose()
    return tmp / "ledger.sqlite", store.identity, late.public_key.hex()[0]


def against_ledger(tmp_path: Path, *commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Run each command as a subprocess against a live ledger serving the played run."""
    from ledger_harness import run_api

    src, identity, _ = played_ledger()
    db = tmp_path / "ledger.sqlite"
    shutil.copy(src, db)

    async def scenario(api):
        loop = asyncio.get_running_loop()
        return [await loop.run_in_executor(None, lambda c=c: veritrain(
            c[0], "--ledger", api.url, *c[1:])) for c in commands]

    return run_api(tmp_path, scenario, db_url=f"sqlite:///{db}", identity=identity)


def test_invalid_ledger_down_is_one_line_and_the_traceback_only_with_v():
    port = free_port()
    quiet = veritrain("audit", "--ledger", f"http://127.0.0.1:{port}", "--retry-for", "0.5",
                      "report")
    line = one_line_failure(quiet, "audit")
    assert f"cannot reach the ledger at http://127.0.0.1:{port}" in line
    assert "connection refused" in line and "veritrain ledger serve" in line
    loud = veritrain("-v", "audit", "--ledger", f"http://127.0.0.1:{port}", "--retry-for",
                     "0.5", "report")
    assert loud.returncode == 1 and "Traceback" in loud.stderr
    assert loud.stderr.splitlines()[-1] == line
    after = veritrain("audit", "--ledger", f"http://127.0.0.1:{port}", "--retry-for", "0.5",
                      "report", "-v")  # -v after the subcommand works too
    assert after.returncode == 1 and "Traceback" in after.stderr


def test_invalid_ledger_url_without_scheme():
    line = one_line_failure(veritrain("audit", "--ledger", "127.0.0.1:8470", "report"), "audit")
    assert "--ledger must be a URL such as http://" in line


def test_invalid_run_worker_and_round_each_end_in_one_line(tmp_path):
    wrong_run, unknown, ambiguous, no_key, no_round, bad_round = against_ledger(
        tmp_path, ["audit", "--run", "no-such-run", "report"], ["audit", "worker", "zz"],
        ["audit", "worker", ""], ["audit", "worker"], ["audit", "round", "99"],
        ["audit", "round", "three"])
    assert f"has no run 'no-such-run'; its runs: {RUN}" in one_line_failure(wrong_run, "audit")
    assert "no worker of run" in one_line_failure(unknown, "audit")
    assert "starting with 'zz'" in one_line_failure(unknown, "audit")
    assert "needs a worker key" in one_line_failure(ambiguous, "audit")
    assert "needs a worker key" in one_line_failure(no_key, "audit")
    line = one_line_failure(no_round, "audit")
    assert "has no round 99 (not_found)" in line and "audit report" in line
    assert "needs a round number" in one_line_failure(bad_round, "audit")


def test_invalid_ambiguous_worker_prefix_asks_for_more_of_the_key(tmp_path):
    shared = played_ledger()[2]
    (result,) = against_ledger(tmp_path, ["audit", "worker", shared])
    assert f"more than one worker of run '{RUN}' has a key starting with '{shared}'; give " \
        "more of the key" in one_line_failure(result, "audit")


@pytest.mark.parametrize("content, mode, expected", [
    (None, 0o600, "no key file"),
    ("not json", 0o600, "is not a veritrain key file"),
    ('{"role": "worker"}', 0o600, "is not a veritrain key file"),
    ("{}", 0o644, "accessible by others (mode 644); chmod 600 it"),
])
def test_invalid_key_file_is_one_line(tmp_path, content, mode, expected):
    key = tmp_path / "w.key"
    if content is not None:
        key.write_text(content)
        key.chmod(mode)
    result = veritrain("worker", "--ledger", "http://127.0.0.1:1", "--key", str(key))
    assert expected in one_line_failure(result, "worker")


def test_invalid_keygen_over_an_existing_key(tmp_path):
    out = tmp_path / "w.key"
    assert veritrain("keygen", "--role", "worker", "--out", str(out)).returncode == 0
    line = one_line_failure(veritrain("keygen", "--role", "worker", "--out", str(out)), "keygen")
    assert "never overwrites" in line


@pytest.fixture(scope="module")
def saved_export(tmp_path_factory) -> bytes:
    """The played run's export, saved by `audit --save` and verified by `audit --export`."""
    tmp = tmp_path_factory.mktemp("export")
    (save,) = against_ledger(tmp, ["audit", "--save", str(tmp / "run.jsonl")])
    assert save.returncode == 0 and save.stderr == ""
    assert save.stdout.startswith(f"saved the export of run {RUN}")
    check = veritrain("audit", "--export", str(tmp / "run.jsonl"), "verify")
    assert check.returncode == 0 and check.stdout.startswith("OK")
    return (tmp / "run.jsonl").read_bytes()


@pytest.mark.parametrize("damage, expected", [
    (lambda lines: [b"garbage\n"], "no export header"),
    (lambda lines: lines[:-3], "truncated"),
    (lambda lines: lines[:3] + [b'{"type": "event", "seq": \n'] + lines[4:], "line 4"),
    (None, "cannot read"),
])
def test_invalid_malformed_export_is_one_line(tmp_path, saved_export, damage, expected):
    path = tmp_path / "run.jsonl"
    lines = saved_export.splitlines(keepends=True)
    if damage is None:
        path = tmp_path / "missing.jsonl"
    else:
        path.write_bytes(b"".join(damage(lines)))
    result = veritrain("audit", "--export", str(path), "verify")
    assert result.returncode == 1 and result.stderr == ""
    assert len(result.stdout.splitlines()) == 1 and result.stdout.startswith("FAILED")
    assert expected in result.stdout


@pytest.mark.parametrize("extra, expected", [
    (["--run-id", "Bad_Id"], "cannot build run 'Bad_Id': run_spec.run_id"),
    (["--run-id", "good-id", "--task-params", "{bad"], "--task-params must be JSON"),
    (["--run-id", "good-id", "--validator", "MISSING"], "cannot read validator identity"),
    (["--run-id", "good-id", "--admission", "bond"], "--admission bond needs --min-bond"),
    (["--run-id", "good-id", "--min-bond", "5"], "--min-bond: only with --admission"),
    (["--run-id", "good-id", "--admission", "allowlist", "--treasury", "zz"],
     "--treasury: only with --admission bond"),
])
def test_invalid_run_create_inputs_are_one_line(tmp_path, extra, expected):
    org, val = tmp_path / "org.key", tmp_path / "v.key"
    veritrain("keygen", "--role", "organiser", "--out", str(org))
    veritrain("keygen", "--role", "validator", "--out", str(val))
    pub = [str(tmp_path / "missing.pub.json") if e == "MISSING" else e for e in extra]
    if "--validator" not in pub:
        pub += ["--validator", f"{val}.pub.json"]
    result = veritrain("run", "create", "--ledger", "http://127.0.0.1:1", "--key", str(org),
                       "--preset", "tiny", *pub)
    assert expected in one_line_failure(result, "run create")


def test_run_create_takes_the_beacon_kind_into_the_signed_spec(tmp_path):
    from veritrain.protocol.identity import Identity
    from veritrain.protocol.organiser import build_run

    from veritrain.cli import _settings_from_args, build_parser

    base = ["run", "create", "--ledger", "http://127.0.0.1:1", "--key", "k", "--run-id",
            "beacon-run", "--validator", "v.pub.json", "--preset", "tiny"]
    validators = [Identity.generate("validator").public for _ in range(3)]
    specs = {}
    for extra in ([], ["--beacon", "threshold"], ["--beacon", "shares"]):
        settings = _settings_from_args(build_parser().parse_args(base + extra))
        specs[tuple(extra)] = build_run(Identity.generate("organiser"), "beacon-run", settings,
                                        validators).signed.message
    assert specs[()].threshold_beacon and specs[("--beacon", "threshold")].threshold_beacon
    assert not specs[("--beacon", "shares")].threshold_beacon
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--beacon", "quorum"])


def test_invalid_ledger_serve_on_a_port_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = veritrain("ledger", "serve", "--data-dir", str(tmp_path / "led"), "--port",
                           str(port))
    assert "the address is in use" in one_line_failure(result, "ledger serve")


# ----------------------------------------------------------------------------- output


def test_audit_worker_and_round_print_tables_and_json_on_request(tmp_path):
    import sqlite3

    src = played_ledger()[0]

    with sqlite3.connect(src) as conn:
        banned = conn.execute("SELECT worker FROM verdicts WHERE reason = 'spot_check_failed'"
                              ).fetchone()[0]
    report, worker, worker_json, round_, round_json = against_ledger(
        tmp_path, ["audit", "report"], ["audit", "worker", banned[:10]],
        ["audit", "--json", "worker", banned[:10]], ["audit", "round", "0"],
        ["audit", "--json", "round", "0"])
    for result in (report, worker, worker_json, round_, round_json):
        assert result.returncode == 0 and result.stderr == "", result.stderr
    assert report.stdout.startswith(f"run {RUN} (")
    # The worker's table: its verdict with the reason, the evidence of its failed check.
    assert worker.stdout.startswith(f"worker {banned}, run {RUN}")
    assert "banned until round" in worker.stdout
    row = next(line for line in worker.stdout.splitlines() if line.lstrip().startswith("0 "))
    assert "rejected" in row and "spot_check_failed" in row and "segment 1" in row
    assert "segment 1: FAILED, distance 5.00e-01, states 777777777777 -> 777777777777" \
        in worker.stdout
    data = json.loads(worker_json.stdout)
    assert data["worker"] == banned and data["verdicts"][0]["reason"] == "spot_check_failed"
    # The round's table: a line per verdict, the certificate's signers.
    assert round_.stdout.startswith(f"run {RUN}, round 0: finalized, eval loss 3.0000")
    assert "certified by validators 0" in round_.stdout
    verdicts = json.loads(round_json.stdout)["verdicts"]
    for v in verdicts:
        line = next(x for x in round_.stdout.splitlines() if x.startswith(v["worker"][:12]))
        assert v["status"] in line and (v["reason"] or "-") in line


def test_a_client_command_prints_no_library_chatter(tmp_path):
    """The issue's seven alembic lines (and retry warnings): gone without -v."""
    (report,) = against_ledger(tmp_path, ["audit", "report"])
    assert report.stderr == "" and "alembic" not in report.stdout


def test_ledger_serve_logs_its_own_lines_only(tmp_path):
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "veritrain.cli", "ledger", "serve",
                             "--data-dir", str(tmp_path / "led"), "--port", "0",
                             "--ready-file", str(ready)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert ready.exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert "listening on http://127.0.0.1:" in out
    assert "alembic" not in out and "INFO" in out


@pytest.mark.parametrize("args, expected", [
    (["--workers", "2"], "at least 3 workers"),
    (["--shard-cheater"], "--shard-cheater and --shard-checkers need --sharded"),
    (["--shard-checkers", "1"], "--shard-cheater and --shard-checkers need --sharded"),
    (["--sharded", "--validators", "2"], "--sharded needs at least 3 validators"),
    (["--masked-buckets", "3", "--sharded"], "does not combine with --sharded"),
])
def test_invalid_demo_options_are_one_line_and_touch_nothing(tmp_path, args, expected):
    out = tmp_path / "demo-out"
    out.mkdir()
    (out / "keep").write_text("an earlier demo's report")
    result = veritrain("demo", "--out", str(out), *args)
    assert expected in one_line_failure(result, "demo")
    assert (out / "keep").read_text() == "an earlier demo's report"
