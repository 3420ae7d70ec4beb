"""Writes take only signed, replay-protected messages from registered keys, within rate
limits; reads are public. Every refusal is problem+json and changes nothing."""

from __future__ import annotations

import asyncio
import hashlib

from fakes import make_fake_run, make_submission
from ledger_backends import make_fixture
from ledger_harness import run_api
from ledger_scenarios import HONEST, beacon_share, build_results
from sqlalchemy import func, select
from veritrain.ledger import schema as t
from veritrain.protocol.beacon import beacon_seed_of, sealed_list_digest, sealed_list_digest_of
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Registration, sign

ledger_url = make_fixture()
PAYLOAD = b"\x07" * 16


def counts(store) -> dict[str, int]:
    with store.sessions() as s:
        return {name: s.execute(select(func.count()).select_from(table)).scalar_one()
                for name, table in [("events", t.Event), ("submissions", t.Submission),
                                    ("participants", t.Participant),
                                    ("results", t.RoundResultRow),
                                    ("shares", t.BeaconShareRow)]}


def unsigned(wire: dict) -> dict:
    return {k: v for k, v in wire.items() if k != "signature"}


def resigned_by(wire: dict, other: Identity) -> dict:
    """Same body, signed by another key than the one it names."""
    from veritrain.protocol.encoding import encode_canonical
    from veritrain.protocol.messages import open_signed  # noqa: F401 (documents the check)
    from veritrain.protocol.signing import compute_signing_root

    body = wire["body"]
    root = compute_signing_root(wire["kind"], body["run_id"], body["round"],
                                encode_canonical(body))
    return {**wire, "signature": other.sign_ed25519(root).hex()}


def registration(run, who: Identity, created_at: int = 1):
    return sign(who, Registration(run_id=run.spec.run_id, round=0,
                                  participant=who.public_key.hex(), role="worker",
                                  created_at=created_at))


async def post_result(api, signed, blobs):
    r = signed.message.round
    return await api.post_parts(
        f"/v1/runs/{signed.message.run_id}/rounds/{r}/results",
        [("result", signed.encode())] + [(name, data) for name, data in blobs.items()])


