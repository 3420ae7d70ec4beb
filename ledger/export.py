"""The audit export: one run's signed history as a JSON-lines file, and reading it back.

Line 1 is a header, then every event row up to the run's latest checkpoint
(so the whole file is vouched for by the ledger's signature), then the
verdict rows of the rounds those events finalize, then an end line with the
counts (a truncated file is refused)::

    {"type": "header", "format": "veritrain-ledger-export/1", "run_id": ..., "ledger_key": ...,
     "exported_at": ..., "head": {"seq": ..., "hash": ...}}
    {"type": "event", "seq": 0, "kind": "run_spec", "prev_hash": ..., "hash": ...,
     "checkpoint": null or signature hex, "body": "<the row's canonical body, as a string>"}
    {"type": "verdict", "round": ..., "worker": ..., "status": ..., ... , "reward": ...}
    {"type": "end", "events": N, "verdicts": M}

``veritrain audit verify --export FILE`` checks such a file offline.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from . import schema as t
from .chain import ChainRow, body_bytes, body_text
from .lists import VerdictFilter, iter_verdicts
from .store import NotFound
from .verify import Columns, Scan, Scanner, gc_paused

FORMAT = "veritrain-ledger-export/1"
PAGE = 2000


class ExportError(ValueError):
    """The file is not a complete, well-formed export."""


def head_checkpoint(s: Session, run_id: str) -> t.Checkpoint | None:
    return s.execute(select(t.Checkpoint).where(t.Checkpoint.run_id == run_id)
                     .order_by(t.Checkpoint.seq.desc()).limit(1)).scalar_one_or_none()


def sealed_from(s: Session, run_id: str) -> int | None:
    """The ``seq`` of the first submission row of the run's open round, or None: /events
    serves no row from there on until the round closes, so nobody reads an open round's
    envelopes (trail, losses, payload hash) there before its close (the signed export,
    the auditor's full copy, is the documented exception: ledger-api.md)."""
    opened = s.execute(select(t.Event.seq).where(
        t.Event.run_id == run_id, t.Event.kind == "round_opened")
        .order_by(t.Event.seq.desc()).limit(1)).scalar_one_or_none()
    if opened is None:
        return None
    rnd = s.execute(select(t.Round.status).where(t.Round.run_id == run_id)
                    .order_by(t.Round.round.desc()).limit(1)).scalar_one_or_none()
    if rnd != "open":
        return None
    return s.execute(select(t.Event.seq).where(
        t.Event.run_id == run_id, t.Event.kind == "submission", t.Event.seq > opened)
        .order_by(t.Event.seq).limit(1)).scalar_one_or_none()


def events_with_checkpoints(s: Session, run_id: str, after: int, limit: int,
                            upto: int | None = None) -> list[dict[str, Any]]:
    """Event rows with ``seq > after`` (at most ``limit``), each with its checkpoint or null."""
    q = (select(t.Event, t.Checkpoint.signature)
         .outerjoin(t.Checkpoint, (t.Checkpoint.run_id == t.Event.run_id)
                    & (t.Checkpoint.seq == t.Event.seq))
         .where(t.Event.run_id == run_id, t.Event.seq > after))
    if upto is not None:
        q = q.where(t.Event.seq <= upto)
    return [{"seq": e.seq, "kind": e.kind, "prev_hash": e.prev_hash, "hash": e.hash,
             "checkpoint": sig, "body": body_text(e.body)}
            for e, sig in s.execute(q.order_by(t.Event.seq).limit(limit)).all()]


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def export_lines(s: Session, run_id: str, ledger_key: str) -> Iterator[bytes]:
    """The export file of ``run_id``, line by line (read in pages from ``s``)."""
    if s.get(t.Run, run_id) is None:
        raise NotFound(f"no run {run_id!r}")
    head = head_checkpoint(s, run_id)
    upto = head.seq if head is not None else -1
    yield _line({"type": "header", "format": FORMAT, "run_id": run_id, "ledger_key": ledger_key,
                 "exported_at": time.time(),
                 "head": None if head is None else {"seq": head.seq, "hash": head.hash}})
    after, events = -1, 0
    while after < upto:
        page = events_with_checkpoints(s, run_id, after, PAGE, upto)
        if not page:
            break
        for e in page:
            yield _line({"type": "event", **e})
        events += len(page)
        after = page[-1]["seq"]
    # Verdict rows are written in the transaction that appends round_finalized, so the
    # rounds finalized by the exported events are exactly the ones to include.
    max_round = last_finalized_round(s, run_id, upto)
    verdicts = 0
    if max_round is not None:
        for v in iter_verdicts(s, run_id, VerdictFilter(), max_round=max_round):
            yield _line({"type": "verdict", **v})
            verdicts += 1
    yield _line({"type": "end", "events": events, "verdicts": verdicts})


def last_finalized_round(s: Session, run_id: str, upto: int) -> int | None:
    """The last round whose round_finalized row is at or before ``seq = upto``.

    A damaged row (one that no longer parses) is passed over: the export still serves
    it, and the audit of the file names it.
    """
    while True:
        rows = s.execute(select(t.Event.seq, t.Event.body).where(
            t.Event.run_id == run_id, t.Event.kind == "round_finalized", t.Event.seq <= upto)
            .order_by(t.Event.seq.desc()).limit(16)).all()
        if not rows:
            return None
        for _, body in rows:
            try:
                return int(json.loads(body)["round"])
            except (ValueError, KeyError, TypeError):
                continue
        upto = rows[-1][0] - 1


@dataclass
class ExportedRun:
    run_id: str
    ledger_key: bytes
    rows: list[ChainRow]
    verdicts: list[dict[str, Any]]
    header: dict[str, Any]


def parse_header(line: bytes | str) -> tuple[dict[str, Any], str, bytes]:
    """The header line: (header, run id, ledger key)."""
    try:
        header = json.loads(line)
    except ValueError as exc:
        raise ExportError("no export header") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ExportError(f"not a {FORMAT} file")
    run_id = str(header["run_id"])
    try:
        ledger_key = bytes.fromhex(header["ledger_key"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError("header has no ledger key") from exc
    return header, run_id, ledger_key


def read_export(lines: Iterable[bytes | str]) -> ExportedRun:
    """Parse an export; refuses a file without its header or end line."""
    it = iter(lines)
    try:
        first = next(it)
    except StopIteration as exc:
        raise ExportError("no export header") from exc
    header, run_id, ledger_key = parse_header(first)
    rows: list[ChainRow] = []
    verdicts: list[dict[str, Any]] = []
    end: dict[str, Any] | None = None
    loads = json.loads
    append = rows.append
    for n, raw in enumerate(it, start=2):
        if end is not None:
            raise ExportError(f"line {n}: data after the end line")
        try:
            obj = loads(raw)
            kind = obj["type"]
            if kind == "event":
                append(ChainRow(obj["seq"], run_id, obj["kind"], body_bytes(obj["body"]),
                                obj["prev_hash"], obj["hash"], obj["checkpoint"]))
            elif kind == "verdict":
                del obj["type"]
                verdicts.append(obj)
            elif kind == "end":
                end = obj
            else:
                raise ExportError(f"line {n}: unknown line type {kind!r}")
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeError) as exc:
            raise ExportError(f"line {n}: not an export line ({exc})") from exc
    if end is None:
        raise ExportError("no end line: the file is truncated")
    if end.get("events") != len(rows) or end.get("verdicts") != len(verdicts):
        raise ExportError("end line counts differ from the lines read")
    return ExportedRun(run_id, ledger_key, rows, verdicts, header)


def read_export_file(path: Path) -> ExportedRun:
    with path.open("rb") as fh:
        return read_export(fh)


# ----------------------------------------------------------------------------- chunks
# The offline audit reads a big export in byte ranges on several processes
# (veritrain.ledger.audit.verify_export_file); a range that holds anything but
# well-formed lines in the layout export_lines writes is reported irregular, and
# the whole file is then read by read_export, which names what is wrong.

VERDICT_START = b'{"type":"verdict",'
_VERDICT_START = VERDICT_START.decode()
_DECODER = json.JSONDecoder()
BLOCK_BYTES = 1 << 24


@dataclass
class ChunkScan:
    """One byte range of an export: its event lines scanned (:class:`verify.Scan`), where
    its verdict lines are (not parsed here: the audit compares them byte for byte with
    the lines the certified results imply), and its end line."""

    scan: Scan
    verdict_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, stop)
    verdict_lines: int = 0
    end: dict[str, Any] | None = None
    end_stop: int = -1  # the file offset just after the end line
    irregular: str | None = None


def line_ranges(path: Path, start: int, stop: int, parts: int, min_bytes: int
                ) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into at most ``parts`` ranges of whole lines."""
    step = max(min_bytes, -(-(stop - start) // max(1, parts)))
    cuts = [start]
    with path.open("rb") as fh:
        while cuts[-1] + step < stop:
            fh.seek(cuts[-1] + step)
            fh.readline()
            if fh.tell() >= stop:
                break
            cuts.append(fh.tell())
    return list(zip(cuts, cuts[1:] + [stop], strict=True))


def _blocks(fh: Any, start: int, stop: int) -> Iterator[tuple[int, bytes]]:
    """(file offset, bytes) of ``[start, stop)`` in blocks that end at a line end."""
    fh.seek(start)
    pos, carry = start, b""
    while pos < stop:
        data = fh.read(min(BLOCK_BYTES, stop - pos))
        if not data:
            break
        pos += len(data)
        buf = carry + data
        cut = buf.rfind(b"\n") + 1 if pos < stop else len(buf)
        if cut:
            yield pos - len(buf), buf[:cut]
        carry = buf[cut:]
    if carry:
        yield pos - len(carry), carry


def _event_row(obj: Any, run_id: str) -> ChainRow:
    """An event line's row, as read_export builds it."""
    return ChainRow(obj["seq"], run_id, obj["kind"], body_bytes(obj["body"]),
                    obj["prev_hash"], obj["hash"], obj["checkpoint"])


def scan_export_chunk(path: str, start: int, stop: int, run_id: str) -> ChunkScan:
    """Scan the lines of ``[start, stop)`` of an export file (run in a worker process)."""
    with gc_paused():
        return _scan_chunk(path, start, stop, run_id)


def _scan_chunk(path: str, start: int, stop: int, run_id: str) -> ChunkScan:
    scanner = Scanner(render=True)
    out = ChunkScan(scanner.scan)
    spans = out.verdict_spans
    decode = _DECODER.raw_decode
    with open(path, "rb") as fh:
        for offset, block in _blocks(fh, start, stop):
            if not block.isascii():
                out.irregular = "non-ASCII bytes"
                return out
            text = block.decode("ascii")
            cols = Columns(offset=[], run_id=run_id)
            add_seq, add_kind, add_body, add_prev, add_hash, add_cp, add_offset = (
                cols.seq.append, cols.kind.append, cols.body.append, cols.prev_hash.append,
                cols.hash.append, cols.checkpoint.append, cols.offset.append)  # type: ignore[union-attr]
            find, starts = text.find, text.startswith
            p, n = 0, len(text)
            while p < n:
                nl = find("\n", p)
                if nl < 0:
                    nl = n
                if out.end is not None:
                    out.irregular = "data after the end line"
                    return out
                if starts(_VERDICT_START, p):
                    if spans and spans[-1][1] == offset + p:
                        spans[-1] = (spans[-1][0], offset + nl + 1)
                    else:
                        spans.append((offset + p, offset + nl + 1))
                    out.verdict_lines += 1
                    p = nl + 1
                    continue
                try:  # an event line exactly as read_export takes it
                    obj, end = decode(text, p)
                    if end != nl or obj["type"] != "event":
                        raise ValueError("not an event line")
                    body = obj["body"].encode("latin-1")  # body_bytes, inlined (hot loop)
                    add_seq(obj["seq"])
                    add_kind(obj["kind"])
                    add_prev(obj["prev_hash"])
                    add_hash(obj["hash"])
                    add_cp(obj["checkpoint"])
                    add_body(body)
                    add_offset(offset + p)
                except (ValueError, KeyError, TypeError, AttributeError, UnicodeError):
                    # The end line, or the file is irregular (the columns are then dropped).
                    try:
                        obj = json.loads(text[p:nl])
                    except ValueError:
                        obj = None
                    if not isinstance(obj, dict) or obj.get("type") != "end":
                        out.irregular = f"unexpected line at byte {offset + p}"
                        return out
                    out.end, out.end_stop = obj, offset + nl + 1
                p = nl + 1
            scanner.feed(cols)
    scanner.travelling()
    return out


def read_event_rows(path: Path, offsets: Mapping[int, int], run_id: str) -> dict[int, ChainRow]:
    """The event rows whose lines start at ``offsets`` (index -> file offset)."""
    out: dict[int, ChainRow] = {}
    with path.open("rb") as fh:
        for i, offset in offsets.items():
            fh.seek(offset)
            line = fh.readline().rstrip(b"\n")
            out[i] = _event_row(json.loads(line), run_id)
    return out


def verdict_views(lines: bytes) -> list[dict[str, Any]] | None:
    """The verdict rows of verdict lines as read_export keeps them, or None if any line is
    not one."""
    views = []
    for raw in lines.splitlines():
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("type") != "verdict":
            return None
        del obj["type"]
        views.append(obj)
    return views
