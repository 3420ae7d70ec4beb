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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from . import schema as t
from .chain import ChainRow
from .lists import VerdictFilter, iter_verdicts
from .store import NotFound

FORMAT = "veritrain-ledger-export/1"
PAGE = 2000


class ExportError(ValueError):
    """The file is not a complete, well-formed export."""


def head_checkpoint(s: Session, run_id: str) -> t.Checkpoint | None:
    return s.execute(select(t.Checkpoint).where(t.Checkpoint.run_id == run_id)
                     .order_by(t.Checkpoint.seq.desc()).limit(1)).scalar_one_or_none()


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
             "checkpoint": sig, "body": e.body.decode("ascii")}
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
    """The last round whose round_finalized row is at or before ``seq = upto``."""
    body = s.execute(select(t.Event.body).where(
        t.Event.run_id == run_id, t.Event.kind == "round_finalized", t.Event.seq <= upto)
        .order_by(t.Event.seq.desc()).limit(1)).scalar()
    return None if body is None else int(json.loads(body)["round"])


@dataclass
class ExportedRun:
    run_id: str
    ledger_key: bytes
    rows: list[ChainRow]
    verdicts: list[dict[str, Any]]
    header: dict[str, Any]


def read_export(lines: Iterable[bytes | str]) -> ExportedRun:
    """Parse an export; refuses a file without its header or end line."""
    it = iter(lines)
    try:
        header = json.loads(next(it))
    except (StopIteration, ValueError) as exc:
        raise ExportError("no export header") from exc
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ExportError(f"not a {FORMAT} file")
    run_id = str(header["run_id"])
    try:
        ledger_key = bytes.fromhex(header["ledger_key"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportError("header has no ledger key") from exc
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
                append(ChainRow(obj["seq"], run_id, obj["kind"], obj["body"].encode("ascii"),
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
