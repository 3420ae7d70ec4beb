"""The ledger's part of sharded aggregation, on SQLite and PostgreSQL.

Only a run's validators post, each only its own shard; the first check share
fixes the list (it must sign exactly the stored results), later results and
shares over another list are refused (before a result's file is read, so a
refused one leaves no blob), a quorum of shares fixes the check seed
as the beacon's rule does, a quorum of faulty findings marks the shard, and the
audit of the chain verifies every new row.
"""

from __future__ import annotations

import asyncio
import hashlib
import json

from fakes import make_fake_run, make_submission
from ledger_backends import make_fixture
from ledger_harness import (
    Api,
    key_rate_limited,
    record_pairing_threads,
    replay_from,
    run_api,
    verdict,
)
from ledger_harness import post_result as post_round_result
from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.ledger.client import LedgerClient
from veritrain.ledger.store import LedgerStore
from veritrain.protocol import bls
from veritrain.protocol.beacon import (
    EVERY_WORKER_ADMITTED,
    beacon_root,
    beacon_seed_of,
    compute_beacon_seed,
    sealed_list_digest_of,
    shard_check_root,
)
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    BeaconShare,
    ShardCheckShare,
    ShardFindingReport,
    ShardPublication,
    sign,
)

ledger_url = make_fixture()
RUN = "shard-ledger"


def _publication(v: Identity, shard: int, blob: bytes) -> ShardPublication:
    return ShardPublication(run_id=RUN, round=0, validator=v.public_key.hex(), shard=shard,
                            inputs_digest="1" * 64,
                            result_digest=hashlib.sha256(b"result" + blob).hexdigest(),
                            result_hash=hashlib.sha256(blob).hexdigest(),
                            result_bytes=len(blob))


def _share(v: Identity, results: list) -> ShardCheckShare:
    return ShardCheckShare(run_id=RUN, round=0, validator=v.public_key.hex(), results=results,
                           share=v.sign_bls(shard_check_root(RUN, 0, results)).hex())


def _finding(v: Identity, about: Identity, shard: int, digest: str) -> ShardFindingReport:
    return ShardFindingReport(run_id=RUN, round=0, validator=v.public_key.hex(), shard=shard,
                              publisher=about.public_key.hex(), faulty=True,
                              reason="stationarity", published_digest=digest,
                              replacement_digest="2" * 64, max_abs_deviation=0.5)


def _sharded_run():
    """Three validators, quorum 2, one CenteredClip shard each."""
    return make_fake_run(RUN, n_validators=3, quorum=2,
                         aggregator={"name": "centered_clip", "params": {"tau_rel": 1.0},
                                     "shards": 3})


async def _open_round_with_one_submission(api: Api, run, worker: Identity):
    """Create the run, register ``worker``, submit once and wait for the round to close;
    the submission."""
    await api.create_run(run)
    await api.register(run, worker)
    submission = make_submission(run, worker, b"p" * 8)
    await api.submit(submission, b"p" * 8)
    while (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]["status"] == "open":
        await asyncio.sleep(0.05)
    return submission


async def _fix_beacon(api: Api, validators) -> dict:
    """Each of ``validators`` posts its beacon share over the served sealed list; the
    beacon the last one's reply names."""
    sealed = sealed_list_digest_of(
        (await api.get(f"/v1/runs/{RUN}/rounds/0/submissions"))[1]["submissions"])
    for v in validators:
        share = BeaconShare(run_id=RUN, round=0, validator=v.public_key.hex(),
                            share=v.sign_bls(beacon_root(RUN, 0)).hex(), sealed=sealed,
                            participants=EVERY_WORKER_ADMITTED)
        beacon = (await api.post_json(f"/v1/runs/{RUN}/rounds/0/beacon",
                                      sign(v, share).to_wire()))[1]["beacon"]
    return beacon