def test_invalid_writes_unsigned_wrongly_signed_replayed_or_unregistered(tmp_path, ledger_url):
    run = make_fake_run("door-run")
    worker, stranger = Identity.generate("worker"), Identity.generate("worker")
    other = Identity.generate("worker")
    validator = run.validators[0]

    async def scenario(api):
        store = api.store
        path = "/v1/runs/door-run"
        assert (await api.create_run(run))[0] == 201
        assert (await api.create_run(run))[1]["reason"] == "duplicate"  # replayed run spec

        # Registrations: signed by the named key; a replay is idempotent and writes nothing.
        reg = registration(run, worker).to_wire()
        before = counts(store)  # (other keeps the round open for the replay below)
        for wire, reason, status in [(unsigned(reg), "malformed", 400),
                                     (resigned_by(reg, stranger), "bad_signature", 401)]:
            got = await api.post_json(path + "/participants", wire)
            assert got == (status, got[1]) and got[1]["reason"] == reason, got
        assert counts(store) == before
        assert (await api.post_json(path + "/participants", reg))[1]["new"] is True
        await api.post_json(path + "/participants", registration(run, other).to_wire())
        after = counts(store)
        replay = await api.post_json(path + "/participants", reg)
        assert replay[0] == 200 and replay[1]["new"] is False
        assert counts(store) == after

        # Submissions: unsigned, wrongly signed, from an unregistered key, replayed.
        sub = make_submission(run, worker, PAYLOAD)
        loose = make_submission(run, stranger, PAYLOAD)
        from veritrain.protocol.encoding import encode_canonical

        async def submit_wire(wire):
            return await api.post_parts(path + "/rounds/0/submissions",
                                        [("envelope", encode_canonical(wire)),
                                         ("payload", PAYLOAD)])

        before = counts(store)
        for wire, reason, status in [
                (unsigned(sub.to_wire()), "malformed", 400),
                (resigned_by(sub.to_wire(), stranger), "bad_signature", 401),
                (loose.to_wire(), "unknown_worker", 403)]:
            got = await submit_wire(wire)
            assert got[0] == status and got[1]["reason"] == reason, got
        assert counts(store) == before
        first = await api.submit(sub, PAYLOAD)
        assert first[0] == 201
        after = counts(store)
        got = await api.submit(sub, PAYLOAD)  # a retry whose reply was lost: same receipt
        assert got == (200, first[1])
        other_update = make_submission(run, worker, PAYLOAD, loss_last=1.5)
        got = await api.submit(other_update, PAYLOAD)
        assert got[0] == 409 and got[1]["reason"] == "duplicate"
        assert counts(store) == after
        late = make_submission(run, other, PAYLOAD + b"!")
        assert (await api.submit(late, PAYLOAD + b"!"))[0] == 201  # closes the round
        closed = counts(store)
        got = await api.submit(sub, PAYLOAD)  # a replay after the close: its receipt, no row
        assert got == (200, first[1]) and counts(store) == closed
        got = await api.submit(other_update, PAYLOAD)  # a new one after the close
        assert got[0] == 400 and got[1]["reason"] == "wrong_round"
        assert counts(store) == closed

        # Beacon shares (after close): only the run's validators; a replay changes nothing.
        sealed = sealed_list_digest_of(
            (await api.get(path + "/rounds/0/submissions"))[1]["submissions"])
        share = beacon_share(run, validator, 0, sealed).to_wire()
        bpath = path + "/rounds/0/beacon"
        for wire, reason in [(unsigned(share), "malformed"),
                             (resigned_by(share, stranger), "bad_signature"),
                             (beacon_share(run, Identity.generate("validator"), 0,
                                           sealed).to_wire(), "unknown_validator"),
                             (beacon_share(run, validator, 0, sealed_list_digest([])).to_wire(),
                              "wrong_sealed_list")]:
            got = await api.post_json(bpath, wire)
            assert got[1]["reason"] == reason, got
        fixed = await api.post_json(bpath, share)
        assert fixed[0] == 200 and fixed[1]["beacon"] is not None
        after = counts(store)
        again = await api.post_json(bpath, share)
        assert again == fixed and counts(store) == after

        # Results: only validators; the same result twice is refused.
        seed = beacon_seed_of(fixed[1]["beacon"])
        subs = {worker.public_key.hex(): sub.digest, other.public_key.hex(): late.digest}
        results, blobs = build_results(run, 0, run.spec.genesis_model_hash, seed, subs,
                                       dict.fromkeys(subs, HONEST))
        impostor = Identity.generate("validator")
        forged = sign(impostor, results[0].message.__class__(
            **{**results[0].message.to_body(), "validator": impostor.public_key.hex()}))
        got = await post_result(api, forged, blobs)
        assert got[0] == 403 and got[1]["reason"] == "unknown_validator", got
        got = await post_result(api, results[0], blobs)
        assert got[0] == 201 and got[1]["certificate"] is True, got
        after = counts(store)
        got = await post_result(api, results[0], blobs)
        assert got[0] == 409 and got[1]["reason"] == "duplicate", got
        assert counts(store) == after

        # Reads stay public; every refused write a member of the run sent was recorded with
        # its reason (unsigned, forged and strangers' ones only in /metrics).
        reasons = {x["reason"] for x in (await api.get(path + "/rejections?limit=100"))[1][
            "rejections"]}
        assert "duplicate" in reasons
        assert not {"malformed", "bad_signature", "unknown_worker", "unknown_validator"} & reasons

    run_api(tmp_path, scenario, db_url=ledger_url)


def test_invalid_flood_from_one_key_is_limited_without_starving_others(tmp_path):
    run = make_fake_run("flood-run")
    flooder, patient = Identity.generate("worker"), Identity.generate("worker")

    async def scenario(api):
        await api.create_run(run)
        # 30 different registrations (only the key's holder can sign them): its budget.
        wires = [registration(run, flooder, created_at=1 + i).to_wire() for i in range(30)]
        replies = await asyncio.gather(*[api.post_json("/v1/runs/flood-run/participants", w)
                                         for w in wires])
        statuses = [s for s, _ in replies]
        assert statuses.count(200) == 5 and statuses.count(429) == 25
        refused = next(body for s, body in replies if s == 429)
        assert refused["reason"] == "rate_limited" and refused["status"] == 429
        # Another key from the same address still gets through at once.
        status, body = await api.post_json("/v1/runs/flood-run/participants",
                                           registration(run, patient).to_wire())
        assert status == 200 and body["new"] is True
        async with api.session.get(f"{api.url}/metrics") as resp:
            text = await resp.text()
        assert 'veritrain_rate_limited_total{scope="key"} 25' in text

    run_api(tmp_path, scenario, key_rate=0.001, key_burst=5, ip_rate=1000, ip_burst=1000)


def test_invalid_flood_from_one_address_gets_429_with_retry_after(tmp_path):
    async def scenario(api):
        got = []
        for _ in range(12):
            async with api.session.get(f"{api.url}/v1/health") as resp:
                got.append((resp.status, resp.headers.get("Retry-After"),
                            resp.headers.get("Content-Type", "")))
        ok = [g for g in got if g[0] == 200]
        limited = [g for g in got if g[0] == 429]
        assert len(ok) == 8 and len(limited) == 4
        assert all(r and int(r) >= 1 and ct.startswith("application/problem+json")
                   for _, r, ct in limited)

    run_api(tmp_path, scenario, ip_rate=0.01, ip_burst=8)


