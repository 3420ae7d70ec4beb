"""Round finalization at the ledger: quorum certificates, dissent, bans and forfeits."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from fakes import make_fake_run, make_submission
from ledger_harness import Api, post_result, post_share, run_api, verdict
from veritrain.protocol.beacon import beacon_seed_of
from veritrain.protocol.certificates import verify_certificate
from veritrain.protocol.identity import Identity
from veritrain.protocol.rules import PENALIZED_REASONS


async def open_round0(api: Api, run, worker: Identity, signers: list[Identity]):
    """Create ``run``, register ``worker``, submit its round-0 update and fix the beacon
    from ``signers``' shares (in that order): (the submission, the fixed beacon)."""
    await api.create_run(run)
    await api.register(run, worker)
    sub = make_submission(run, worker, b"payload!")
    assert (await api.submit(sub, b"payload!"))[0] == 201
    fixed = None
    for v in signers:
        fixed = (await post_share(api, run, v, 0))["beacon"]
    return sub, fixed


def test_quorum_certifies_and_a_dissenting_validator_is_recorded(tmp_path):
    run = make_fake_run("quorum-run", n_validators=3, quorum=2)
    worker = Identity.generate("worker")
    v0, v1, v2 = run.validators

    async def scenario(api: Api):
        sub, fixed = await open_round0(api, run, worker, [v2])
        assert fixed is None  # one share is not a quorum
        fixed = (await post_share(api, run, v0, 0))["beacon"]
        assert fixed["signers"] == [0, 2]
        seed = beacon_seed_of(fixed)
        base = run.spec.genesis_model_hash
        verdicts = [verdict(worker, sub.digest, True)]
        rewards = {worker.public_key.hex(): 100.0}
        status, body = await post_result(api, run, v1, 0, base, seed, verdicts, rewards, b"M1")
        assert status == 201 and body["certificate"] is False
        # A validator signing another model does not count towards the quorum ...
        status, body = await post_result(api, run, v2, 0, base, seed, verdicts, rewards, b"EVIL")
        assert status == 201 and body["certificate"] is False
        status, body = await post_result(api, run, v0, 0, base, seed, verdicts, rewards, b"M1")
        assert status == 201 and body["certificate"] is True
        info = (await api.get("/v1/runs/quorum-run/rounds/0"))[1]
        report = (await api.get("/v1/runs/quorum-run/report"))[1]
        return info, report

    info, report = run_api(tmp_path, scenario)
    state = verify_certificate(info["certificate"], run.spec, base_of_round=1)
    assert state.model_hash == hashlib.sha256(b"M1").hexdigest()
    assert info["certificate"]["signers"] == [0, 1]
    # ... and is recorded with both digests.
    faults = report["validator_faults"]
    assert [f["validator"] for f in faults] == [v2.public_key.hex()]
    assert faults[0]["result_digest"] != faults[0]["certified_digest"]


@pytest.mark.parametrize("reason", sorted(PENALIZED_REASONS))
def test_failed_check_bans_and_forfeits_unvested_rewards(tmp_path, reason):
    """A failed check and a withheld reveal are both proof: ban and forfeit alike."""
    run = make_fake_run("penalty-run")
    cheat, honest = Identity.generate("worker"), Identity.generate("worker")
    (v,) = run.validators

    async def scenario(api: Api):
        await api.create_run(run)
        await api.register(run, cheat)
        await api.register(run, honest)
        base = run.spec.genesis_model_hash
        for r, cheat_ok in ((0, True), (1, False)):
            subs = {w.public_key.hex(): make_submission(run, w, b"p" * (r + 3), round_index=r,
                                                        base=base) for w in (cheat, honest)}
            for w in (cheat, honest):
                assert (await api.submit(subs[w.public_key.hex()], b"p" * (r + 3)))[0] == 201
            seed = beacon_seed_of((await post_share(api, run, v, r))["beacon"])
            verdicts = sorted([verdict(cheat, subs[cheat.public_key.hex()].digest, cheat_ok,
                                       reason),
                               verdict(honest, subs[honest.public_key.hex()].digest, True)],
                              key=lambda x: x["worker"])
            rewards = {honest.public_key.hex(): 50.0 if cheat_ok else 100.0}
            if cheat_ok:
                rewards[cheat.public_key.hex()] = 50.0
            model = f"M{r + 1}".encode()
            status, body = await post_result(api, run, v, r, base, seed, verdicts, rewards, model)
            assert status == 201 and body["certificate"] is True, body
            base = hashlib.sha256(model).hexdigest()
        # Banned: its next submission is refused at the door.
        late = make_submission(run, cheat, b"again", round_index=2, base=base)
        status, refused = await api.submit(late, b"again")
        return (await api.get("/v1/runs/penalty-run/report"))[1], status, refused

    report, status, refused = run_api(tmp_path, scenario)
    rows = {w["worker"]: w for w in report["workers"]}
    assert rows[cheat.public_key.hex()]["forfeited"] == 50.0
    assert rows[cheat.public_key.hex()]["reward"] == 50.0  # earned in round 0, then taken back
    assert rows[honest.public_key.hex()]["forfeited"] == 0.0
    assert rows[cheat.public_key.hex()]["banned_until_round"] == 1 + run.spec.verification["ban_rounds"]
    assert status == 403 and refused["reason"] == "banned"