def test_shard_board_fixes_one_list_and_one_seed(tmp_path, ledger_url, monkeypatch):
    run = _sharded_run()
    v0, v1, v2 = run.validators
    worker = Identity.generate("worker")
    base = f"/v1/runs/{RUN}/rounds/0/shards"
    pairing_threads = record_pairing_threads(monkeypatch)

    async def post_result(api: Api, signer: Identity, pub: ShardPublication, blob: bytes):
        return await api.post_parts(base, [("publication", sign(signer, pub).encode()),
                                           ("result", blob)])

    async def scenario(api: Api):
        submission = await _open_round_with_one_submission(api, run, worker)
        out = {"early": await post_result(api, v0, _publication(v0, 0, b"a"), b"a")}
        beacon = await _fix_beacon(api, (v0, v1))
        pub0 = _publication(v0, 0, b"a")
        out["first"] = await post_result(api, v0, pub0, b"a")
        out["again"] = await post_result(api, v0, pub0, b"a")
        out["other_digest"] = await post_result(api, v0, _publication(v0, 0, b"b"), b"b")
        other_file = ShardPublication(**{**pub0.to_body(),
                                         "result_hash": hashlib.sha256(b"z").hexdigest()})
        out["other_file"] = await post_result(api, v0, other_file, b"z")
        # Two different publications racing: both pass the precheck, the loser's file was
        # stored before the board refused it, and must not stay behind.
        with monkeypatch.context() as m:
            m.setattr(LedgerStore, "precheck_shard_result", lambda self, signed: None)
            out["raced"] = await post_result(api, v0, _publication(v0, 0, b"r"), b"r")
        out["wrong_shard"] = await post_result(api, v0, _publication(v0, 1, b"c"), b"c")
        out["stranger"] = await post_result(api, worker, _publication(worker, 1, b"d"), b"d")
        out["size_lie"] = await post_result(api, v1, _publication(v1, 1, b"e"), b"ee")
        d0 = pub0.result_digest
        pairings = out["pairings"] = {}

        async def check_share(name: str, signer: Identity, share: ShardCheckShare) -> None:
            before = api.store.bls.computed  # pairings computed, not found cached
            out[name] = await api.post_json(base + "/check", sign(signer, share).to_wire())
            pairings[name] = api.store.bls.computed - before

        await check_share("stale_share", v1, _share(v1, [d0, "3" * 64, None]))
        forged = _share(v1, [d0, None, None])
        forged = ShardCheckShare(**{**forged.to_body(), "validator": v2.public_key.hex()})
        await check_share("forged", v2, forged)
        out["early_finding"] = await api.post_json(base + "/findings",
                                                   sign(v1, _finding(v1, v0, 0, d0)).to_wire())
        await check_share("fixing", v1, _share(v1, [d0, None, None]))
        await check_share("fixing_again", v1, _share(v1, [d0, None, None]))
        out["late"] = await post_result(api, v1, _publication(v1, 1, b"f"), b"f")
        await check_share("other_list", v2, _share(v2, [None, None, None]))
        await check_share("seed", v2, _share(v2, [d0, None, None]))
        for v in (v1, v2):
            out[f"finding{v is v2:d}"] = await api.post_json(
                base + "/findings", sign(v, _finding(v, v0, 0, d0)).to_wire())
        out["self_finding"] = await api.post_json(
            base + "/findings", sign(v0, _finding(v0, v0, 0, d0)).to_wire())
        out["view"] = (await api.get(base))[1]
        # The faulted publisher's attestation does not count: its result and v1's agree,
        # but only v2's makes a quorum, and v0 is not among the certificate's signers.
        seed = beacon_seed_of(beacon)
        verdicts = [verdict(worker, submission.digest, True)]
        rewards = {worker.public_key.hex(): 100.0}
        genesis = run.spec.genesis_model_hash
        # Shard 0 recomputed (proven faulty), 1 and 2 too (the list has none of them).
        sources = [{"shard": k, "result": None, "aggregate": f"{k:02x}" * 32} for k in range(3)]
        out["no_sources"] = await post_round_result(api, run, v1, 0, genesis, seed, verdicts,
                                                    rewards, b"M1")
        for v in (v0, v1, v2):
            out[f"result{run.validators.index(v)}"] = await post_round_result(
                api, run, v, 0, genesis, seed, verdicts, rewards, b"M1", shards=sources)
        out["info"] = (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]
        async with LedgerClient(api.url) as client:
            key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
            out["audit"] = verify_events(await fetch_events(client, RUN), key)
            out["full"] = verify_events(await fetch_events(client, RUN), key, full=True)
            out["events"] = await fetch_events(client, RUN)
        return out

    out = run_api(tmp_path, scenario, db_url=ledger_url)
    code = {k: v[0] for k, v in out.items() if isinstance(v, tuple)}
    reason = {k: v[1].get("reason") for k, v in out.items() if isinstance(v, tuple)}
    assert (code["early"], reason["early"]) == (409, "wrong_state")
    assert code["first"] == 201 and not out["first"][1]["already"]
    assert code["again"] == 201 and out["again"][1]["already"]
    assert (code["other_digest"], reason["other_digest"]) == (409, "duplicate")
    assert (code["other_file"], reason["other_file"]) == (409, "duplicate")
    assert (code["raced"], reason["raced"]) == (409, "duplicate")
    assert (code["wrong_shard"], reason["wrong_shard"]) == (403, "wrong_shard")
    assert code["stranger"] == 403
    assert code["size_lie"] == 400
    assert (code["stale_share"], reason["stale_share"]) == (409, "shard_list_fixed")
    assert (code["forged"], reason["forged"]) == (401, "bad_signature")
    # Only a share past every cheap check costs a pairing, an exact resend none, and
    # none runs on the writer.
    assert out["pairings"] == {"stale_share": 0, "forged": 1, "fixing": 1, "fixing_again": 0,
                               "other_list": 0, "seed": 1}
    assert out["fixing_again"][1] == {"already": True}
    assert [n for n in pairing_threads if n.startswith("ledger-writer")] == []
    assert code["early_finding"] == 409
    assert out["fixing"][1]["check"] is None and out["fixing"][1]["results"][0] is not None
    assert (code["late"], reason["late"]) == (409, "shard_list_fixed")
    assert (code["other_list"], reason["other_list"]) == (409, "shard_list_fixed")
    check = out["seed"][1]["check"]
    shares = [s["body"]["share"] for s in out["view"]["check_shares"]]
    assert check["signers"] == [1, 2]
    assert check["seed"] == compute_beacon_seed([bytes.fromhex(s) for s in shares]).hex()
    assert code["finding0"] == code["finding1"] == 201
    assert out["finding1"][1]["faulty_reports"] == 2
    assert code["self_finding"] == 403
    view = out["view"]
    assert view["faulty_shards"] == [0] and len(view["results"]) == 1
    faults = [json.loads(e.body) for e in out["events"] if e.kind == "shard_fault"]
    assert [f["penalty"] for f in faults] == ["excluded_from_quorum"]  # the fault's cost
    assert view["list"] == [out["view"]["results"][0]["body"]["result_digest"], None, None]
    assert (code["no_sources"], reason["no_sources"]) == (400, "malformed")
    assert [out[f"result{i}"][1]["certificate"] for i in range(3)] == [False, False, True]
    assert [x["result"] for x in out["info"]["certificate"]["certified"]["shards"]] == [None] * 3
    assert out["result1"][1]["attestations"] == 1  # v0's equal result left out
    assert out["info"]["certificate"]["signers"] == [1, 2]
    assert out["audit"].ok, out["audit"].problem
    assert out["full"].ok, out["full"].problem
    stored = {p.name for p in (tmp_path / "ledger").rglob("*") if p.is_file()}
    assert hashlib.sha256(b"a").hexdigest() in stored
    refused = {k: hashlib.sha256(blob).hexdigest() for k, blob in
               (("other_digest", b"b"), ("other_file", b"z"), ("wrong_shard", b"c"),
                ("late", b"f"), ("raced", b"r"))}
    assert not set(refused.values()) & stored, "a refused result's file was kept"


