"""Auditing a run: terminal views of the ledger and full verification of its log.

``verify_events`` checks, without trusting the server: the hash chain, the
ledger's checkpoint signatures, the organiser's signature on the run spec,
the writer's signature on every signed row (directly, or through the quorum
certificate that vouches for it: :mod:`veritrain.ledger.verify`), and every
certificate against the validator set. It reports the first row that fails.
The same checks run on a live ledger (its API) or offline on an export file
(:mod:`veritrain.ledger.export`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from veritrain.ledger.client import LedgerClient, LedgerRefused, fetch_run
from veritrain.protocol.certificates import verify_certificate
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import RevealReceipt, Submission, open_signed
from veritrain.protocol.receipts import (
    ReceiptCheck,
    certified_verdicts,
    check_reveal_receipt,
    check_submission_receipt,
    open_receipt,
)

from .chain import ChainRow, body_bytes
from .export import (
    ExportError,
    line_ranges,
    parse_header,
    read_event_rows,
    read_export_file,
    scan_export_chunk,
    verdict_views,
)
from .tables import format_report, format_round, format_worker
from .verify import AuditResult, check_views, fork_pool, gc_paused, verify_log, verify_scans

__all__ = ["AuditResult", "UnreadableRow", "fetch_and_verify", "fetch_events", "fetch_verdicts",
           "fetch_worker", "format_report", "format_result", "pick_run", "pick_worker",
           "run_audit", "verify_events", "verify_export_file"]

PAGE = 1000
#: Export files from this size on are read on several processes, in ranges of at least
#: CHUNK_MIN_BYTES (about six per process, so that none waits long for the last one).
PARALLEL_MIN_BYTES = 8 << 20
CHUNK_MIN_BYTES = 4 << 20


def verify_events(rows: Iterable[ChainRow], ledger_key: bytes, *, full: bool = False,
                  views: list[dict[str, Any]] | None = None,
                  processes: int | None = None,
                  pruned: list[dict[str, Any]] | None = None) -> AuditResult:
    """Verify a run's whole event log; names the first bad row (see verify.py). ``pruned``:
    the blobs the ledger lists as deleted by its retention policy, counted and checked."""
    return verify_log(list(rows), ledger_key, full=full, views=views, processes=processes,
                      pruned=pruned)


def verify_export_file(path: Path, *, full: bool = False,
                       processes: int | None = None) -> AuditResult:
    """Offline verification of an export file (chain, signatures, certificates, verdicts).

    Fast mode reads the file in chunks on several processes (:func:`verify_export_chunks`);
    a file that is not exactly in the layout the ledger writes is read line by line
    instead (:func:`read_export_file`), which names the line that is wrong. Full mode
    checks every signature, which dwarfs the reading, so it reads line by line.
    """
    if not full:
        result = verify_export_chunks(path, processes=processes)
        if result is not None:
            return result
    exported = read_export_file(path)
    return verify_log(exported.rows, exported.ledger_key, full=full, views=exported.verdicts,
                      processes=processes)


def verify_export_chunks(path: Path, *, processes: int | None = None,
                         chunk_bytes: int | None = None) -> AuditResult | None:
    """Fast-mode verification of an export file read in byte ranges, one process each.

    Each range's event lines are scanned where they are read (hashes, links, submission
    digests, ledger records and round results parsed: :class:`verify.Scanner`); the scans
    are joined here by checking each range's first row against the row before, then the
    usual pass and signature checks run (:func:`verify.verify_scans`), on the same pool.
    Verdict lines are compared byte for byte with the lines the certified results imply
    (``export_lines`` writes them so); if they differ they are parsed and compared field
    by field, which names the first row that differs. None when the file is not exactly
    in the ledger's layout (the caller then reads it with :func:`read_export_file`).
    ``chunk_bytes`` (tests): cut the file in ranges of about that many bytes.
    """
    with gc_paused():
        return _verify_chunks(path, processes, chunk_bytes)


def _verify_chunks(path: Path, processes: int | None, chunk_bytes: int | None
                   ) -> AuditResult | None:
    n_proc = processes if processes is not None else (os.cpu_count() or 1)
    with path.open("rb") as fh:
        header_line = fh.readline()
        size = os.fstat(fh.fileno()).st_size
    if not header_line:
        return None
    _, run_id, ledger_key = parse_header(header_line)
    parallel = n_proc > 1 and size >= PARALLEL_MIN_BYTES
    if chunk_bytes is not None:  # ranges of about that size (tests cut small files)
        ranges = line_ranges(path, len(header_line), size, size // chunk_bytes + 1,
                             chunk_bytes)
    else:
        ranges = line_ranges(path, len(header_line), size, 6 * n_proc if parallel else 1,
                             CHUNK_MIN_BYTES if parallel else size)
    pool = fork_pool(n_proc) if parallel else None
    try:
        if pool is not None:
            futures = [pool.submit(scan_export_chunk, str(path), a, b, run_id)
                       for a, b in ranges]
            # This process scans too, from the last range back, while the pool works
            # from the first; it stops at a range a worker has started.
            here = {}
            for k in range(len(ranges) - 1, -1, -1):
                if not futures[k].cancel():
                    break
                here[k] = scan_export_chunk(str(path), *ranges[k], run_id)
            chunks = [here[k] if k in here else f.result() for k, f in enumerate(futures)]
        else:
            chunks = [scan_export_chunk(str(path), a, b, run_id) for a, b in ranges]
        ends = [c for c in chunks if c.end is not None]
        if any(c.irregular for c in chunks) or len(ends) != 1 or ends[0].end_stop != size:
            return None
        end, scans = ends[0].end, [c.scan for c in chunks]
        n_verdicts = sum(c.verdict_lines for c in chunks)
        if end.get("events") != sum(s.n for s in scans) or end.get("verdicts") != n_verdicts:
            return None

        where: dict[int, int] = {}

        def load(indices: list[int]) -> dict[int, ChainRow]:
            """Rows the scans did not keep, read again from their lines."""
            if not where:
                base = 0
                for scan in scans:
                    where.update(zip(map(base.__add__, scan.subs), scan.sub_offsets,
                                     strict=True))
                    where.update((base + k, off) for k, off in scan.row_offsets.items())
                    base += scan.n
            return read_event_rows(path, {i: where[i] for i in indices}, run_id)

        done = verify_scans(scans, None, ledger_key, processes=n_proc, pool=pool, load=load)
    finally:
        if pool is not None:
            pool.shutdown()
    out = done.out
    with path.open("rb") as fh:
        served = b"".join(_read_at(fh, a, b) for c in chunks for a, b in c.verdict_spans)
    if out.ok and served == done.passed.expected_lines():
        out.view_rows = n_verdicts
        return out
    views = verdict_views(served)
    if views is None:
        return None
    if out.ok:
        check_views(out, done.passed.expected_views(), views)
    return out


def _read_at(fh: Any, start: int, stop: int) -> bytes:
    fh.seek(start)
    return fh.read(stop - start)


class UnreadableRow(Exception):
    """A served event row that is not a row (a field missing or of the wrong type)."""

    def __init__(self, seq: int, problem: str, rows: list[ChainRow]) -> None:
        super().__init__(f"row {seq}: {problem}")
        self.seq = seq
        self.problem = problem
        self.rows = rows  # the rows read before it


def chain_row(e: Any, run_id: str) -> ChainRow:
    """One served event as a row; ValueError, KeyError, TypeError or AttributeError if it
    is not one."""
    row = ChainRow(seq=e["seq"], run_id=run_id, kind=e["kind"], body=body_bytes(e["body"]),
                   prev_hash=e["prev_hash"], hash=e["hash"], checkpoint=e.get("checkpoint"))
    if (type(row.seq) is not int or not isinstance(row.kind, str)
            or not isinstance(row.prev_hash, str) or not isinstance(row.hash, str)
            or not isinstance(row.checkpoint, str | None)):
        raise TypeError("a field has the wrong type")
    return row


async def fetch_events(client: LedgerClient, run_id: str) -> list[ChainRow]:
    """Every event row of the run, in pages; :class:`UnreadableRow` names one that is not."""
    rows: list[ChainRow] = []
    after = -1
    while True:
        page = await client.get_json(f"/v1/runs/{run_id}/events?after={after}&limit={PAGE}")
        events = page.get("events") if isinstance(page, dict) else None
        if not isinstance(events, list):
            raise UnreadableRow(after + 1, "the ledger served no list of events", rows)
        for e in events:
            try:
                rows.append(chain_row(e, run_id))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                seq = e.get("seq") if isinstance(e, dict) else None
                raise UnreadableRow(seq if type(seq) is int else after + 1 + len(rows),
                                    f"cannot read the row as served ({exc!r})", rows) from None
        if len(events) < PAGE:
            return rows
        after = rows[-1].seq


async def fetch_verdicts(client: LedgerClient, run_id: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        page = await client.get_json(f"/v1/runs/{run_id}/verdicts?offset={offset}&limit={PAGE}")
        out.extend(page["verdicts"])
        offset = page["next_offset"]
    return out


async def fetch_pruned(client: LedgerClient, run_id: str) -> list[dict[str, Any]] | None:
    """Every blob the ledger lists as deleted by its retention policy; None from a ledger
    that lists none (an older one, without the endpoint)."""
    out: list[dict[str, Any]] = []
    offset: int | None = 0
    while offset is not None:
        try:
            page = await client.get_json(f"/v1/runs/{run_id}/pruned?offset={offset}"
                                         f"&limit={PAGE}")
        except LedgerRefused as exc:
            if exc.status == 404 and not out:
                return None
            raise
        rows = page.get("pruned") if isinstance(page, dict) else None
        if not isinstance(rows, list):  # not a ledger that lists pruned blobs
            return None
        out.extend(rows)
        offset = page.get("next_offset")
    return out


async def fetch_and_verify(client: LedgerClient, run_id: str, *, full: bool = False,
                           processes: int | None = None) -> AuditResult:
    """Live audit: the chain first, then the verdict rows (rounds finalized later are skipped)
    and the blobs pruned by the ledger's retention policy (read before the chain, so that
    every round they name is in it).

    A row the ledger serves in a form that is not a row is named like any other bad row
    (after the rows before it, which may fail first).
    """
    ledger_key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
    pruned = await fetch_pruned(client, run_id)
    try:
        rows = await fetch_events(client, run_id)
    except UnreadableRow as exc:
        result = verify_events(exc.rows, ledger_key, full=full, processes=processes)
        if result.ok:
            result.first_bad_seq, result.problem = exc.seq, exc.problem
        return result
    views = await fetch_verdicts(client, run_id)
    return verify_events(rows, ledger_key, full=full, views=views, processes=processes,
                         pruned=pruned)


def format_result(result: AuditResult) -> str:
    if not result.ok:
        where = (f"row {result.first_bad_seq}: {result.problem}" if result.first_bad_seq
                 is not None else result.bad_view_row or result.bad_pruned)
        return f"FAILED at {where}"
    tail = (f"; {result.unsigned_tail} newest row(s) await the ledger's next checkpoint"
            if result.unsigned_tail else "")
    if result.pruned_blobs:
        tail += (f"; {result.pruned_blobs} blob(s), {result.pruned_bytes} bytes, gone by the "
                 "ledger's retention policy (none of them evidence of a failed check)")
    elif result.pruned_blobs == 0:
        tail += "; no blob pruned"
    return (f"OK ({result.mode}): {result.rows} rows chained, {result.checkpoints} ledger "
            f"checkpoints, {result.signatures} writer signatures checked directly, "
            f"{result.covered_by_certificates} submissions vouched for by "
            f"{result.certificates} certificates, {result.view_rows} verdict rows match{tail}")


async def save_export(client: LedgerClient, run_id: str, path: Path) -> None:
    """Download the run's export file (written to a temporary name, then renamed)."""
    tmp = path.with_name(path.name + ".part")
    async with client.session.get(f"{client.base_url}/v1/runs/{run_id}/export") as resp:
        if resp.status != 200:
            raise SystemExit(f"the ledger refused the export of run {run_id!r}: HTTP "
                             f"{resp.status} {(await resp.text())[:200]}")
        try:
            with tmp.open("wb") as fh:
                async for chunk in resp.content.iter_chunked(1 << 16):
                    fh.write(chunk)
        except OSError as exc:
            raise SystemExit(f"cannot write {path}: {exc.strerror or exc}") from None
    tmp.replace(path)


