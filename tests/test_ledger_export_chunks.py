"""The offline audit of an export file read in byte ranges (one process each, joined at the
range boundaries) gives the answer of the line-by-line reader: the same counts and totals,
the same first bad row and problem, the same bad verdict row; a file that is not exactly in
the ledger's layout is read line by line instead."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import tempfile
from functools import cache
from pathlib import Path

import pytest
from fakes import make_submission
from ledger_scenarios import (
    COPIER,
    FREE_RIDER,
    HONEST,
    SPOT_FAIL,
    make_store,
    play_run,
    quick_run,
    rechain,
    register,
)
from veritrain.ledger import audit, verify
from veritrain.ledger.audit import verify_export_chunks
from veritrain.ledger.chain import ChainRow
from veritrain.ledger.export import ExportError, export_lines, line_ranges, read_export_file
from veritrain.protocol.identity import Identity

RUN = "chunk-run"


def _export(store) -> bytes:
    with store.sessions() as s:
        data = b"".join(export_lines(s, RUN, store.identity.public_key.hex()))
    store.engine.dispose()
    return data


@cache
def played() -> tuple[bytes, Identity]:
    """Three finalized rounds (certificates, verdict rows, a ban and its spot check)."""
    store = make_store(f"sqlite:///{Path(tempfile.mkdtemp(prefix='chunks-')) / 'l.sqlite'}")
    play_run(store, quick_run(RUN), [HONEST, HONEST, FREE_RIDER, COPIER, SPOT_FAIL], 3)
    store.checkpointer.sign_pending(store.sessions)
    return _export(store), store.identity


@cache
def open_round() -> tuple[bytes, Identity]:
    """Submissions in a round no certificate covers yet: their own signatures are checked,
    so the chunked audit reads their rows again from the file."""
    store = make_store(f"sqlite:///{Path(tempfile.mkdtemp(prefix='chunks-')) / 'l.sqlite'}")
    run = quick_run(RUN)
    for data, kind in ((run.dataset, "dataset"), (run.genesis, "model")):
        store.record_blob(hashlib.sha256(data).hexdigest(), len(data), kind, RUN)
    store.create_run(run.signed)
    workers = [Identity.generate("worker") for _ in range(6)]
    for w in workers:
        register(store, run, w)
    for w in workers[:4]:
        payload = b"update of " + w.public_key
        digest = hashlib.sha256(payload).hexdigest()
        store.record_blob(digest, len(payload), "payload", RUN, 0)
        store.accept_submission(make_submission(run, w, payload), digest, len(payload))
    store.checkpointer.sign_pending(store.sessions)
    return _export(store), store.identity


LOGS = {"played": played, "open_round": open_round}


def sequential(path: Path) -> dict:
    exported = read_export_file(path)
    return verify.verify_log(exported.rows, exported.ledger_key,
                             views=exported.verdicts).to_json()


def chunked(path: Path, processes: int, chunk_bytes: int | None) -> dict:
    result = verify_export_chunks(path, processes=processes, chunk_bytes=chunk_bytes)
    assert result is not None, "a file in the ledger's layout is read in chunks"
    return result.to_json()


def lines_of(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True)


def write_rows(path: Path, data: bytes, rows: list[ChainRow]) -> None:
    """The export ``data`` with its event lines replaced by ``rows``."""
    out = []
    rows_iter = iter(rows)
    for line in lines_of(data):
        if line.startswith(b'{"type":"event"'):
            r = next(rows_iter)
            line = json.dumps({"type": "event", "seq": r.seq, "kind": r.kind,
                               "prev_hash": r.prev_hash, "hash": r.hash,
                               "checkpoint": r.checkpoint, "body": r.body.decode()},
                              separators=(",", ":")).encode() + b"\n"
        out.append(line)
    path.write_bytes(b"".join(out))


def event_rows(data: bytes) -> list[ChainRow]:
    return [ChainRow(o["seq"], RUN, o["kind"], o["body"].encode(), o["prev_hash"], o["hash"],
                     o["checkpoint"])
            for o in map(json.loads, lines_of(data)) if o["type"] == "event"]


def boundary_rows(path: Path, chunk_bytes: int) -> list[int]:
    """The seq of the first and last event row of every range the file is cut into."""
    data = path.read_bytes()
    header = len(lines_of(data)[0])
    starts = [a for a, _ in line_ranges(path, header, len(data), len(data) // chunk_bytes + 1,
                                        chunk_bytes)]
    seqs, offset = [], header
    for line in lines_of(data)[1:]:
        if line.startswith(b'{"type":"event"') and (offset in starts or offset + len(line)
                                                     in starts):
            seqs.append(json.loads(line)["seq"])
        offset += len(line)
    return sorted(set(seqs))


# ----------------------------------------------------------------------------- untouched


@pytest.mark.parametrize("log", sorted(LOGS))
@pytest.mark.parametrize("processes,chunk_bytes", [(1, None), (1, 1500), (2, 2500), (2, None)])
def test_chunks_give_the_line_by_line_result(tmp_path, monkeypatch, log, processes,
                                             chunk_bytes):
    monkeypatch.setattr(audit, "PARALLEL_MIN_BYTES", 0)  # a pool even for a small file
    data, _ = LOGS[log]()
    path = tmp_path / "run.jsonl"
    path.write_bytes(data)
    want = sequential(path)
    assert want["ok"], want
    assert chunked(path, processes, chunk_bytes) == want
    assert audit.verify_export_file(path, processes=processes).to_json() == want


def test_verdict_lines_are_compared_as_the_lines_the_certificates_imply(tmp_path, monkeypatch):
    """An untouched file needs no field-by-field comparison: the lines the certified
    results imply are byte for byte the ones the ledger wrote."""
    data, _ = played()
    path = tmp_path / "run.jsonl"
    path.write_bytes(data)

    def refuse(*args, **kwargs):
        raise AssertionError("field-by-field comparison on an untouched file")

    monkeypatch.setattr(audit, "check_views", refuse)
    result = chunked(path, 1, 2000)
    assert result["ok"] and result["view_rows"] == data.count(b'{"type":"verdict"')


def test_uncovered_submissions_are_read_again_from_their_lines(tmp_path):
    data, identity = open_round()
    rows = event_rows(data)
    subs = [i for i, r in enumerate(rows) if r.kind == "submission"]
    path = tmp_path / "run.jsonl"
    path.write_bytes(data)
    assert chunked(path, 1, 1500)["signatures"] == 1 + 6 + 4  # spec, registrations, subs
    # A submission signed by nobody, re-chained and re-checkpointed by the ledger's key:
    # only its own signature, read again from the file, can tell.
    k = subs[2]
    wire = json.loads(rows[k].body)
    wire["signature"] = ("0" if wire["signature"][0] != "0" else "1") + wire["signature"][1:]
    forged = list(rows)
    forged[k] = dataclasses.replace(rows[k], body=json.dumps(
        wire, sort_keys=True, separators=(",", ":")).encode())
    write_rows(path, data, rechain(forged, identity))
    want = sequential(path)
    assert want["first_bad_seq"] == k and "signature" in want["problem"]
    assert chunked(path, 1, 1500) == want
    assert chunked(path, 2, 2500) == want


# ----------------------------------------------------------------------------- tampering


def _flip_hex_in_body(line: bytes) -> bytes:
    """One hex digit of a row's body changed (the line stays well-formed JSON)."""
    at = line.index(b'"body":"') + 8
    for i in range(at + 40, len(line)):
        if line[i:i + 1] in b"0123456789abcdef" and line[i - 1:i] in b"0123456789abcdef":
            return line[:i] + (b"1" if line[i:i + 1] != b"1" else b"2") + line[i + 1:]
    raise AssertionError("no hex digit in the body")


