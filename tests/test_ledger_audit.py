"""`veritrain audit verify`: from the live API or an export file, it checks the chain,
the checkpoints, every signature and certificate, and names the first row that fails."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import shutil
import sqlite3
import tempfile
from functools import cache
from pathlib import Path

import pytest
from ledger_harness import run_api
from ledger_scenarios import (
    COPIER,
    FREE_RIDER,
    HONEST,
    SPOT_FAIL,
    make_store,
    play_run,
    quick_run,
    rechain,
)
from veritrain.ledger import verify
from veritrain.ledger.audit import run_audit, verify_events, verify_export_file
from veritrain.ledger.chain import ChainRow
from veritrain.ledger.export import ExportError, read_export_file
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.identity import Identity

RUN = "audit-run"


@cache
def played() -> tuple[Path, Identity]:
    """Three finalized rounds with honest workers, a free rider, a copier and a worker that
    fails its spot check (banned), stored in a SQLite file that tests copy and tamper with."""
    tmp = Path(tempfile.mkdtemp(prefix="audit-"))
    store = make_store(f"sqlite:///{tmp / 'ledger.sqlite'}")
    play_run(store, quick_run(RUN), [HONEST, HONEST, FREE_RIDER, COPIER, SPOT_FAIL], 3)
    store.engine.dispose()
    return tmp / "ledger.sqlite", store.identity


def copy_db(tmp_path: Path) -> tuple[Path, Identity]:
    src, identity = played()
    dst = tmp_path / "ledger.sqlite"
    shutil.copy(src, dst)
    return dst, identity


def rows_of(db: Path) -> list[ChainRow]:
    with sqlite3.connect(db) as conn:
        return [ChainRow(seq, RUN, kind, bytes(body), prev, h, sig) for seq, kind, body, prev, h,
                sig in conn.execute(
                    "SELECT e.seq, e.kind, e.body, e.prev_hash, e.hash, c.signature FROM events e "
                    "LEFT JOIN checkpoints c ON c.run_id = e.run_id AND c.seq = e.seq "
                    "WHERE e.run_id = ? ORDER BY e.seq", (RUN,))]


def first(rows: list[ChainRow], kind: str, nth: int = 0) -> int:
    return [i for i, r in enumerate(rows) if r.kind == kind][nth]


def edit_body(row: ChainRow, change) -> ChainRow:
    body = decode_canonical(row.body)
    change(body)
    return dataclasses.replace(row, body=encode_canonical(body))


def audit_cli(**kwargs) -> tuple[int, dict]:
    args = argparse.Namespace(**{"ledger": None, "run": None, "what": "verify", "arg": None,
                                 "json": True, "export": None, "full": False, "save": None,
                                 **kwargs})
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        import asyncio

        rc = asyncio.run(run_audit(args))
    return rc, json.loads(out.getvalue())


# ----------------------------------------------------------------------------- untouched


def test_played_run_verifies_in_fast_mode():
    db, identity = played()
    result = verify_events(rows_of(db), identity.public_key)
    assert result.ok, result.problem
    assert result.certificates == 3 and result.unsigned_tail == 0
    assert result.covered_by_certificates == result.kinds["submission"]
    # Only the few rows no certificate covers have their signatures checked one by one.
    assert result.signatures == result.kinds["registration"] + result.kinds["round_result"] \
        + result.kinds["beacon_share"] + 1


def test_full_mode_checks_every_signature_in_parallel(monkeypatch):
    db, identity = played()
    monkeypatch.setattr(verify, "PARALLEL_MIN_ROWS", 1)  # use the process pool even here
    result = verify_events(rows_of(db), identity.public_key, full=True, processes=2)
    assert result.ok, result.problem
    assert result.mode == "full"
    assert result.signatures >= result.kinds["submission"] + result.kinds["receipt"]


# ----------------------------------------------------------------------------- tampering


@pytest.mark.parametrize("kind", ["submission", "receipt", "round_result", "round_finalized",
                                  "registration"])
def test_invalid_row_edited_in_the_sqlite_file_is_named_by_audit_verify(tmp_path, kind):
    db, identity = copy_db(tmp_path)
    target = rows_of(db)[first(rows_of(db), kind, -1)]
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE events SET body = ? WHERE run_id = ? AND seq = ?",
                     (target.body.replace(b'"round":', b'"round":1', 1) if b'"round":' in
                      target.body else target.body + b" ", RUN, target.seq))

    async def scenario(api):
        import asyncio

        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: audit_cli(ledger=api.url))

    rc, report = run_api(tmp_path, scenario, db_url=f"sqlite:///{db}", identity=identity)
    assert rc == 1 and not report["ok"]
    assert report["first_bad_seq"] == target.seq
    assert "hash does not match" in report["problem"]


def _served_and_audited(tmp_path, db, identity):
    """What the ledger serves from ``db`` (status of each read) and what the audit finds,
    live and offline on the export it serves."""

    async def scenario(api):
        import asyncio

        statuses = {}
        for path in (f"/v1/runs/{RUN}/events?after=-1&limit=1000", f"/v1/runs/{RUN}/report",
                     f"/runs/{RUN}", f"/v1/runs/{RUN}/export"):
            async with api.session.get(api.url + path) as resp:
                statuses[path.split("?")[0]] = resp.status
                body = await resp.read()
        (tmp_path / "served.jsonl").write_bytes(body)
        live = await asyncio.get_running_loop().run_in_executor(
            None, lambda: audit_cli(ledger=api.url))
        return statuses, live

    statuses, live = run_api(tmp_path, scenario, db_url=f"sqlite:///{db}", identity=identity)
    return statuses, live, audit_cli(export=str(tmp_path / "served.jsonl"))


@pytest.mark.parametrize("replacement", ["'\"received_At\":'",  # still ASCII
                                         "'\"received_at\":' || char(233)",  # UTF-8 text
                                         "'\"received_at\":' || CAST(X'FF' AS TEXT)"])
def test_invalid_body_rewritten_as_text_by_sqlite_replace_is_named(tmp_path, replacement):
    """``replace()`` in sqlite3 stores the body back as TEXT (the issue's case: the ledger
    answered 500 on it); the ledger serves the stored bytes as they are, and the audit,
    live and on the export, names the row."""
    db, identity = copy_db(tmp_path)
    target = rows_of(db)[first(rows_of(db), "receipt", 1)]
    with sqlite3.connect(db) as conn:
        conn.execute(f"UPDATE events SET body = replace(body, '\"received_at\":', "
                     f"{replacement}) WHERE run_id = ? AND seq = ?", (RUN, target.seq))
        assert conn.execute("SELECT typeof(body) FROM events WHERE run_id = ? AND seq = ?",
                            (RUN, target.seq)).fetchone() == ("text",)
    statuses, (rc, live), (rc_file, offline) = _served_and_audited(tmp_path, db, identity)
    assert set(statuses.values()) == {200}, statuses
    for code, report in ((rc, live), (rc_file, offline)):
        assert code == 1 and report["first_bad_seq"] == target.seq, report
        assert "hash does not match" in report["problem"]


def test_bodies_stored_as_text_with_unchanged_bytes_still_verify(tmp_path):
    """A replace() that matches nothing leaves every body as TEXT with the same bytes: the
    rows read back as the same bytes, so the chain still verifies."""
    db, identity = copy_db(tmp_path)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE events SET body = replace(body, 'no such text', '')")
        assert conn.execute("SELECT count(*) FROM events WHERE typeof(body) = 'blob'"
                            ).fetchone() == (0,)
    statuses, (rc, live), (rc_file, offline) = _served_and_audited(tmp_path, db, identity)
    assert set(statuses.values()) == {200}, statuses
    assert rc == 0 and live["ok"] and rc_file == 0 and offline["ok"]


class ServedRows:
    """A ledger client that serves the given event dicts (one page) and no verdicts."""

    def __init__(self, events, ledger_key: bytes) -> None:
        self.events, self.key = events, ledger_key

    async def get_json(self, path):
        if path == "/v1/ledger":
            return {"ledger_key": self.key.hex()}
        if "/events" in path:
            return {"events": self.events if "after=-1&" in path else []}
        return {"verdicts": [], "next_offset": None}


@pytest.mark.parametrize("damage", [
    lambda e: e.update(body="\u0100" + e["body"]),  # no byte is above U+00FF
    lambda e: e.pop("hash"),
    lambda e: e.update(seq="7"),
    lambda e: e.update(body=None),
])
def test_invalid_served_row_that_is_no_row_is_named(damage):
    import asyncio

    from veritrain.ledger.audit import fetch_and_verify

    db, identity = played()
    served = [{"seq": r.seq, "kind": r.kind, "prev_hash": r.prev_hash, "hash": r.hash,
               "checkpoint": r.checkpoint, "body": r.body.decode()} for r in rows_of(db)]
    good = asyncio.run(fetch_and_verify(ServedRows(served, identity.public_key), RUN))
    assert good.first_bad_seq is None, good.problem  # (no verdict rows served here)
    damage(served[7])
    result = asyncio.run(fetch_and_verify(ServedRows(served, identity.public_key), RUN))
    assert result.first_bad_seq == 7 and "cannot read the row" in result.problem


def test_invalid_verdict_row_edited_in_the_sqlite_file_is_named(tmp_path):
    db, identity = copy_db(tmp_path)
    with sqlite3.connect(db) as conn:
        worker = conn.execute("SELECT worker FROM verdicts WHERE round = 1 AND status = "
                              "'rejected' LIMIT 1").fetchone()[0]
        conn.execute("UPDATE verdicts SET reward = 42.0 WHERE round = 1 AND worker = ?",
                     (worker,))

    async def scenario(api):
        import asyncio

        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: audit_cli(ledger=api.url))

    rc, report = run_api(tmp_path, scenario, db_url=f"sqlite:///{db}", identity=identity)
    assert rc == 1 and report["first_bad_seq"] is None
    assert "round 1" in report["bad_view_row"] and worker[:16] in report["bad_view_row"]
    assert "reward" in report["bad_view_row"]


def test_invalid_history_rewritten_with_the_ledgers_own_key_is_caught():
    """The operator changes a certified submission and re-signs the whole chain: the
    validators' certificate still names the original digest."""
    db, identity = played()
    rows = rows_of(db)
    i = first(rows, "submission", 1)
    rows[i] = edit_body(rows[i], lambda b: b["body"].update(loss_last=0.01))
    closed = first(rows, "round_closed")
    rows[closed] = edit_body(rows[closed], lambda b: b.update(
        submissions=sorted(__import__("hashlib").sha256(r.body).hexdigest()
                           for r in rows[:closed] if r.kind == "submission")))
    result = verify_events(rechain(rows, identity), identity.public_key)
    # The certificate does not cover the new digest (round_finalized fails), so the
    # submission's own signature is checked, and it is the first row that fails.
    assert result.first_bad_seq == i
    assert "signature does not verify" in result.problem
    rows[i] = rows_of(db)[i]  # the untouched submission, with the rewritten sealed list:
    result = verify_events(rechain(rows, identity), identity.public_key)
    assert result.first_bad_seq == closed and "sealed list" in result.problem