async def _events_and_key(api: Api, run_id: str):
    from veritrain.ledger.audit import fetch_events
    from veritrain.ledger.client import LedgerClient

    async with LedgerClient(api.url, retry_for=5.0) as client:
        key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
        return await fetch_events(client, run_id), key


def test_a_split_round_is_voided_and_the_run_goes_on_from_the_same_base(tmp_path):
    """Round 0 is certified. In round 1 three validators certify three different states:
    no quorum of 2 can ever agree, so the ledger voids it at once (nobody paid or banned,
    each digest chained) and round 2 opens on round 0's certified model, vouched for by
    round 0's certificate (the newest before it)."""
    from veritrain.ledger.audit import verify_events
    from veritrain.protocol.certificates import (
        CERTIFIED_MARK_FILE,
        CertifiedMark,
        base_round,
        certified_base,
    )
    from veritrain.protocol.encoding import decode_canonical
    from veritrain.protocol.errors import RejectedInput

    run = make_fake_run("split-run", n_validators=3, quorum=2, schedule={
        "round_seconds": 3600.0, "min_submissions": 1, "max_rounds": 5})
    worker = Identity.generate("worker")
    v0, v1, v2 = run.validators
    genesis, m0 = run.spec.genesis_model_hash, hashlib.sha256(b"M0").hexdigest()
    rewards = {worker.public_key.hex(): 100.0}

    async def scenario(api: Api):
        sub, fixed = await open_round0(api, run, worker, [v0, v1])
        seed = beacon_seed_of(fixed)
        for v in (v0, v1):
            await post_result(api, run, v, 0, genesis, seed,
                              [verdict(worker, sub.digest, True)], rewards, b"M0")
        sub1 = make_submission(run, worker, b"payload1", round_index=1, base=m0)
        assert (await api.submit(sub1, b"payload1"))[0] == 201
        await post_share(api, run, v0, 1)
        seed1 = beacon_seed_of((await post_share(api, run, v2, 1))["beacon"])
        verdicts1 = [verdict(worker, sub1.digest, True)]
        for v, model in ((v0, b"M-a"), (v1, b"M-b")):
            status, _ = await post_result(api, run, v, 1, m0, seed1, verdicts1, rewards, model)
            assert status == 201
        await asyncio.sleep(0.3)  # a quorum can still agree: v2 may side with either
        still = (await api.get("/v1/runs/split-run/rounds/1"))[1]
        status, _ = await post_result(api, run, v2, 1, m0, seed1, verdicts1, rewards, b"M-c")
        assert status == 201
        while (await api.get("/v1/runs/split-run/rounds/1"))[1]["status"] != "voided":
            await asyncio.sleep(0.05)
        nxt = (await api.get("/v1/runs/split-run/rounds/2"))[1]
        sub2 = make_submission(run, worker, b"payload2", round_index=2, base=m0)
        accepted = (await api.submit(sub2, b"payload2"))[0]
        report = (await api.get("/v1/runs/split-run/report"))[1]
        events, key = await _events_and_key(api, "split-run")
        return still, nxt, accepted, report, events, key

    still, nxt, accepted, report, events, key = run_api(tmp_path, scenario)
    assert still["status"] == "closed"
    assert nxt["status"] == "open" and nxt["base_model_hash"] == m0 and accepted == 201
    assert nxt["base_certificate"]["certified"]["round"] == 1
    assert certified_base(run.spec, nxt) == (m0, hashlib.sha256(b"momentum M0").hexdigest())
    # A node that already saw round 1's certificate takes round 0's base no more (round 2 was
    # served on round 0's model legitimately; a ledger serving an older one rolls it back).
    assert base_round(nxt) == 1
    assert certified_base(run.spec, nxt, newest_certified=1)[0] == m0
    with pytest.raises(RejectedInput) as rollback:
        certified_base(run.spec, nxt, newest_certified=2)
    assert rollback.value.reason == "invalid_base" and "rollback" in str(rollback.value)
    genesis = {**nxt, "base_certificate": None, "base_model_hash": run.spec.genesis_model_hash,
               "outer_state_hash": None}
    assert certified_base(run.spec, genesis)[0] == run.spec.genesis_model_hash
    with pytest.raises(RejectedInput, match="rollback"):
        certified_base(run.spec, genesis, newest_certified=1)
    # The mark survives a restart: a node that kept it in its state directory refuses the
    # rollback after coming back (a fresh mark in memory would take it).
    mark_file = tmp_path / "node-state" / CERTIFIED_MARK_FILE
    mark_file.parent.mkdir()
    CertifiedMark.in_file(mark_file).raise_to("split-run", base_round(nxt))
    restarted = CertifiedMark.in_file(mark_file)
    assert restarted.of("split-run") == 1 and restarted.of("another-run") == 0
    with pytest.raises(RejectedInput, match="rollback"):
        certified_base(run.spec, genesis, newest_certified=restarted.of("split-run"))
    assert certified_base(run.spec, genesis, newest_certified=CertifiedMark().of("split-run"))
    voided = [decode_canonical(e.body) for e in events if e.kind == "round_voided"]
    assert len(voided) == 1 and voided[0]["round"] == 1
    assert voided[0]["reason"].startswith("split: 3 results certify 3")
    assert [x["validator"] for x in voided[0]["results"]] == [0, 1, 2]
    assert len({x["certified_digest"] for x in voided[0]["results"]}) == 3
    (w,) = report["workers"]
    assert w["reward"] == pytest.approx(100.0) and w["accepted"] == 1  # round 0's only
    audit = verify_events(events, key)
    assert audit.ok, audit.problem


