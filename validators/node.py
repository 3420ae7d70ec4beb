"""The validator node: follows a run over HTTP and processes each closed round.

For round r it: verifies the base model against the previous certificate,
posts its beacon share and waits for the round's fixed beacon, fetches the
sealed submissions and their payloads, runs :func:`process_round`, and posts
its signed result with a BLS attestation and the new model and momentum. It
keeps no state of its own: after a restart it reads where the run stands
from the ledger and carries on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from veritrain.protocol.beacon import beacon_root, beacon_seed_of
from veritrain.protocol.challenges import max_reveal_bytes
from veritrain.protocol.client import LedgerClient, LedgerRefused
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.follow import fetch_base, fetch_run
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    BeaconShare,
    CertifiedState,
    Registration,
    RoundResult,
    Submission,
    digest_of,
    open_signed,
    sign,
)
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import sha256_hex

from .checks import Candidate
from .round import RoundOutcome, process_round

log = logging.getLogger("veritrain.validator")


@dataclass
class ValidatorConfig:
    ledger_url: str
    run_id: str | None = None
    device: str = "cpu"
    poll_seconds: float = 0.5
    retry_for: float = 300.0


class ValidatorNode:
    def __init__(self, config: ValidatorConfig, identity: Identity) -> None:
        if identity.role != "validator":
            raise ValueError("a validator needs a validator key (veritrain keygen --role validator)")
        self.config = config
        self.identity = identity
        self.me = identity.public_key.hex()

    async def run(self, *, max_rounds: int | None = None) -> None:
        async with LedgerClient(self.config.ledger_url, retry_for=self.config.retry_for) as client:
            spec = await fetch_run(client, self.config.run_id)
            if spec.validator_index(self.me) is None:
                raise SystemExit("this key is not a validator of the run")
            dataset = await client.get_blob(spec.dataset_hash, max_bytes=spec.dataset_bytes)
            run = await asyncio.to_thread(RunContext.build, spec, dataset)
            log.info("validating run %s (%d parameters)", spec.run_id, run.numel)
            r = 0
            done = 0
            while max_rounds is None or done < max_rounds:
                try:
                    info = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}")
                except LedgerRefused as exc:
                    if exc.reason != "not_found":
                        raise
                    overview = await client.get_json(f"/v1/runs/{spec.run_id}")
                    if overview["status"] != "active":
                        log.info("run %s is %s", spec.run_id, overview["status"])
                        return
                    await asyncio.sleep(self.config.poll_seconds)
                    continue
                if info["status"] == "finalized":
                    r += 1
                    continue
                if info["status"] == "open":
                    await asyncio.sleep(min(self.config.poll_seconds,
                                            max(0.05, info["deadline"] - info["now"])))
                    continue
                results = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}/results")
                if any(x["body"]["validator"] == self.me for x in results["results"]):
                    await asyncio.sleep(self.config.poll_seconds)
                    continue
                await self.validate_round(client, run, info)
                done += 1

    async def beacon_seed(self, client: LedgerClient, run_id: str, r: int) -> bytes:
        share = BeaconShare(run_id=run_id, round=r, validator=self.me,
                            share=self.identity.sign_bls(beacon_root(run_id, r)).hex())
        path = f"/v1/runs/{run_id}/rounds/{r}/beacon"
        reply = await client.post_message(path, sign(self.identity, share).to_wire())
        while reply["beacon"] is None:
            await asyncio.sleep(self.config.poll_seconds)
            reply = await client.get_json(path)
        return bytes.fromhex(beacon_seed_of(reply["beacon"]))

    async def gather_evidence(self, client: LedgerClient, run_id: str, r: int,
                              numel: int) -> dict[str, bytes]:
        """Wait until every challenge is answered or the reveal deadline passes; fetch files.

        What was not revealed in time is simply absent, and the segment checks
        that need it fail.
        """
        path = f"/v1/runs/{run_id}/rounds/{r}/challenges"
        view = await client.get_json(path)
        while not view["complete"] and (not view["fixed"] or view["now"] < view["reveal_deadline"]):
            await asyncio.sleep(self.config.poll_seconds)
            view = await client.get_json(path)
        evidence: dict[str, bytes] = {}
        for c in view["challenges"]:
            for digest in c["received"]:
                if digest not in evidence:
                    evidence[digest] = await client.get_blob(
                        digest, max_bytes=max_reveal_bytes(numel))
        return evidence

    async def validate_round(self, client: LedgerClient, run: RunContext,
                             info: dict[str, Any]) -> RoundOutcome:
        spec = run.spec
        r = info["round"]
        started = time.monotonic()
        base_flat, outer = await fetch_base(client, run, info)
        seed = await self.beacon_seed(client, spec.run_id, r)
        sealed = await client.get_json(f"/v1/runs/{spec.run_id}/rounds/{r}/submissions")
        parts = await client.get_json(f"/v1/runs/{spec.run_id}/participants")
        registered, banned = set(), set()
        for p in parts["participants"]:
            try:
                reg = open_signed(p["registration"], Registration).message
            except RejectedInput:
                continue
            registered.add(reg.participant)
            if p["banned_until_round"] >= r:
                banned.add(reg.participant)
        candidates = []
        for wire in sealed["submissions"]:
            try:
                signed = open_signed(wire, Submission)
            except RejectedInput as exc:
                log.warning("ledger served an invalid submission: %s", exc)
                continue
            payload: bytes | None
            try:
                payload = await client.get_blob(
                    signed.message.payload_hash,
                    max_bytes=min(signed.message.payload_bytes,
                                  spec.limits["max_payload_bytes"]))
            except (LedgerRefused, RejectedInput) as exc:
                log.warning("payload of %s unavailable: %s", signed.message.worker[:12], exc)
                payload = None
            candidates.append(Candidate(signed, payload))
        evidence = await self.gather_evidence(client, spec.run_id, r, run.numel)
        outcome = await asyncio.to_thread(
            process_round, run, r, info["base_model_hash"], base_flat, outer, candidates,
            registered, banned, seed, evidence=evidence, device=self.config.device)
        model_bytes = run.encode_model(outcome.new_flat)
        outer_bytes = outcome.new_outer.to_bytes()
        certified = CertifiedState(
            run_id=spec.run_id, round=r + 1, model_hash=sha256_hex(model_bytes),
            outer_state_hash=sha256_hex(outer_bytes),
            update_hash=sha256_hex(outcome.update_payload),
            verdicts_hash=digest_of(outcome.verdicts),
            scores_hash=digest_of(outcome.scores), eval_loss=outcome.eval_loss)
        result = RoundResult(
            run_id=spec.run_id, round=r, validator=self.me,
            base_model_hash=info["base_model_hash"], beacon_seed=seed.hex(),
            verdicts=outcome.verdicts, scores=outcome.scores, certified=certified.to_body(),
            attestation=self.identity.sign_bls(certified.signing_root()).hex())
        reply = await client.post_multipart(
            f"/v1/runs/{spec.run_id}/rounds/{r}/results",
            [("result", sign(self.identity, result).encode(), "application/json"),
             ("model", model_bytes, "application/octet-stream"),
             ("outer_state", outer_bytes, "application/octet-stream"),
             ("update", outcome.update_payload, "application/octet-stream")])
        rejected = [v for v in outcome.verdicts if v["status"] == "rejected"]
        log.info("round %d: %d accepted, %d rejected, eval loss %.4f, %s (%.1fs)", r,
                 len(outcome.accepted), len(rejected), outcome.eval_loss, reply["status"],
                 time.monotonic() - started)
        return outcome
