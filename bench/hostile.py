"""Hostile-load benchmark (issue #25): the issue's attacks against a live ledger while
honest workers and a validator run rounds.

A ``veritrain ledger serve`` process on loopback hosts one run. Honest traffic, the
same in every phase: workers submit each round (the round closes at its quota), the
validator (a process of its own) posts its beacon share and its result, a newcomer
registers now and then. Each phase runs the honest traffic for ``--seconds``
alongside one attack, made by a process of its own (it shares the machine, as an
attacker on the same host would, not the honest clients' event loop):

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

The whole sequence of phases runs ``--repeats`` times (default 3), so each attack is
measured beside an idle phase of the same stretch of the shared machine. Reported per
phase: the honest writes' p99 latency over all its repetitions (pooled: a phase gives
some 40 writes, whose p99 alone is nearly their maximum) and its ratio to idle's, with
the worst and the median of the ratios within each repetition; the refused requests
sent; and after all phases the disk used by refused requests (files under the blob
directory the store does not name, and upload leftovers), the rejection rows written
per refused request, and the honest writes answered 429. Last line (the ratio is the
pooled one of the worst attack)::

    hostile: honest_write_p99_ratio_worst=<x> refused_bytes_stored=<n> refused_rows_per_request=<x> victim_429s=<n>

Run: ``.venv/bin/python bench/hostile.py [--seconds 4] [--workers 4] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from sqlalchemy import create_engine, func, select
from veritrain.ledger import schema as t
from veritrain.protocol import bls
from veritrain.protocol.beacon import beacon_seed_of, sealed_list_digest_of
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Registration, RoundResult, RunSpec, open_signed, sign

from veritrain.local import LocalProcesses
from veritrain.synthetic import (
    HONEST,
    SyntheticRun,
    beacon_share,
    build_results,
    make_synthetic_run,
    synthetic_submission,
)

RUN = "hostile-run"
PHASES = ("idle", "dup_run", "refused_blobs", "replay", "junk", "sybil", "hangup")
#: Where newcomers and Sybils register (RUN's rounds close when its workers all submitted).
OTHER = "other-run"


def _parts(parts: list[tuple[str, bytes]]) -> aiohttp.MultipartWriter:
    mp = aiohttp.MultipartWriter("form-data")
    for name, data in parts:
        part = mp.append(data, {"Content-Type": "application/octet-stream"})
        part.set_content_disposition("form-data", name=name)
    return mp


class Honest:
    """Workers running rounds and newcomers registering: the latency of the workers'
    writes (submissions, registrations) and the status of every write. The run's
    validator is a process of its own (:func:`validator`), as ``veritrain validator``
    is: its BLS work never shares this process, whose clock times the writes."""

    def __init__(self, url: str, run: Any, workers: list[Identity]) -> None:
        self.url, self.run, self.workers = url, run, workers
        self.latencies: list[float] = []
        self.statuses: list[int] = []
        self.rounds = 0
        self.submitted = -1  # the last round the workers submitted to

    async def _post(self, s: aiohttp.ClientSession, path: str, data: Any) -> tuple[int, Any]:
        started = time.perf_counter()
        async with s.post(self.url + path, data=data) as resp:
            body = await resp.json(content_type=None)
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
        """Each round: every worker submits (the last closes the round); then they wait,
        across phases too, until the validator has finished it and the next is open."""
        path = f"/v1/runs/{RUN}"
        while time.monotonic() < until:
            info = await (await s.get(self.url + path + "/rounds/current")).json()
            r, base = info["round"], info["base_model_hash"]
            if r <= self.submitted:
                await asyncio.sleep(0.02)
                continue
            for w in self.workers:
                payload = os.urandom(4096)
                signed = synthetic_submission(self.run, w, payload, round_index=r, base=base)
                status, body = await self._post(s, f"{path}/rounds/{r}/submissions", _parts(
                    [("envelope", signed.encode()), ("payload", payload)]))
                if status not in (200, 201):
                    raise RuntimeError(f"honest submission refused in round {r}: {body}")
            self.submitted = r
            self.rounds += 1


def validator(url: str, spec_wire: bytes, seed: bytes, bls_secret: int, stop: Any) -> None:
    """The run's validator, in its own process until ``stop`` is set: for each closed
    round, its beacon share over the sealed list, then its result (every worker
    accepted)."""
    me = Identity("validator", seed, bls_secret)
    run = SyntheticRun(me, [me], open_signed(decode_canonical(spec_wire), RunSpec), b"", b"")

    async def loop() -> None:
        path = f"{url}/v1/runs/{RUN}"
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                info = await (await s.get(path + "/rounds/current")).json()
                r, base = info["round"], info["base_model_hash"]
                if (await (await s.get(f"{path}/rounds/{r}")).json())["status"] == "open":
                    await asyncio.sleep(0.02)
                    continue
                listed = (await (await s.get(f"{path}/rounds/{r}/submissions")).json())
                envelopes = listed["submissions"]
                share = beacon_share(run, me, r, sealed_list_digest_of(envelopes))
                async with s.post(f"{path}/rounds/{r}/beacon",
                                  data=encode_canonical(share.to_wire())) as resp:
                    fixed = (await resp.json())["beacon"]
                subs = {w["body"]["worker"]: hashlib.sha256(encode_canonical(w)).hexdigest()
                        for w in envelopes}
                results, blobs = build_results(run, r, base, beacon_seed_of(fixed), subs,
                                               dict.fromkeys(subs, HONEST))
                async with s.post(f"{path}/rounds/{r}/results", data=_parts(
                        [("result", results[0].encode()), *blobs.items()])) as resp:
                    if resp.status >= 400:
                        raise RuntimeError(f"the validator's result for round {r} was "
                                           f"refused: {await resp.text()}")

    asyncio.run(loop())


@dataclass(frozen=True)
class AttackKit:
    """What the attacks send, signed beforehand in the bench's main process: the attacker
    process does no cryptography while a phase is timed. A replayed registration or
    hang-up envelope is the honest worker's own public message; the replayed beacon share
    the attacker reads from the ledger, as anyone can."""

    url: str
    dup_spec: bytes
    forged_result: bytes
    empty_specs: list[tuple[bytes, bytes]]
    genesis: bytes
    sybil_regs: list[bytes]
    victim_registration: bytes
    hangup_envelope: bytes

    @classmethod
    def build(cls, url: str, run: Any, victim: Identity) -> AttackKit:
        stranger = Identity.generate("organiser")
        validators = [{"ed25519": os.urandom(32).hex(), "bls": os.urandom(48).hex(),
                       "bls_pop": os.urandom(96).hex()} for _ in range(64)]
        dup_spec = sign(stranger, RunSpec.from_body({
            **run.spec.to_body(), "organiser": stranger.public_key.hex(),
            "validators": validators, "quorum": 43})).encode()
        forger = Identity.generate("worker")
        results, _ = build_results(run, 0, run.spec.genesis_model_hash, "00" * 32, {}, {})
        forged_result = sign(forger, RoundResult.from_body({
            **results[0].message.to_body(), "validator": forger.public_key.hex()})).encode()
        empty_specs = []
        for k in range(32):
            data = os.urandom(1 << 20)
            empty_specs.append((sign(stranger, RunSpec.from_body({
                **run.spec.to_body(), "organiser": stranger.public_key.hex(),
                "run_id": f"empty-{k}", "validators": [],
                "dataset_hash": hashlib.sha256(data).hexdigest()})).encode(), data))
        sybil_regs = []
        for _ in range(2000):
            key = Identity.generate("worker")
            sybil_regs.append(encode_canonical(sign(key, Registration(
                run_id=OTHER, round=0, participant=key.public_key.hex(), role="worker",
                created_at=1)).to_wire()))
        victim_registration = encode_canonical(sign(victim, Registration(
            run_id=RUN, round=0, participant=victim.public_key.hex(), role="worker",
            created_at=1)).to_wire())
        hangup_envelope = synthetic_submission(run, victim, os.urandom(1 << 18),
                                               round_index=10**6).encode()
        return cls(url, dup_spec, forged_result, empty_specs, run.genesis, sybil_regs,
                   victim_registration, hangup_envelope)


class Attacks:
    """One attacker process's attack loops (see the module docstring)."""

    def __init__(self, kit: AttackKit) -> None:
        self.kit, self.url = kit, kit.url
        self.sent = 0
        self.sybils = 0
        self.share: bytes | None = None
        self.share_read = -1.0

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
        await self._send(s, "/v1/runs", _parts([("spec", self.kit.dup_spec),
                                                 ("dataset", os.urandom(1 << 20)),
                                                 ("genesis", os.urandom(1 << 20))]))

    async def refused_blobs(self, s: aiohttp.ClientSession) -> None:
        await self._send(s, f"/v1/runs/{RUN}/rounds/0/results", _parts(
            [("result", self.kit.forged_result), ("model", os.urandom(1 << 20)),
             ("outer_state", os.urandom(1 << 20)), ("update", os.urandom(1 << 20))]))
        spec, data = self.kit.empty_specs[self.sent % len(self.kit.empty_specs)]
        await self._send(s, "/v1/runs", _parts([("spec", spec), ("dataset", data),
                                                 ("genesis", self.kit.genesis)]))

    async def _latest_share(self, s: aiohttp.ClientSession) -> tuple[int, bytes] | None:
        """The honest validator's share of the last fixed beacon, as the ledger serves it
        (read again every half second)."""
        if time.monotonic() - self.share_read > 0.5:
            self.share_read = time.monotonic()
            async with s.get(f"{self.url}/v1/runs/{RUN}/rounds/current") as resp:
                r = int((await resp.json())["round"]) - 1
            if r >= 0:
                async with s.get(f"{self.url}/v1/runs/{RUN}/rounds/{r}/beacon") as resp:
                    envelopes = (await resp.json())["envelopes"]
                if envelopes:
                    self.share = encode_canonical(envelopes[0])
        if self.share is None:
            return None
        return int(decode_canonical(self.share)["body"]["round"]), self.share

    async def replay(self, s: aiohttp.ClientSession) -> None:
        for path in (f"/v1/runs/{RUN}/participants", f"/v1/runs/{OTHER}/participants"):
            await self._send(s, path, self.kit.victim_registration)
        share = await self._latest_share(s)
        if share is not None:
            await self._send(s, f"/v1/runs/{RUN}/rounds/{share[0]}/beacon", share[1])

    async def junk(self, s: aiohttp.ClientSession) -> None:
        await self._send(s, "/v1/runs/no-such-run/participants",
                         encode_canonical({"junk": os.urandom(8).hex()}))

    async def sybil(self, s: aiohttp.ClientSession) -> None:
        self.sybils += 1
        await self._send(s, f"/v1/runs/{OTHER}/participants",
                         self.kit.sybil_regs[self.sybils % len(self.kit.sybil_regs)])

    async def hangup(self, s: aiohttp.ClientSession) -> None:
        host, port = self.url.split("//")[1].split(":")
        payload = os.urandom(1 << 18)
        env = self.kit.hangup_envelope
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


