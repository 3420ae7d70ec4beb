"""A ledger that censors a reveal it receipted cannot get the worker banned (issue #28).

A worker hands the signed envelope and the ledger's signed receipt of each reveal to
every validator inbox the run spec names (workers/disputes.py); a validator holding such
a claim for a due worker whose file the board does not serve certifies nothing for the
round (``withheld_reveal``) instead of judging the reveal missing. Shown with a real
ledger on loopback whose challenge list, as served, drops one honest worker's reveal,
the real inbox server and the real worker hand-off:

* handed its claim, the validator refuses the round: no result, no ``missing_reveal``;
* not handed (the same lying ledger), the worker is certified ``missing_reveal``, the
  ban the claim prevents;
* with an honest ledger the same hand-off changes nothing: every claim the inbox holds
  is on the board (the inbox is read before the board), and the round certifies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import time

import aiohttp
import pytest
from fakes import validator_identities
from ledger_harness import Api, open_and_submit, reveal_all, run_api
from test_validator_http import honest, synthetic_settings
from veritrain.ledger import node_api
from veritrain.ledger.client import LedgerClient, LedgerRefused
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import RevealReceipt, SpotReveal, sign
from veritrain.protocol.organiser import build_run
from veritrain.protocol.receipts import open_reveal_claim
from veritrain.protocol.runtime import RunContext
from veritrain.validators.inbox import ReceiptInbox, start_inbox
from veritrain.validators.node import ValidatorConfig, ValidatorNode
from veritrain.workers.disputes import hand_to_validators

from veritrain.local import free_port

RUN = "dispute-run"


def _run(*, inbox: bool):
    validator = validator_identities(1)[0]
    public = validator.public
    if inbox:
        public = dataclasses.replace(public, inbox=f"http://127.0.0.1:{free_port()}")
    settings = synthetic_settings()
    settings["verification"]["reveal_seconds"] = 10.0
    bundle = build_run(Identity.generate("organiser"), RUN, settings, [public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(3)]
    preps = {w.public_key.hex(): honest(run, base, w) for w in workers}
    return validator, bundle, run, workers, preps


def _censor(monkeypatch, worker: str) -> None:
    """The ledger's challenge list, as served, never shows ``worker``'s reveal."""
    real = node_api.challenges_view

    def lying(*args, **kwargs):
        view = real(*args, **kwargs)
        for c in view["challenges"]:
            if c["worker"] == worker:
                c["reveal"] = None
        view["complete"] = False
        return view

    monkeypatch.setattr(node_api, "challenges_view", lying)


async def _play(api: Api, validator, bundle, run, workers, preps, *, hand: bool):
    await open_and_submit(api, bundle, workers, preps)
    node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=RUN, poll_seconds=0.05),
                         validator)
    async with LedgerClient(api.url, retry_for=5.0) as client:
        runner = await node.open_inbox(client, run.spec)
        try:
            info = await client.get_json(f"/v1/runs/{RUN}/rounds/0")
            await node.beacon_seed(client, run.spec, 0)
            assert await reveal_all(api, run, preps, workers, hand=hand) == len(workers)
            refused = None
            try:
                await node.validate_round(client, run, info)
            except RejectedInput as exc:
                refused = exc
        finally:
            if runner is not None:
                await runner.cleanup()
    summary = (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]
    results = (await api.get(f"/v1/runs/{RUN}/rounds/0/results"))[1]["results"]
    held = sorted(node.inbox.held(0)) if node.inbox is not None else []
    return refused, summary, results, held


@pytest.mark.parametrize("hand", [True, False], ids=["claim handed", "claim not handed"])
def test_a_censored_receipted_reveal_does_not_get_its_worker_banned(tmp_path, monkeypatch,
                                                                    hand):
    validator, bundle, run, workers, preps = _run(inbox=True)
    censored = workers[2].public_key.hex()
    _censor(monkeypatch, censored)
    refused, summary, results, held = run_api(tmp_path, lambda api: _play(
        api, validator, bundle, run, workers, preps, hand=hand))
    if hand:
        assert refused is not None and refused.reason == "withheld_reveal", refused
        assert censored[:12] in str(refused) and "not listed" in str(refused)
        assert summary["status"] == "closed" and results == []  # nothing certified
        assert censored in held
    else:  # the same lie without the claim: the honest worker is certified missing
        assert refused is None
        verdicts = {v["worker"]: v for v in summary["verdicts"]}
        assert summary["status"] == "finalized"
        assert verdicts[censored]["reason"] == "missing_reveal"
        assert held == []


def test_with_an_honest_ledger_handed_claims_change_nothing(tmp_path):
    validator, bundle, run, workers, preps = _run(inbox=True)
    refused, summary, results, held = run_api(tmp_path, lambda api: _play(
        api, validator, bundle, run, workers, preps, hand=True))
    assert refused is None
    assert summary["status"] == "finalized"
    assert {v["status"] for v in summary["verdicts"]} == {"accepted"}
    assert held == sorted(preps)  # every worker's claim was held, and each was on the board


# ------------------------------------------------------------------ the inbox itself


def _claim(ledger: Identity, worker: Identity, *, received: float = 9.0,
           run_id: str = RUN, r: int = 0, data: bytes = b"reveal") -> dict:
    me = worker.public_key.hex()
    env = sign(worker, SpotReveal(run_id=run_id, round=r, worker=me,
                                  submission_digest="aa" * 32,
                                  reveal_hash=hashlib.sha256(data).hexdigest(),
                                  reveal_bytes=len(data), created_at=1))
    receipt = sign(ledger, RevealReceipt(
        run_id=run_id, round=r, worker=me, reveal_digest=env.digest,
        reveal_hash=hashlib.sha256(data).hexdigest(), received_at=received, deadline=10.0,
        sequence=1))
    return {"envelope": env.to_wire(), "receipt": receipt.to_wire()}


def test_the_inbox_holds_only_claims_that_check_out_and_keeps_them(tmp_path):
    ledger, stranger = Identity.generate("ledger"), Identity.generate("ledger")
    w1, w2, w3 = (Identity.generate("worker") for _ in range(3))
    path = tmp_path / "inbox.jsonl"
    inbox = ReceiptInbox(RUN, ledger.public_key.hex(), path)
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1/runs/{RUN}/reveal-receipts"
    forged_env = _claim(ledger, w2)
    forged_env["envelope"]["body"]["reveal_bytes"] += 1  # the worker's signature breaks

    async def post(session, body, target=url):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        async with session.post(target, data=data) as resp:
            return resp.status, await resp.json()

    async def scenario():
        runner = await start_inbox(inbox, "127.0.0.1", port)
        try:
            async with aiohttp.ClientSession() as session:
                got = {
                    "new": await post(session, _claim(ledger, w1)),
                    "again": await post(session, _claim(ledger, w1, data=b"other file")),
                    "other ledger": await post(session, _claim(stranger, w2)),
                    "forged": await post(session, forged_env),
                    "late": await post(session, _claim(ledger, w2, received=11.0)),
                    "other run": await post(session, _claim(ledger, w2), url.replace(
                        RUN, "other-run")),
                    "wrong run in body": await post(session, _claim(ledger, w2,
                                                                    run_id="other-run")),
                    "not json": await post(session, b"{not json"),
                    "not a claim": await post(session, {"envelope": 1}),
                    "oversized": await post(session, b"[" + b"0," * 20000 + b"0]"),
                    "round 5": await post(session, _claim(ledger, w2, r=5)),
                }
                inbox.moved_to(8)  # rounds before 5 are forgotten, and refused from now
                got["stale"] = await post(session, _claim(ledger, w3, r=1))
                async with session.get(url + "/5") as resp:
                    got["listed"] = resp.status, await resp.json()
        finally:
            await runner.cleanup()
        return got

    got = asyncio.run(scenario())
    status = {k: v[0] for k, v in got.items()}
    assert status == {"new": 201, "again": 200, "other ledger": 401, "forged": 401,
                      "late": 409, "other run": 404, "wrong run in body": 401,
                      "not json": 400, "not a claim": 400, "oversized": 413, "round 5": 201,
                      "stale": 409, "listed": 200}, got
    assert got["late"][1]["error"] == "reveal_late"
    assert got["listed"][1]["workers"] == [w2.public_key.hex()]
    assert inbox.held(0) == {}  # round 0 fell behind the kept rounds
    # A restart reads back what was kept, checking each line again.
    with path.open("a") as f:
        f.write("not a claim\n" + json.dumps(_claim(stranger, w3, r=6)) + "\n")
    again = ReceiptInbox(RUN, ledger.public_key.hex(), path)
    assert {r: sorted(h) for r, h in again.claims.items()} == {5: [w2.public_key.hex()]}


def test_a_worker_hands_its_claim_to_every_inbox_and_a_down_one_costs_only_its_copy(tmp_path):
    ledger, worker = Identity.generate("ledger"), Identity.generate("worker")
    validators = validator_identities(2)
    up, down = free_port(), free_port()
    publics = [dataclasses.replace(validators[0].public, inbox=f"http://127.0.0.1:{up}"),
               dataclasses.replace(validators[1].public, inbox=f"http://127.0.0.1:{down}")]
    spec = build_run(Identity.generate("organiser"), RUN, synthetic_settings(), publics
                     ).signed.message
    assert spec.validator_inboxes() == {p.ed25519: p.inbox for p in publics}
    inbox = ReceiptInbox(RUN, ledger.public_key.hex())
    claim = open_reveal_claim(_claim(ledger, worker), RUN, ledger.public_key.hex())

    async def scenario():
        runner = await start_inbox(inbox, "127.0.0.1", up)
        try:
            return await hand_to_validators(spec, claim, timeout=5.0)
        finally:
            await runner.cleanup()

    answers = asyncio.run(scenario())
    assert answers[publics[0].ed25519] == "held"
    assert answers[publics[1].ed25519].startswith("retry, unreachable")
    assert list(inbox.held(0)) == [worker.public_key.hex()]


# --------------------------------------------------- a listed reveal the ledger won't serve


class _Board:
    """A ledger whose challenge list shows each worker's receipted reveal and whose blob
    store serves only the files in ``blobs``."""

    def __init__(self, ledger: Identity, listed: dict[str, dict], blobs: dict[str, bytes],
                 deadline: float = 10.0):
        self.ledger, self.listed, self.blobs, self.deadline = ledger, listed, blobs, deadline

    async def get_json(self, path: str):
        if path == "/v1/ledger":
            return {"ledger_key": self.ledger.public_key.hex()}
        return {"complete": True, "fixed": True, "now": self.deadline + 2.0,
                "reveal_deadline": self.deadline,
                "challenges": [{"worker": w, "segments": [0], "reveal": c}
                               for w, c in self.listed.items()]}

    async def get_blob(self, digest: str, **_):
        if digest not in self.blobs:
            raise LedgerRefused(404, "not_found", f"no blob {digest[:12]}")
        return self.blobs[digest]


def test_a_listed_reveal_whose_file_is_not_served_is_withheld_not_missing(tmp_path):
    ledger = Identity.generate("ledger")
    bundle = build_run(Identity.generate("organiser"), RUN, synthetic_settings(),
                       [validator_identities(1)[0].public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    served, kept = Identity.generate("worker"), Identity.generate("worker")
    listed = {w.public_key.hex(): _claim(ledger, w, data=w.public_key.hex().encode())
              for w in (served, kept)}
    blobs = {hashlib.sha256(served.public_key.hex().encode()).hexdigest():
             served.public_key.hex().encode()}
    submitted = {w: "aa" * 32 for w in listed}
    node = ValidatorNode(ValidatorConfig(ledger_url="http://unused", run_id=RUN),
                         validator_identities(1)[0])

    def gather(board):
        return asyncio.run(node.gather_reveals(board, run, 0, submitted,
                                               due={w: [0] for w in submitted}))

    with pytest.raises(RejectedInput) as info:
        gather(_Board(ledger, listed, blobs))
    assert info.value.reason == "withheld_reveal"
    assert kept.public_key.hex()[:12] in str(info.value) and "file not served" in str(info.value)
    # A reveal whose own signed envelope claims an oversized file is the worker's doing:
    # left out (its checks fail), not blamed on the ledger.
    too_big = json.loads(json.dumps(listed))
    w = kept.public_key.hex()
    big = dataclasses.replace(SpotReveal.from_body(too_big[w]["envelope"]["body"]),
                              reveal_bytes=1 << 40)
    env = sign(kept, big)
    receipt = RevealReceipt.from_body(too_big[w]["receipt"]["body"])
    too_big[w] = {"envelope": env.to_wire(), "receipt": sign(ledger, dataclasses.replace(
        receipt, reveal_digest=env.digest)).to_wire()}
    assert set(gather(_Board(ledger, too_big, blobs))) == {served.public_key.hex()}
    # Not due under this node's own draw: never fetched, whatever the ledger lists.
    assert asyncio.run(node.gather_reveals(_Board(ledger, listed, blobs), run, 0, submitted,
                                           due={})) == {}


def test_a_reveal_file_that_is_a_sealed_payload_is_refused_and_nothing_stored(tmp_path):
    """An honest ledger serves every reveal it receipts: a worker whose reveal file is the
    bytes of a payload still sealed (here in another run's open round) would otherwise
    get a receipt for a file nobody may fetch, and every validator holding its claim
    would certify nothing, round after round."""
    validator, bundle, run, workers, preps = _run(inbox=False)
    other = build_run(Identity.generate("organiser"), "dispute-other", synthetic_settings(),
                      [validator.public])
    other_run = RunContext.build(other.signed.message, other.dataset)
    outsiders = [Identity.generate("worker") for _ in range(2)]
    sealed = honest(other_run, other_run.decode_model(other.genesis), outsiders[0])

    async def scenario(api: Api):
        # The other run's round stays open: one of its two workers submitted.
        await open_and_submit(api, other, outsiders, {outsiders[0].public_key.hex(): sealed},
                              submitting=outsiders[:1])
        await open_and_submit(api, bundle, workers, preps)
        node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=RUN,
                                             poll_seconds=0.05), validator)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            await node.beacon_seed(client, run.spec, 0)
        w = workers[0]
        env = SpotReveal(run_id=RUN, round=0, worker=w.public_key.hex(),
                         submission_digest=preps[w.public_key.hex()].signed.digest,
                         reveal_hash=hashlib.sha256(sealed.payload).hexdigest(),
                         reveal_bytes=len(sealed.payload), created_at=1)
        refused = await api.post_parts(f"/v1/runs/{RUN}/rounds/0/reveals", [
            ("envelope", sign(w, env).encode()), ("reveal", sealed.payload)])
        other_round = (await api.get("/v1/runs/dispute-other/rounds/0"))[1]["status"]
        sent = await reveal_all(api, run, preps, workers)  # the real reveals still go in
        listed = (await api.get(f"/v1/runs/{RUN}/rounds/0/challenges"))[1]
        return refused, other_round, sent, listed

    refused, other_round, sent, listed = run_api(tmp_path, scenario)
    assert other_round == "open"
    assert refused[0] == 409 and refused[1]["reason"] == "blob_sealed", refused
    assert sent == len(workers) and listed["complete"]


def test_a_worker_hands_its_claim_again_until_every_inbox_holds_it(tmp_path, monkeypatch):
    """An inbox that was down when the worker revealed gets the claim on a later pass
    (kept beside the receipt, so a restart catches up too); one that holds it is not
    asked again, and neither is one that refused it for good (here: an inbox for another
    run, 404)."""
    import veritrain.workers.node as worker_node
    from veritrain.workers.state import WorkerState

    monkeypatch.setattr(worker_node, "HAND_RETRY_SECONDS", 0.0)
    ledger, worker = Identity.generate("ledger"), Identity.generate("worker")
    validators = validator_identities(3)
    ports = [free_port(), free_port(), free_port()]
    publics = [dataclasses.replace(v.public, inbox=f"http://127.0.0.1:{p}")
               for v, p in zip(validators, ports, strict=True)]
    spec = build_run(Identity.generate("organiser"), RUN, synthetic_settings(), publics
                     ).signed.message
    inboxes = [ReceiptInbox(run, ledger.public_key.hex()) for run in (RUN, RUN, "other-run")]
    state = WorkerState(tmp_path / "worker", RUN, 8)
    state.record_claim(0, _claim(ledger, worker))
    posts: list[str] = []
    real = worker_node.hand_to_validators

    async def counted(spec_, claim, *, skip=()):
        posts.extend(k for k in spec_.validator_inboxes() if k not in skip)
        return await real(spec_, claim, skip=skip, timeout=5.0)

    monkeypatch.setattr(worker_node, "hand_to_validators", counted)

    async def scenario():
        first = await start_inbox(inboxes[0], "127.0.0.1", ports[0])
        other = await start_inbox(inboxes[2], "127.0.0.1", ports[2])
        try:
            await worker_node.hand_claim(spec, state, 0, ledger.public_key.hex())
            after_one = (state.handed(0), state.refused(0))
            second = await start_inbox(inboxes[1], "127.0.0.1", ports[1])  # it comes up
            try:
                await worker_node.hand_claim(spec, state, 0, ledger.public_key.hex())
                await worker_node.hand_claim(spec, state, 0, ledger.public_key.hex())
            finally:
                await second.cleanup()
        finally:
            await first.cleanup()
            await other.cleanup()
        return after_one

    after_one = asyncio.run(scenario())
    keys = [p.ed25519 for p in publics]
    assert after_one == ({keys[0]}, {keys[2]})
    assert state.handed(0) == {keys[0], keys[1]} and state.refused(0) == {keys[2]}
    # The first pass asked all three, the second only the one that was down, the third
    # nobody: the refusing inbox was never asked again.
    assert posts == [keys[0], keys[1], keys[2], keys[1]]
    assert all(list(i.held(0)) == [worker.public_key.hex()] for i in inboxes[:2])
    assert list(inboxes[2].held(0)) == []
    # A state directory from before refusals were kept (a list of holders) still reads.
    (state.dir / "receipts" / "0.handed.json").write_text(json.dumps([keys[0]]))
    assert state.handed(0) == {keys[0]} and state.refused(0) == set()


def test_a_claim_that_arrives_while_the_round_is_judged_stops_a_missing_verdict():
    ledger, worker = Identity.generate("ledger"), Identity.generate("worker")
    bundle = build_run(Identity.generate("organiser"), RUN, synthetic_settings(),
                       [validator_identities(1)[0].public])
    node = ValidatorNode(ValidatorConfig(ledger_url="http://unused", run_id=RUN),
                         validator_identities(1)[0])
    node.inbox = ReceiptInbox(RUN, ledger.public_key.hex())
    me = worker.public_key.hex()
    verdicts = [{"worker": me, "submission_digest": "aa" * 32, "status": "rejected",
                 "reason": "missing_reveal"}]
    spec = bundle.signed.message
    node.check_claims_before_signing(spec, 0, verdicts)  # no claim held: signs
    assert node.inbox.offer(_claim(ledger, worker))
    with pytest.raises(RejectedInput) as info:
        node.check_claims_before_signing(spec, 0, verdicts)
    assert info.value.reason == "withheld_reveal" and me[:12] in str(info.value)
    # A claim on another submission, or another verdict, does not stop the round.
    node.check_claims_before_signing(spec, 0, [{**verdicts[0], "submission_digest": "bb" * 32}])
    node.check_claims_before_signing(spec, 0, [{**verdicts[0], "reason": "spot_check_failed"}])


def test_the_ledgers_word_on_the_deadline_and_on_completeness_is_not_taken():
    """The board says every reveal is in and the deadline passed; by this node's own draw
    one due reveal is missing, so it waits until its own clock passes the deadline too.
    A deadline earlier than the beacon this node saw fixed allows is ``early_deadline``."""
    ledger = Identity.generate("ledger")
    bundle = build_run(Identity.generate("organiser"), RUN, synthetic_settings(),
                       [validator_identities(1)[0].public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    listed_worker, silent = Identity.generate("worker"), Identity.generate("worker")
    data = b"the listed reveal"
    listed = {listed_worker.public_key.hex(): _claim(ledger, listed_worker, data=data)}
    blobs = {hashlib.sha256(data).hexdigest(): data}
    submitted = {listed_worker.public_key.hex(): "aa" * 32, silent.public_key.hex(): "aa" * 32}
    due = {w: [0] for w in submitted}
    node = ValidatorNode(ValidatorConfig(ledger_url="http://unused", run_id=RUN,
                                         poll_seconds=0.05), validator_identities(1)[0])
    deadline = time.time() + 1.0
    started = time.monotonic()
    got = asyncio.run(node.gather_reveals(_Board(ledger, listed, blobs, deadline), run, 0,
                                          submitted, due=due))
    assert time.monotonic() - started >= 0.9  # until this node's clock passed it as well
    assert set(got) == set(listed)
    with pytest.raises(RejectedInput) as info:
        asyncio.run(node.gather_reveals(_Board(ledger, listed, blobs), run, 0, submitted,
                                        due=due, not_before=50.0))
    assert info.value.reason == "early_deadline"


def test_only_the_inbox_s_own_final_refusal_stops_the_worker_asking(tmp_path):
    """An inbox for another run refuses the claim for good (its error JSON, 404
    ``not_found``); a proxy's bare 404 while the validator restarts, and the inbox's own
    429, are worth another try."""
    from aiohttp import web

    ledger, worker = Identity.generate("ledger"), Identity.generate("worker")
    validators = validator_identities(3)
    ports = [free_port() for _ in validators]
    publics = [dataclasses.replace(v.public, inbox=f"http://127.0.0.1:{p}")
               for v, p in zip(validators, ports, strict=True)]
    spec = build_run(Identity.generate("organiser"), RUN, synthetic_settings(), publics
                     ).signed.message
    claim = open_reveal_claim(_claim(ledger, worker), RUN, ledger.public_key.hex())

    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": "rate_limited", "detail": "slow down"}, status=429)

    async def scenario():
        runners = [await start_inbox(ReceiptInbox("other-run", ledger.public_key.hex()),
                                     "127.0.0.1", ports[0])]
        for port, routes in ((ports[1], []), (ports[2], [web.post("/{tail:.*}", busy)])):
            app = web.Application()
            app.add_routes(routes)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
        try:
            return await hand_to_validators(spec, claim, timeout=5.0)
        finally:
            for runner in runners:
                await runner.cleanup()

    answers = asyncio.run(scenario())
    other_run, proxy, busy_inbox = (answers[p.ed25519] for p in publics)
    assert other_run.startswith("refused 404"), other_run
    assert proxy.startswith("retry 404"), proxy
    assert busy_inbox.startswith("retry 429"), busy_inbox
