"""Test doubles that need no torch: identities and a signed run spec over opaque blobs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import RunSpec, Signed, sign
from veritrain.protocol.presets import run_preset

_VALIDATORS: list[Identity] = []


def validator_identities(n: int) -> list[Identity]:
    """BLS key generation is slow in pure Python: make validator keys once per session."""
    while len(_VALIDATORS) < n:
        _VALIDATORS.append(Identity.generate("validator"))
    return _VALIDATORS[:n]


@dataclass
class FakeRun:
    """A signed run spec over opaque dataset and genesis blobs (the ledger never parses them)."""

    organiser: Identity
    validators: list[Identity]
    signed: Signed[RunSpec]
    dataset: bytes
    genesis: bytes

    @property
    def spec(self) -> RunSpec:
        return self.signed.message


def make_fake_run(run_id: str = "test-run", *, n_validators: int = 1, quorum: int = 1,
                  **overrides: Any) -> FakeRun:
    organiser = Identity.generate("organiser")
    validators = validator_identities(n_validators)
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
    for key, value in overrides.items():
        body[key] = value
    spec = RunSpec.from_body(body)
    return FakeRun(organiser, validators, sign(organiser, spec), dataset, genesis)


def make_submission(run: FakeRun, worker: Identity, payload: bytes, *, round_index: int = 0,
                    base: str | None = None, **overrides: Any) -> Signed[Any]:
    """A well-formed signed submission for ``run`` (override any field to break it)."""
    from veritrain.protocol.messages import Submission
    from veritrain.protocol.rules import expected_samples, expected_trail_length

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
