"""Validator-side rejections, sent over HTTP to a live ledger and judged by a real validator.

Each bad submission gets a recorded verdict with its reason, never reaches the
aggregate (the new model equals the one built from the honest updates alone),
and leaves every honest submission accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from fakes import validator_identities
from ledger_harness import Api, reveal_all, reveals_under, run_api
from veritrain.ledger.client import LedgerClient
from veritrain.protocol.codecs import ErrorFeedback
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Registration, Submission, sign
from veritrain.protocol.organiser import build_run
from veritrain.protocol.outer import OuterState
from veritrain.protocol.presets import run_preset
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import sha256_hex
from veritrain.validators.checks import Candidate
from veritrain.validators.node import ValidatorConfig, ValidatorNode
from veritrain.validators.round import process_round
from veritrain.workers.round import PreparedSubmission, prepare_submission


def synthetic_settings(challenges: float = 2.0, binding_chunks: int = 16) -> dict:
    settings = run_preset("tiny")
    settings["task"] = {"name": "synthetic", "preset": "tiny"}
    settings["verification"]["challenges_per_worker"] = challenges
    settings["verification"]["binding_chunks"] = binding_chunks
    # fp16: bad_payload writes a NaN into that codec's plain little-endian layout.
    settings["codec"] = {"name": "fp16", "params": {}}
    settings["schedule"]["round_seconds"] = 30.0
    # A withheld reveal is judged missing at this deadline; honest reveals take under a
    # second, so 10 s leaves room on a loaded machine without every such test waiting 30.
    settings["verification"]["reveal_seconds"] = 10.0
    return settings


def honest(run: RunContext, base: torch.Tensor, worker: Identity) -> PreparedSubmission:
    return prepare_submission(run, worker, 0, base, run.spec.genesis_model_hash,
                              ErrorFeedback(run.numel))


def bad_payload(kind: str, run: RunContext, good: bytes) -> bytes:
    codec = run.codec
    if kind == "undecodable":
        return good[: len(good) // 2]
    decoded = codec.decode(good, run.numel, seed=0)
    if kind == "non_finite":
        raw = bytearray(codec.encode(decoded, seed=0))
        nan16 = np.array([np.nan], dtype="<f2").tobytes()
        raw[-2:] = nan16
        return bytes(raw)
    if kind == "norm_outlier":
        return codec.encode(decoded * 1000.0, seed=0)
    raise AssertionError(kind)


async def submit_all(api: Api, bundle, workers: list[Identity],
                     prepared: dict[str, tuple[Submission, bytes]]) -> None:
    status, _ = await api.post_parts("/v1/runs", [("spec", bundle.signed.encode()),
                                                  ("dataset", bundle.dataset),
                                                  ("genesis", bundle.genesis)])
    assert status == 201
    run_id = bundle.signed.message.run_id
    for w in workers:
        reg = Registration(run_id=run_id, round=0, participant=w.public_key.hex(),
                           role="worker", created_at=1)
        await api.post_json(f"/v1/runs/{run_id}/participants", sign(w, reg).to_wire())
    for w in workers:
        sub, payload = prepared[w.public_key.hex()]
        status, body = await api.submit(sign(w, sub), payload)
        assert status == 201, body


async def validate(api: Api, run: RunContext, validator: Identity, preps: dict,
                   workers: list[Identity], skip: frozenset[str] = frozenset()):
    node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=run.spec.run_id,
                                         poll_seconds=0.05), validator)
    async with LedgerClient(api.url, retry_for=5.0) as client:
        info = await client.get_json(f"/v1/runs/{run.spec.run_id}/rounds/0")
        assert info["status"] == "closed"
        await node.beacon_seed(client, run.spec, 0)
        await reveal_all(api, run, preps, workers, skip=skip)
        outcome = await node.validate_round(client, run, info)
    return outcome, (await api.get(f"/v1/runs/{run.spec.run_id}/rounds/0"))[1]


@pytest.mark.parametrize("kind", ["undecodable", "non_finite", "norm_outlier"])
def test_invalid_payload_rejected_by_validator_and_kept_out_of_aggregate(tmp_path, kind):
    organiser = Identity.generate("organiser")
    validator = validator_identities(1)[0]
    # Without checks (no challenges, no binding) the norm filter must catch the scaled
    # update; with the binding on, it is a proven spot_check_failed instead (the next test).
    checks = kind != "norm_outlier"
    settings = synthetic_settings(challenges=2.0 if checks else 0.0,
                                  binding_chunks=16 if checks else 0)
    bundle = build_run(organiser, "val-run", settings, [validator.public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    good = [Identity.generate("worker") for _ in range(3)]
    cheat = Identity.generate("worker")
    preps = {w.public_key.hex(): honest(run, base, w) for w in [*good, cheat]}
    prepared = {k: (p.signed.message, p.payload) for k, p in preps.items()}
    sub, payload = prepared[cheat.public_key.hex()]
    bad = bad_payload(kind, run, payload)
    prepared[cheat.public_key.hex()] = (dataclasses.replace(
        sub, payload_hash=sha256_hex(bad), payload_bytes=len(bad)), bad)

    async def scenario(api: Api):
        await submit_all(api, bundle, [*good, cheat], prepared)
        return await validate(api, run, validator, preps, [*good, cheat],
                              skip=frozenset({cheat.public_key.hex()}))

    outcome, summary = run_api(tmp_path, scenario)
    verdicts = {v["worker"]: v for v in summary["verdicts"]}
    assert summary["status"] == "finalized"
    v = verdicts[cheat.public_key.hex()]
    assert v["reason"] == kind
    if kind == "norm_outlier":
        # Suspicion, not proof: excluded (not rejected) and paid by its clip quality at the
        # aggregate, which for an update 1000 times too long is next to nothing.
        assert v["status"] == "excluded"
        assert 0 < v["quality"] < 0.01
        assert v["score"] == pytest.approx(v["samples"] * v["quality"], rel=1e-6)
    else:
        assert v["status"] == "rejected" and v["score"] == 0
    assert all(verdicts[w.public_key.hex()]["status"] == "accepted" for w in good)
    assert all(verdicts[w.public_key.hex()]["spot_checked"] == checks for w in good)
    # The aggregate is exactly what the honest updates alone produce.
    only_honest = [Candidate(preps[w.public_key.hex()].signed, preps[w.public_key.hex()].payload)
                   for w in good]
    registered = {w.public_key.hex() for w in good}
    reference = process_round(run, 0, run.spec.genesis_model_hash, base, OuterState.zeros(run.numel),
                              only_honest, registered, set(), bytes(32),
                              reveals=reveals_under(run, {w.public_key.hex(): preps[
                                  w.public_key.hex()] for w in good}, bytes(32)))
    assert torch.equal(outcome.aggregate, reference.aggregate)
    assert torch.equal(outcome.new_flat, reference.new_flat)


@pytest.mark.parametrize("cheat", ["missing_reveal", "forged_trail", "sign_flip", "free_rider",
                                   "scaled_payload"])
def test_invalid_work_fails_its_segment_check_over_http(tmp_path, cheat):
    """Cheats that decode fine are caught by the revealed segments, and banned."""
    organiser = Identity.generate("organiser")
    validator = validator_identities(1)[0]
    bundle = build_run(organiser, "seg-run", synthetic_settings(), [validator.public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    good = [Identity.generate("worker") for _ in range(2)]
    bad = Identity.generate("worker")
    preps = {w.public_key.hex(): honest(run, base, w) for w in good}
    attack = cheat if cheat in ("sign_flip", "free_rider") else None
    preps[bad.public_key.hex()] = prepare_submission(
        run, bad, 0, base, run.spec.genesis_model_hash, ErrorFeedback(run.numel), attack=attack)
    prepared = {k: (p.signed.message, p.payload) for k, p in preps.items()}
    sub = prepared[bad.public_key.hex()][0]
    skip = frozenset({bad.public_key.hex()}) if cheat == "missing_reveal" else frozenset()
    if cheat == "scaled_payload":  # decodes, passes the norm filter: only the binding tells
        scaled = run.codec.encode(run.codec.decode(prepared[bad.public_key.hex()][1],
                                                   run.numel) * 2.0)
        scaled_sub = dataclasses.replace(sub, payload_hash=sha256_hex(scaled),
                                         payload_bytes=len(scaled))
        prepared[bad.public_key.hex()] = (scaled_sub, scaled)
        preps[bad.public_key.hex()] = dataclasses.replace(
            preps[bad.public_key.hex()], signed=sign(bad, scaled_sub), payload=scaled)
    if cheat == "forged_trail":
        forged = [*sub.trail[:-1], "ab" * 32]
        forged_sub = dataclasses.replace(sub, trail=forged)
        prepared[bad.public_key.hex()] = (forged_sub, prepared[bad.public_key.hex()][1])
        preps[bad.public_key.hex()] = dataclasses.replace(
            preps[bad.public_key.hex()], signed=sign(bad, forged_sub))

    async def scenario(api: Api):
        await submit_all(api, bundle, [*good, bad], prepared)
        _, summary = await validate(api, run, validator, preps, [*good, bad], skip=skip)
        return summary, (await api.get("/v1/runs/seg-run/participants"))[1]

    summary, parts = run_api(tmp_path, scenario)
    verdicts = {v["worker"]: v for v in summary["verdicts"]}
    v = verdicts[bad.public_key.hex()]
    # Nothing revealed (withheld, or a free rider with nothing to open) is its own proven
    # reason; a reveal that does not check out is a failed spot check. Both are banned.
    expected = "missing_reveal" if cheat in ("missing_reveal", "free_rider") else \
        "spot_check_failed"
    assert v["status"] == "rejected" and v["reason"] == expected, v
    if cheat in ("sign_flip", "scaled_payload"):  # an honest trail: the binding fails
        assert "payload binding" in v["detail"], v
    assert v["score"] == 0
    assert all(verdicts[w.public_key.hex()]["status"] == "accepted" for w in good)
    banned = {p["pubkey"]: p["banned_until_round"] for p in parts["participants"]}
    assert banned[bad.public_key.hex()] >= 0
    assert all(banned[w.public_key.hex()] == -1 for w in good)


def test_beacon_waits_for_quorum_and_is_the_same_for_every_validator(tmp_path):
    from fakes import make_fake_run, make_submission

    run = make_fake_run("beacon-run", n_validators=3, quorum=2)
    worker = Identity.generate("worker")

    async def scenario(api: Api):
        await api.create_run(run)
        await api.register(run, worker)
        await api.submit(make_submission(run, worker, b"p" * 8), b"p" * 8)
        seeds = []
        async with LedgerClient(api.url, retry_for=5.0) as client:
            nodes = [ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id="beacon-run",
                                                   poll_seconds=0.05), v)
                     for v in run.validators]
            first = asyncio.create_task(nodes[2].beacon_seed(client, run.spec, 0))
            await asyncio.sleep(0.3)
            assert not first.done()  # one share is not a quorum
            seeds.append(await nodes[0].beacon_seed(client, run.spec, 0))
            seeds.append(await first)
            seeds.append(await nodes[1].beacon_seed(client, run.spec, 0))
        return seeds

    seeds = run_api(tmp_path, scenario)
    assert len(set(seeds)) == 1 and len(seeds[0]) == 32


def test_a_validator_refuses_a_beacon_whose_shares_do_not_verify(tmp_path, monkeypatch):
    """The seed picks the spot checks: a ledger serving a share of its own making (the
    right size, no validator's signature) gets ``invalid_beacon``, not a seed."""
    from fakes import make_fake_run, make_submission
    from veritrain.ledger.store import LedgerStore

    run = make_fake_run("forged-beacon", n_validators=1, quorum=1)
    worker = Identity.generate("worker")
    honest = LedgerStore.post_beacon_share

    def forging(self, signed):
        reply = honest(self, signed)
        if reply["beacon"] is not None:
            other = validator_identities(2)[1].sign_bls(b"any other root").hex()
            reply = {"beacon": {**reply["beacon"], "shares": [other]}}
        return reply

    monkeypatch.setattr(LedgerStore, "post_beacon_share", forging)

    async def scenario(api: Api):
        await api.create_run(run)
        await api.register(run, worker)
        await api.submit(make_submission(run, worker, b"p" * 8), b"p" * 8)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id="forged-beacon",
                                                 poll_seconds=0.05), run.validators[0])
            with pytest.raises(RejectedInput) as err:
                await node.beacon_seed(client, run.spec, 0)
        return err.value.reason

    assert run_api(tmp_path, scenario) == "invalid_beacon"


def test_worker_keeps_the_run_specs_share_of_its_residual():
    """inner.feedback_decay changes what the worker carries over, never what it sends."""
    settings = synthetic_settings()
    settings["codec"] = {"name": "int4", "params": {"block": 64}}  # lossy: a residual
    bundle = build_run(Identity.generate("organiser"), "decay-run", settings,
                       [validator_identities(1)[0].public])
    spec = bundle.signed.message
    worker = Identity.generate("worker")
    kept = {}
    for decay in (None, 0.25):
        inner = spec.inner if decay is None else {**spec.inner, "feedback_decay": decay}
        run = RunContext.build(dataclasses.replace(spec, inner=inner), bundle.dataset)
        assert run.spec.feedback_decay == (1.0 if decay is None else decay)
        prep = honest(run, run.decode_model(bundle.genesis), worker)
        kept[decay] = (prep.payload, prep.error_feedback.residual)
    (payload_1, residual_1), (payload_q, residual_q) = kept[None], kept[0.25]
    assert payload_1 == payload_q
    assert residual_1.norm() > 0
    assert torch.allclose(residual_q, 0.25 * residual_1, atol=0, rtol=1e-6)