def attacker(kit: AttackKit, name: str, clients: int, ready: Any, go: Any, sent: Any) -> None:
    """The attacker process of one phase: set up, say ready, wait for the start (a
    monotonic deadline: one clock for every process on the machine), attack until it,
    then report how many of its requests were refused."""
    attacks = Attacks(kit)
    ready.set()
    go.wait()
    asyncio.run(_attack_loop(attacks, name, go.until.value, clients))
    sent.value = attacks.sent


class _Go:
    """A start signal that carries the phase's deadline."""

    def __init__(self, ctx: Any) -> None:
        self.event = ctx.Event()
        self.until = ctx.Value("d", 0.0)

    def wait(self) -> None:
        self.event.wait()

    def start(self, until: float) -> None:
        self.until.value = until
        self.event.set()


def _p99(xs: list[float]) -> float:
    if len(xs) < 2:
        return xs[0] if xs else 0.0
    return statistics.quantiles(xs, n=100, method="inclusive")[98]


async def _main(args: argparse.Namespace, url: str, data_dir: Path) -> dict[str, Any]:
    seed, bls_secret = os.urandom(32), bls.keygen(os.urandom(32))
    run = make_synthetic_run(RUN, [Identity("validator", seed, bls_secret)], quorum=1, schedule={
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
    kit = AttackKit.build(url, run, workers[0])
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    validating = ctx.Process(target=validator, args=(url, run.signed.encode(), seed,
                                                     bls_secret, stop), daemon=True)
    validating.start()
    rows_before = rejection_rows()
    report: dict[str, Any] = {"refused_sent": 0, "victim_429s": 0}
    #: phase -> the honest write latencies of all its repetitions; and per repetition.
    pooled: dict[str, list[float]] = {phase: [] for phase in PHASES}
    each: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for rep in range(args.repeats):
        for phase in PHASES:
            honest.latencies, honest.statuses = [], []
            proc, go, sent = None, _Go(ctx), ctx.Value("q", 0)
            if phase != "idle":  # its own process: it shares the machine, not our loop
                ready = ctx.Event()
                proc = ctx.Process(target=attacker, args=(kit, phase, args.attackers, ready,
                                                          go, sent), daemon=True)
                proc.start()
                if not await asyncio.to_thread(ready.wait, 120):
                    raise RuntimeError(f"the {phase} attacker did not start")
            until = time.monotonic() + args.seconds
            go.start(until)
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(honest.play(s, until), honest.newcomers(s, until))
            if proc is not None:
                await asyncio.to_thread(proc.join, 60)
            p99 = _p99(honest.latencies)
            pooled[phase] += honest.latencies
            each[phase].append(p99)
            report["refused_sent"] += sent.value
            report["victim_429s"] += honest.statuses.count(429)
            print(f"[{rep + 1}/{args.repeats}] {phase:14s} rounds={honest.rounds:3d} honest "
                  f"writes={len(honest.latencies):4d} p99={1000 * p99:7.1f} ms refused "
                  f"sent={sent.value:5d} 429s={honest.statuses.count(429)}", flush=True)
    report["p99_ms"] = {phase: 1000 * _p99(xs) for phase, xs in pooled.items()}
    report["writes"] = {phase: len(xs) for phase, xs in pooled.items()}
    report["each_ratio"] = {phase: [x / max(i, 1e-9) for x, i in zip(each[phase], each["idle"],
                                                                       strict=True)]
                            for phase in PHASES}
    stop.set()
    await asyncio.to_thread(validating.join, 30)
    await asyncio.sleep(1.0)
    with engine.connect() as c:
        named = set(c.execute(select(t.Blob.sha256)).scalars())
    blob_root = data_dir / "blobs"
    stray = sum(p.stat().st_size for p in blob_root.glob("??/*") if p.name not in named)
    leftovers = sum(p.stat().st_size for p in (blob_root / "tmp").glob("*"))
    report["refused_bytes_stored"] = stray + leftovers
    report["refused_rows"] = rejection_rows() - rows_before
    report["rounds"] = honest.rounds
    engine.dispose()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each phase")
    ap.add_argument("--workers", type=int, default=4, help="honest workers per round")
    ap.add_argument("--attackers", type=int, default=8, help="concurrent attack clients")
    ap.add_argument("--repeats", type=int, default=3,
                    help="times the whole phase sequence runs (p99s pooled per phase)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        procs = LocalProcesses(Path(tmp) / "logs")
        try:
            url = procs.start_ledger(Path(tmp) / "ledger", extra=[
                "--ip-rate", "1000", "--ip-burst", "2000"])
            report = asyncio.run(_main(args, url, Path(tmp) / "ledger"))
        finally:
            procs.stop_all()
    idle = report["p99_ms"]["idle"] or 1e-9
    ratios = {name: ms / idle for name, ms in report["p99_ms"].items()}
    worst = max(r for name, r in ratios.items() if name != "idle")
    print(f"\nhonest writes' p99 over {args.repeats} repetitions of each phase (pooled), "
          "its ratio to idle's, and the ratio within each repetition (worst / median):")
    for name in PHASES:
        per_rep = report["each_ratio"][name]
        print(f"{name:14s} writes {report['writes'][name]:4d}  p99 {report['p99_ms'][name]:7.1f} "
              f"ms  ratio {ratios[name]:5.2f}  per repetition {max(per_rep):5.2f} / "
              f"{statistics.median(per_rep):5.2f}")
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
