"""What validators certify about spot checks: outcomes, never hardware-dependent floats.

Honest validators on other thread counts, kernels or devices recompute a challenged
step to slightly different last bits (specs/protocol.md 10.2), so a certified verdict
must not carry the recomputation distance: two honest validators must sign the same
bytes. A withheld reveal has its own reason code and is penalized like a failed check;
a validator records bad input and faults by round and never stops over them.
"""

from __future__ import annotations

import time

import pytest
import veritrain.validators.spot_checks as spot_checks
from veritrain.ledger.client import LedgerClient
from veritrain.protocol import training
from veritrain.protocol.messages import digest_of
from veritrain.protocol.presets import run_preset
from veritrain.protocol.rules import PENALIZED_REASONS, REJECTION_REASONS
from veritrain.validators.node import MAX_ROUND_FAULTS, ValidatorConfig, ValidatorNode
from veritrain.validators.spot_checks import (
    CheckResult,
    RevealToCheck,
    check_reveal,
    check_reveals,
    failure_reason,
)
from veritrain.workers.evidence import reveal_bytes
from veritrain.workers.round import prepare_submission

from veritrain.swarm import Swarm


def tiny_swarm() -> Swarm:
    return Swarm(run_preset("tiny"), n_workers=3, seed="verdicts")


def test_a_certified_check_carries_its_outcome_not_its_distance():
    check = CheckResult("step", 2, "a" * 64, "b" * 64, None, 3.7e-8, True, "")
    assert check.to_json()["distance"] is None
    assert check.to_json()["ok"] is True and check.to_json()["segment"] == 2
    assert check.distance == 3.7e-8  # kept for the node's logs and stats


def test_validators_with_different_recomputation_noise_sign_the_same_verdicts(monkeypatch):
    """Two honest validators whose recomputations differ in the last bits (0 on one,
    a few 1e-8 on the other, as 1 and 2 threads do) certify byte-identical verdicts."""
    real = spot_checks.vectors_distance
    monkeypatch.setattr(time, "time", lambda: 1_800_000_000.0)  # same submissions twice
    digests = []
    for noise in (0.0, 4e-8):
        monkeypatch.setattr(spot_checks, "vectors_distance",
                            lambda a, b, noise=noise: real(a, b) + noise)
        swarm = tiny_swarm()
        outcome = swarm.step(0)
        assert {v["status"] for v in outcome.verdicts} == {"accepted"}
        assert all(v["spot_checked"] for v in outcome.verdicts)
        digests.append((digest_of(outcome.verdicts), digest_of(outcome.scores)))
    assert digests[0] == digests[1]


@pytest.fixture(scope="module")
def submitted():
    swarm = tiny_swarm()
    ident = swarm.workers[0]
    prep = prepare_submission(swarm.run, ident, 0, swarm.base, swarm.base_hash,
                              swarm.error_feedback[0])
    return swarm, prep


def test_a_withheld_reveal_is_missing_reveal_and_a_bad_one_is_a_failed_check(submitted):
    swarm, prep = submitted
    sub, seed = prep.signed.message, b"\x07" * 32
    segments = [len(sub.trail) - 1]
    honest = check_reveal(swarm.run, swarm.base, sub, prep.payload, segments,
                          reveal_bytes(prep.evidence, seed, segments, sub), seed)
    assert honest and all(x.ok for x in honest)

    withheld = check_reveal(swarm.run, swarm.base, sub, prep.payload, segments, None, seed)
    assert withheld and not any(x.ok for x in withheld)
    assert failure_reason(withheld) == "missing_reveal"

    garbled = check_reveal(swarm.run, swarm.base, sub, prep.payload, segments, b"\x00" * 64,
                           seed)
    assert not any(x.ok for x in garbled)
    assert failure_reason(garbled) == "spot_check_failed"
    assert "parse" in garbled[0].note


def test_a_rounds_checks_build_one_model_and_judge_as_one_at_a_time(monkeypatch):
    """``check_reveals`` (what a validator's round runs) gives each submission the results
    ``check_reveal`` gives it alone, builds the recomputing model once for all the step
    checks, reads each reveal once per pass, and keeps no model afterwards."""
    swarm = tiny_swarm()
    seed = b"\x05" * 32
    items, alone, reads = [], {}, {}
    for n, ident in enumerate(swarm.workers):
        prep = prepare_submission(swarm.run, ident, 0, swarm.base, swarm.base_hash,
                                  swarm.error_feedback[n])
        sub = prep.signed.message
        segments = [0, len(sub.trail) - 1] if n < 2 else [1]
        reveal = None if n == 2 else reveal_bytes(prep.evidence, seed, segments, sub)
        alone[sub.worker] = check_reveal(swarm.run, swarm.base, sub, prep.payload, segments,
                                         reveal, seed)

        def read(worker=sub.worker, reveal=reveal):
            reads[worker] = reads.get(worker, 0) + 1
            return reveal
        items.append(RevealToCheck(sub, segments, read, lambda p=prep.payload: p))
    built = []

    class CountedTrainer(training._Trainer):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(training, "_Trainer", CountedTrainer)
    together = check_reveals(swarm.run, swarm.base, items, seed)
    assert len(built) == 1  # four step checks of two workers, one model
    assert not training._TRAINERS  # gone before the bindings, not kept after the round
    assert reads == {w: 2 for w in reads} and len(reads) == 3
    for worker, results in alone.items():
        again = together[worker]
        assert [(x.kind, x.segment, x.ok, x.note, x.missing) for x in again] == [
            (x.kind, x.segment, x.ok, x.note, x.missing) for x in results]
        assert [x.distance for x in again] == [x.distance for x in results]
    honest = [w for w, r in together.items() if all(x.ok for x in r)]
    assert len(honest) == 2 and all(len(together[w]) == 3 for w in honest)
    withheld = next(r for w, r in together.items() if w not in honest)
    assert [x.kind for x in withheld] == ["step", "binding"]
    assert failure_reason(withheld) == "missing_reveal"


def test_penalized_reasons_are_rejection_reasons():
    assert {"spot_check_failed", "missing_reveal"} == PENALIZED_REASONS
    assert set(REJECTION_REASONS) >= PENALIZED_REASONS
    # Suspicion is not proof: statistical filters never ban.
    assert not {"loss_regression", "norm_outlier"} & PENALIZED_REASONS


def test_validator_faults_are_recorded_and_retried_then_the_round_is_refused(tmp_path):
    node = ValidatorNode(ValidatorConfig("http://127.0.0.1:1", stats_path=tmp_path / "s.json"),
                         tiny_swarm().validator)
    node.client = LedgerClient("http://127.0.0.1:1")  # what run() opens; never used here
    refused: set[int] = set()
    for _ in range(MAX_ROUND_FAULTS - 1):
        node.fault(3, "undecodable", "a reveal blob that does not parse", refused)
    assert refused == set()  # retried: a transient fault must not lose the round
    node.fault(3, "undecodable", "again", refused)
    assert refused == {3}
    node.fault(4, "invalid_beacon", "shares that do not verify", refused, final=True)
    assert refused == {3, 4}  # a board that does not check out is refused at once
    assert [f["round"] for f in node.faults] == [3] * MAX_ROUND_FAULTS + [4]
    assert '"faults"' in (tmp_path / "s.json").read_text()