async def pick_run(client: LedgerClient, run_id: str | None) -> str:
    """The run to audit: ``run_id`` if the ledger has it, else the ledger's only run."""
    runs = [str(r["run_id"]) for r in (await client.get_json("/v1/ledger"))["runs"]]
    if run_id is not None and run_id not in runs:
        raise SystemExit(f"the ledger at {client.base_url} has no run {run_id!r}; its runs: "
                         f"{', '.join(runs) or 'none yet'}")
    if run_id is None and len(runs) != 1:
        raise SystemExit(f"the ledger at {client.base_url} has {len(runs)} runs"
                         + (f" ({', '.join(runs[:10])}); pass --run" if runs else
                            "; create one with `veritrain run create`"))
    return run_id or runs[0]


async def pick_worker(client: LedgerClient, run_id: str, prefix: str | None) -> str:
    """The one worker of the run whose key starts with ``prefix``."""
    if not prefix:
        raise SystemExit("audit worker needs a worker key or its first hex digits")
    prefix = prefix.lower()
    matches: list[str] = []
    offset: int | None = 0
    while offset is not None and len(matches) < 2:
        page = await client.get_json(f"/v1/runs/{run_id}/scores?offset={offset}&limit={PAGE}")
        matches += [w["worker"] for w in page["workers"] if w["worker"].startswith(prefix)]
        offset = page["next_offset"]
    if not matches:
        raise SystemExit(f"no worker of run {run_id!r} has a key starting with {prefix!r}; "
                         "`veritrain audit report` lists them")
    if len(matches) > 1:
        raise SystemExit(f"more than one worker of run {run_id!r} has a key starting with "
                         f"{prefix!r}; give more of the key")
    return matches[0]