@pytest.mark.parametrize("log", sorted(LOGS))
@pytest.mark.parametrize("edit", ["body", "prev_hash", "seq"])
def test_one_changed_byte_at_a_range_boundary_names_the_same_row(tmp_path, monkeypatch, log,
                                                                 edit):
    monkeypatch.setattr(audit, "PARALLEL_MIN_BYTES", 0)
    data, _ = LOGS[log]()
    path = tmp_path / "run.jsonl"
    path.write_bytes(data)
    chunk_bytes = 2500
    targets = boundary_rows(path, chunk_bytes)
    assert len(targets) >= 6
    middle = targets[len(targets) // 2 - 1: len(targets) // 2 + 2]  # in middle ranges
    for seq in [*middle, targets[-1]]:
        lines = lines_of(data)
        n = next(j for j, line in enumerate(lines) if line.startswith(
            b'{"type":"event","seq":%d,' % seq))
        if edit == "body":
            lines[n] = _flip_hex_in_body(lines[n])
        elif edit == "prev_hash":
            at = lines[n].index(b'"prev_hash":"') + 13
            lines[n] = lines[n][:at] + (b"f" if lines[n][at:at + 1] != b"f" else b"e") \
                + lines[n][at + 1:]
        else:
            lines[n] = lines[n].replace(b'"seq":%d,' % seq, b'"seq":%d,' % (seq + 7), 1)
        path.write_bytes(b"".join(lines))
        want = sequential(path)
        assert want["first_bad_seq"] == seq, (seq, want["problem"])
        for processes in (1, 2):
            assert chunked(path, processes, chunk_bytes) == want, (seq, edit, processes)


def test_an_edited_verdict_line_is_named(tmp_path):
    data, _ = played()
    lines = lines_of(data)
    n = next(j for j, line in enumerate(lines) if line.startswith(b'{"type":"verdict"')
             and b'"status":"accepted"' in line)
    lines[n] = lines[n].replace(b'"score":80.0', b'"score":81.0')
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"".join(lines))
    want = sequential(path)
    assert "score" in want["bad_view_row"]
    assert chunked(path, 1, 3000) == want
    assert chunked(path, 2, 3000) == want


@pytest.mark.parametrize("change", ["blank line", "data after the end", "crlf"])
def test_a_file_not_in_the_ledgers_layout_is_read_line_by_line(tmp_path, change):
    data, _ = played()
    lines = lines_of(data)
    if change == "blank line":
        lines.insert(len(lines) // 2, b"\n")
    elif change == "data after the end":
        lines.append(b"{}\n")
    else:
        lines = [line.replace(b"\n", b"\r\n") for line in lines]
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"".join(lines))
    assert verify_export_chunks(path, processes=1, chunk_bytes=2000) is None
    if change == "crlf":  # JSON lines all the same: the reader takes them
        assert audit.verify_export_file(path).ok
    else:
        with pytest.raises(ExportError):
            audit.verify_export_file(path)


def test_json_spacing_is_read_as_json(tmp_path):
    data, _ = played()
    lines = lines_of(data)
    lines[3] = lines[3].replace(b'","', b'", "', 1)  # between two members of an event line
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"".join(lines))
    assert chunked(path, 1, 2000) == sequential(path)