def test_a_certificate_that_recomputes_a_listed_shard_waits_for_its_proven_fault(
        tmp_path, ledger_url):
    """The race CI caught: one checker found shard 0 faulty, and the publisher's own result
    agrees with that checker's (both recompute shard 0). A quorum of equal results is not
    enough: the ledger holds the certificate back until a quorum of findings records the
    ``shard_fault``, then certifies without waiting for another result (the publisher's
    attestation no longer counting)."""
    run = _sharded_run()
    v0, v1, v2 = run.validators
    worker = Identity.generate("worker")
    base = f"/v1/runs/{RUN}/rounds/0/shards"

    async def scenario(api: Api):
        submission = await _open_round_with_one_submission(api, run, worker)
        beacon = await _fix_beacon(api, (v0, v1))
        pub0 = _publication(v0, 0, b"a")
        await api.post_parts(base, [("publication", sign(v0, pub0).encode()), ("result", b"a")])
        d0 = pub0.result_digest
        for v in (v1, v2):
            await api.post_json(base + "/check", sign(v, _share(v, [d0, None, None])).to_wire())
        out = {"finding1": await api.post_json(base + "/findings",
                                               sign(v1, _finding(v1, v0, 0, d0)).to_wire())}
        seed = beacon_seed_of(beacon)
        verdicts = [verdict(worker, submission.digest, True)]
        rewards = {worker.public_key.hex(): 100.0}
        genesis = run.spec.genesis_model_hash
        recomputed = [{"shard": k, "result": None, "aggregate": f"{k:02x}" * 32}
                      for k in range(3)]
        for v in (v1, v0, v2):
            out[f"result{run.validators.index(v)}"] = await post_round_result(
                api, run, v, 0, genesis, seed, verdicts, rewards, b"M1", shards=recomputed)
        out["waiting"] = (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]
        out["finding2"] = await api.post_json(base + "/findings",
                                              sign(v2, _finding(v2, v0, 0, d0)).to_wire())
        out["after"] = (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]
        async with LedgerClient(api.url) as client:
            key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
            out["audit"] = verify_events(await fetch_events(client, RUN), key, full=True)
        return out

    out = run_api(tmp_path, scenario, db_url=ledger_url)
    assert out["finding1"][0] == 201 and out["finding1"][1]["faulty_reports"] == 1
    waiting = [out[f"result{i}"][1] for i in range(3)]
    assert [w["certificate"] for w in waiting] == [False] * 3
    assert [w["attestations"] for w in waiting] == [2, 1, 3]
    assert {w.get("waiting") for w in (waiting[0], waiting[2])} == {
        "shard 0 recomputed although listed and never proven faulty"}
    assert out["waiting"]["status"] == "closed"
    # The fault recorded, the publisher's attestation stops counting and the other two
    # certify at once.
    assert out["finding2"][0] == 201 and out["finding2"][1]["faulty_reports"] == 2
    assert out["after"]["status"] == "finalized"
    assert out["after"]["certificate"]["signers"] == [1, 2]
    assert out["audit"].ok, out["audit"].problem