async def fetch_worker(client: LedgerClient, run_id: str, worker: str) -> dict[str, Any]:
    """A worker's whole history, its pages joined."""
    data: dict[str, Any] = {}
    offset = 0
    while True:
        page = await client.get_json(
            f"/v1/runs/{run_id}/workers/{worker}?offset={offset}&limit={PAGE}")
        if not data:
            data = page
        else:
            for key in ("submissions", "verdicts", "penalties"):
                data[key] += page.get(key, [])
        if max(len(page.get(k, [])) for k in ("submissions", "verdicts", "penalties")) < PAGE:
            return data
        offset += PAGE


async def audit_receipt(client: LedgerClient, run_id: str, wire: Any) -> ReceiptCheck:
    """Whether this ledger honoured a receipt it signed (protocol/receipts.py): signed by
    the ledger's key, a submission in the round's sealed list once the round closed, and
    in the certified verdicts (the round's quorum certificate, BLS-checked here, and a
    validator's result whose verdicts hash to it); a reveal receipted in time never
    certified missing."""
    ledger_key = (await client.get_json("/v1/ledger"))["ledger_key"]
    signed = open_receipt(wire, ledger_key)
    msg = signed.message
    if msg.run_id != run_id:
        raise RejectedInput(f"the receipt is for run {msg.run_id}, not {run_id}", "wrong_run")
    spec = await fetch_run(client, run_id, wait_for=0.0)
    base = f"/v1/runs/{run_id}/rounds/{msg.round}"
    info = await client.get_json(base)
    verdicts = None
    if info.get("certificate") is not None:
        cert = verify_certificate(info["certificate"], spec, base_of_round=msg.round + 1)
        verdicts = certified_verdicts((await client.get_json(f"{base}/results"))["results"],
                                      cert, spec)
    if isinstance(msg, RevealReceipt):
        return check_reveal_receipt(msg, verdicts)
    sealed = None
    if info["status"] != "open":
        wires = (await client.get_json(f"{base}/submissions"))["submissions"]
        sealed = [open_signed(w, Submission).digest for w in wires]
    return check_submission_receipt(msg, verdicts, sealed)


