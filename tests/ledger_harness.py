"""An in-process ledger on a loopback port with a real SQLite file, for API tests."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from fakes import FakeRun
from veritrain.ledger.server import LEDGER, LedgerConfig, make_app
from veritrain.protocol.beacon import EVERY_WORKER_ADMITTED, beacon_root, sealed_list_digest_of
from veritrain.protocol.encoding import encode_canonical
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import BeaconShare, CertifiedState, RoundResult, digest_of, sign


class Api:
    def __init__(self, server: TestServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.session = session
        self.url = str(server.make_url("")).rstrip("/")

    @property
    def store(self) -> Any:
        return self.server.app[LEDGER].store

    async def get(self, path: str) -> tuple[int, Any]:
        async with self.session.get(self.url + path) as resp:
            return resp.status, await resp.json(content_type=None)

    async def post_json(self, path: str, wire: Any) -> tuple[int, Any]:
        async with self.session.post(self.url + path, data=encode_canonical(wire)) as resp:
            return resp.status, await resp.json(content_type=None)

    async def post_parts(self, path: str, parts: list[tuple[str, bytes]]) -> tuple[int, Any]:
        with aiohttp.MultipartWriter("form-data") as mp:
            for name, data in parts:
                part = mp.append(data, {"Content-Type": "application/octet-stream"})
                part.set_content_disposition("form-data", name=name)
            async with self.session.post(self.url + path, data=mp) as resp:
                return resp.status, await resp.json(content_type=None)

    async def create_run(self, run: FakeRun) -> tuple[int, Any]:
        return await self.post_parts("/v1/runs", [("spec", run.signed.encode()),
                                                  ("dataset", run.dataset),
                                                  ("genesis", run.genesis)])

    async def register(self, run: FakeRun, worker: Identity) -> tuple[int, Any]:
        from veritrain.protocol.messages import Registration, sign

        reg = Registration(run_id=run.spec.run_id, round=0, participant=worker.public_key.hex(),
                           role="worker", created_at=1)
        return await self.post_json(f"/v1/runs/{run.spec.run_id}/participants",
                                    sign(worker, reg).to_wire())

    async def submit(self, signed: Any, payload: bytes, *, run_id: str | None = None,
                     round_index: int | None = None) -> tuple[int, Any]:
        msg = signed.message
        path = (f"/v1/runs/{run_id or msg.run_id}/rounds/"
                f"{msg.round if round_index is None else round_index}/submissions")
        return await self.post_parts(path, [("envelope", signed.encode()), ("payload", payload)])


async def replay_from(api: Any, address: str, path: str, wire: Any, times: int) -> list[int]:
    """POST an exact copy of a public message ``times`` times from another loopback
    address (another source on the same machine); the statuses."""
    statuses = []
    connector = aiohttp.TCPConnector(local_addr=(address, 0))
    async with aiohttp.ClientSession(connector=connector) as attacker:
        for _ in range(times):
            async with attacker.post(f"{api.url}{path}", data=encode_canonical(wire)) as resp:
                statuses.append(resp.status)
    return statuses


async def key_rate_limited(api: Any) -> int:
    """How many writes the ledger answered 429 for a key's own budget (its metrics)."""
    async with api.session.get(f"{api.url}/metrics") as resp:
        text = await resp.text()
    line = next(x for x in text.splitlines()
                if x.startswith('veritrain_rate_limited_total{scope="key"}'))
    return int(float(line.split()[-1]))


def run_api(tmp_path: Path, scenario: Callable[[Api], Awaitable[Any]], *,
            tick_seconds: float = 0.05, db_url: str | None = None,
            identity: Identity | None = None, **config: Any) -> Any:
    """Run ``scenario`` against a fresh ledger app served on loopback.

    ``db_url`` picks the database (default: a SQLite file in ``tmp_path``); other
    keywords are :class:`LedgerConfig` fields (rate limits, for example).
    """

    async def main() -> Any:
        cfg = LedgerConfig(data_dir=tmp_path / "ledger",
                           db_url=db_url or f"sqlite:///{tmp_path / 'ledger.sqlite'}",
                           tick_seconds=tick_seconds, **config)
        server = TestServer(make_app(cfg, identity or Identity.generate("ledger")),
                            host="127.0.0.1")
        await server.start_server()
        try:
            async with aiohttp.ClientSession() as session:
                return await scenario(Api(server, session))
        finally:
            await server.close()

    return asyncio.run(main())