def test_replayed_shard_posts_cost_no_bls_and_spend_no_validators_budget(tmp_path, ledger_url,
                                                                         monkeypatch):
    """A validator's check share is public: a third party copying it from another address
    is answered from the store (no BLS verification) and throttled on its own address,
    never on the validator's key."""
    run = _sharded_run()
    v0, v1, v2 = run.validators
    worker = Identity.generate("worker")
    base = f"/v1/runs/{RUN}/rounds/0/shards"
    verified = []
    real_verify = bls.verify
    monkeypatch.setattr(bls, "verify", lambda *a: verified.append(1) or real_verify(*a))

    async def scenario(api: Api):
        await api.create_run(run)
        await api.register(run, worker)
        await api.submit(make_submission(run, worker, b"p" * 8), b"p" * 8)
        while (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]["status"] == "open":
            await asyncio.sleep(0.05)
        sealed = sealed_list_digest_of(
            (await api.get(f"/v1/runs/{RUN}/rounds/0/submissions"))[1]["submissions"])
        for v in (v0, v1):  # v1's first write
            share = BeaconShare(run_id=RUN, round=0, validator=v.public_key.hex(),
                                share=v.sign_bls(beacon_root(RUN, 0)).hex(), sealed=sealed,
                                participants=EVERY_WORKER_ADMITTED)
            await api.post_json(f"/v1/runs/{RUN}/rounds/0/beacon", sign(v, share).to_wire())
        pub0 = _publication(v0, 0, b"a")
        assert (await api.post_parts(base, [("publication", sign(v0, pub0).encode()),
                                            ("result", b"a")]))[0] == 201
        d0 = pub0.result_digest
        check = sign(v1, _share(v1, [d0, None, None])).to_wire()
        out = {"check": await api.post_json(base + "/check", check)}  # v1's second write
        before = len(verified)
        out["replays"] = await replay_from(api, "127.0.0.2", base + "/check", check, 30)
        out["bls_for_replays"] = len(verified) - before
        assert (await api.post_json(base + "/check",
                                    sign(v2, _share(v2, [d0, None, None])).to_wire()))[0] == 200
        out["own"] = await api.post_json(base + "/findings",  # v1's third write
                                         sign(v1, _finding(v1, v0, 0, d0)).to_wire())
        out["limited"] = await key_rate_limited(api)
        return out

    out = run_api(tmp_path, scenario, db_url=ledger_url, key_rate=0.001, key_burst=3,
                  ip_rate=1000.0, ip_burst=1000.0)
    assert out["check"][0] == 200 and out["check"][1]["check"] is None
    assert out["replays"][0] == 200 and 429 in out["replays"]
    assert out["bls_for_replays"] == 0
    assert out["own"][0] == 201, out["own"]
    assert out["limited"] == 0
