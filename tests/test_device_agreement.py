"""Validators on different devices certify one state (issue #28 item 1).

Two real validator nodes judge the same round on a real ledger (loopback), each
recomputing the challenged segments on its own device; the round needs both (quorum 2
of 2), so it is finalized only if their certified states are byte-identical. One
worker forges its payload, so a failed check is certified too. On a machine without a
GPU the pair is CPU and CPU; with one, CPU and CUDA (the CUDA case is skipped here).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from fakes import validator_identities
from ledger_harness import Api, open_and_submit, reveal_all, run_api
from test_validator_http import honest, synthetic_settings
from veritrain.ledger.client import LedgerClient
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import digest_of, sign
from veritrain.protocol.organiser import build_run
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import sha256_hex
from veritrain.validators.node import ValidatorConfig, ValidatorNode

RUN = "device-run"


def _play(tmp_path, devices: tuple[str, str]):
    validators = validator_identities(2)
    bundle = build_run(Identity.generate("organiser"), RUN, synthetic_settings(),
                       [v.public for v in validators], quorum=2)
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    base = run.decode_model(bundle.genesis)
    workers = [Identity.generate("worker") for _ in range(4)]
    preps = {w.public_key.hex(): honest(run, base, w) for w in workers}
    forger = workers[-1].public_key.hex()
    good = preps[forger]
    flipped = run.codec.encode(-run.codec.decode(good.payload, run.numel, seed=0), seed=0)
    forged = dataclasses.replace(good.signed.message, payload_hash=sha256_hex(flipped),
                                 payload_bytes=len(flipped))

    async def scenario(api: Api):
        preps[forger] = dataclasses.replace(good, signed=sign(workers[-1], forged),
                                            payload=flipped)
        await open_and_submit(api, bundle, workers, preps)
        nodes = [ValidatorNode(ValidatorConfig(ledger_url=api.url, run_id=RUN, device=d,
                                               poll_seconds=0.05), v)
                 for v, d in zip(validators, devices, strict=True)]
        async with LedgerClient(api.url, retry_for=5.0) as client:
            info = await client.get_json(f"/v1/runs/{RUN}/rounds/0")
            await asyncio.gather(*(n.beacon_seed(client, run.spec, 0) for n in nodes))
            await reveal_all(api, run, preps, workers)
            # One after the other: a process keeps one recomputing model (a node per
            # process in a real run).
            outcomes = [await n.validate_round(client, run, info) for n in nodes]
        summary = (await api.get(f"/v1/runs/{RUN}/rounds/0"))[1]
        return outcomes, summary

    outcomes, summary = run_api(tmp_path, scenario)
    return forger, outcomes, summary


def _check(forger, outcomes, summary) -> None:
    assert summary["status"] == "finalized", summary  # both attestations, one state
    a, b = outcomes
    assert digest_of(a.verdicts) == digest_of(b.verdicts)
    assert a.eval_loss == b.eval_loss and torch.equal(a.new_flat, b.new_flat)
    verdicts = {v["worker"]: v for v in summary["verdicts"]}
    assert verdicts[forger]["reason"] == "spot_check_failed"
    assert sum(v["status"] == "accepted" for v in verdicts.values()) == 3


def test_two_cpu_validators_certify_one_state(tmp_path):
    _check(*_play(tmp_path, ("cpu", "cpu")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cpu_and_a_cuda_validator_certify_one_state(tmp_path):
    _check(*_play(tmp_path, ("cpu", "cuda")))
