"""A receipt the ledger signed must be honoured, and its holder can tell (issue #28).

A real ledger on loopback and a real validator node finalize a round; the receipts the
ledger returned are then checked by the worker's own check
(:func:`veritrain.workers.node.check_receipts_honoured`) and by ``veritrain audit
receipt`` (:func:`veritrain.ledger.audit.audit_receipt`). A ledger that receipted a
submission it then kept out of the round, or a reveal it receipted in time whose worker
is certified ``missing_reveal``, is named by both; the verdicts they compare against
come from the quorum certificate and a validator's signed result, not the ledger's word.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time

import pytest
from fakes import validator_identities
from ledger_harness import Api, run_api
from test_validator_http import honest, synthetic_settings, validate
from veritrain.ledger.audit import audit_receipt, run_audit
from veritrain.ledger.client import LedgerClient
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    Receipt,
    Registration,
    RevealReceipt,
    sign,
)
from veritrain.protocol.organiser import build_run
from veritrain.protocol.receipts import check_reveal_receipt, check_submission_receipt
from veritrain.protocol.runtime import RunContext
from veritrain.workers.node import check_receipts_honoured


def _played(tmp_path):
    """One finalized round: three honest workers, the last one's reveal never shown to
    the validator; returns what each party holds afterwards."""
    ledger = Identity.generate("ledger")
    validator = validator_identities(1)[0]
    bundle = build_run(Identity.generate("organiser"), "rcpt-run", synthetic_settings(),
                       [validator.public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(3)]
    preps = {w.public_key.hex(): honest(run, base, w) for w in workers}
    censored = workers[2].public_key.hex()

    async def scenario(api: Api):
        status, _ = await api.create_run(type("R", (), {
            "signed": bundle.signed, "dataset": bundle.dataset, "genesis": bundle.genesis})())
        assert status == 201
        receipts = {}
        for w in workers:
            reg = Registration(run_id="rcpt-run", round=0, participant=w.public_key.hex(),
                               role="worker", created_at=1)
            await api.post_json("/v1/runs/rcpt-run/participants", sign(w, reg).to_wire())
        for w in workers:
            p = preps[w.public_key.hex()]
            status, receipts[w.public_key.hex()] = await api.submit(p.signed, p.payload)
            assert status == 201
        await validate(api, run, validator, preps, workers, skip=frozenset({censored}))
        _, info = await api.get("/v1/runs/rcpt-run/rounds/0")
        _, results = await api.get("/v1/runs/rcpt-run/rounds/0/results")

        async def audit(wire):
            async with LedgerClient(api.url, retry_for=5.0) as client:
                return await audit_receipt(client, "rcpt-run", wire)

        # The ledger receipts a submission it never logs (signed with its own key), and a
        # reveal of the censored worker in time that it never showed the validator.
        me = workers[0].public_key.hex()
        dropped = sign(ledger, Receipt(run_id="rcpt-run", round=0, worker=me,
                                       submission_digest="ab" * 32, received_at=time.time(),
                                       sequence=99)).to_wire()
        withheld = sign(ledger, RevealReceipt(
            run_id="rcpt-run", round=0, worker=censored, reveal_digest="cd" * 32,
            reveal_hash="ef" * 32, received_at=1.0, deadline=2.0, sequence=100)).to_wire()
        found = {name: await audit(wire) for name, wire in
                 [("honest", receipts[me]), ("dropped", dropped), ("withheld", withheld)]}
        stranger = sign(Identity.generate("ledger"), Receipt(
            run_id="rcpt-run", round=0, worker=me, submission_digest="ab" * 32,
            received_at=1.0, sequence=1)).to_wire()
        with pytest.raises(RejectedInput, match="not by this ledger"):
            await audit(stranger)
        rc, printed = await _audit_cli(api.url, tmp_path, dropped)
        return (receipts, dropped, withheld, info, results["results"], found, rc, printed)

    out = run_api(tmp_path, scenario, identity=ledger)
    return run, ledger, workers, censored, out


async def _audit_cli(url, tmp_path, wire):
    path = tmp_path / "receipt.json"
    path.write_text(json.dumps(wire))
    args = argparse.Namespace(ledger=url, run="rcpt-run", what="receipt", arg=str(path),
                              json=True, export=None, full=False, save=None, retry_for=5.0)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = await run_audit(args)
    return rc, json.loads(buf.getvalue())


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    return _played(tmp_path_factory.mktemp("receipts"))


def test_an_honoured_receipt_is_honoured_for_worker_and_auditor(played):
    run, ledger, workers, _, (receipts, _, _, info, results, found, _, _) = played
    me = workers[0].public_key.hex()
    assert info["status"] == "finalized"
    assert found["honest"].honoured is True and "accepted" in found["honest"].reason
    assert check_receipts_honoured(run, [receipts[me]], ledger.public_key.hex(), info, results)


def test_a_dropped_receipted_submission_is_named_by_worker_and_auditor(played):
    run, ledger, _, _, (_, dropped, _, info, results, found, rc, printed) = played
    assert found["dropped"].honoured is False
    assert "not in the sealed list" in found["dropped"].reason
    assert not check_receipts_honoured(run, [dropped], ledger.public_key.hex(), info, results)
    assert rc == 1 and printed["honoured"] is False  # `veritrain audit receipt FILE`


def test_a_withheld_timely_reveal_is_named(played):
    run, ledger, _, censored, (_, _, withheld, info, results, found, _, _) = played
    assert found["withheld"].honoured is False
    assert "missing_reveal" in found["withheld"].reason
    assert not check_receipts_honoured(run, [withheld], ledger.public_key.hex(), info, results)


def test_verdicts_served_without_a_matching_certified_result_are_not_believed(played):
    """A ledger serving a result list that leaves the worker out (to make an honest
    worker think itself dropped, or hide a drop) cannot make the worker conclude anything:
    the list no longer hashes to the certificate's, so it is not read."""
    run, ledger, workers, _, (receipts, _, _, info, results, _, _, _) = played
    me = workers[0].public_key.hex()
    tampered = json.loads(json.dumps(results))
    for wire in tampered:
        wire["body"]["verdicts"] = [v for v in wire["body"]["verdicts"] if v["worker"] != me]
    assert check_receipts_honoured(run, [receipts[me]], ledger.public_key.hex(), info, tampered)
    assert not check_submission_receipt(  # what believing the served list would conclude
        Receipt.from_body(receipts[me]["body"]), tampered[0]["body"]["verdicts"]).honoured


