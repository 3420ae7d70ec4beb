"""The ledger's door over HTTP: each refusal is clear, recorded when its signer sent it,
and changes nothing."""

import hashlib

import pytest
from fakes import make_fake_run, make_submission
from ledger_backends import make_fixture
from ledger_harness import run_api
from sqlalchemy import func, select
from veritrain.ledger import schema as t
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Receipt, open_signed

PAYLOAD = b"\x01\x02" * 10
ledger_url = make_fixture()  # every test runs on SQLite and on PostgreSQL


def _counts(store):
    with store.sessions() as s:
        return {name: s.execute(select(func.count()).select_from(table)).scalar_one()
                for name, table in [("submissions", t.Submission), ("events", t.Event),
                                    ("blobs", t.Blob)]}


def test_submission_gets_a_signed_receipt_and_payload_is_sealed(tmp_path, ledger_url):
    run = make_fake_run("api-run")
    worker, other = Identity.generate("worker"), Identity.generate("worker")

    async def scenario(api):
        assert (await api.create_run(run))[0] == 201
        assert (await api.register(run, worker))[0] == 200
        assert (await api.register(run, other))[0] == 200
        status, wire = await api.submit(make_submission(run, worker, PAYLOAD), PAYLOAD)
        assert status == 201, wire
        receipt = open_signed(wire, Receipt)
        ledger_key = (await api.get("/v1/ledger"))[1]["ledger_key"]
        assert receipt.signer == ledger_key
        digest = hashlib.sha256(PAYLOAD).hexdigest()
        status, body = await api.get(f"/v1/blobs/{digest}")
        assert status == 403 and body["reason"] == "sealed"
        status, body = await api.get(f"/v1/runs/{run.spec.run_id}/rounds/0/submissions")
        assert status == 409
        # The second registered worker's submission closes the round early.
        payload2 = b"\x05" * 8
        assert (await api.submit(make_submission(run, other, payload2), payload2))[0] == 201
        info = (await api.get(f"/v1/runs/{run.spec.run_id}/rounds/current"))[1]
        assert info["status"] == "closed"
        async with api.session.get(f"{api.url}/v1/blobs/{digest}") as resp:
            assert resp.status == 200 and await resp.read() == PAYLOAD
        sealed = (await api.get(f"/v1/runs/{run.spec.run_id}/rounds/0/submissions"))[1]
        assert len(sealed["submissions"]) == 2

    run_api(tmp_path, scenario, db_url=ledger_url)


BREAKERS = {
    "malformed": dict(overrides={"trail": []}),
    "bad_signature": dict(tamper=True),
    "wrong_run": dict(url_run="other-run"),
    "wrong_round": dict(overrides={"round": 1}),
    "unknown_worker": dict(unregistered=True),
    "wrong_base_model": dict(overrides={"base_model_hash": "9" * 64}),
    "wrong_codec": dict(overrides={"codec": {"name": "int8", "params": {}}}),
    "oversized": dict(payload=b"x" * 5000),
    "payload_mismatch": dict(overrides={"payload_hash": "8" * 64}),
    "duplicate": dict(twice=True, overrides={"loss_last": 1.5}),  # another update, same round
}
STATUS = {"bad_signature": 401, "unknown_worker": 403, "oversized": 413, "duplicate": 409,
          "not_found": 404}


