"""Hostile-load benchmark (issue #25): the issue's attacks against a live ledger while
honest workers and a validator run rounds.

A ``veritrain ledger serve`` process on loopback hosts one run. Honest traffic, the
same in every phase: workers submit each round (the round closes at its quota), the
validator posts its beacon share and its result, a newcomer registers now and then.
Each phase runs the honest traffic for ``--seconds`` alongside one attack:

* ``idle``: none (the baseline);
* ``dup_run``: ``POST /v1/runs`` reusing the run id, signed by a fresh organiser,
  naming 64 made-up validators, with 1 MiB files;
* ``refused_blobs``: results signed by a key in no run with three 1 MiB parts, specs
  with no validators with a 1 MiB dataset;
* ``replay``: the honest validator's beacon share and a worker's registration replayed
  from another loopback address, to the run and to another run's URL;
* ``junk``: unsigned junk POSTs to a run that does not exist, from 16 addresses;
* ``sybil``: fresh keys registering as fast as they are answered;
* ``hangup``: clients hanging up mid-upload.

Reported per phase: the honest writes' p99 latency and its ratio to idle, the refused
requests sent, and after all phases the disk used by refused requests (files under
the blob directory the store does not name, and upload leftovers), the rejection rows
written per refused request, and the honest writes answered 429. Last line::

    hostile: honest_write_p99_ratio_worst=<x> refused_bytes_stored=<n> refused_rows_per_request=<x> victim_429s=<n>

Run: ``.venv/bin/python bench/hostile.py [--seconds 4] [--workers 4]``
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from sqlalchemy import create_engine, func, select
from veritrain.ledger import schema as t
from veritrain.protocol.beacon import beacon_seed_of, sealed_list_digest_of
from veritrain.protocol.encoding import encode_canonical
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Registration, RoundResult, RunSpec, sign

from veritrain.local import LocalProcesses
from veritrain.synthetic import (
    HONEST,
    beacon_share,
    build_results,
    make_synthetic_run,
    synthetic_submission,
)

RUN = "hostile-run"
#: Where newcomers and Sybils register (RUN's rounds close when its workers all submitted).
OTHER = "other-run"


def _parts(parts: list[tuple[str, bytes]]) -> aiohttp.MultipartWriter:
    mp = aiohttp.MultipartWriter("form-data")
    for name, data in parts:
        part = mp.append(data, {"Content-Type": "application/octet-stream"})
        part.set_content_disposition("form-data", name=name)
    return mp


class Honest:
    """Workers and a validator running rounds, and newcomers registering: the latency of
    the workers' writes (submissions, registrations; the validator's BLS-bound writes
    are few and dominated by their own verification) and the status of every write."""

    def __init__(self, url: str, run: Any, workers: list[Identity]) -> None:
        self.url, self.run, self.workers = url, run, workers
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self.share_wire: Any = None
        self.rounds = 0

    async def _post(self, s: aiohttp.ClientSession, path: str, data: Any,
                    timed: bool = True) -> tuple[int, Any]:
        started = time.perf_counter()
        async with s.post(self.url + path, data=data) as resp:
            body = await resp.json(content_type=None)
            if timed:
                self.latencies.append(time.perf_counter() - started)
            self.statuses.append(resp.status)
            return resp.status, body

    async def newcomers(self, s: aiohttp.ClientSession, until: float) -> None:
        while time.monotonic() < until:
            key = Identity.generate("worker")  # joins the other run: RUN's quota stays
            await self._post(s, f"/v1/runs/{OTHER}/participants", encode_canonical(sign(
                key, Registration(run_id=OTHER, round=0, participant=key.public_key.hex(),
                                  role="worker", created_at=1)).to_wire()))
            await asyncio.sleep(0.05)

    async def play(self, s: aiohttp.ClientSession, until: float) -> None:
        path = f"/v1/runs/{RUN}"
        while time.monotonic() < until:
            info = await (await s.get(self.url + path + "/rounds/current")).json()
            r, base = info["round"], info["base_model_hash"]
            subs = {}
            for w in self.workers:
                payload = os.urandom(4096)
                signed = synthetic_submission(self.run, w, payload, round_index=r, base=base)
                status, _ = await self._post(s, f"{path}/rounds/{r}/submissions", _parts(
                    [("envelope", signed.encode()), ("payload", payload)]))
                if status == 201:
                    subs[w.public_key.hex()] = signed.digest
            if len(subs) < len(self.workers):
                raise RuntimeError(f"honest submissions refused in round {r}: {self.statuses}")
            while (await (await s.get(f"{self.url}{path}/rounds/{r}")).json())["status"] == "open":
                await asyncio.sleep(0.05)
            listed = (await (await s.get(f"{self.url}{path}/rounds/{r}/submissions")).json())
            sealed = sealed_list_digest_of(listed["submissions"])
            share = await asyncio.to_thread(beacon_share, self.run, self.run.validators[0], r,
                                            sealed)
            self.share_wire = share.to_wire()
            _, fixed = await self._post(s, f"{path}/rounds/{r}/beacon",
                                        encode_canonical(self.share_wire), timed=False)
            seed = beacon_seed_of(fixed["beacon"])
            results, blobs = await asyncio.to_thread(build_results, self.run, r, base, seed,
                                                     subs, dict.fromkeys(subs, HONEST))
            await self._post(s, f"{path}/rounds/{r}/results", _parts(
                [("result", results[0].encode()), *blobs.items()]), timed=False)
            self.rounds += 1


class Attacks:
    def __init__(self, url: str, run: Any, honest: Honest, other_run: Any) -> None:
        self.url, self.run, self.honest, self.other = url, run, honest, other_run
        self.sent = 0
        self.sybils = 0
        # Signed once here: the attack loops share the honest clients' event loop, so they
        # do no cryptography of their own while a phase is timed.
        stranger = Identity.generate("organiser")
        validators = [{"ed25519": os.urandom(32).hex(), "bls": os.urandom(48).hex(),
                       "bls_pop": os.urandom(96).hex()} for _ in range(64)]
        self.dup_spec = sign(stranger, RunSpec.from_body({
            **run.spec.to_body(), "organiser": stranger.public_key.hex(),
            "validators": validators, "quorum": 43})).encode()
        forger = Identity.generate("worker")
        results, _ = build_results(run, 0, run.spec.genesis_model_hash, "00" * 32, {}, {})
        self.forged_result = sign(forger, RoundResult.from_body({
            **results[0].message.to_body(), "validator": forger.public_key.hex()})).encode()
        self.empty_specs = []
        for k in range(32):
            data = os.urandom(1 << 20)
            self.empty_specs.append((sign(stranger, RunSpec.from_body({
                **run.spec.to_body(), "organiser": stranger.public_key.hex(),
                "run_id": f"empty-{k}", "validators": [],
                "dataset_hash": hashlib.sha256(data).hexdigest()})).encode(), data))
        self.sybil_regs = []
        for _ in range(2000):
            key = Identity.generate("worker")
            self.sybil_regs.append(encode_canonical(sign(key, Registration(
                run_id=OTHER, round=0, participant=key.public_key.hex(), role="worker",
                created_at=1)).to_wire()))

    async def _send(self, s: aiohttp.ClientSession, path: str, data: Any) -> int:
        try:
            async with s.post(self.url + path, data=data) as resp:
                await resp.read()
                if resp.status >= 400:
                    self.sent += 1
                return resp.status
        except aiohttp.ClientError:
            return 0

    async def dup_run(self, s: aiohttp.ClientSession) -> None:
        await self._send(s, "/v1/runs", _parts([("spec", self.dup_spec),
                                                 ("dataset", os.urandom(1 << 20)),
                                                 ("genesis", os.urandom(1 << 20))]))

    async def refused_blobs(self, s: aiohttp.ClientSession) -> None:
        await self._send(s, f"/v1/runs/{RUN}/rounds/0/results", _parts(
            [("result", self.forged_result), ("model", os.urandom(1 << 20)),
             ("outer_state", os.urandom(1 << 20)), ("update", os.urandom(1 << 20))]))
        spec, data = self.empty_specs[self.sent % len(self.empty_specs)]
        await self._send(s, "/v1/runs", _parts([("spec", spec), ("dataset", data),
                                                 ("genesis", self.run.genesis)]))

    async def replay(self, s: aiohttp.ClientSession) -> None:
        victim = self.honest.workers[0]
        reg = sign(victim, Registration(run_id=RUN, round=0, participant=victim.public_key
                                        .hex(), role="worker", created_at=1)).to_wire()
        for path in (f"/v1/runs/{RUN}/participants", f"/v1/runs/{self.other}/participants"):
            await self._send(s, path, encode_canonical(reg))
        if self.honest.share_wire is not None:
            r = self.honest.share_wire["body"]["round"]
            await self._send(s, f"/v1/runs/{RUN}/rounds/{r}/beacon",
                             encode_canonical(self.honest.share_wire))

    async def junk(self, s: aiohttp.ClientSession) -> None:
        await self._send(s, "/v1/runs/no-such-run/participants",
                         encode_canonical({"junk": os.urandom(8).hex()}))

    async def sybil(self, s: aiohttp.ClientSession) -> None:
        self.sybils += 1
        await self._send(s, f"/v1/runs/{OTHER}/participants",
                         self.sybil_regs[self.sybils % len(self.sybil_regs)])

    async def hangup(self, s: aiohttp.ClientSession) -> None:
        host, port = self.url.split("//")[1].split(":")
        worker = self.honest.workers[0]
        payload = os.urandom(1 << 18)
        env = synthetic_submission(self.run, worker, payload, round_index=10**6).encode()
        b = "hangup"
        head = (f"--{b}\r\nContent-Disposition: form-data; name=\"envelope\"\r\n\r\n").encode() \
            + env + f"\r\n--{b}\r\nContent-Disposition: form-data; name=\"payload\"\r\n\r\n".encode()
        try:
            _, writer = await asyncio.open_connection(host, int(port))
            writer.write((f"POST /v1/runs/{RUN}/rounds/0/submissions HTTP/1.1\r\nHost: x\r\n"
                          f"Content-Length: {len(head) + len(payload) + 64}\r\n"
                          f"Content-Type: multipart/form-data; boundary={b}\r\n\r\n").encode()
                         + head + payload[: len(payload) // 2])
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.transport.abort()
            self.sent += 1
        except OSError:
            pass


async def _attack_loop(attacks: Attacks, name: str, until: float, clients: int) -> None:
    async def one(k: int) -> None:
        addr = f"127.0.0.{2 + k % 16}"
        conn = aiohttp.TCPConnector(local_addr=(addr, 0))
        async with aiohttp.ClientSession(connector=conn) as s:
            while time.monotonic() < until:
                await getattr(attacks, name)(s)
                await asyncio.sleep(0)

    await asyncio.gather(*(one(k) for k in range(clients)))


def _p99(xs: list[float]) -> float:
    if len(xs) < 2:
        return xs[0] if xs else 0.0
    return statistics.quantiles(xs, n=100, method="inclusive")[98]


async def _main(args: argparse.Namespace, url: str, data_dir: Path) -> dict[str, Any]:
    run = make_synthetic_run(RUN, [Identity.generate("validator")], quorum=1, schedule={
        "round_seconds": 3600.0, "min_submissions": args.workers, "max_rounds": 10_000})
    other = make_synthetic_run(OTHER, run.validators, quorum=1)
    workers = [Identity.generate("worker") for _ in range(args.workers)]
    async with aiohttp.ClientSession() as s:
        for r in (run, other):
            async with s.post(url + "/v1/runs", data=_parts(
                    [("spec", r.signed.encode()), ("dataset", r.dataset),
                     ("genesis", r.genesis)])) as resp:
                assert resp.status == 201, await resp.text()
        for w in workers:
            async with s.post(f"{url}/v1/runs/{RUN}/participants", data=encode_canonical(sign(
                    w, Registration(run_id=RUN, round=0, participant=w.public_key.hex(),
                                    role="worker", created_at=1)).to_wire())) as resp:
                assert resp.status == 200
    engine = create_engine(f"sqlite:///{data_dir / 'ledger.sqlite'}")

    def rejection_rows() -> int:
        with engine.connect() as c:
            return c.execute(select(func.count()).select_from(t.Rejection)).scalar_one()

    honest = Honest(url, run, workers)
    attacks = Attacks(url, run, honest, OTHER)
    rows_before = rejection_rows()
    report: dict[str, Any] = {"phases": {}}
    for phase in ("idle", "dup_run", "refused_blobs", "replay", "junk", "sybil", "hangup"):
        honest.latencies, honest.statuses = [], []
        until = time.monotonic() + args.seconds
        async with aiohttp.ClientSession() as s:
            jobs = [honest.play(s, until), honest.newcomers(s, until)]
            if phase != "idle":
                jobs.append(_attack_loop(attacks, phase, until, args.attackers))
            sent = attacks.sent
            await asyncio.gather(*jobs)
        p99 = _p99(honest.latencies)
        report["phases"][phase] = {"p99_ms": 1000 * p99, "writes": len(honest.latencies),
                                   "refused_sent": attacks.sent - sent,
                                   "victim_429s": honest.statuses.count(429)}
        report.setdefault("victim_429s", 0)
        report["victim_429s"] += honest.statuses.count(429)
        print(f"{phase:14s} rounds={honest.rounds:3d} honest writes={len(honest.latencies):4d} "
              f"p99={1000 * p99:7.1f} ms refused sent={attacks.sent - sent:5d} "
              f"429s={honest.statuses.count(429)}", flush=True)
    await asyncio.sleep(1.0)
    with engine.connect() as c:
        named = set(c.execute(select(t.Blob.sha256)).scalars())
    blob_root = data_dir / "blobs"
    stray = sum(p.stat().st_size for p in blob_root.glob("??/*") if p.name not in named)
    leftovers = sum(p.stat().st_size for p in (blob_root / "tmp").glob("*"))
    report["refused_bytes_stored"] = stray + leftovers
    report["refused_rows"] = rejection_rows() - rows_before
    report["refused_sent"] = attacks.sent
    report["rounds"] = honest.rounds
    engine.dispose()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    ap.add_argument("--workers", type=int, default=4, help="honest workers per round")
    ap.add_argument("--attackers", type=int, default=8, help="concurrent attack clients")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        procs = LocalProcesses(Path(tmp) / "logs")
        try:
            url = procs.start_ledger(Path(tmp) / "ledger", extra=[
                "--ip-rate", "1000", "--ip-burst", "2000"])
            report = asyncio.run(_main(args, url, Path(tmp) / "ledger"))
        finally:
            procs.stop_all()
    idle = report["phases"]["idle"]["p99_ms"] or 1e-9
    worst = max(p["p99_ms"] / idle for name, p in report["phases"].items() if name != "idle")
    for name, p in report["phases"].items():
        print(f"{name:14s} p99 ratio to idle {p['p99_ms'] / idle:5.2f}")
    per_request = report["refused_rows"] / max(1, report["refused_sent"])
    print(f"refused requests sent {report['refused_sent']}, rejection rows written "
          f"{report['refused_rows']}, disk used by refused requests "
          f"{report['refused_bytes_stored']} B")
    print(f"hostile: honest_write_p99_ratio_worst={worst:.2f} "
          f"refused_bytes_stored={report['refused_bytes_stored']} "
          f"refused_rows_per_request={per_request:.4f} victim_429s={report['victim_429s']}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