def test_rules_on_verdict_lists() -> None:
    r = Receipt(run_id="x", round=3, worker="aa" * 32, submission_digest="bb" * 32,
                received_at=1.0, sequence=1)
    judged = [{"worker": "aa" * 32, "submission_digest": "bb" * 32, "status": "rejected",
               "reason": "spot_check_failed"}]
    assert check_submission_receipt(r, judged).honoured is True  # judged, even if rejected
    assert check_submission_receipt(r, None).honoured is None  # not certified yet
    assert check_submission_receipt(r, judged, sealed=["cc" * 32]).honoured is False
    other = [{**judged[0], "submission_digest": "cc" * 32}]
    assert check_submission_receipt(r, other).honoured is False
    rr = RevealReceipt(run_id="x", round=3, worker="aa" * 32, reveal_digest="dd" * 32,
                       reveal_hash="ee" * 32, received_at=5.0, deadline=4.0, sequence=2)
    missing = [{**judged[0], "reason": "missing_reveal"}]
    assert check_reveal_receipt(rr, missing).honoured is True  # its own receipt says late
    timely = RevealReceipt(**{**rr.to_body(), "received_at": 3.0})
    assert check_reveal_receipt(timely, missing).honoured is False
    assert check_reveal_receipt(timely, judged).honoured is True


def test_every_validator_leaves_out_a_reveal_its_receipt_calls_late(tmp_path) -> None:
    """Whatever the ledger lists and whenever a validator polls, a reveal whose own
    signed receipt records it after the deadline is not judged: one reveal set."""
    import asyncio

    from veritrain.protocol.messages import SpotReveal
    from veritrain.validators.node import ValidatorConfig, ValidatorNode

    ledger = Identity.generate("ledger")
    bundle = build_run(Identity.generate("organiser"), "late-run", synthetic_settings(),
                       [validator_identities(1)[0].public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    on_time, late = Identity.generate("worker"), Identity.generate("worker")
    blobs, challenges, submitted = {}, [], {}
    for w, received in ((on_time, 9.0), (late, 11.0)):
        me, data = w.public_key.hex(), b"reveal of " + w.public_key.hex().encode()
        submitted[me] = "aa" * 32
        env = sign(w, SpotReveal(run_id="late-run", round=0, worker=me,
                                 submission_digest=submitted[me],
                                 reveal_hash=sha(data), reveal_bytes=len(data), created_at=1))
        receipt = sign(ledger, RevealReceipt(
            run_id="late-run", round=0, worker=me, reveal_digest=env.digest,
            reveal_hash=sha(data), received_at=received, deadline=10.0, sequence=1))
        blobs[sha(data)] = data
        challenges.append({"worker": me, "segments": [0],
                           "reveal": {"envelope": env.to_wire(), "receipt": receipt.to_wire()}})

    class Board:
        async def get_json(self, path: str):
            if path == "/v1/ledger":
                return {"ledger_key": ledger.public_key.hex()}
            return {"complete": True, "fixed": True, "now": 12.0, "reveal_deadline": 10.0,
                    "challenges": challenges}

        async def get_blob(self, digest: str, **_):
            return blobs[digest]

    node = ValidatorNode(ValidatorConfig(ledger_url="http://unused", run_id="late-run"),
                         validator_identities(1)[0])
    got = asyncio.run(node.gather_reveals(Board(), run, 0, submitted,
                                          due={w: [0] for w in submitted}))
    assert set(got) == {on_time.public_key.hex()}


def sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