def test_a_round_without_a_quorum_by_certify_seconds_is_voided(tmp_path):
    """Only one of three validators posts: after ``certify_seconds`` the round is voided
    (timeout) and, as it was the last round, the run finishes on the genesis model."""
    from veritrain.ledger.audit import verify_events
    from veritrain.protocol.encoding import decode_canonical

    run = make_fake_run("timeout-run", n_validators=3, quorum=2, schedule={
        "round_seconds": 3600.0, "min_submissions": 1, "max_rounds": 1,
        "certify_seconds": 60.0})
    worker = Identity.generate("worker")
    v0, v1, _ = run.validators

    async def scenario(api: Api):
        real, ahead = api.store.clock, [0.0]
        api.store.clock = lambda: real() + ahead[0]  # the ledger's clock, moved on below
        sub, fixed = await open_round0(api, run, worker, [v0, v1])
        seed = beacon_seed_of(fixed)
        await post_result(api, run, v0, 0, run.spec.genesis_model_hash, seed,
                          [verdict(worker, sub.digest, True)], {}, b"M1")
        await asyncio.sleep(0.3)
        assert (await api.get("/v1/runs/timeout-run/rounds/0"))[1]["status"] == "closed"
        ahead[0] = 61.0  # certify_seconds have passed
        for _ in range(100):
            overview = (await api.get("/v1/runs/timeout-run"))[1]
            if overview["status"] != "active":
                break
            await asyncio.sleep(0.05)
        info = (await api.get("/v1/runs/timeout-run/rounds/0"))[1]
        late = await post_result(api, run, v1, 0, run.spec.genesis_model_hash, seed,
                                 [verdict(worker, sub.digest, True)], {}, b"M1")
        events, key = await _events_and_key(api, "timeout-run")
        return overview, info, late, events, key

    overview, info, late, events, key = run_api(tmp_path, scenario)
    assert overview["status"] == "finished" and info["status"] == "voided"
    assert late[0] == 409 and late[1]["reason"] == "wrong_state" and "voided" in late[1][
        "detail"], late
    voided = [decode_canonical(e.body) for e in events if e.kind == "round_voided"]
    assert len(voided) == 1 and voided[0]["reason"].startswith("timeout: no certificate 60 s")
    assert voided[0]["voided_at"] - info["closed_at"] >= 60.0
    assert [e.kind for e in events][-2:] == ["round_voided", "run_finished"]
    audit = verify_events(events, key)
    assert audit.ok, audit.problem


def test_nodes_keep_their_certified_mark_in_their_state_directory(tmp_path):
    """A worker and a validator restarted on the same state directory hold the ledger to
    the newest certified round they had taken a base from; a damaged mark file is refused
    rather than silently reset to 0 (which would re-open the rollback)."""
    from veritrain.protocol.certificates import CERTIFIED_MARK_FILE, CertifiedMark
    from veritrain.validators.node import ValidatorConfig, ValidatorNode
    from veritrain.workers.node import WorkerConfig, WorkerNode

    wdir, vdir = tmp_path / "worker", tmp_path / "validator"
    worker = WorkerNode(WorkerConfig("http://127.0.0.1:9", wdir), Identity.generate("worker"))
    validator = ValidatorNode(ValidatorConfig("http://127.0.0.1:9", state_dir=vdir),
                              Identity.generate("validator"))
    worker.certified_mark.raise_to("run-a", 4)
    worker.certified_mark.raise_to("run-a", 2)  # never lowered
    validator.certified_mark.raise_to("run-a", 7)
    assert WorkerNode(WorkerConfig("http://127.0.0.1:9", wdir),
                      Identity.generate("worker")).certified_mark.of("run-a") == 4
    again = ValidatorNode(ValidatorConfig("http://127.0.0.1:9", state_dir=vdir),
                          Identity.generate("validator"))
    assert again.certified_mark.of("run-a") == 7 and again.certified_mark.of("run-b") == 0
    (vdir / CERTIFIED_MARK_FILE).write_text('{"run-a": -1}')
    with pytest.raises(ValueError, match="certified-round mark"):
        CertifiedMark.in_file(vdir / CERTIFIED_MARK_FILE)
