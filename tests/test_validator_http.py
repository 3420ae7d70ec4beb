"""Validator-side rejections, sent over HTTP to a live ledger and judged by a real validator.

Each bad submission gets a recorded verdict with its reason, never reaches the
aggregate (the new model equals the one built from the honest updates alone),
and leaves every honest submission accepted.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from fakes import validator_identities
from ledger_harness import Api, run_api
from veritrain.protocol.client import LedgerClient
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import Registration, Submission, sign
from veritrain.protocol.organiser import build_run
from veritrain.protocol.presets import run_preset
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import sha256_hex
from veritrain.validators.checks import Candidate
from veritrain.validators.node import ValidatorConfig, ValidatorNode
from veritrain.validators.round import process_round


def synthetic_settings(spot_checks: int = 0) -> dict:
    settings = run_preset("tiny")
    settings["task"] = {"name": "synthetic", "preset": "tiny"}
    settings["verification"]["spot_checks_per_round"] = spot_checks
    settings["schedule"]["round_seconds"] = 30.0
    return settings


def honest_payload(run: RunContext, base: torch.Tensor, worker: Identity) -> tuple[bytes, list]:
    result = run.train(base, 0, worker.public_key.hex())
    payload = run.codec.encode(result.delta, seed=run.codec_seed(0, worker.public_key.hex()))
    return payload, result.trail


def fp16_bytes(values: torch.Tensor) -> bytes:
    """A payload in the fp16 codec's own layout, made by encoding then patching values."""
    return values.to(torch.float16).numpy().astype("<f2").tobytes()


def envelope(run: RunContext, worker: Identity, payload: bytes, trail: list[str]) -> Submission:
    return Submission(
        run_id=run.spec.run_id, round=0, worker=worker.public_key.hex(),
        base_model_hash=run.spec.genesis_model_hash, payload_hash=sha256_hex(payload),
        payload_bytes=len(payload), codec=run.spec.codec,
        samples=run.inner.steps * run.inner.batch_size, trail=trail, loss_first=1.0,
        loss_last=0.5, created_at=1)


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


@pytest.mark.parametrize("kind", ["undecodable", "non_finite", "norm_outlier"])
def test_invalid_payload_rejected_by_validator_and_kept_out_of_aggregate(tmp_path, kind):
    organiser = Identity.generate("organiser")
    validator = validator_identities(1)[0]
    bundle = build_run(organiser, "val-run", synthetic_settings(), [validator.public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    honest = [Identity.generate("worker") for _ in range(3)]
    cheat = Identity.generate("worker")
    payloads = {w.public_key.hex(): honest_payload(run, base, w) for w in honest}
    good_payload, trail = honest_payload(run, base, cheat)
    payloads[cheat.public_key.hex()] = (bad_payload(kind, run, good_payload), trail)

    async def scenario(api: Api):
        status, _ = await api.post_parts("/v1/runs", [("spec", bundle.signed.encode()),
                                                      ("dataset", bundle.dataset),
                                                      ("genesis", bundle.genesis)])
        assert status == 201
        for w in [*honest, cheat]:
            reg = Registration(run_id="val-run", round=0, participant=w.public_key.hex(),
                               role="worker", created_at=1)
            await api.post_json("/v1/runs/val-run/participants", sign(w, reg).to_wire())
        for w in [*honest, cheat]:
            payload, trail = payloads[w.public_key.hex()]
            status, body = await api.submit(sign(w, envelope(run, w, payload, trail)), payload)
            assert status == 201, body
        node = ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id="val-run"), validator)
        async with LedgerClient(api.url, retry_for=5.0) as client:
            info = await client.get_json("/v1/runs/val-run/rounds/0")
            assert info["status"] == "closed"
            outcome = await node.validate_round(client, run, info)
        summary = (await api.get("/v1/runs/val-run/rounds/0"))[1]
        return outcome, summary

    outcome, summary = run_api(tmp_path, scenario)
    verdicts = {v["worker"]: v for v in summary["verdicts"]}
    assert summary["status"] == "finalized"
    assert verdicts[cheat.public_key.hex()]["status"] == "rejected"
    assert verdicts[cheat.public_key.hex()]["reason"] == kind
    assert verdicts[cheat.public_key.hex()]["score"] == 0
    assert all(verdicts[w.public_key.hex()]["status"] == "accepted" for w in honest)
    # The aggregate is exactly what the honest updates alone produce.
    only_honest = [
        Candidate(sign(w, envelope(run, w, *payloads[w.public_key.hex()])),
                  payloads[w.public_key.hex()][0]) for w in honest]
    registered = {w.public_key.hex() for w in honest}
    reference = process_round(run, 0, run.spec.genesis_model_hash, base, torch.zeros_like(base),
                              only_honest, registered, set(), bytes(32))
    assert torch.equal(outcome.aggregate, reference.aggregate)
    assert torch.equal(outcome.new_flat, reference.new_flat)


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
            first = asyncio.create_task(nodes[2].beacon_seed(client, "beacon-run", 0))
            await asyncio.sleep(0.3)
            assert not first.done()  # one share is not a quorum
            seeds.append(await nodes[0].beacon_seed(client, "beacon-run", 0))
            seeds.append(await first)
            seeds.append(await nodes[1].beacon_seed(client, "beacon-run", 0))
        return seeds

    seeds = run_api(tmp_path, scenario)
    assert len(set(seeds)) == 1 and len(seeds[0]) == 32
