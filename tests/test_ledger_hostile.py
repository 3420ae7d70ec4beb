"""What a stranger's request may cost the ledger (issue #25), tried over HTTP on loopback.

Each test is one row of the issue's table: cheap checks answer before any BLS
verification; a refused request leaves no blob on disk or in the store; replays of
public messages do not spend the victim's budget; key-less junk writes no row; reads are
paged; an open round's envelopes stay unpublished; every response has its security
headers; a client that hangs up is not a 500.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import os
import time
from pathlib import Path

from fakes import make_fake_run, make_submission
from ledger_harness import key_rate_limited, replay_from, run_api
from ledger_scenarios import beacon_share
from sqlalchemy import func, select
from veritrain.ledger import schema as t
from veritrain.ledger.api_base import LEDGER
from veritrain.protocol.beacon import sealed_list_digest_of
from veritrain.protocol.encoding import encode_canonical
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Registration, RoundResult, RunSpec, sign

PAYLOAD = b"\x03" * 32


def _rows(store, table) -> int:
    with store.sessions() as s:
        return s.execute(select(func.count()).select_from(table)).scalar_one()


def _blob_files(tmp_path: Path) -> list[Path]:
    root = tmp_path / "ledger" / "blobs"
    return [p for p in root.rglob("*") if p.is_file()]


def _junk_validators(n: int) -> list[dict[str, str]]:
    """Validator entries whose keys parse but whose proofs of possession are made up."""
    return [{"ed25519": os.urandom(32).hex(), "bls": os.urandom(48).hex(),
             "bls_pop": os.urandom(96).hex()} for _ in range(n)]


def _respec(run, organiser: Identity, **changes):
    body = {**run.spec.to_body(), "organiser": organiser.public_key.hex(), **changes}
    return sign(organiser, RunSpec.from_body(body))


def _registration(run, who: Identity, created_at: int = 1):
    return sign(who, Registration(run_id=run.spec.run_id, round=0,
                                  participant=who.public_key.hex(), role="worker",
                                  created_at=created_at))


def test_duplicate_run_with_many_validators_is_answered_before_any_bls(tmp_path):
    run = make_fake_run("dup-run")
    stranger = Identity.generate("organiser")

    async def scenario(api):
        assert (await api.create_run(run))[0] == 201
        verifier = api.store.bls
        before = verifier.computed
        dup = _respec(run, stranger, validators=_junk_validators(64), quorum=43)
        for _ in range(3):  # repeatable, and each time free
            started = time.monotonic()
            status, body = await api.post_parts("/v1/runs", [
                ("spec", dup.encode()), ("dataset", os.urandom(1 << 20)),
                ("genesis", os.urandom(1 << 20))])
            assert status == 409 and body["reason"] == "duplicate", body
            assert time.monotonic() - started < 0.5
        assert verifier.computed == before  # no proof of possession was looked at
        # Over the operator's cap: refused by counting, before any verification.
        big = _respec(run, stranger, run_id="big-run", validators=_junk_validators(65),
                      quorum=1)
        status, body = await api.post_parts("/v1/runs", [("spec", big.encode())])
        assert status == 400 and "at most 64" in body["detail"], body
        assert verifier.computed == before
        # A quorum of half the validators or fewer: two disjoint quorums could certify two
        # states of one round. Refused as cheaply.
        for quorum in (2, 5):
            odd = _respec(run, stranger, run_id="minority-run",
                          validators=_junk_validators(4), quorum=quorum)
            status, body = await api.post_parts("/v1/runs", [("spec", odd.encode())])
            assert status == 400 and "quorum" in body["detail"], body
        assert verifier.computed == before
        # A proof verified once is remembered: the same key list in a new spec costs nothing.
        again = _respec(run, stranger, run_id="dup-run-2")
        status, _ = await api.post_parts("/v1/runs", [
            ("spec", again.encode()), ("dataset", run.dataset), ("genesis", run.genesis)])
        assert status == 201 and verifier.computed == before

    run_api(tmp_path, scenario, max_validators=64)


def test_replayed_beacon_share_and_result_cost_no_bls(tmp_path):
    from ledger_scenarios import HONEST, build_results
    from veritrain.protocol.beacon import beacon_seed_of

    run = make_fake_run("replay-run")
    validator = run.validators[0]
    worker = Identity.generate("worker")

    async def scenario(api):
        path = f"/v1/runs/{run.spec.run_id}"
        await api.create_run(run)
        await api.register(run, worker)
        sub = make_submission(run, worker, PAYLOAD)
        assert (await api.submit(sub, PAYLOAD))[0] == 201
        while (await api.get(path + "/rounds/0"))[1]["status"] == "open":
            await asyncio.sleep(0.05)
        sealed = sealed_list_digest_of(
            (await api.get(path + "/rounds/0/submissions"))[1]["submissions"])
        share = beacon_share(run, validator, 0, sealed).to_wire()
        fixed = await api.post_json(path + "/rounds/0/beacon", share)
        assert fixed[0] == 200 and fixed[1]["beacon"] is not None
        verifier = api.store.bls
        before = verifier.computed
        for _ in range(5):
            assert await api.post_json(path + "/rounds/0/beacon", share) == fixed
        assert verifier.computed == before
        seed = beacon_seed_of(fixed[1]["beacon"])
        subs = {worker.public_key.hex(): sub.digest}
        results, blobs = build_results(run, 0, run.spec.genesis_model_hash, seed, subs,
                                       dict.fromkeys(subs, HONEST))
        parts = [("result", results[0].encode()), *blobs.items()]
        assert (await api.post_parts(path + "/rounds/0/results", parts))[0] == 201
        before = verifier.computed
        for _ in range(3):
            status, body = await api.post_parts(path + "/rounds/0/results", parts)
            assert status == 409 and body["reason"] == "duplicate"
        assert verifier.computed == before

    run_api(tmp_path, scenario)


def test_refused_results_and_specs_leave_no_blob(tmp_path):
    run = make_fake_run("blob-run")
    stranger = Identity.generate("validator")

    async def scenario(api):
        path = f"/v1/runs/{run.spec.run_id}"
        assert (await api.create_run(run))[0] == 201
        files_before = sorted(_blob_files(tmp_path))
        rows_before = _rows(api.store, t.Blob)
        parts = [os.urandom(3 << 20) for _ in range(3)]
        digests = [hashlib.sha256(p).hexdigest() for p in parts]
        # A round result signed by a key in no run, carrying three 3 MiB parts.
        body = {"run_id": run.spec.run_id, "round": 0, "validator": stranger.public_key.hex()}
        from ledger_scenarios import build_results

        results, _ = build_results(run, 0, run.spec.genesis_model_hash, "00" * 32, {}, {})
        forged = sign(stranger, RoundResult.from_body({**results[0].message.to_body(), **body}))
        status, reply = await api.post_parts(path + "/rounds/0/results", [
            ("result", forged.encode()), ("model", parts[0]), ("outer_state", parts[1]),
            ("update", parts[2])])
        assert status in (403, 409) and reply["reason"] in ("unknown_validator",
                                                             "wrong_state"), reply
        # A spec with no validators, and one reusing the run id: their files are refused.
        organiser = Identity.generate("organiser")
        for spec, data in [(_respec(run, organiser, run_id="no-validators", validators=[],
                                    dataset_hash=digests[0]), parts[0]),
                           (_respec(run, organiser, dataset_hash=digests[1]), parts[1])]:
            status, reply = await api.post_parts("/v1/runs", [
                ("spec", spec.encode()), ("dataset", data), ("genesis", parts[2])])
            assert status in (400, 409), reply
        assert sorted(_blob_files(tmp_path)) == files_before
        assert _rows(api.store, t.Blob) == rows_before
        for digest in digests:
            status, reply = await api.get(f"/v1/blobs/{digest}")
            assert status == 404 and reply["reason"] == "not_found"
        assert list((tmp_path / "ledger" / "blobs" / "tmp").iterdir()) == []

    run_api(tmp_path, scenario)


def test_a_refused_submission_keeps_nothing_and_an_accepted_one_is_published(tmp_path):
    run = make_fake_run("stage-run", schedule={"round_seconds": 3600.0, "min_submissions": 9,
                                               "max_rounds": 2})
    worker = Identity.generate("worker")

    async def scenario(api):
        await api.create_run(run)
        await api.register(run, worker)
        files = sorted(_blob_files(tmp_path))
        wrong = make_submission(run, worker, PAYLOAD, base_model_hash="9" * 64)
        assert (await api.submit(wrong, PAYLOAD))[0] == 400
        assert sorted(_blob_files(tmp_path)) == files
        ok = make_submission(run, worker, PAYLOAD)
        assert (await api.submit(ok, PAYLOAD))[0] == 201
        assert (tmp_path / "ledger" / "blobs" / ok.message.payload_hash[:2]
                / ok.message.payload_hash).read_bytes() == PAYLOAD

    run_api(tmp_path, scenario)


def test_unreferenced_files_are_collected_at_start(tmp_path):
    from veritrain.ledger.blobs import BlobStore

    store = BlobStore(tmp_path / "ledger" / "blobs")
    stray = store.put(b"left by a crash between publishing and commit")
    leftover = store.tmp_dir / "up-leftover"
    leftover.write_bytes(b"partial")
    old = time.time() - 3600
    os.utime(leftover, (old, old))

    async def scenario(api):
        return api.store

    run_api(tmp_path, scenario)
    assert not store.exists(stray)
    assert not leftover.exists()


def test_replayed_public_messages_do_not_spend_the_victims_budget(tmp_path):
    run = make_fake_run("victim-run", schedule={"round_seconds": 3600.0, "min_submissions": 9,
                                                "max_rounds": 2})
    other_run = make_fake_run("other-run")
    victim = Identity.generate("worker")

    async def scenario(api):
        await api.create_run(run)
        await api.create_run(other_run)
        reg = _registration(run, victim).to_wire()
        assert (await api.post_json(f"/v1/runs/{run.spec.run_id}/participants", reg))[0] == 200
        statuses = []
        for target in (run.spec.run_id, other_run.spec.run_id):
            statuses += await replay_from(api, "127.0.0.2", f"/v1/runs/{target}/participants",
                                          reg, 30)
        assert 429 in statuses  # the replayer throttles itself ...
        # ... and the victim's own next writes go through at once.
        sub = make_submission(run, victim, PAYLOAD)
        assert (await api.submit(sub, PAYLOAD))[0] == 201
        again = _registration(run, victim, created_at=2).to_wire()
        assert (await api.post_json(f"/v1/runs/{run.spec.run_id}/participants", again))[0] == 200
        # No rejection row names the victim for the copy sent to another run's URL.
        for rid in (run.spec.run_id, other_run.spec.run_id):
            rows = (await api.get(f"/v1/runs/{rid}/rejections?signer={victim.public_key.hex()}"))
            assert rows[1]["rejections"] == []
        assert await key_rate_limited(api) == 0

    run_api(tmp_path, scenario, key_rate=0.001, key_burst=3, ip_rate=1000, ip_burst=1000)


def test_keyless_junk_writes_no_row_and_is_counted(tmp_path):
    run = make_fake_run("junk-run")

    async def scenario(api):
        await api.create_run(run)
        before = _rows(api.store, t.Rejection)
        for target in ("no-such-run", run.spec.run_id):
            for i in range(50):
                async with api.session.post(
                        f"{api.url}/v1/runs/{target}/participants",
                        data=encode_canonical({"junk": i})) as resp:
                    assert resp.status == 400
        assert _rows(api.store, t.Rejection) == before
        async with api.session.get(f"{api.url}/metrics") as resp:
            assert 'veritrain_rejections_total{reason="malformed"} 100' in await resp.text()

    run_api(tmp_path, scenario)


def test_refusals_are_rows_only_for_members_and_bounded_per_run_reason_and_hour(tmp_path):
    run = make_fake_run("bound-run", schedule={"round_seconds": 3600.0, "min_submissions": 9,
                                               "max_rounds": 2})
    member = Identity.generate("worker")

    async def scenario(api):
        await api.create_run(run)
        for _ in range(12):  # throwaway keys: no row at all
            sub = make_submission(run, Identity.generate("worker"), PAYLOAD)
            status, body = await api.submit(sub, PAYLOAD)
            assert status == 403 and body["reason"] == "unknown_worker"
        assert _rows(api.store, t.Rejection) == 0
        await api.register(run, member)
        for k in range(8):  # a member's own refusals: rows, at most 5 an hour per reason
            sub = make_submission(run, member, PAYLOAD, base_model_hash=f"{k}" * 64)
            assert (await api.submit(sub, PAYLOAD))[0] == 400
        assert _rows(api.store, t.Rejection) == 5

    run_api(tmp_path, scenario, rejection_rows_per_hour=5, key_burst=50)


def test_participants_are_paged(tmp_path):
    run = make_fake_run("page-run")
    workers = [Identity.generate("worker") for _ in range(5)]

    async def scenario(api):
        await api.create_run(run)
        for w in workers:
            await api.register(run, w)
        path = f"/v1/runs/{run.spec.run_id}/participants"
        first = (await api.get(path + "?limit=2"))[1]
        assert len(first["participants"]) == 2 and first["next_offset"] == 2
        last = (await api.get(path + "?offset=4&limit=2"))[1]
        assert len(last["participants"]) == 1 and last["next_offset"] is None
        keys = [p["pubkey"] for p in (await api.get(path))[1]["participants"]]
        assert keys == [w.public_key.hex() for w in workers]
        # What a validator reads: every page (a run may have 10,000 workers, 10 pages).
        from veritrain.ledger.client import LedgerClient, fetch_participants

        async with LedgerClient(api.url, retry_for=5.0) as client:
            paged = await fetch_participants(client, run.spec.run_id, page=2)
        assert [p["pubkey"] for p in paged] == keys

    run_api(tmp_path, scenario)


def test_report_takes_a_bounded_number_of_queries(tmp_path):
    from sqlalchemy import event

    run = make_fake_run("report-run")

    async def scenario(api):
        await api.create_run(run)
        counts = []
        for n in (2, 12):
            while len(counts) < n:
                await api.register(run, Identity.generate("worker"))
                counts.append(None)
            queries: list[int] = []

            def count(_conn, _cursor, statement, *_args, queries=queries):
                if not statement.lstrip().upper().startswith("PRAGMA"):  # a new connection's
                    queries.append(1)

            event.listen(api.store.engine, "before_cursor_execute", count)
            try:
                assert (await api.get(f"/v1/runs/{run.spec.run_id}/report"))[0] == 200
            finally:
                event.remove(api.store.engine, "before_cursor_execute", count)
            counts[-1] = len(queries)
        return counts[1], counts[-1]

    # The round ticker's own queries would land in the count: it ticks once at start-up only.
    few, many = run_api(tmp_path, scenario, tick_seconds=3600.0)
    assert many <= few  # 12 workers take no more queries than 2


def test_an_open_rounds_envelopes_are_not_readable(tmp_path):
    run = make_fake_run("sealed-run", schedule={"round_seconds": 3600.0, "min_submissions": 2,
                                                "max_rounds": 2})
    w1, w2 = Identity.generate("worker"), Identity.generate("worker")

    async def scenario(api):
        await api.create_run(run)
        await api.register(run, w1)
        await api.register(run, w2)
        path = f"/v1/runs/{run.spec.run_id}"
        sub = make_submission(run, w1, PAYLOAD)
        assert (await api.submit(sub, PAYLOAD))[0] == 201

        async def readable() -> dict[str, bool]:
            events = (await api.get(path + "/events?limit=1000"))[1]["events"]
            listed = (await api.get(path + "/submissions?round=0"))[1]["submissions"]
            async with api.session.get(f"{api.url}/v1/blobs/{sub.message.payload_hash}") as r:
                payload = r.status == 200
            return {"events": any(e["kind"] == "submission" for e in events),
                    "list": bool(listed),
                    "round": (await api.get(path + "/rounds/0/submissions"))[0] == 200,
                    "payload": payload}

        assert await readable() == dict.fromkeys(("events", "list", "round", "payload"), False)
        payload2 = b"\x04" * 8
        assert (await api.submit(make_submission(run, w2, payload2), payload2))[0] == 201
        while (await api.get(path + "/rounds/0"))[1]["status"] == "open":
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # the checkpoint of the closing rows
        assert await readable() == dict.fromkeys(("events", "list", "round", "payload"), True)

    run_api(tmp_path, scenario)


def test_security_headers_on_pages_json_and_blobs(tmp_path):
    run = make_fake_run("head-run")

    async def scenario(api):
        await api.create_run(run)
        seen = {}
        for name, path in [("page", "/"), ("json", "/v1/health"),
                           ("blob", f"/v1/blobs/{run.spec.dataset_hash}"),
                           ("problem", "/v1/runs/nope")]:
            async with api.session.get(api.url + path) as resp:
                seen[name] = resp.headers
        for name, headers in seen.items():
            assert headers["X-Content-Type-Options"] == "nosniff", name
            assert "frame-ancestors 'none'" in headers.get("Content-Security-Policy", "") or (
                headers["X-Frame-Options"] == "DENY"), name
            assert headers["Referrer-Policy"] == "no-referrer", name
        assert "script-src 'self'" in seen["page"]["Content-Security-Policy"]
        assert "sandbox" in seen["blob"]["Content-Security-Policy"]
        assert seen["blob"]["Content-Type"] == "application/octet-stream"

    run_api(tmp_path, scenario)


def test_a_client_hanging_up_mid_upload_is_no_500(tmp_path):
    run = make_fake_run("hang-run", schedule={"round_seconds": 3600.0, "min_submissions": 9,
                                              "max_rounds": 2},
                        limits={"max_payload_bytes": 1 << 20})
    worker = Identity.generate("worker")

    async def scenario(api):
        await api.create_run(run)
        await api.register(run, worker)
        payload = os.urandom(1 << 20)
        envelope = make_submission(run, worker, payload).encode()
        boundary = "hangupboundary"
        head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"envelope\"\r\n\r\n"
                ).encode() + envelope + (
            f"\r\n--{boundary}\r\nContent-Disposition: form-data; name=\"payload\"\r\n\r\n"
        ).encode()
        for _ in range(20):
            reader, writer = await asyncio.open_connection(api.server.host, api.server.port)
            writer.write((f"POST /v1/runs/{run.spec.run_id}/rounds/0/submissions HTTP/1.1\r\n"
                          f"Host: x\r\nContent-Length: {len(head) + len(payload) + 64}\r\n"
                          f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n"
                          ).encode() + head + payload[: 300_000])
            await writer.drain()
            await asyncio.sleep(0.02)
            writer.transport.abort()
        await asyncio.sleep(0.5)
        async with api.session.get(f"{api.url}/metrics") as resp:
            text = await resp.text()
        assert 'status="500"' not in text
        assert list((tmp_path / "ledger" / "blobs" / "tmp").iterdir()) == []
        assert (await api.get(f"/v1/runs/{run.spec.run_id}/rounds/0"))[1]["submissions"] == 0

    run_api(tmp_path, scenario)


def _limited(text: str, scope: str) -> int:
    line = next(x for x in text.splitlines()
                if x.startswith(f'veritrain_rate_limited_total{{scope="{scope}"}}'))
    return int(float(line.split()[-1]))


def test_a_key_whose_bls_signatures_keep_failing_gets_no_more_pairings(tmp_path):
    """The ledger verifies pairings one at a time (~0.3 s each): a validator sending beacon
    shares that do not verify is paired five times, then refused (429, Retry-After: until
    its budget refills) before any pairing, so it cannot hold the other validators' shares behind
    its own; the other validator's share goes through at once."""
    run = make_fake_run("pairing-run", n_validators=2, quorum=2)
    byzantine, honest = run.validators
    worker = Identity.generate("worker")
    path = f"/v1/runs/{run.spec.run_id}/rounds/0"

    def forged(i: int) -> dict:
        good = beacon_share(run, byzantine, 0, sealed)
        body = dataclasses.replace(good.message, share=byzantine.sign_bls(b"junk %d" % i).hex())
        return sign(byzantine, body).to_wire()

    async def scenario(api):
        nonlocal sealed
        await api.create_run(run)
        assert (await api.register(run, worker))[0] == 200
        assert (await api.submit(make_submission(run, worker, PAYLOAD), PAYLOAD))[0] == 201
        while (await api.get(path))[1]["status"] != "closed":
            await asyncio.sleep(0.02)
        subs = (await api.get(f"{path}/submissions"))[1]["submissions"]
        sealed = sealed_list_digest_of(subs)
        async def post(i: int) -> tuple[int, str, str | None]:
            async with api.session.post(f"{api.url}{path}/beacon",
                                        data=encode_canonical(forged(i))) as resp:
                return (resp.status, (await resp.json(content_type=None))["reason"],
                        resp.headers.get("Retry-After"))

        # Sent all at once: none may pass the budget's check before the earlier are charged.
        before = api.store.bls.computed
        answers = sorted(await asyncio.gather(*(post(i) for i in range(8))))
        answers.append(await post(8))
        pairings = api.store.bls.computed - before
        turns_left = len(api.server.app[LEDGER].pairing_turns)
        own = beacon_share(run, byzantine, 0, sealed).to_wire()
        status_own, _ = await api.post_json(f"{path}/beacon", own)
        status_other, body = await api.post_json(f"{path}/beacon",
                                                 beacon_share(run, honest, 0, sealed).to_wire())
        async with api.session.get(f"{api.url}/metrics") as resp:
            metrics = await resp.text()
        return answers, pairings, turns_left, status_own, status_other, body, metrics

    sealed = ""
    # One token back per 10 minutes here (a minute by default), so that slow pairings on a
    # loaded machine do not refill one mid-test.
    answers, pairings, turns_left, status_own, status_other, body, metrics = run_api(
        tmp_path, scenario, bad_signature_rate=1 / 600)
    assert [a[:2] for a in answers[:5]] == [(401, "bad_signature")] * 5
    assert pairings == 5  # one each for the five refused 401, none for the rest
    assert [a[:2] for a in answers[5:]] == [(429, "rate_limited")] * 4
    assert all(60 < int(a[2]) <= 600 for a in answers[5:]), answers
    assert turns_left == 0  # a key's turn is forgotten once nobody holds or waits for it
    assert status_own == 429  # its own good share waits out the budget too
    assert status_other == 200 and body["shares"] == 1, body
    assert _limited(metrics, "bad_signature") == 5