def test_token_bucket_refills_at_its_rate():
    from veritrain.ledger.ratelimit import TokenBuckets

    now = [0.0]
    buckets = TokenBuckets(2.0, 3, clock=lambda: now[0], max_keys=2)
    assert [buckets.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert buckets.take("a") == 0.5
    now[0] = 0.5
    assert buckets.take("a") == 0.0 and buckets.take("a") > 0
    buckets.take("b"), buckets.take("c")  # at most two keys are remembered
    assert "a" not in buckets._buckets
    # wait() says what take() would, spending nothing.
    now[0] = 10.0
    assert [buckets.wait("d") for _ in range(5)] == [0.0] * 5
    assert [buckets.take("d") for _ in range(3)] == [0.0] * 3
    assert buckets.wait("d") == buckets.wait("d") == 0.5
    assert hashlib  # (imported for the module's helpers)


def test_concurrent_submissions_committed_together_keep_their_own_outcomes(tmp_path):
    """Group commit: requests arriving together share a transaction, yet each gets
    the answer it would get alone: a byte-identical resend gets the same receipt, a
    second different envelope from one worker 409, everyone else a receipt."""
    run = make_fake_run("group-run", schedule={"round_seconds": 3600.0,
                                               "min_submissions": 100, "max_rounds": 3})
    workers = [Identity.generate("worker") for _ in range(12)]

    async def scenario(api):
        assert (await api.create_run(run))[0] == 201
        for w in workers:
            assert (await api.register(run, w))[1]["new"] is True
        subs = [make_submission(run, w, PAYLOAD + bytes([i])) for i, w in enumerate(workers)]
        twin = make_submission(run, workers[1], PAYLOAD + b"other", loss_last=1.5)
        sends = [(s, PAYLOAD + bytes([i])) for i, s in enumerate(subs)]
        sends += [(subs[0], PAYLOAD + bytes([0])), (twin, PAYLOAD + b"other")]
        got = await asyncio.gather(*(api.submit(s, p) for s, p in sends))
        statuses = [status for status, _ in got]
        assert statuses[2:12] == [201] * 10
        # worker 0 sent the same envelope twice: one 201 and one 200, same receipt
        assert sorted([statuses[0], statuses[12]]) == [200, 201]
        assert got[0][1] == got[12][1]
        # worker 1 sent two different envelopes: exactly one was recorded
        assert sorted([statuses[1], statuses[13]]) == [201, 409]
        loser = got[13] if statuses[13] == 409 else got[1]
        assert loser[1]["reason"] == "duplicate"
        with api.store.sessions() as s:
            rows = s.execute(select(t.Submission.worker, t.Submission.digest)).all()
            receipts = s.execute(select(func.count()).select_from(t.Event)
                                 .where(t.Event.kind == "receipt")).scalar_one()
        assert sorted(w for w, _ in rows) == sorted(w.public_key.hex() for w in workers)
        assert receipts == len(workers)
        kept = next(d for w, d in rows if w == workers[1].public_key.hex())
        winner = subs[1] if statuses[1] == 201 else twin
        assert kept == winner.digest

    run_api(tmp_path, scenario)


def test_resend_recorded_while_in_flight_gets_the_receipt_not_a_conflict(tmp_path):
    """The interleaving the group-commit test can only hit by chance: a resend passes the
    "already recorded?" check, then its twin commits before the resend's own checks run.
    The resend must still get the twin's receipt with 200, never 409."""
    run = make_fake_run("race-run", schedule={"round_seconds": 3600.0,
                                              "min_submissions": 100, "max_rounds": 3})
    worker = Identity.generate("worker")

    async def scenario(api):
        assert (await api.create_run(run))[0] == 201
        assert (await api.register(run, worker))[1]["new"] is True
        sub = make_submission(run, worker, PAYLOAD)
        status, first = await api.submit(sub, PAYLOAD)
        assert status == 201
        store = api.store
        real = type(store).recorded_receipt
        calls = []

        def stale_first_look(self, s, signed):
            calls.append(signed.digest)
            return None if len(calls) == 1 else real(self, s, signed)

        store.recorded_receipt = stale_first_look.__get__(store)
        try:
            status, again = await api.submit(sub, PAYLOAD)
        finally:
            del store.recorded_receipt
        assert len(calls) == 2  # the stale look, then the look after the refusal
        assert (status, again) == (200, first)
        other = make_submission(run, worker, PAYLOAD + b"x", loss_last=1.5)
        status, body = await api.submit(other, PAYLOAD + b"x")
        assert (status, body["reason"]) == (409, "duplicate")

    run_api(tmp_path, scenario)