async def open_and_submit(api: Api, bundle: Any, workers: list[Identity], preps: dict[str, Any],
                          submitting: list[Identity] | None = None) -> None:
    """Create ``bundle``'s run (a ``build_run`` result), register ``workers`` and submit
    the prepared submission (``preps``: worker key -> PreparedSubmission) of each worker
    in ``submitting`` (default: all of them)."""
    from veritrain.protocol.messages import Registration, sign

    run_id = bundle.signed.message.run_id
    status, _ = await api.create_run(type("R", (), {
        "signed": bundle.signed, "dataset": bundle.dataset, "genesis": bundle.genesis})())
    assert status == 201
    for w in workers:
        reg = Registration(run_id=run_id, round=0, participant=w.public_key.hex(),
                           role="worker", created_at=1)
        await api.post_json(f"/v1/runs/{run_id}/participants", sign(w, reg).to_wire())
    for w in submitting if submitting is not None else workers:
        p = preps[w.public_key.hex()]
        status, _ = await api.submit(p.signed, p.payload)
        assert status == 201


async def reveal_all(api: Api, run: Any, preps: dict[str, Any], identities: list[Identity],
                     r: int = 0, *, skip: frozenset[str] = frozenset(),
                     hand: bool = False) -> int:
    """Answer every due check of round ``r`` as the workers would: each worker in ``preps``
    (worker key -> its PreparedSubmission) whose reveal is due writes its reveal from its
    evidence and posts it signed with its key from ``identities``; ``skip`` workers reveal
    nothing. With ``hand`` each worker then hands its receipted claim to the validators'
    inboxes, as workers/node.py does. Returns how many posted."""
    from veritrain.protocol.beacon import beacon_seed_of
    from veritrain.protocol.messages import SpotReveal, sign
    from veritrain.protocol.tensors import sha256_hex
    from veritrain.workers.evidence import reveal_bytes

    run_id = run.spec.run_id
    view = (await api.get(f"/v1/runs/{run_id}/rounds/{r}/challenges"))[1]
    assert view["fixed"], view
    if run.spec.masked is not None:  # a masked round's checks come from its openings seed
        board = (await api.get(f"/v1/runs/{run_id}/rounds/{r}/secagg"))[1]
        seed = bytes.fromhex(board["openings"]["fixed"]["seed"])
    else:
        beacon = (await api.get(f"/v1/runs/{run_id}/rounds/{r}/beacon"))[1]
        seed = bytes.fromhex(beacon_seed_of(beacon["beacon"]))
    sent = 0
    for c in view["challenges"]:
        prep = preps.get(c["worker"])
        if not c["due"] or prep is None or c["worker"] in skip:
            continue
        sub = prep.signed.message
        data = reveal_bytes(prep.evidence, seed, c["segments"], sub)
        if data is None and run.spec.masked is not None:
            data = hollow_reveal(run, c["segments"], sub, prep.payload)
        if data is None:  # nothing kept to open (a free rider)
            continue
        envelope = SpotReveal(run_id=run_id, round=r, worker=sub.worker,
                              submission_digest=prep.signed.digest,
                              reveal_hash=sha256_hex(data), reveal_bytes=len(data),
                              created_at=1)
        identity = next(i for i in identities if i.public_key.hex() == sub.worker)
        status, body = await api.post_parts(f"/v1/runs/{run_id}/rounds/{r}/reveals",
                                            [("envelope", sign(identity, envelope).encode()),
                                             ("reveal", data)])
        assert status == 201, body
        sent += 1
        if hand:
            from veritrain.protocol.receipts import open_reveal_claim
            from veritrain.workers.disputes import hand_to_validators

            ledger_key = (await api.get("/v1/ledger"))[1]["ledger_key"]
            claim = open_reveal_claim({"envelope": sign(identity, envelope).to_wire(),
                                       "receipt": body}, run_id, ledger_key)
            answers = await hand_to_validators(run.spec, claim)
            assert set(answers.values()) <= {"held"}, answers
    return sent


def reveals_under(run: Any, preps: dict[str, Any], seed: bytes) -> dict[str, bytes | None]:
    """The reveal each worker in ``preps`` would send under ``seed`` (checks in process)."""
    from veritrain.protocol.challenges import ChallengePolicy, compute_challenges
    from veritrain.workers.evidence import reveal_bytes

    policy = ChallengePolicy.of_run(run.spec)
    challenges = compute_challenges(seed, sorted(preps), policy)
    return {w: reveal_bytes(preps[w].evidence, seed, challenges[w], preps[w].signed.message)
            for w in policy.checked_workers(challenges)}


