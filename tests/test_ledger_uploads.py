"""Slow and stalled request bodies are cut off, recorded, and leave nothing behind."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from fakes import make_fake_run, make_submission
from ledger_harness import run_api
from sqlalchemy import func, select
from veritrain.ledger import schema as t
from veritrain.ledger.uploads import BodyClock, UploadPolicy, UploadTimeout
from veritrain.protocol.identity import Identity

PAYLOAD = b"p" * 3000
POLICY = UploadPolicy(idle_seconds=0.6, grace_seconds=0.4, min_bytes_per_s=4000.0)
BOUNDARY = "veritrainboundary"


def test_body_clock_deadline_is_idle_limit_or_rate_floor():
    now = [100.0]
    clock = BodyClock(UploadPolicy(idle_seconds=5.0, grace_seconds=2.0, min_bytes_per_s=100.0),
                      clock=lambda: now[0])
    assert clock.time_left() == pytest.approx(2.0)  # the floor: nothing yet, grace left
    clock.received = 1000  # 10 s of budget at 100 B/s: the idle limit binds
    assert clock.time_left() == pytest.approx(5.0)
    now[0] += 11.0  # 1000 B cover 2 s of grace + 10 s at 100 B/s: 1 s left
    assert clock.time_left() == pytest.approx(1.0)
    now[0] += 1.5
    assert clock.time_left() <= 0


def test_body_clock_raises_upload_timeout_on_a_read_that_never_returns():
    clock = BodyClock(UploadPolicy(idle_seconds=0.05, grace_seconds=0.05, min_bytes_per_s=1.0))

    async def never(_: int) -> bytes:
        await asyncio.sleep(10)
        return b""

    async def main() -> None:
        with pytest.raises(UploadTimeout) as err:
            await clock.chunk(never)
        assert err.value.reason == "upload_timeout"

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 1.0


def _multipart_head(envelope: bytes) -> tuple[bytes, bytes]:
    """The body up to the payload part's content, and the closing delimiter."""
    head = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"envelope\"\r\n"
            "Content-Type: application/json\r\n\r\n").encode() + envelope + (
            f"\r\n--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"payload\"\r\n"
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    return head, f"\r\n--{BOUNDARY}--\r\n".encode()


async def _slow_submit(api, envelope: bytes, payload: bytes, *, stall_after: int,
                       trickle: float | None) -> tuple[int, dict, float]:
    """POST a submission whose payload stops after ``stall_after`` bytes (``trickle``:
    then one byte every that many seconds); returns status, problem body, seconds."""
    head, tail = _multipart_head(envelope)
    length = len(head) + len(payload) + len(tail)
    reader, writer = await asyncio.open_connection(api.server.host, api.server.port)
    writer.write((f"POST /v1/runs/up-run/rounds/0/submissions HTTP/1.1\r\n"
                  f"Host: {api.server.host}\r\nContent-Length: {length}\r\n"
                  f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n"
                  "Connection: close\r\n\r\n").encode() + head + payload[:stall_after])
    await writer.drain()
    started = time.monotonic()

    async def dribble() -> None:
        for i in range(stall_after, len(payload)):
            await asyncio.sleep(trickle)
            writer.write(payload[i:i + 1])
            await writer.drain()

    feeder = asyncio.create_task(dribble()) if trickle else None
    head_raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    elapsed = time.monotonic() - started
    if feeder is not None:
        feeder.cancel()
    status_line, *header_lines = head_raw.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
    body = await reader.readexactly(int(headers["content-length"]))
    writer.close()
    return int(status_line.split()[1]), json.loads(body), elapsed


@pytest.mark.parametrize("trickle", [None, 0.05], ids=["stalled", "trickling"])
def test_invalid_slow_upload_times_out_and_changes_nothing(tmp_path: Path, trickle):
    run = make_fake_run("up-run", limits={"max_payload_bytes": 4096})
    worker, other = Identity.generate("worker"), Identity.generate("worker")

    async def scenario(api):
        await api.create_run(run)
        await api.register(run, worker)
        await api.register(run, other)
        signed = make_submission(run, worker, PAYLOAD)
        status, body, elapsed = await _slow_submit(api, signed.encode(), PAYLOAD,
                                                   stall_after=100, trickle=trickle)
        assert status == 408 and body["reason"] == "upload_timeout", body
        # Stalled: the idle limit; trickling (20 B/s, never idle): the rate floor.
        assert elapsed < (POLICY.idle_seconds + 1.0 if trickle is None else 1.0 + 0.5)
        if trickle is not None:
            assert elapsed < POLICY.idle_seconds + POLICY.grace_seconds
        with api.store.sessions() as s:
            assert s.execute(select(func.count()).select_from(t.Submission)).scalar_one() == 0
        assert list((tmp_path / "ledger" / "blobs" / "tmp").iterdir()) == []
        assert not (tmp_path / "ledger" / "blobs" / signed.message.payload_hash[:2]).exists()
        # Cut off before its envelope was whole (aiohttp reads ahead of a part's end): no
        # verified signer, so the refusal is counted in /metrics and written nowhere.
        rejections = (await api.get("/v1/runs/up-run/rejections"))[1]["rejections"]
        assert rejections == []
        async with api.session.get(f"{api.url}/metrics") as resp:
            assert 'veritrain_rejections_total{reason="upload_timeout"} 1' in await resp.text()
        # The same worker, at full speed, is then accepted; so is everyone else.
        assert (await api.submit(signed, PAYLOAD))[0] == 201
        assert (await api.submit(make_submission(run, other, PAYLOAD), PAYLOAD))[0] == 201

    run_api(tmp_path, scenario, uploads=POLICY)


def test_partial_uploads_left_by_a_crash_are_discarded_at_start(tmp_path: Path):
    from veritrain.ledger.blobs import BlobStore

    store = BlobStore(tmp_path / "blobs")
    kept = store.put(b"a finished blob")
    writer = store.writer(1 << 20)
    writer.write(b"half of an upload")  # the process dies here: the temp file stays
    assert len(list(store.tmp_dir.iterdir())) == 1
    again = BlobStore(tmp_path / "blobs")
    assert list(again.tmp_dir.iterdir()) == []
    assert again.read(kept) == b"a finished blob"