def test_invalid_beacon_share_naming_another_sealed_list_is_named():
    """A share whose validator saw another list than the chain's sealed one: the list
    was changed around the beacon (the ledger refuses such shares when posted)."""
    from fakes import validator_identities
    from veritrain.protocol.messages import BeaconShare, sign

    db, identity = played()
    rows = rows_of(db)
    i = first(rows, "beacon_share")
    wire = decode_canonical(rows[i].body)
    signer = next(v for v in validator_identities(4) if v.public_key.hex() == wire["signer"])
    resigned = sign(signer, BeaconShare(**{**wire["body"], "sealed": "ab" * 32}))
    rows[i] = dataclasses.replace(rows[i], body=resigned.encode())
    result = verify_events(rechain(rows, identity), identity.public_key)
    assert result.first_bad_seq == i and "sealed list" in result.problem


def test_invalid_beacon_fixed_without_its_signers_logged_shares_is_named():
    """A ledger that leaves a signer's beacon_share out of the chain (so the audit would
    never see which list that validator named) cannot fix a beacon from it."""
    db, identity = played()
    rows = rows_of(db)
    i = first(rows, "beacon_share")
    fixed = first(rows, "beacon_fixed")
    rows = rows[:i] + rows[i + 1:]
    rows = [dataclasses.replace(r, seq=k) for k, r in enumerate(rows)]
    result = verify_events(rechain(rows, identity), identity.public_key)
    assert result.first_bad_seq == fixed - 1 and "logged beacon_share" in result.problem


