"""Round finalization at the ledger: quorum certificates, dissent, bans and forfeits."""

from __future__ import annotations

import hashlib

import pytest
from fakes import make_fake_run, make_submission
from ledger_harness import Api, post_result, post_share, run_api, verdict
from veritrain.protocol.beacon import beacon_seed_of
from veritrain.protocol.certificates import verify_certificate
from veritrain.protocol.identity import Identity
from veritrain.protocol.rules import PENALIZED_REASONS


def test_quorum_certifies_and_a_dissenting_validator_is_recorded(tmp_path):
    run = make_fake_run("quorum-run", n_validators=3, quorum=2)
    worker = Identity.generate("worker")
    v0, v1, v2 = run.validators

    async def scenario(api: Api):
        await api.create_run(run)
        await api.register(run, worker)
        sub = make_submission(run, worker, b"payload!")
        assert (await api.submit(sub, b"payload!"))[0] == 201
        assert (await post_share(api, run, v2, 0))["beacon"] is None
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