def hollow_reveal(run: Any, segments: list[int], sub: Any, payload: bytes) -> bytes:
    """What a free rider of a masked run can reveal: the layout its checks need, its real
    payload, zeros where states it never trained should be (their checks then fail)."""
    import io
    import math

    from veritrain.protocol.reveal import reveal_layout, write_reveal

    layout = reveal_layout(run, segments, masked_payload=sub.payload_bytes)

    def zeros(size: int) -> Any:
        return lambda fh: fh.write(bytes(size))

    producers = {name: (lambda fh: fh.write(payload)) if name == "payload" else zeros(
        math.prod(shape) * (4 if dtype == "F32" else 1)) for name, dtype, shape in layout.entries}
    buf = io.BytesIO()
    write_reveal(buf, layout, producers)
    return buf.getvalue()


def record_pairing_threads(monkeypatch: Any) -> list[str]:
    """The name of the thread each ``bls.verify`` runs on, appended as it runs (patched for
    the test): the ledger's pairings belong on its verifier thread, never its single
    writer, where one would hold up every queued post past its phase's deadline."""
    import threading

    from veritrain.protocol import bls

    threads: list[str] = []
    real = bls.verify

    def recording(pub: bytes, message: bytes, signature: bytes) -> bool:
        threads.append(threading.current_thread().name)
        return real(pub, message, signature)

    monkeypatch.setattr(bls, "verify", recording)
    return threads


# --- a round's beacon shares and results, as validators post them ----------------------


async def post_share(api: Api, run: FakeRun, v: Identity, r: int) -> dict:
    sealed = sealed_list_digest_of(
        (await api.get(f"/v1/runs/{run.spec.run_id}/rounds/{r}/submissions"))[1]["submissions"])
    share = BeaconShare(run_id=run.spec.run_id, round=r, validator=v.public_key.hex(),
                        share=v.sign_bls(beacon_root(run.spec.run_id, r)).hex(), sealed=sealed,
                        participants=EVERY_WORKER_ADMITTED)
    status, body = await api.post_json(f"/v1/runs/{run.spec.run_id}/rounds/{r}/beacon",
                                       sign(v, share).to_wire())
    assert status == 200, body
    return body


def verdict(worker: Identity, digest: str, ok: bool, reason: str = "spot_check_failed"
            ) -> dict:
    return {"worker": worker.public_key.hex(), "submission_digest": digest,
            "status": "accepted" if ok else "rejected",
            "reason": "" if ok else reason,
            "detail": "" if ok else "segment 1: recomputed state differs by 0.8",
            "spot_checked": True, "distance": 0.0 if ok else 0.8, "checks": []}


async def post_result(api: Api, run: FakeRun, v: Identity, r: int, base: str, seed: str,
                      verdicts: list, rewards: dict[str, float], model: bytes,
                      shards: list[dict] | None = None) -> tuple[int, dict]:
    scores = [{"worker": x["worker"], "samples": 80, "quality": 1.0,
               "score": 80.0 if x["status"] == "accepted" else 0.0,
               "reward": rewards.get(x["worker"], 0.0)} for x in verdicts]
    outer, update = b"momentum " + model, b"update " + model
    certified = CertifiedState(
        run_id=run.spec.run_id, round=r + 1, model_hash=hashlib.sha256(model).hexdigest(),
        outer_state_hash=hashlib.sha256(outer).hexdigest(),
        update_hash=hashlib.sha256(update).hexdigest(), verdicts_hash=digest_of(verdicts),
        scores_hash=digest_of(scores), eval_loss=2.0, shards=shards)
    result = RoundResult(run_id=run.spec.run_id, round=r, validator=v.public_key.hex(),
                         base_model_hash=base, beacon_seed=seed, verdicts=verdicts,
                         scores=scores, certified=certified.to_body(),
                         attestation=v.sign_bls(certified.signing_root()).hex())
    return await api.post_parts(f"/v1/runs/{run.spec.run_id}/rounds/{r}/results",
                                [("result", sign(v, result).encode()), ("model", model),
                                 ("outer_state", outer), ("update", update)])