def test_invalid_forged_certificate_is_named_among_batched_ones():
    db, identity = played()
    rows = rows_of(db)
    fin = [i for i, r in enumerate(rows) if r.kind == "round_finalized"]
    other = decode_canonical(rows[fin[0]].body)["certificate"]["signature"]
    rows[fin[1]] = edit_body(rows[fin[1]], lambda b: b["certificate"].update(signature=other))
    result = verify_events(rechain(rows, identity), identity.public_key)
    assert result.first_bad_seq == fin[1]
    assert "aggregate signature" in result.problem


def test_invalid_receipt_signature_needs_full_mode():
    """Fast mode trusts the ledger's own receipts through its checkpoint; full checks them."""
    db, identity = played()
    rows = rows_of(db)
    i = first(rows, "receipt", 2)
    rows[i] = edit_body(rows[i], lambda b: b.update(signature="ab" * 64))
    forged = rechain(rows, identity)
    assert verify_events(forged, identity.public_key).ok
    full = verify_events(forged, identity.public_key, full=True, processes=1)
    assert full.first_bad_seq == i and "signature" in full.problem


def test_invalid_checkpoint_by_another_key_is_named():
    db, identity = played()
    rows = rows_of(db)
    result = verify_events(rechain(rows, Identity.generate("ledger")), identity.public_key)
    assert result.first_bad_seq == min(r.seq for r in rows if r.checkpoint is not None)
    assert "checkpoint" in result.problem


