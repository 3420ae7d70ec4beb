"""Verification calibration (issue 5, parts 4 and 5) at the tiny scale.

The benchmark ``bench/verification.py`` measures at the bench scale; these tests
run the same code on the tiny charlm task with the bench preset's one-step
segments (H = 10, k = 1; later-round base models from a short swarm) and check,
with the validator's own ``check_segment`` at the recommended tolerance, that
honest recomputations with another thread count are never flagged, that every
cheat of the benchmark is, and that the challenge policy's detection power
matches its derivation under Monte Carlo beacons.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest
import torch
from veritrain.protocol.challenges import ChallengePolicy
from veritrain.protocol.presets import run_preset
from veritrain.validators.segments import check_segment

from veritrain.swarm import Swarm

_PATH = Path(__file__).resolve().parents[1] / "bench" / "verification.py"
_SPEC = importlib.util.spec_from_file_location("bench_verification", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
V = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = V
_SPEC.loader.exec_module(V)

TOL = V.RECOMMENDED_TOLERANCE


def tiny_settings() -> dict:
    settings = run_preset("tiny")
    settings["inner"]["steps"] = 10  # S = 10 one-step segments; regrouped, 1 of 10 steps
    settings["inner"]["trail_every"] = 1
    settings["verification"]["tolerance"] = TOL
    return settings


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread unless a test asks for two (2 threads on a busy 2-core machine spin)."""
    with V.num_threads(1):
        yield


@pytest.fixture(scope="module")
def world():
    """A tiny run, base models of rounds 0..2 from a 3-worker swarm, its workers' residuals."""
    with V.num_threads(1):
        swarm = Swarm(tiny_settings(), n_workers=3, seed="calibration-test")
        bases, efs = [swarm.base], [list(swarm.error_feedback)]

        def keep(r, outcome):
            assert all(v["status"] == "accepted" for v in outcome.verdicts), outcome.verdicts
            bases.append(swarm.base)
            efs.append(list(swarm.error_feedback))

        swarm.train(2, on_round=keep)
    return swarm, bases, efs


def strict(claim):
    """The claim judged at the recommended tolerance (the benchmark judges with infinity)."""
    return dataclasses.replace(claim, run=V.judging_run(claim.run, TOL))


def check(claim, j, threads=1):
    with V.num_threads(threads):
        return check_segment(claim.run, claim.base, claim.sub, claim.payload, j, claim.evidence)


