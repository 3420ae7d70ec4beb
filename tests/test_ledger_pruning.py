"""Blob retention (ledger/retention.py, specs/protocol.md 9.7): once a round is finalized
and the audit window has passed, its reveal files and the models it superseded are
recorded as pruned and deleted; the chain, payloads, the models nodes need and the
evidence of every failed check stay; a pruned blob answers 410 ``pruned``; the audit
still passes and counts what is gone."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import hashlib
import io
import json
import shutil
import sqlite3
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fakes import FakeRun
from ledger_backends import make_fixture
from ledger_harness import Api, post_result, post_share, run_api, verdict
from ledger_scenarios import (
    HONEST,
    SPOT_FAIL,
    beacon_share,
    build_results,
    make_store,
    play_run,
    quick_run,
)
from veritrain.ledger import migrate
from veritrain.ledger.audit import fetch_and_verify, fetch_events, format_result
from veritrain.ledger.blobs import BlobPruned
from veritrain.ledger.client import LedgerClient
from veritrain.ledger.retention import (
    Candidate,
    RetentionPolicy,
    RoundFiles,
    run_candidates,
)
from veritrain.ledger.server import PRUNER
from veritrain.ledger.verify import verify_log
from veritrain.protocol.beacon import beacon_seed_of, sealed_list_digest
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import SpotReveal, sign

from veritrain.synthetic import synthetic_submission

RUN = "prune-run"
ROUNDS = 5
FAILS_IN = 1  # the third worker fails its spot check in this round (then it is banned)


# ----------------------------------------------------------------------------- playing


@dataclass
class Played:
    """What a played run stored, to check against the disk afterwards."""

    run: FakeRun
    workers: list[str]
    reveals: dict[tuple[int, str], str] = field(default_factory=dict)  # (r, w) -> digest
    reveal_sizes: dict[str, int] = field(default_factory=dict)
    bases: list[tuple[str, str | None]] = field(default_factory=list)  # base, outer of round r
    updates: list[str] = field(default_factory=list)
    payloads: list[str] = field(default_factory=list)

    @property
    def failed(self) -> tuple[int, str]:
        return FAILS_IN, self.workers[2]


def reveal_data(r: int, worker: str) -> bytes:
    return (f"reveal file of {worker} in round {r}\n" * 60).encode()


async def wait_status(api: Api, r: int, status: str) -> None:
    for _ in range(600):
        if (await api.get(f"/v1/runs/{RUN}/rounds/{r}"))[1]["status"] == status:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"round {r} never became {status}")


async def play_round(api: Api, played: Played, ids: list[Identity], r: int,
                     banned: dict[str, int]) -> None:
    """One finalized round over HTTP: submissions, the beacon share, a reveal file from
    every worker with a reveal due, the validator's result with its model files."""
    run, path = played.run, f"/v1/runs/{RUN}/rounds/{r}"
    base = played.bases[r][0]
    kinds = {w: SPOT_FAIL if (i == 2 and r == FAILS_IN) else HONEST
             for i, w in enumerate(played.workers)}
    subs = {}
    for ident in ids:
        w = ident.public_key.hex()
        if banned.get(w, -1) >= r:
            continue
        payload = f"payload {r} {w}".encode()
        signed = synthetic_submission(run, ident, payload, round_index=r, base=base)
        status, body = await api.submit(signed, payload)
        assert status == 201, body
        subs[w] = signed.digest
        played.payloads.append(hashlib.sha256(payload).hexdigest())
    await wait_status(api, r, "closed")
    status, body = await api.post_json(path + "/beacon", beacon_share(
        run, run.validators[0], r, sealed_list_digest(list(subs.values()))).to_wire())
    assert status == 200 and body["beacon"] is not None, body
    for c in (await api.get(path + "/challenges"))[1]["challenges"]:
        if not c["due"]:
            continue
        w = c["worker"]
        data = reveal_data(r, w)
        envelope = SpotReveal(run_id=RUN, round=r, worker=w, submission_digest=subs[w],
                              reveal_hash=hashlib.sha256(data).hexdigest(),
                              reveal_bytes=len(data), created_at=1)
        ident = next(i for i in ids if i.public_key.hex() == w)
        status, body = await api.post_parts(path + "/reveals", [
            ("envelope", sign(ident, envelope).encode()), ("reveal", data)])
        assert status == 201, body
        played.reveals[(r, w)] = envelope.reveal_hash
        played.reveal_sizes[envelope.reveal_hash] = len(data)
    seed = beacon_seed_of((await api.get(path + "/beacon"))[1]["beacon"])
    results, blobs = build_results(run, r, base, seed, subs, {w: kinds[w] for w in subs})
    for res in results:
        status, body = await api.post_parts(path + "/results", [
            ("result", res.encode()), *blobs.items()])
        assert status == 201, body
    certified = results[0].message.certified
    played.bases.append((certified["model_hash"], certified["outer_state_hash"]))
    played.updates.append(certified["update_hash"])
    for w in subs:
        if kinds[w] == SPOT_FAIL:
            banned[w] = r + run.spec.verification["ban_rounds"]


