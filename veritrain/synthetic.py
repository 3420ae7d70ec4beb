"""Synthetic runs for load, fault and ledger tests: real signatures, no training.

A synthetic run is a signed run spec over opaque dataset and genesis blobs (the
ledger never parses them); its workers submit signed envelopes over arbitrary
payload bytes, and its validators post real BLS beacon shares and
BLS-attested round results whose verdicts follow the kind given to each worker.
Everything the ledger checks is real; only the training is absent.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from veritrain.protocol.beacon import EVERY_WORKER_ADMITTED, beacon_root
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    BeaconShare,
    CertifiedState,
    Registration,
    RoundResult,
    RunSpec,
    Signed,
    Submission,
    digest_of,
    sign,
)
from veritrain.protocol.presets import run_preset
from veritrain.protocol.rules import expected_samples, expected_trail_length
from veritrain.protocol.scoring import compute_scores, split_rewards

#: Kinds of worker: what the synthetic validators decide about their submissions.
HONEST, FREE_RIDER, COPIER, SPOT_FAIL = "honest", "free_rider", "copier", "spot_fail"
REJECT_REASON = {FREE_RIDER: "norm_outlier", COPIER: "duplicate", SPOT_FAIL: "spot_check_failed"}


@dataclass
class SyntheticRun:
    organiser: Identity
    validators: list[Identity]
    signed: Signed[RunSpec]
    dataset: bytes
    genesis: bytes

    @property
    def spec(self) -> RunSpec:
        return self.signed.message


def make_synthetic_run(run_id: str, validators: list[Identity], /, *, quorum: int = 1,
                       **overrides: Any) -> SyntheticRun:
    """A run of the ``tiny`` preset's rules over opaque blobs; ``overrides`` replace
    spec fields (``limits``, ``schedule``, even the ``validators`` list)."""
    organiser = Identity.generate("organiser")
    settings = run_preset("tiny")
    dataset = b"dataset bytes for " + run_id.encode()
    genesis = b"genesis model for " + run_id.encode()
    body: dict[str, Any] = {
        "run_id": run_id, "round": 0, "created_at": 1, "organiser": organiser.public_key.hex(),
        "seed": "ab" * 32, "task": {"name": "synthetic", "params": {}},
        "dataset_hash": hashlib.sha256(dataset).hexdigest(), "dataset_bytes": len(dataset),
        "genesis_model_hash": hashlib.sha256(genesis).hexdigest(), "num_params": 10,
        "inner": settings["inner"], "outer": settings["outer"], "codec": settings["codec"],
        "aggregator": settings["aggregator"], "schedule": settings["schedule"],
        "verification": settings["verification"], "limits": {"max_payload_bytes": 4096},
        "rewards": settings["rewards"],
        "validators": [v.public.to_json() for v in validators], "quorum": quorum,
    }
    body.update(overrides)
    spec = RunSpec.from_body(body)
    return SyntheticRun(organiser, validators, sign(organiser, spec), dataset, genesis)


def registration(run: SyntheticRun, worker: Identity) -> Signed[Registration]:
    return sign(worker, Registration(run_id=run.spec.run_id, round=0,
                                     participant=worker.public_key.hex(), role="worker",
                                     created_at=1))


def synthetic_submission(run: SyntheticRun, worker: Identity, payload: bytes, *,
                         round_index: int = 0, base: str | None = None,
                         **overrides: Any) -> Signed[Submission]:
    """A well-formed signed submission of ``payload`` (override any field to break it)."""
    spec = run.spec
    body: dict[str, Any] = {
        "run_id": spec.run_id, "round": round_index, "worker": worker.public_key.hex(),
        "base_model_hash": base or spec.genesis_model_hash,
        "payload_hash": hashlib.sha256(payload).hexdigest(), "payload_bytes": len(payload),
        "codec": spec.codec, "samples": expected_samples(spec),
        "trail": ["7" * 64] * expected_trail_length(spec), "ef_hash": "6" * 64,
        "loss_first": 3.0, "loss_last": 2.0,
        "created_at": 1,
    }
    body.update(overrides)
    return sign(worker, Submission(**body))


def beacon_share(run: SyntheticRun, validator: Identity, r: int, sealed: str,
                 participants: str = EVERY_WORKER_ADMITTED) -> Signed[BeaconShare]:
    """``validator``'s share of round ``r``'s beacon, naming the sealed list digest
    ``sealed`` (``sealed_list_digest`` of the round's submission digests) and the
    participant view digest ``participants`` (by default: every sealed worker registered
    and unbanned, as in a synthetic run)."""
    spec = run.spec
    return sign(validator, BeaconShare(run_id=spec.run_id, round=r,
                                       validator=validator.public_key.hex(),
                                       share=validator.sign_bls(beacon_root(spec.run_id, r)).hex(),
                                       sealed=sealed, participants=participants))


def _verdict(worker: str, digest: str, kind: str) -> dict[str, Any]:
    rejected = kind != HONEST
    return {"worker": worker, "submission_digest": digest,
            "status": "rejected" if rejected else "accepted",
            "reason": REJECT_REASON.get(kind, ""), "detail": f"synthetic verdict for a {kind}",
            "spot_checked": kind == SPOT_FAIL, "distance": 0.5 if kind == SPOT_FAIL else None,
            # The evidence a failed check names: the revealed states' content hashes.
            "checks": [{"segment": 1, "start": "7" * 64, "end": "7" * 64, "ef": None,
                        "distance": 0.5, "ok": False,
                        "note": "recomputed end state differs"}] if kind == SPOT_FAIL else []}


def build_results(run: SyntheticRun, r: int, base: str, seed: str, subs: dict[str, str],
                  kinds: dict[str, str], quality: dict[str, float] | None = None
                  ) -> tuple[list[Signed[RoundResult]], dict[str, bytes]]:
    """The quorum's signed, BLS-attested results for round ``r`` over ``subs`` (worker ->
    submission digest) and the blobs they name (multipart part name -> bytes)."""
    spec = run.spec
    workers = sorted(subs)
    verdicts = [_verdict(w, subs[w], kinds[w]) for w in workers]
    samples = {w: expected_samples(spec) if kinds[w] == HONEST else 0 for w in workers}
    q = {w: (quality or {}).get(w, 1.0) for w in workers}
    scores_map = compute_scores(samples, q)
    rewards = split_rewards(scores_map, spec.rewards["per_round"])
    scores = [{"worker": w, "samples": samples[w], "quality": q[w] if samples[w] else 0.0,
               "score": scores_map[w], "reward": rewards[w]} for w in workers]
    blobs = {name: f"{name} {spec.run_id} {r + 1}".encode()
             for name in ("model", "outer_state", "update")}
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in blobs.items()}
    fields = {"run_id": spec.run_id, "round": r + 1, "model_hash": digests["model"],
              "outer_state_hash": digests["outer_state"], "update_hash": digests["update"],
              "verdicts_hash": digest_of(verdicts), "scores_hash": digest_of(scores),
              "eval_loss": 3.0 - 0.25 * r}
    cert = CertifiedState.from_body({k: v for k, v in fields.items()
                                     if k in CertifiedState.SCHEMA})
    signed = [sign(v, RoundResult(
        run_id=spec.run_id, round=r, validator=v.public_key.hex(), base_model_hash=base,
        beacon_seed=seed, verdicts=verdicts, scores=scores, certified=cert.to_body(),
        attestation=v.sign_bls(cert.signing_root()).hex())) for v in run.validators[: spec.quorum]]
    return signed, blobs