@pytest.mark.parametrize("reason", sorted(BREAKERS))
def test_invalid_submission_refused_with_reason(tmp_path, reason, ledger_url):
    case = BREAKERS[reason]
    run = make_fake_run("api-run")
    worker, bystander = Identity.generate("worker"), Identity.generate("worker")

    async def scenario(api):
        await api.create_run(run)
        await api.register(run, bystander)
        if not case.get("unregistered"):
            await api.register(run, worker)
        if case.get("twice"):
            ok = make_submission(run, worker, PAYLOAD)
            assert (await api.submit(ok, PAYLOAD))[0] == 201
        payload = case.get("payload", PAYLOAD)
        signed = make_submission(run, worker, payload, **case.get("overrides", {}))
        if case.get("tamper"):
            wire = signed.to_wire()
            wire["body"]["loss_last"] = 0.5
            from veritrain.protocol.encoding import encode_canonical

            async def post():
                import aiohttp
                with aiohttp.MultipartWriter("form-data") as mp:
                    for name, data in (("envelope", encode_canonical(wire)), ("payload", payload)):
                        part = mp.append(data, {"Content-Type": "application/octet-stream"})
                        part.set_content_disposition("form-data", name=name)
                    async with api.session.post(
                            f"{api.url}/v1/runs/api-run/rounds/0/submissions", data=mp) as resp:
                        return resp.status, await resp.json(content_type=None)
            before = _counts(api.store)
            status, body = await post()
        else:
            before = _counts(api.store)
            status, body = await api.submit(signed, payload, run_id=case.get("url_run"))
        expected_reason = "wrong_round" if reason == "wrong_run" else reason
        assert body["reason"] == expected_reason, body
        assert status == STATUS.get(expected_reason, 400)
        assert body["status"] == status and body["detail"]
        assert _counts(api.store) == before
        rejections = (await api.get("/v1/runs/api-run/rejections"))[1]["rejections"]
        # A row names a member of the run that sent the refused message; a forged
        # signature, a copy sent to another run's URL or a key in no run (a throwaway key)
        # writes none and is only counted in /metrics.
        if reason not in ("wrong_run", "bad_signature", "unknown_worker"):
            assert [r["reason"] for r in rejections] == [expected_reason]
        else:
            assert rejections == []
        round_info = (await api.get("/v1/runs/api-run/rounds/0"))[1]
        assert round_info["status"] == "open"
        assert round_info["submissions"] == (1 if case.get("twice") else 0)

    run_api(tmp_path, scenario, db_url=ledger_url)


def test_invalid_oversized_body_refused_before_read(tmp_path, ledger_url):
    run = make_fake_run("api-run")

    async def scenario(api):
        await api.create_run(run)
        async with api.session.post(f"{api.url}/v1/runs/api-run/participants",
                                    data=b"x" * (2 << 20)) as resp:
            body = await resp.json(content_type=None)
            assert resp.status == 413 and body["reason"] == "oversized"
            assert resp.headers["Content-Type"].startswith("application/problem+json")

    run_api(tmp_path, scenario, db_url=ledger_url)


def test_invalid_run_spec_with_bad_proof_of_possession(tmp_path, ledger_url):
    good = make_fake_run("pop-run")
    imposter = Identity.generate("validator")
    validators = [dict(good.spec.validators[0], bls_pop=imposter.public.bls_pop)]
    bad = make_fake_run("pop-run", validators=validators)

    async def scenario(api):
        status, body = await api.create_run(bad)
        assert status == 401 and body["reason"] == "bad_signature"
        assert (await api.get("/v1/runs/pop-run"))[0] == 404

    run_api(tmp_path, scenario, db_url=ledger_url)


def test_round_extends_when_too_few_submissions(tmp_path, ledger_url):
    schedule = {"round_seconds": 0.2, "min_submissions": 2, "max_rounds": 3}
    run = make_fake_run("slow-run", schedule=schedule)
    worker = Identity.generate("worker")

    async def scenario(api):
        import asyncio

        await api.create_run(run)
        await api.register(run, worker)
        await api.register(run, Identity.generate("worker"))
        await api.register(run, Identity.generate("worker"))
        assert (await api.submit(make_submission(run, worker, PAYLOAD), PAYLOAD))[0] == 201
        await asyncio.sleep(0.7)
        info = (await api.get("/v1/runs/slow-run/rounds/current"))[1]
        assert info["status"] == "open" and info["extensions"] >= 1
        # The extension is chained after the open round's first submission, so /events
        # holds it back with the sealed rows until the round closes (ledger-api.md).
        kinds = [e["kind"] for e in (await api.get("/v1/runs/slow-run/events"))[1]["events"]]
        assert "submission" not in kinds and "round_extended" not in kinds
        with api.store.sessions() as s:
            assert s.execute(select(func.count()).select_from(t.Event).where(
                t.Event.kind == "round_extended")).scalar_one() >= 1

    run_api(tmp_path, scenario, db_url=ledger_url)