async def play(api: Api, rounds: int, after_round: Any = None) -> Played:
    """A run of three workers over ``rounds`` finalized rounds; ``after_round(played, r)``
    is awaited after each."""
    run = quick_run(RUN)
    ids = [Identity.generate("worker") for _ in range(3)]
    played = Played(run, [i.public_key.hex() for i in ids],
                    bases=[(run.spec.genesis_model_hash, None)])
    assert (await api.create_run(run))[0] == 201
    for ident in ids:
        assert (await api.register(run, ident))[0] == 200
    banned: dict[str, int] = {}
    for r in range(rounds):
        await play_round(api, played, ids, r, banned)
        if after_round is not None:
            await after_round(played, r)
    return played


@functools.cache
def played_once() -> tuple[Path, Identity, Played]:
    """Five finalized rounds kept whole (``keep_blobs``), in a directory tests copy."""
    tmp = Path(tempfile.mkdtemp(prefix="prune-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    identity = Identity.generate("ledger")
    played = run_api(tmp, lambda api: play(api, ROUNDS), identity=identity,
                     retention=RetentionPolicy(keep_blobs=True), ip_rate=0, key_rate=0)
    return tmp, identity, played


def copy_played(tmp_path: Path) -> tuple[Identity, Played]:
    src, identity, played = played_once()
    shutil.copytree(src / "ledger", tmp_path / "ledger")
    shutil.copy(src / "ledger.sqlite", tmp_path / "ledger.sqlite")
    return identity, played


def serve_copy(tmp_path: Path, scenario: Any, policy: RetentionPolicy) -> Any:
    """``scenario`` against a ledger over the played copy (made here unless it is there),
    once the ledger's start-up prune is done."""
    if not (tmp_path / "ledger").exists():
        copy_played(tmp_path)
    _, identity, played = played_once()

    async def settled(api: Api) -> Any:
        pruner = api.server.app.get(PRUNER)
        if pruner is not None:
            await pruner.settle()
        return await scenario(api, played)

    return run_api(tmp_path, settled, identity=identity, retention=policy, ip_rate=0,
                   key_rate=0)


def on_disk(tmp_path: Path, digest: str) -> bool:
    return (tmp_path / "ledger" / "blobs" / digest[:2] / digest).exists()


def pruned_rows(tmp_path: Path) -> list[tuple[str, str, int, str | None, int, str]]:
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:
        return conn.execute("SELECT sha256, kind, round, worker, size, policy FROM "
                            "pruned_blobs ORDER BY round, kind, sha256").fetchall()


def expected_pruned(played: Played, window: int) -> set[tuple[str, str, int, str | None]]:
    """(digest, kind, round, worker) of what the policy deletes after ``ROUNDS`` rounds."""
    through = ROUNDS - 1 - window
    out: set[tuple[str, str, int, str | None]] = set()
    for (r, w), digest in played.reveals.items():
        if r <= through and (r, w) != played.failed:
            out.add((digest, "reveal", r, w))
    for r in range(1, through + 1):
        if r != FAILS_IN:  # the base of a round with a failed check is its evidence
            out.add((played.bases[r][0], "model", r, None))
            out.add((played.bases[r][1], "outer_state", r, None))
    return out


# ----------------------------------------------------------------------------- the rule


def test_rule_keeps_the_evidence_the_kept_digests_and_a_masked_run_s_reveals():
    rounds = [RoundFiles(3, "m3", "o3", {"a": "ra3", "b": "rb3"}, frozenset()),
              RoundFiles(4, "m4", "o4", {"a": "ra4", "b": "rb4"}, frozenset({"b"}),
                         (("model", "bad4"), ("outer_state", "badouter4")))]
    got = {(c.sha256, c.kind, c.round, c.worker)
           for c in run_candidates("r", rounds, {"o3"}, masked=False)}
    assert got == {("ra3", "reveal", 3, "a"), ("rb3", "reveal", 3, "b"), ("m3", "model", 3, None),
                   ("ra4", "reveal", 4, "a"), ("bad4", "model", 4, None),
                   ("badouter4", "outer_state", 4, None)}
    masked = {c.sha256 for c in run_candidates("r", rounds, set(), masked=True)}
    assert masked == {"m3", "o3", "bad4", "badouter4"}
    assert all(isinstance(c, Candidate) for c in run_candidates("r", rounds, set(),
                                                                masked=False))


@pytest.mark.parametrize("policy,last,through", [
    (RetentionPolicy(2), 4, 2), (RetentionPolicy(0), 4, 4), (RetentionPolicy(2), 1, -1),
    (RetentionPolicy(2), None, -1), (RetentionPolicy(0, keep_blobs=True), 9, -1)])
def test_the_window_counts_finalized_rounds(policy, last, through):
    assert policy.expired_through(last) == through


def test_invalid_window_is_refused():
    with pytest.raises(ValueError):
        RetentionPolicy(-1)


# ----------------------------------------------------------------------------- the server


def test_each_finalized_round_prunes_the_round_that_left_the_window(tmp_path):
    """Live, window 1: after round r is finalized the server has deleted round r-1's reveal
    files and the model it superseded, and kept round r's."""
    seen: list[tuple[int, set[str], set[str]]] = []

    async def scenario(api: Api) -> Played:
        pruner = api.server.app[PRUNER]

        async def after(played: Played, r: int) -> None:
            await pruner.settle()
            listed = {p["sha256"] for p in (await api.get(f"/v1/runs/{RUN}/pruned"))[1]
                      ["pruned"]}
            gone = {d for d in list(played.reveals.values()) + [b for b, _ in played.bases]
                    if not on_disk(tmp_path, d)}
            seen.append((r, listed, gone))

        return await play(api, 3, after)

    played = run_api(tmp_path, scenario, retention=RetentionPolicy(1), ip_rate=0, key_rate=0)
    for r, listed, gone in seen:
        old = {d for (q, w), d in played.reveals.items()
               if q < r and (q, w) != played.failed}
        old |= {played.bases[q][0] for q in range(1, r) if q != FAILS_IN}
        assert gone == old == listed - {played.bases[q][1] for q in range(1, r)}, r
    assert seen[-1][2], "something was pruned by the end"
    assert on_disk(tmp_path, played.reveals[played.failed])


def test_old_rounds_lose_their_reveals_and_models_the_window_keeps_the_rest(tmp_path):
    async def scenario(api: Api, played: Played) -> None:
        pass

    serve_copy(tmp_path, scenario, RetentionPolicy(2))
    played = played_once()[2]
    gone = expected_pruned(played, 2)
    assert {(d, k, r, w) for d, k, r, w, _, _ in pruned_rows(tmp_path)} == gone
    assert all(not on_disk(tmp_path, d) for d, *_ in gone)
    kept_reveals = set(played.reveals.values()) - {d for d, *_ in gone}
    assert {d for (r, _), d in played.reveals.items() if r > ROUNDS - 3} <= kept_reveals
    must_stay = (kept_reveals | {played.reveals[played.failed]}
                 | {played.run.spec.dataset_hash, played.run.spec.genesis_model_hash}
                 | {h for r in (FAILS_IN, ROUNDS - 2, ROUNDS - 1, ROUNDS)
                    for h in played.bases[r] if h is not None}
                 | set(played.updates) | set(played.payloads))
    missing = {d for d in must_stay if not on_disk(tmp_path, d)}
    assert missing == set()
    assert {size for *_, size, _ in pruned_rows(tmp_path)} and all(
        policy == "audit_window=2" for *_, policy in pruned_rows(tmp_path))


def test_pruned_blobs_are_listed_and_answer_410_pruned(tmp_path):
    identity, played = copy_played(tmp_path)
    lost = played.reveals[(ROUNDS - 3, played.workers[0])]  # due to go, but lost first
    (tmp_path / "ledger" / "blobs" / lost[:2] / lost).unlink()

    async def scenario(api: Api, played: Played) -> dict[str, Any]:
        out: dict[str, Any] = {"pages": []}
        offset = 0
        while offset is not None:
            page = (await api.get(f"/v1/runs/{RUN}/pruned?limit=5&offset={offset}"))[1]
            out["pages"].append(page)
            offset = page["next_offset"]
        gone = played.reveals[(0, played.workers[1])]
        out["gone"] = await api.get(f"/v1/blobs/{gone}")
        kept = played.reveals[played.failed]
        async with api.session.get(f"{api.url}/v1/blobs/{kept}") as resp:
            out["kept"] = resp.status, hashlib.sha256(await resp.read()).hexdigest() == kept
        out["lost"] = await api.get(f"/v1/blobs/{lost}")
        out["unknown_run"] = (await api.get("/v1/runs/no-such-run/pruned"))[0]
        async with LedgerClient(api.url, retry_for=1) as client:
            try:
                await client.get_blob(gone, max_bytes=1 << 20)
            except BlobPruned as exc:
                out["client"] = exc
        return out

    out = serve_copy(tmp_path, scenario, RetentionPolicy(2))
    listed = [row for page in out["pages"] for row in page["pruned"]]
    want = expected_pruned(played, 2) - {(lost, "reveal", ROUNDS - 3, played.workers[0])}
    assert {(p["sha256"], p["kind"], p["round"], p["worker"]) for p in listed} == want
    assert len(out["pages"]) == 2 and len(listed) == len(want)
    for p in listed:
        if p["kind"] == "reveal":
            assert p["size"] == played.reveal_sizes[p["sha256"]]
        assert p["policy"] == "audit_window=2" and p["pruned_at"] > 0
    status, body = out["gone"]
    assert status == 410 and body["reason"] == "pruned", body
    assert "retention policy" in body["detail"] and "round 0" in body["detail"]
    assert out["kept"] == (200, True)
    assert out["lost"][0] == 404 and out["lost"][1]["reason"] == "not_found"
    assert out["unknown_run"] == 404
    # `veritrain audit recheck` of a round whose reveal is gone ends in this one line.
    from veritrain.failures import failure_line

    line = failure_line(out["client"])
    assert "\n" not in line and "retention policy" in line and line.endswith("(pruned)")


def audit(api: Api) -> Any:
    async def run() -> Any:
        async with LedgerClient(api.url, retry_for=1) as client:
            return await fetch_and_verify(client, RUN, processes=1)

    return run()


def test_audit_verify_passes_on_a_pruned_ledger_and_counts_what_is_gone(tmp_path):
    async def scenario(api: Api, played: Played) -> Any:
        return await audit(api)

    result = serve_copy(tmp_path, scenario, RetentionPolicy(2))
    rows = pruned_rows(tmp_path)
    assert result.ok, result.to_json()
    assert result.pruned_blobs == len(rows) == len(expected_pruned(played_once()[2], 2))
    assert result.pruned_bytes == sum(size for *_, size, _ in rows) > 0
    assert f"{len(rows)} blob(s), {result.pruned_bytes} bytes, gone" in format_result(result)
    data = json.loads(json.dumps(result.to_json()))  # `audit verify --json`
    assert data["ok"] and data["pruned_blobs"] == len(rows) and data["bad_pruned"] is None


def test_audit_verify_of_an_unpruned_ledger_says_no_blob_was_pruned(tmp_path):
    async def scenario(api: Api, played: Played) -> Any:
        return await audit(api)

    result = serve_copy(tmp_path, scenario, RetentionPolicy(keep_blobs=True))
    assert result.ok and result.pruned_blobs == 0 and "no blob pruned" in format_result(result)


@pytest.mark.parametrize("what", ["failed_reveal", "failed_base", "genesis", "open_round"])
def test_invalid_pruning_of_evidence_is_named_by_audit_verify(tmp_path, what):
    """A ledger that lists as pruned what the policy never deletes fails the audit."""
    identity, played = copy_played(tmp_path)
    digest, kind, r, worker = {
        "failed_reveal": (played.reveals[played.failed], "reveal", FAILS_IN, played.failed[1]),
        "failed_base": (played.bases[FAILS_IN][0], "model", FAILS_IN, None),
        "genesis": (played.run.spec.genesis_model_hash, "model", 0, None),
        "open_round": (played.bases[ROUNDS][0], "model", ROUNDS, None),
    }[what]
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:
        conn.execute("INSERT INTO pruned_blobs VALUES (?, ?, ?, ?, ?, 10, 1.0, 'rogue')",
                     (RUN, digest, kind, r, worker))

    async def scenario(api: Api, played: Played) -> Any:
        return await audit(api)

    result = serve_copy(tmp_path, scenario, RetentionPolicy(keep_blobs=True))
    assert not result.ok and result.first_bad_seq is None
    assert result.bad_pruned is not None and digest[:16] in result.bad_pruned
    assert {"failed_reveal": "whose check failed", "failed_base": "failed check",
            "genesis": "genesis model", "open_round": "latest certified"}[what] \
        in result.bad_pruned
    assert format_result(result).startswith("FAILED at pruned blob")


# ----------------------------------------------------------------------------- the command


def prune_cli(tmp_path: Path, *args: str) -> tuple[int, str]:
    from veritrain.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["ledger", "prune", "--data-dir", str(tmp_path / "ledger"), "--db",
                   f"sqlite:///{tmp_path / 'ledger.sqlite'}", *args])
    return rc, out.getvalue()


def files(tmp_path: Path) -> set[str]:
    return {p.name for p in (tmp_path / "ledger" / "blobs").glob("??/*")}


def test_prune_command_dry_run_then_prune_then_again(tmp_path):
    identity, played = copy_played(tmp_path)
    before = files(tmp_path)
    gone = expected_pruned(played, 2)
    freed = sum((tmp_path / "ledger" / "blobs" / d[:2] / d).stat().st_size for d, *_ in gone)

    rc, dry = prune_cli(tmp_path, "--audit-window", "2", "--dry-run")
    assert rc == 0 and files(tmp_path) == before and pruned_rows(tmp_path) == []
    assert f"would delete {len(gone)} blob(s)" in dry and f"would free {freed} bytes" in dry

    rc, out = prune_cli(tmp_path, "--audit-window", "2")
    assert rc == 0 and files(tmp_path) == before - {d for d, *_ in gone}
    assert {(d, k, r, w) for d, k, r, w, _, _ in pruned_rows(tmp_path)} == gone
    assert f"deleted {len(gone)} blob(s)" in out and f"freed {freed} bytes" in out
    kept = sum(p.stat().st_size for p in (tmp_path / "ledger" / "blobs").glob("??/*"))
    assert f"kept on disk: {kept} bytes" in out and "per round" in out
    assert f"would keep on disk: {kept} bytes" in dry

    rows = pruned_rows(tmp_path)
    rc, again = prune_cli(tmp_path, "--audit-window", "2")
    assert rc == 0 and pruned_rows(tmp_path) == rows and files(tmp_path) == before - {
        d for d, *_ in gone}
    assert "nothing to prune" in again and f"kept on disk: {kept} bytes" in again

    rc, narrower = prune_cli(tmp_path, "--audit-window", "1", "--run", RUN)
    assert rc == 0 and len(pruned_rows(tmp_path)) > len(rows)
    assert played.reveals[played.failed] in files(tmp_path)


def test_a_prune_cut_short_after_recording_deletes_without_recording_twice(tmp_path):
    """Rows are written before files go: after a crash in between, the next prune deletes
    the recorded files and records each once."""
    from sqlalchemy.orm import sessionmaker
    from veritrain.ledger.blobs import BlobStore
    from veritrain.ledger.retention import plan, prune, record_batch
    from veritrain.ledger.store import make_engine

    identity, played = copy_played(tmp_path)
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    migrate.upgrade(engine)
    sessions = sessionmaker(engine, expire_on_commit=False)
    blobs = BlobStore(tmp_path / "ledger" / "blobs", owner=False)
    policy = RetentionPolicy(2)
    try:
        with sessions() as s:
            todo = plan(s, blobs, policy)
        assert record_batch(sessions, todo.candidates[:3], policy, 1.0) == 3  # then a crash
        assert all(on_disk(tmp_path, c.sha256) for c in todo.candidates)
        report = prune(sessions, blobs, policy)
    finally:
        engine.dispose()
    gone = expected_pruned(played, 2)
    assert {(d, k, r, w) for d, k, r, w, _, _ in pruned_rows(tmp_path)} == gone
    assert report.recorded == len(gone) - 3 and len(report.deleted) == len(gone)
    assert not any(on_disk(tmp_path, d) for d, *_ in gone)


ledger_url = make_fixture()


def test_prune_on_each_database(ledger_url, tmp_path):
    """The policy's queries on SQLite and PostgreSQL: rounds played through the store, their
    files written, then pruned with window 1 (the models of rounds 1 and 2 go)."""
    from sqlalchemy import select
    from veritrain.ledger import schema as t
    from veritrain.ledger.blobs import BlobStore
    from veritrain.ledger.retention import prune, usage

    store = make_store(ledger_url)
    try:
        run = quick_run("db-run")
        played = play_run(store, run, [HONEST, HONEST], 4)
        blobs = BlobStore(tmp_path / "blobs")
        datas = [run.dataset, run.genesis] + [
            f"{name} db-run {r + 1}".encode()
            for r in range(4) for name in ("model", "outer_state", "update")] + [
            f"payload {r} {w}".encode() for r in range(4) for w in played.workers]
        for data in datas:
            blobs.put(data)
        report = prune(store.sessions, blobs, RetentionPolicy(1))
        again = prune(store.sessions, blobs, RetentionPolicy(1))
        with store.sessions() as s:
            rows = {(p.sha256, p.kind, p.round) for p in s.execute(select(t.PrunedBlob)).scalars()}
            total = usage(s).total
    finally:
        store.engine.dispose()

    def digest(name: str, r: int) -> str:
        return hashlib.sha256(f"{name} db-run {r}".encode()).hexdigest()

    gone = {(digest(name, r), name, r) for r in (1, 2) for name in ("model", "outer_state")}
    assert rows == gone and report.freed == sum(len(f"{n} db-run {r}") for _, n, r in gone)
    assert again.deleted == [] and again.freed == 0
    assert total == sum(map(len, datas)) - report.freed
    assert not any(blobs.exists(d) for d, _, _ in gone)


def test_prune_command_without_a_ledger_directory_says_so(tmp_path, capsys):
    from veritrain.cli import main

    assert main(["ledger", "prune", "--data-dir", str(tmp_path / "nothing")]) == 1
    assert "holds no ledger blobs" in capsys.readouterr().err


def test_keep_blobs_keeps_everything(tmp_path):
    identity, played = copy_played(tmp_path)
    before = files(tmp_path)

    async def scenario(api: Api, played: Played) -> Any:
        assert api.server.app.get(PRUNER) is None
        return (await api.get(f"/v1/runs/{RUN}/pruned"))[1]

    page = serve_copy(tmp_path, scenario, RetentionPolicy(0, keep_blobs=True))
    assert page["pruned"] == [] and files(tmp_path) == before
    assert set(played.reveals.values()) <= before


def test_serve_options_set_the_retention_policy(tmp_path, monkeypatch):
    from veritrain.ledger import serve

    from veritrain import cli

    configs = []

    async def fake_serve(config, host, port, ready_file):
        configs.append(config)

    monkeypatch.setattr(serve, "serve", fake_serve)
    for argv in ([], ["--audit-window", "5"], ["--keep-blobs"]):
        assert cli.main(["ledger", "serve", "--data-dir", str(tmp_path), *argv]) == 0
    assert [c.retention for c in configs] == [RetentionPolicy(2), RetentionPolicy(5),
                                              RetentionPolicy(2, keep_blobs=True)]


def test_migration_adds_and_removes_the_pruned_blobs_table(tmp_path):
    from sqlalchemy import create_engine, inspect

    engine = create_engine(f"sqlite:///{tmp_path / 'm.sqlite'}")
    try:
        migrate.upgrade(engine)
        assert "pruned_blobs" in inspect(engine).get_table_names()
        migrate.downgrade(engine, "0008")
        assert "pruned_blobs" not in inspect(engine).get_table_names()
        migrate.upgrade(engine)
        assert {c["name"] for c in inspect(engine).get_columns("pruned_blobs")} == {
            "run_id", "sha256", "kind", "round", "worker", "size", "pruned_at", "policy"}
    finally:
        engine.dispose()



def test_a_file_a_round_of_another_run_still_needs_is_kept(tmp_path):
    """Blobs are shared by content: a reveal of another run's round still in its window
    (here a closed, unjudged round) keeps its file even when the same bytes are an expired
    reveal of this run. Otherwise validators would find a receipted reveal gone and
    certify nothing (specs/protocol.md 7.5 step 3)."""
    copy_played(tmp_path)
    _, _, played = played_once()
    shared = sorted(d for d, kind, *_ in expected_pruned(played, 2) if kind == "reveal")[0]
    with sqlite3.connect(tmp_path / "ledger.sqlite") as conn:
        conn.execute("INSERT INTO runs SELECT 'other-run', organiser, spec, created_at, status "
                     "FROM runs WHERE run_id = ?", (RUN,))
        conn.execute("INSERT INTO rounds (run_id, round, status, base_model_hash, opened_at, "
                     "deadline, extensions) VALUES ('other-run', 0, 'closed', 'aa', 0, 1, 0)")
        conn.execute("INSERT INTO spot_reveals (run_id, round, worker, digest, envelope, "
                     "reveal_hash, size, received_at, receipt) VALUES ('other-run', 0, 'w', "
                     "'dd', x'00', ?, 1, 0, x'00')", (shared,))

    async def scenario(api: Api, played: Played) -> None:
        pass

    serve_copy(tmp_path, scenario, RetentionPolicy(2))
    pruned = {d for d, *_ in pruned_rows(tmp_path)}
    assert pruned == {d for d, *_ in expected_pruned(played, 2)} - {shared}
    assert on_disk(tmp_path, shared)


def test_a_voided_round_s_files_go_once_out_of_the_window(tmp_path):
    """Round 1's three validators certify three different states: it is voided, and no
    certificate will ever take its results' models, outer states or its reveal files.
    Once the window has passed it (window 1: rounds 2 and 3 finalized after it), they
    are recorded and deleted like a finalized round's; the updates and payloads stay,
    and the audit passes and counts them."""
    run = quick_run("void-run", n_validators=3, quorum=2)
    worker = Identity.generate("worker")
    w = worker.public_key.hex()
    validators = run.validators
    models: dict[int, list[bytes]] = {0: [b"M0"] * 2, 1: [b"M-a", b"M-b", b"M-c"],
                                      2: [b"M2"] * 2, 3: [b"M3"] * 2}
    path = "/v1/runs/void-run/rounds"

    async def scenario(api: Api) -> dict[str, Any]:
        assert (await api.create_run(run))[0] == 201
        assert (await api.register(run, worker))[0] == 200
        base, reveals, statuses = run.spec.genesis_model_hash, {}, {}
        for r in range(4):
            payload = f"payload {r}".encode()
            sub = synthetic_submission(run, worker, payload, round_index=r, base=base)
            assert (await api.submit(sub, payload))[0] == 201
            for _ in range(600):
                if (await api.get(f"{path}/{r}"))[1]["status"] == "closed":
                    break
                await asyncio.sleep(0.02)
            fixed = None
            for v in validators[:2]:
                fixed = (await post_share(api, run, v, r))["beacon"]
            for c in (await api.get(f"{path}/{r}/challenges"))[1]["challenges"]:
                if c["due"]:
                    data = reveal_data(r, w)
                    envelope = SpotReveal(run_id="void-run", round=r, worker=w,
                                          submission_digest=sub.digest,
                                          reveal_hash=hashlib.sha256(data).hexdigest(),
                                          reveal_bytes=len(data), created_at=1)
                    status, body = await api.post_parts(f"{path}/{r}/reveals", [
                        ("envelope", sign(worker, envelope).encode()), ("reveal", data)])
                    assert status == 201, body
                    reveals[r] = envelope.reveal_hash
            for v, model in zip(validators, models[r], strict=False):
                status, body = await post_result(api, run, v, r, base, beacon_seed_of(fixed),
                                                 [verdict(worker, sub.digest, True)],
                                                 {w: 1.0}, model)
                assert status == 201, body
            for _ in range(600):
                statuses[r] = (await api.get(f"{path}/{r}"))[1]["status"]
                if statuses[r] in ("finalized", "voided"):
                    break
                await asyncio.sleep(0.02)
            if statuses[r] == "finalized":
                base = hashlib.sha256(models[r][0]).hexdigest()
        await api.server.app[PRUNER].settle()
        pruned = (await api.get("/v1/runs/void-run/pruned"))[1]["pruned"]
        async with LedgerClient(api.url) as client:
            audit = await fetch_and_verify(client, "void-run")
            key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
            rows = await fetch_events(client, "void-run")
        # The chain as it stood before round 1 was voided: the same pruned list names a
        # reveal file of a round that was not settled then.
        cut = next(i for i, row in enumerate(rows) if row.kind == "round_voided")
        before_void = verify_log(rows[:cut], key, pruned=pruned)
        return {"statuses": statuses, "reveals": reveals, "pruned": pruned, "audit": audit,
                "before_void": before_void}

    out = run_api(tmp_path, scenario, retention=RetentionPolicy(1), ip_rate=0, key_rate=0)
    assert out["statuses"] == {0: "finalized", 1: "voided", 2: "finalized", 3: "finalized"}
    assert 1 in out["reveals"], "round 1 has a reveal file to prune"

    def sha(data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()

    voided_files = ({(sha(m), "model") for m in models[1]}
                    | {(sha(b"momentum " + m), "outer_state") for m in models[1]}
                    | {(out["reveals"][1], "reveal")})
    listed = {(p["sha256"], p["kind"]) for p in out["pruned"] if p["round"] == 1}
    assert listed == voided_files
    assert all(not on_disk(tmp_path, d) for d, _ in voided_files)
    # The updates and payloads of the voided round stay; so do round 3's base and files.
    assert all(on_disk(tmp_path, sha(b"update " + m)) for m in models[1])
    assert on_disk(tmp_path, sha(b"payload 1"))
    assert on_disk(tmp_path, sha(b"M2")) and on_disk(tmp_path, out["reveals"][3])
    assert out["audit"].ok, out["audit"].to_json()
    assert out["audit"].pruned_blobs == len(out["pruned"]) >= len(voided_files)
    early = out["before_void"]
    assert not early.ok and early.bad_pruned is not None and "not settled" in early.bad_pruned
