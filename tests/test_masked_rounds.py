"""Masked rounds end to end over HTTP: workers on the board, three validators unmasking.

Five workers share one bucket (t = 2). One drops out after dealing, one reveals
forged shares, one is a free rider; every worker is spot-checked. The bucket
still unmasks (three valid shares per secret), the free rider's masked input
opens to its payload and is subtracted, the forger is blamed, and all three
validators certify the same model, whose aggregate is the mean of the
remaining masked inputs to within the fixed-point step. A second round setting
loses more than t members and is dropped, with nobody revealing anything. A
ledger that deals buckets other than the beacon's finds no worker dealing
shares and no validator certifying, and the audit names the deal.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from fakes import validator_identities
from ledger_harness import Api, reveal_all, run_api
from test_validator_http import synthetic_settings
from veritrain.aggregation.secure import fixed_point_scale
from veritrain.ledger.audit import fetch_events, verify_events
from veritrain.ledger.client import LedgerClient
from veritrain.protocol.codecs import ErrorFeedback
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Registration, sign
from veritrain.protocol.organiser import build_run
from veritrain.protocol.runtime import RunContext
from veritrain.validators.node import ValidatorConfig, ValidatorNode
from veritrain.workers.masked import MaskedRound
from veritrain.workers.round import prepare_submission

V = 3
CLIP = 1000.0


@pytest.fixture(autouse=True)
def _restore_determinism_flag():
    """Three in-process validators train concurrently; restore the process-wide flag."""
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


def masked_settings(bucket: int, dropouts: int, spot_checks: int) -> dict:
    settings = synthetic_settings()
    settings["aggregator"] = {"name": "centered_clip", "params": {"tau_rel": 1.0},
                              "masked": {"bucket_size": bucket, "max_dropouts": dropouts,
                                         "clip_norm": CLIP, "phase_seconds": 15.0}}
    settings["verification"]["probe_examples"] = 0
    settings["verification"]["spot_checks_per_round"] = spot_checks
    settings["verification"]["reveal_seconds"] = 15.0
    settings["schedule"]["min_submissions"] = 2
    return settings


def test_build_run_refuses_masked_settings_that_cannot_run():
    organiser = Identity.generate("organiser")
    pubs = [v.public for v in validator_identities(V)]
    settings = masked_settings(4, 2, 1)
    with pytest.raises(ValueError, match="threshold"):
        build_run(organiser, "bad-masked", settings, pubs)
    settings = masked_settings(4, 1, 1)
    settings["verification"]["probe_examples"] = 16
    with pytest.raises(ValueError, match="probe"):
        build_run(organiser, "bad-masked", settings, pubs)
    settings = masked_settings(4, 1, 1)
    settings["schedule"]["min_submissions"] = 1
    with pytest.raises(ValueError, match="min_submissions"):
        build_run(organiser, "bad-masked", settings, pubs)
    settings = masked_settings(4, 1, 1)
    settings["aggregator"]["shards"] = V
    with pytest.raises(ValueError, match="sharded"):
        build_run(organiser, "bad-masked", settings, pubs)


def _masked_round(tmp_path, settings: dict, run_id: str, attacks: dict[int, str], n: int):
    organiser = Identity.generate("organiser")
    validators = validator_identities(V)
    bundle = build_run(organiser, run_id, settings, [v.public for v in validators])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(n)]
    preps = [prepare_submission(run, w, 0, base, run.spec.genesis_model_hash,
                                ErrorFeedback(run.numel),
                                attack="free_rider" if attacks.get(i) == "free_rider" else None)
             for i, w in enumerate(workers)]
    for p in preps:  # a masked run's payload stays with its worker until a check opens it
        p.evidence.keep_payload(p.payload)
    updates = [run.codec.decode(p.payload, run.numel,
                                seed=run.codec_seed(0, p.signed.message.worker)) for p in preps]

    async def judge(api: Api, ident: Identity):
        node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=run_id,
                                             poll_seconds=0.05), ident)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            info = await client.get_json(f"/v1/runs/{run_id}/rounds/0")
            await node.beacon_seed(client, bundle.signed.message, 0)
            own_run = RunContext.build(bundle.signed.message, bundle.dataset)
            try:
                return await node.validate_round(client, own_run, info)
            except RejectedInput as exc:  # a board it refuses to certify
                return exc

    async def take_part(api: Api, i: int) -> str:
        attack = attacks.get(i) if attacks.get(i) != "free_rider" else None
        async with LedgerClient(api.url, retry_for=5.0) as client:
            return await MaskedRound(client, run.spec, workers[i], 0, poll_seconds=0.05,
                                     attack=attack).run(updates[i])

    async def reveal_once_challenged(api: Api) -> None:
        while not (await api.get(f"/v1/runs/{run_id}/rounds/0/challenges"))[1]["fixed"]:
            await asyncio.sleep(0.05)
        await reveal_all(api, run, {p.signed.message.worker: p for p in preps}, workers)

    async def scenario(api: Api):
        status, _ = await api.post_parts("/v1/runs", [("spec", bundle.signed.encode()),
                                                      ("dataset", bundle.dataset),
                                                      ("genesis", bundle.genesis)])
        assert status == 201
        for w in workers:
            reg = Registration(run_id=run_id, round=0, participant=w.public_key.hex(),
                               role="worker", created_at=1)
            await api.post_json(f"/v1/runs/{run_id}/participants", sign(w, reg).to_wire())
        for w, p in zip(workers, preps, strict=True):  # the envelope alone: no payload part
            status, body = await api.post_parts(f"/v1/runs/{run_id}/rounds/0/submissions",
                                                [("envelope", sign(w, p.signed.message).encode())])
            assert status == 201, body
        while (await api.get(f"/v1/runs/{run_id}/rounds/0"))[1]["status"] == "open":
            await asyncio.sleep(0.05)
        # A board the nodes refuse never gets its openings seed, so no checks are fixed:
        # the reveals wait only as long as the nodes take.
        revealing = asyncio.create_task(reveal_once_challenged(api))
        outcomes, ends = await asyncio.gather(
            asyncio.gather(*(judge(api, v) for v in validators)),
            asyncio.gather(*(take_part(api, i) for i in range(n))))
        revealing.cancel()
        await asyncio.gather(revealing, return_exceptions=True)
        board = (await api.get(f"/v1/runs/{run_id}/rounds/0/secagg"))[1]
        summary = (await api.get(f"/v1/runs/{run_id}/rounds/0"))[1]
        checks = (await api.get(f"/v1/runs/{run_id}/rounds/0/challenges"))[1]["challenges"]
        payload_blob = 404
        last = next((c for c in checks if c["worker"] == preps[-1].signed.message.worker), None)
        if last is not None and last["reveal"] is not None:
            async with api.session.get(f"{api.url}/v1/blobs/"
                                       f"{last['reveal']['envelope']['body']['reveal_hash']}"
                                       ) as resp:
                data = await resp.read()
            payload_blob = resp.status if preps[-1].payload in data else 404
        async with LedgerClient(api.url) as client:
            key = bytes.fromhex((await client.get_json("/v1/ledger"))["ledger_key"])
            audit = verify_events(await fetch_events(client, run_id), key)
        return outcomes, ends, board, summary, payload_blob, audit

    result = run_api(tmp_path, scenario)
    return workers, updates, result


def test_a_bucket_survives_a_dropout_a_forger_and_an_opened_free_rider(tmp_path):
    # Seven workers, t = 2 (the cap floor((7 - 1) / 3) = 2), k = 5: one dropout and one
    # forger leave five valid shares of each secret.
    attacks = {0: "drop_after_deal", 1: "forge_reveal", 2: "free_rider"}
    workers, updates, result = _masked_round(
        tmp_path, masked_settings(7, 2, 7), "masked-run", attacks, 7)
    outcomes, ends, board, summary, payload_blob, audit = result
    keys = [w.public_key.hex() for w in workers]
    assert summary["status"] == "finalized"
    assert ends == ["dropped out"] + ["revealed"] * 6, ends
    (bucket,) = board["buckets"]
    assert bucket["live"] and bucket["survivors"] == sorted(keys[1:])
    assert len(board["posts"]["opening"]) == 6  # every survivor was spot-checked
    verdicts = {v["worker"]: v for v in outcomes[0].verdicts}
    assert verdicts[keys[0]]["reason"] == "dropped_out", verdicts
    assert verdicts[keys[1]]["reason"] == "forged_share"
    assert verdicts[keys[2]]["reason"] == "spot_check_failed"
    assert [verdicts[k]["status"] for k in keys[3:]] == ["accepted"] * 4
    # All three validators certify the same model.
    assert all(torch.equal(o.new_flat, outcomes[0].new_flat) for o in outcomes)
    # The aggregate is the mean of the inputs left in the sum: the free rider's was
    # subtracted after its opening, the forger's stays (its shares were ignored, not its input).
    expected = torch.stack([updates[1]] + updates[3:]).double().mean(dim=0)
    step = 1 / fixed_point_scale(CLIP, 7)
    assert float((outcomes[0].aggregate.double() - expected).abs().max()) <= 2 * step + 1e-7
    # The opened workers' payloads reached the ledger inside their spot check's reveal.
    assert payload_blob == 200
    assert audit.ok, audit.problem


def test_more_dropouts_than_t_drop_the_bucket_and_nothing_is_revealed(tmp_path):
    attacks = {0: "drop_after_deal", 1: "drop_after_deal"}
    workers, _, result = _masked_round(
        tmp_path, masked_settings(3, 1, 0), "masked-drop", attacks, 3)
    outcomes, ends, board, summary, payload_blob, audit = result
    keys = [w.public_key.hex() for w in workers]
    assert summary["status"] == "finalized"
    assert payload_blob == 404  # nobody was spot-checked: no payload ever reached the ledger
    assert ends[2] == "too few survivors: nothing revealed"
    assert not board["buckets"][0]["live"] and board["posts"]["reveal"] == []
    verdicts = {v["worker"]: v for v in outcomes[0].verdicts}
    assert {verdicts[k]["reason"] for k in keys} == {"bucket_dropped"}
    # The dropouts are rejected; the member that masked and was left alone did its part:
    # excluded (not blamed) and paid its samples at quality 1.
    assert [verdicts[k]["status"] for k in keys] == ["rejected", "rejected", "excluded"]
    scores = {sc["worker"]: sc for sc in outcomes[0].scores}
    assert scores[keys[2]]["quality"] == 1.0 and scores[keys[2]]["score"] > 0
    assert scores[keys[0]]["score"] == scores[keys[1]]["score"] == 0
    assert float(outcomes[0].aggregate.abs().max()) == 0.0
    assert all(torch.equal(o.new_flat, outcomes[0].new_flat) for o in outcomes)
    assert audit.ok, audit.problem


def test_a_ledger_dealing_its_own_buckets_gets_no_shares_and_no_certificate(tmp_path,
                                                                          monkeypatch):
    import veritrain.ledger.secagg as ledger_secagg
    from veritrain.protocol.secagg import round_buckets

    def rigged(seed: bytes, workers, size: int) -> list[list[str]]:
        """The beacon's deal with two members swapped across buckets: what a ledger
        placing a victim among chosen workers would publish."""
        fair = round_buckets(seed, workers, size)
        fair[0][0], fair[1][0] = fair[1][0], fair[0][0]
        return [sorted(b) for b in fair]

    monkeypatch.setattr(ledger_secagg, "round_buckets", rigged)
    workers, _, result = _masked_round(
        tmp_path, masked_settings(2, 0, 0), "masked-rigged", {}, 4)
    outcomes, ends, board, summary, _, audit = result
    assert ends == ["invalid board"] * 4
    assert [getattr(o, "reason", None) for o in outcomes] == ["invalid_board"] * V
    assert summary["status"] == "closed"  # nobody certified it
    assert board["posts"]["deal"] == []  # keys are public; no share was dealt
    assert not audit.ok and "deal" in audit.problem
