"""Test doubles that need no torch: cached validator keys over :mod:`veritrain.synthetic`."""

from __future__ import annotations

from typing import Any

from veritrain.protocol.identity import Identity

from veritrain.synthetic import SyntheticRun, make_synthetic_run, synthetic_submission

_VALIDATORS: list[Identity] = []


def validator_identities(n: int) -> list[Identity]:
    """BLS key generation is slow in pure Python: make validator keys once per session."""
    while len(_VALIDATORS) < n:
        _VALIDATORS.append(Identity.generate("validator"))
    return _VALIDATORS[:n]


FakeRun = SyntheticRun
make_submission = synthetic_submission


def make_fake_run(run_id: str = "test-run", *, n_validators: int = 1, quorum: int = 1,
                  **overrides: Any) -> SyntheticRun:
    return make_synthetic_run(run_id, validator_identities(n_validators), quorum=quorum,
                              **overrides)