def test_rows_after_the_last_checkpoint_are_reported_not_trusted():
    db, identity = played()
    rows = rows_of(db)
    cut = [dataclasses.replace(r, checkpoint=None) if r.seq > 20 else r for r in rows]
    result = verify_events(cut, identity.public_key)
    assert result.ok and result.unsigned_tail == len(rows) - 1 - max(
        r.seq for r in cut if r.checkpoint is not None)


# ----------------------------------------------------------------------------- export file


def test_export_file_verifies_offline_and_names_an_edited_line(tmp_path):
    db, identity = copy_db(tmp_path)

    async def scenario(api):
        async with api.session.get(f"{api.url}/v1/runs/{RUN}/export") as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("application/x-ndjson")
            return await resp.read()

    data = run_api(tmp_path, scenario, db_url=f"sqlite:///{db}", identity=identity)
    path = tmp_path / "run.jsonl"
    path.write_bytes(data)
    exported = read_export_file(path)
    assert exported.header["head"]["seq"] == exported.rows[-1].seq
    assert len(exported.verdicts) == 13
    rc, report = audit_cli(export=str(path))
    assert rc == 0 and report["ok"] and report["view_rows"] == 13

    lines = data.splitlines(keepends=True)
    k = next(n for n, line in enumerate(lines) if b'"kind":"receipt"' in line)
    seq = json.loads(lines[k])["seq"]
    lines[k] = lines[k].replace(b'received_at', b'received_At', 1)
    path.write_bytes(b"".join(lines))
    result = verify_export_file(path)
    assert result.first_bad_seq == seq and "hash" in result.problem

    vline = next(n for n, line in enumerate(lines) if b'"type":"verdict"' in line
                 and b'"status":"accepted"' in line)
    fixed = data.splitlines(keepends=True)
    fixed[vline] = fixed[vline].replace(b'"score":80.0', b'"score":81.0')
    path.write_bytes(b"".join(fixed))
    assert "score" in (verify_export_file(path).bad_view_row or "")


def test_invalid_truncated_export_is_refused(tmp_path):
    db, identity = copy_db(tmp_path)

    async def scenario(api):
        async with api.session.get(f"{api.url}/v1/runs/{RUN}/export") as resp:
            return await resp.read()

    data = run_api(tmp_path, scenario, db_url=f"sqlite:///{db}", identity=identity)
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b"".join(data.splitlines(keepends=True)[:-5]))
    with pytest.raises(ExportError, match="truncated"):
        read_export_file(path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        import asyncio

        rc = asyncio.run(run_audit(argparse.Namespace(
            ledger=None, run=None, what="verify", arg=None, json=False, export=str(path),
            full=False, save=None)))
    assert rc == 1 and out.getvalue().startswith("FAILED")


def test_fast_mode_on_a_process_pool_names_the_same_row(monkeypatch):
    db, identity = played()
    rows = rows_of(db)
    fin = [i for i, r in enumerate(rows) if r.kind == "round_finalized"]
    other = decode_canonical(rows[fin[0]].body)["certificate"]["signature"]
    rows[fin[2]] = edit_body(rows[fin[2]], lambda b: b["certificate"].update(signature=other))
    forged = rechain(rows, identity)
    monkeypatch.setattr(verify, "PARALLEL_MIN_ROWS", 1)
    pooled = verify_events(forged, identity.public_key, processes=2)
    assert pooled.first_bad_seq == fin[2] and "aggregate signature" in pooled.problem
    assert verify_events(rows_of(db), identity.public_key, processes=2).ok


def test_penalties_must_forfeit_certified_unvested_rewards(tmp_path):
    """A worker honest in rounds 0-1 fails its spot check in round 2: the ledger forfeits
    its unvested rewards (penalty rows); the audit checks each against the certificates."""
    store = make_store(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    play_run(store, quick_run(RUN), [HONEST, HONEST, HONEST], 3, turns={2: (2, SPOT_FAIL)})
    store.engine.dispose()
    rows = rows_of(tmp_path / "ledger.sqlite")
    assert verify_events(rows, store.identity.public_key).ok
    penalties = [i for i, r in enumerate(rows) if r.kind == "penalty"]
    assert penalties, "the scenario should forfeit something"
    i = penalties[0]
    rows[i] = edit_body(rows[i], lambda b: b.update(amount=b["amount"] * 2))
    result = verify_events(rechain(rows, store.identity), store.identity.public_key)
    assert result.first_bad_seq == i and "penalty" in result.problem