async def run_audit(args: argparse.Namespace) -> int:
    """``veritrain audit``: a failure the user can fix is a one-line SystemExit."""
    export = getattr(args, "export", None)
    full = bool(getattr(args, "full", False))
    if export:
        try:
            result = verify_export_file(Path(export), full=full)
        except OSError as exc:
            print(f"FAILED: cannot read {export}: {exc.strerror or exc}")
            return 1
        except ExportError as exc:
            print(f"FAILED: {export} is not a complete ledger export: {exc}")
            return 1
        print(json.dumps(result.to_json()) if args.json else format_result(result))
        return 0 if result.ok else 1
    if not args.ledger:
        raise SystemExit("audit needs --ledger URL (or --export FILE to verify a file)")
    async with LedgerClient(args.ledger, retry_for=getattr(args, "retry_for", 10.0)) as client:
        run_id = await pick_run(client, args.run)
        save = getattr(args, "save", None)
        if save:
            await save_export(client, run_id, Path(save))
            print(f"saved the export of run {run_id} to {save}")
            return 0
        if args.what == "verify":
            result = await fetch_and_verify(client, run_id, full=full)
            print(json.dumps(result.to_json()) if args.json else format_result(result))
            return 0 if result.ok else 1
        if args.what == "receipt":
            if args.arg is None:
                raise SystemExit("audit receipt needs the receipt file a worker kept, e.g. "
                                 "`audit receipt STATE_DIR/RUN/receipts/3.json`")
            try:
                wire = json.loads(Path(args.arg).read_bytes())
                check = await audit_receipt(client, run_id, wire)
            except OSError as exc:
                print(f"FAILED: cannot read {args.arg}: {exc.strerror or exc}")
                return 1
            except (ValueError, RejectedInput) as exc:
                print(f"FAILED: {exc}")
                return 1
            verdict = {True: "HONOURED", False: "NOT HONOURED", None: "UNDECIDED"}[check.honoured]
            print(json.dumps({"honoured": check.honoured, "reason": check.reason}) if args.json
                  else f"{verdict}: {check.reason}")
            return 1 if check.honoured is False else 0
        if args.what == "report":
            data = await client.get_json(f"/v1/runs/{run_id}/report")
            print(json.dumps(data, indent=1) if args.json else format_report(data))
            return 0
        if args.what == "round":
            if args.arg is None or not args.arg.isdigit():
                raise SystemExit("audit round needs a round number, e.g. `audit round 3`")
            data = await client.get_json(f"/v1/runs/{run_id}/rounds/{int(args.arg)}")
            print(json.dumps(data, indent=1) if args.json else format_round(data))
            return 0
        worker = await pick_worker(client, run_id, args.arg)
        data = await fetch_worker(client, run_id, worker)
        print(json.dumps(data, indent=1) if args.json else format_worker(data))
        return 0