def test_honest_recomputation_is_never_flagged(world):
    """40 segment checks over three rounds' base models and every worker, 16 of them with
    worker and validator on different thread counts (1 -> 2 and 2 -> 1, the rest 1 -> 1;
    few, because two threads on a busy two-core machine are slow): no false positive at
    the tolerance."""
    swarm, bases, efs = world
    results = []
    directions = [(1, 2), (2, 1), (1, 1), (1, 1), (1, 1)]
    for i, (worker_threads, validator_threads) in enumerate(directions):
        r, w = i % 3, (i + i // 3) % 3  # rounds 0, 1, 2 in turn, every worker
        claim = strict(V.honest_claim(swarm.run, swarm.workers[w], r, bases[r], efs[r][w],
                                      threads=worker_threads))
        segments = [0, claim.last, *range(1 + i % 2, claim.last)][:8]
        results += [check(claim, j, validator_threads) for j in segments]
    assert len(results) == 40
    failed = [(x.segment, x.distance, x.note) for x in results if not x.ok]
    assert not failed
    assert max(x.distance for x in results) < TOL / 4  # a margin, not just a pass


@pytest.fixture(scope="module")
def victim(world):
    """Worker 0's honest round-1 claim, its round-0 claim and round-0 payload."""
    swarm, bases, efs = world
    old = V.honest_claim(swarm.run, swarm.workers[0], 0, bases[0], efs[0][0], threads=1)
    claim = V.honest_claim(swarm.run, swarm.workers[0], 1, bases[1], efs[1][0], threads=1)
    return swarm, bases, claim, old


def build_cheat(name, swarm, bases, claim, old):
    """(cheating claim, the segment to judge) for each cheat of the benchmark."""
    j = 1
    if name == "free_rider":
        return V.free_rider_claim(swarm.run, swarm.workers[0], 1, bases[1]), 0
    if name == "skip_k1":
        return V.cheat_skip_step(claim, j), j  # the segment's one step
    if name == "skip_k10":
        k10 = claim.regroup(10)
        return V.cheat_skip_step(k10, 0, skip=9), 0  # 9 of 10 steps
    if name == "other_data":
        return V.cheat_other_data(claim, j, swarm.workers[1].public_key.hex()), j
    if name == "half_batch":
        return V.cheat_half_batch(claim, j), j
    if name == "stale_payload":
        return V.cheat_stale_payload(claim, old.payload), claim.last
    if name == "stale_round":
        return V.cheat_stale_round(old, bases[1], 1), j
    if name == "state_noise":
        return V.cheat_state_noise(claim, j, seed=3), j
    if name == "update_noise":
        return V.cheat_update_noise(claim, seed=3), claim.last
    if name == "lr_x2":
        return V.cheat_lr(claim, j, 2.0), j
    if name == "lr_half":
        return V.cheat_lr(claim, j, 0.5), j
    raise AssertionError(name)


def test_every_cheat_has_a_case():
    assert set(V.CHEAT_LABELS) == {
        "free_rider", "skip_k1", "skip_k10", "other_data", "half_batch", "stale_payload",
        "stale_round", "state_noise", "update_noise", "lr_x2", "lr_half"}


@pytest.mark.parametrize("name", list(V.CHEAT_LABELS))
def test_each_cheat_is_caught(victim, name):
    swarm, bases, claim, old = victim
    cheat, j = build_cheat(name, swarm, bases, claim, old)
    result = check(strict(cheat), j)
    assert not result.ok, (name, result)
    if name in V.NOT_BY_DISTANCE:
        assert result.distance is None or result.distance <= TOL  # caught by another rule
    else:
        assert result.distance is not None and result.distance > 3 * TOL, (name, result)
    # The honest claim for the same segment passes: the cheat, not the setup, is caught.
    assert check(strict(claim), j).ok


def test_cheats_judged_without_a_tolerance_report_their_distance(victim):
    """The benchmark's judge (infinite tolerance) keeps the distance and the other rules."""
    swarm, bases, claim, old = victim
    honest = V.judge(claim, 1, threads=1)
    assert honest.ok and honest.distance == 0.0 and not honest.flagged(TOL)
    noisy = V.judge(V.cheat_state_noise(claim, 1, seed=1), 1, threads=1)
    assert noisy.ok and noisy.flagged(TOL) and not noisy.flagged(0.02)
    assert noisy.distance == pytest.approx(V.NOISE, rel=0.05)
    stale = V.judge(V.cheat_stale_payload(claim, old.payload), claim.last, threads=1)
    assert not stale.ok and "re-derive" in stale.note and stale.flagged(1.0)


BENCH = ChallengePolicy(segments=30, per_worker=1.5, full_checks=0, always_last=False)


def test_monte_carlo_matches_the_derivation_for_the_bench_policy():
    mc = V.monte_carlo(BENCH, n_workers=16, seeds=400, faked=[30, 8, 3])
    assert mc.free_rider_caught == 1.0  # c >= 1: every worker is challenged, every round
    assert V.p_escape(BENCH, 30) == 0.0
    assert mc.cost == pytest.approx(BENCH.expected_cost(16), abs=0.004)
    assert BENCH.expected_cost(16) == pytest.approx(0.05)
    for f in (8, 3):
        assert mc.escape[f] == pytest.approx(V.p_escape(BENCH, f), abs=0.03)
    assert V.p_escape(BENCH, 8) == pytest.approx(
        0.5 * 22 / 30 + 0.5 * math.comb(22, 2) / math.comb(30, 2))
    assert V.p_caught_within(BENCH, 8, 10) >= 0.95
    assert mc.caught_within[8] == pytest.approx(V.p_caught_within(BENCH, 8, 10), abs=0.03)
    assert mc.last_challenged == pytest.approx(V.p_last_challenged(BENCH), abs=0.01)


@pytest.mark.parametrize("policy", [
    ChallengePolicy(segments=10, per_worker=0.5, full_checks=0, always_last=False),
    ChallengePolicy(segments=4, per_worker=1.0, full_checks=0, always_last=True),
    ChallengePolicy(segments=6, per_worker=2.0, full_checks=2, always_last=True),
])
def test_monte_carlo_matches_the_derivation_for_other_policies(policy):
    """Below c = 1 a free rider escapes with 1 - c; always_last binds the payload for sure;
    full checks catch every faker they draw."""
    s = policy.segments
    mc = V.monte_carlo(policy, n_workers=8, seeds=400, faked=[s, 1, 2])
    assert mc.free_rider_caught == pytest.approx(1 - V.p_escape(policy, s, n_workers=8),
                                                 abs=0.03)
    assert mc.cost == pytest.approx(policy.expected_cost(8), abs=0.02)
    for f in (1, 2):
        assert mc.escape[f] == pytest.approx(V.p_escape(policy, f, n_workers=8), abs=0.03)
    assert mc.last_challenged == pytest.approx(V.p_last_challenged(policy, n_workers=8),
                                               abs=0.03)
    if policy.per_worker < 1:
        assert 0.4 < mc.free_rider_caught < 0.6


def test_tolerance_choice_and_summary_line():
    assert V.choose_tolerance(1e-6, 1e-2) == pytest.approx(1e-4)
    assert V.choose_tolerance(0.0, 1e-2) == pytest.approx(math.sqrt(V.FLOAT32_EPS * 1e-2))
    assert V.choose_tolerance(1e-3, 1e-3) is None
    assert V.round_sig(5.7e-5) == pytest.approx(6e-5)
    assert V.round_sig(1.65e-4) == pytest.approx(2e-4)
    assert V.round_sig(2.22e-4) == pytest.approx(2e-4)
    line = V.summary_line(0, 612, 1.0, 0.0371)
    assert re.fullmatch(r"verification: honest_false_positives=\d+/\d+ "
                        r"weakest_cheat_detected=\d\.\d\d validator_cost=\d+\.\d%", line), line
    assert line.endswith("honest_false_positives=0/612 weakest_cheat_detected=1.00 "
                         "validator_cost=3.7%")


def test_threads_restore():
    before = torch.get_num_threads()
    with V.num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
