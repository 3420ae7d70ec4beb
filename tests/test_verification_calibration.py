"""Verification calibration (issue 5, parts 4 and 5) at the tiny scale.

The benchmark ``bench/verification.py`` measures at the bench scale; these tests
run the same code on the tiny charlm task with the bench preset's one-step
segments (H = 10, k = 1; later-round base models from a short swarm) and check,
with the validator's own ``check_reveal`` on reveals the worker's evidence writes,
at the recommended tolerance, that honest recomputations with another thread count
are never flagged, that every cheat of the benchmark is (by the step check's
distance, or by the binding or the reveal where the benchmark says so), and that
the challenge policy's detection power matches its derivation under Monte Carlo
beacons. The tiny model has 3 chunks of 16,384 values; step checks here open 2 of
them (``opened_chunks`` = 2), so that, as at the bench scale, a check sees only part
of each state; the binding opens all 3, and 2 in one test.
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
from veritrain.protocol.commitments import chunk_count, opened_label, sample_chunks
from veritrain.protocol.presets import run_preset
from veritrain.validators.spot_checks import check_reveal, check_reveals
from veritrain.workers.evidence import reveal_bytes

from veritrain.swarm import Swarm

_PATH = Path(__file__).resolve().parents[1] / "bench" / "verification.py"
_SPEC = importlib.util.spec_from_file_location("bench_verification", _PATH)
assert _SPEC is not None and _SPEC.loader is not None
V = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = V
_SPEC.loader.exec_module(V)

TOL = V.RECOMMENDED_TOLERANCE
OPENED = 2
SEED = V.BENCH_SEED


def tiny_settings() -> dict:
    settings = run_preset("tiny")
    settings["inner"]["steps"] = 10  # S = 10 one-step segments; regrouped, 1 of 10 steps
    settings["inner"]["trail_every"] = 1
    settings["verification"]["tolerance"] = TOL
    settings["verification"]["opened_chunks"] = OPENED
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
            assert all(len(v["checks"]) == 3 for v in outcome.verdicts)  # 2 steps + binding
            bases.append(swarm.base)
            efs.append(list(swarm.error_feedback))

        swarm.train(2, on_round=keep)
    assert chunk_count(swarm.run.numel) == 3
    return swarm, bases, efs


def strict(claim):
    """The claim judged at the recommended tolerance (the benchmark judges with infinity)."""
    return dataclasses.replace(claim, run=V.judging_run(claim.run, TOL))


def check(claim, j, threads=1):
    """The validator's checks of segment ``j`` (a step check, then the binding), on the
    reveal the claim's evidence writes, as the swarm makes them."""
    with V.num_threads(threads):
        reveal = reveal_bytes(claim.evidence, SEED, [j], claim.sub)
        results = check_reveal(claim.run, claim.base, claim.sub, claim.payload, [j], reveal,
                               SEED)
    assert [x.kind for x in results] == ["step", "binding"]
    return results


def test_honest_recomputation_is_never_flagged(world):
    """40 segment checks over three rounds' base models and every worker, 16 of them with
    worker and validator on different thread counts (1 -> 2 and 2 -> 1, the rest 1 -> 1;
    few, because two threads on a busy two-core machine are slow): no false positive at
    the tolerance, and every binding holds."""
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
    failed = [(x.kind, x.segment, x.distance, x.note) for pair in results for x in pair
              if not x.ok]
    assert not failed
    steps = [pair[0] for pair in results]
    assert max(x.distance for x in steps) < TOL / 4  # a margin, not just a pass


@pytest.fixture(scope="module")
def victim(world):
    """Worker 0's honest round-1 claim, its round-0 claim and round-0 payload."""
    swarm, bases, efs = world
    with V.num_threads(1):
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
        return V.cheat_stale_payload(claim, old.payload), j  # any segment: the binding
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
    assert set(V.NOT_BY_DISTANCE) == {"free_rider", "stale_payload"}


@pytest.mark.parametrize("name", list(V.CHEAT_LABELS))
def test_each_cheat_is_caught(victim, name):
    swarm, bases, claim, old = victim
    cheat, j = build_cheat(name, swarm, bases, claim, old)
    step, binding = check(strict(cheat), j)
    assert not (step.ok and binding.ok), (name, step, binding)
    if name == "free_rider":  # it kept no states: no reveal, every check fails
        assert step.distance is None and "revealed nothing" in step.note
        assert not binding.ok and "revealed nothing" in binding.note
    elif name == "stale_payload":  # an honest trail: only the binding catches it
        assert step.ok and step.distance <= TOL, step
        assert not binding.ok and "payload does not encode" in binding.note, binding
    else:
        assert not step.ok and step.distance is not None and step.distance > 3 * TOL, step
        assert "recomputed state differs" in step.note, step
        # A careful cheater's payload re-derives from its (forged) final state; only the
        # lazy worker's payload, made from last round's base, fails the binding too.
        assert binding.ok == (name != "stale_round"), binding
    # The honest claim for the same segment passes: the cheat, not the setup, is caught.
    honest = claim.regroup(10) if name == "skip_k10" else claim
    assert all(x.ok for x in check(strict(honest), j))


def test_cheats_judged_without_a_tolerance_report_their_distance(victim):
    """The benchmark's judge (infinite tolerance) keeps the distance and the other rules."""
    swarm, bases, claim, old = victim
    honest = V.judge(claim, 1, threads=1)
    assert honest.ok and honest.binding and honest.distance == 0.0 and not honest.flagged(TOL)
    noisy = V.judge(V.cheat_state_noise(claim, 1, seed=1), 1, threads=1)
    assert noisy.ok and noisy.binding and noisy.flagged(TOL) and not noisy.flagged(0.02)
    assert noisy.distance == pytest.approx(V.NOISE, rel=0.1)
    stale = V.judge(V.cheat_stale_payload(claim, old.payload), 1, threads=1)
    assert stale.distance == 0.0 and stale.binding is False
    assert not stale.ok and "binding" in stale.note and stale.flagged(1.0)
    rider = V.judge(V.free_rider_claim(swarm.run, swarm.workers[0], 1, bases[1]), 3)
    assert rider.distance is None and not rider.ok and rider.flagged(math.inf)


def test_regrouped_trails_are_what_a_k_step_worker_commits(victim):
    """A k = 1 trail regrouped to k = 5 checks as a k = 5 worker's (whole start moments in the
    reveal, five steps recomputed): same thread count, so distance 0; a state forged in the
    regrouped claim is caught."""
    swarm, bases, claim, old = victim
    k5 = claim.regroup(5)
    assert k5.k == 5 and k5.last == 1 and k5.sub.trail == [claim.sub.trail[4], claim.sub.trail[9]]
    for j in (0, 1):
        result = V.judge(k5, j, threads=1)
        assert result.ok and result.distance == 0.0, result
    assert V.judge(V.cheat_state_noise(k5, 1, seed=2), 1, threads=1).flagged(TOL)
    with pytest.raises(ValueError):
        claim.regroup(3)


def test_only_the_opened_chunks_are_compared(victim):
    """The step check compares the opened chunks alone: a forgery confined to a chunk the
    beacon did not open passes, the same forgery in an opened chunk is caught."""
    swarm, bases, claim, old = victim
    j = 2
    opened = sample_chunks(SEED, opened_label(claim.sub.worker, j), 3, OPENED)
    (hidden,) = set(range(3)) - set(opened)
    missed = V.judge(V.cheat_state_noise(claim, j, seed=4, chunks=[hidden]), j, threads=1)
    assert missed.ok and missed.distance == 0.0
    caught = V.judge(V.cheat_state_noise(claim, j, seed=4, chunks=[opened[0]]), j, threads=1)
    assert caught.ok and caught.distance > 3 * TOL


def with_binding_chunks(claim, n):
    """The claim in a run whose binding opens ``n`` chunks (its evidence writes that layout)."""
    def of(run):
        verification = {**run.spec.verification, "binding_chunks": n}
        return dataclasses.replace(run, spec=dataclasses.replace(run.spec,
                                                                 verification=verification))
    return dataclasses.replace(claim, run=of(claim.run)).with_evidence(
        claim.evidence.store, of(claim.evidence.run))


def test_the_binding_at_some_chunks_passes_an_honest_payload(victim):
    """The binding opening fewer chunks than the model has (the bench preset: 16 of 64)
    encodes a vector that is zero outside them: its all-zero blocks must give scales the
    decoder accepts (int4's absmax scale once came out -0.0 and failed every honest
    binding), and a stale payload is still caught."""
    swarm, bases, claim, old = victim
    partial = with_binding_chunks(claim, OPENED)
    assert V.judge(V.cheat_stale_payload(partial, old.payload), 1).binding is False
    honest = V.judge(partial, 1, threads=1)
    assert honest.ok and honest.binding, honest


def test_the_instrumented_swarm_times_the_real_checks():
    """The cost measurement patches the functions the swarm really calls: every honest
    worker's training, reveal, step checks and binding are counted, the free rider's are
    not, and each observed submission comes with every state for the benchmark's checks."""
    swarm = Swarm(tiny_settings(), n_workers=3, byzantine={2: "free_rider"}, seed="timed")
    rider = swarm.workers[2].public_key.hex()
    timers = V.Timers()
    claims = []

    def observe(prep, args, kwargs, side):
        store = V.copied_store(prep.evidence.store)
        store.vectors.update(side.vectors)
        claims.append(V.Claim(V.judging_run(args[0]), args[3], prep.signed.message,
                              prep.payload, V.evidence_in(store, args[0], args[2],
                                                          prep.signed.message.worker)))
        V.judge(claims[-1], 5, threads=1)  # the bench's own checks are not the validator's

    with V.instrumented(timers, {rider}, observe):
        outcome = swarm.step(0)
    honest = [v for v in outcome.verdicts if v["worker"] != rider]
    assert all(v["status"] == "accepted" for v in honest)
    assert [v["reason"] for v in outcome.verdicts if v["worker"] == rider] == [
        "missing_reveal"]  # nothing kept to open: a withheld reveal
    assert timers.worker_rounds == 2 and timers.worker_steps == 20
    assert timers.segments_checked == sum(len(v["checks"]) - 1 for v in honest) == 4
    assert timers.bindings_checked == 2 and timers.reveals == 2
    assert timers.validator_checks_cpu > 0 and timers.validator_steps_cpu > 0
    assert timers.validator_bindings_cpu > 0 and timers.worker_train_cpu > 0
    assert (timers.validator_steps_cpu + timers.validator_bindings_cpu
            <= timers.validator_checks_cpu)  # parts of the round's check_reveal only
    assert timers.capture_cpu > 0  # states the swarm's workers did not keep were copied
    # Traffic is read from what the nodes produced: each honest payload, every submitter's
    # payload and reveal as the validator received them, and the round's inputs kept.
    candidates = timers.last_round[0][5]
    assert sorted(timers.payload_sizes) == sorted(len(c.payload) for c in candidates
                                                  if c.worker != rider)
    assert len(timers.validator_down) == 1 and timers.validator_down[0][2] == 3
    assert timers.validator_down[0][1] == timers.reveal_bytes  # the rider revealed nothing
    assert len(claims) == 2
    for claim in claims:
        assert all(claim.evidence.store.has(f"state-{s}") for s in range(1, 11))
        result = V.judge(claim, 5, threads=1)
        assert result.ok and result.distance == 0.0
    import veritrain.validators.round as round_mod

    assert round_mod.check_reveals is check_reveals  # restored


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
    """Below c = 1 a free rider escapes with 1 - c; always_last checks the last segment for
    sure; full checks catch every faker they draw."""
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


def test_chunk_draws_match_the_derivation():
    """16 of the bench model's 64 chunks are opened: a one-chunk forgery is seen with 1/4."""
    assert V.p_chunk_opened(64, 16) == pytest.approx(0.25)
    assert V.p_chunk_opened(64, 16, forged=4) == pytest.approx(
        1 - math.comb(60, 16) / math.comb(64, 16))
    assert V.p_chunk_opened(3, 16) == 1.0  # a small model is opened whole
    assert V.chunk_draws(64, 16, seeds=1500) == pytest.approx(0.25, abs=0.04)
    assert V.chunk_draws(64, 16, seeds=1500, forged=4, binding=True) == pytest.approx(
        V.p_chunk_opened(64, 16, forged=4), abs=0.04)
    assert V.chunk_draws(3, 16, seeds=50) == 1.0


def test_recommended_tolerance_is_the_presets_for_one_step_segments():
    for name in ("bench", "demo"):
        settings = run_preset(name)
        assert settings["inner"]["trail_every"] == 1
        assert settings["verification"]["tolerance"] == V.RECOMMENDED_TOLERANCE


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


def test_checks_of_folds_the_binding_into_each_step_check():
    """A verdict's checks (``to_json``) as the benchmark reads them: a step that failed only
    by its distance keeps its distance; a failed binding fails every step's Check."""
    rows = [{"kind": "step", "segment": 1, "distance": 0.5, "ok": False,
             "note": "recomputed state differs by 0.5"},
            {"kind": "step", "segment": 4, "distance": None, "ok": False,
             "note": "end leaves do not make the committed end state"},
            {"kind": "binding", "segment": 10, "distance": None, "ok": True, "note": ""}]
    by_distance, bad = V.checks_of(rows)
    assert by_distance.ok and by_distance.distance == 0.5 and by_distance.flagged(0.1)
    assert not by_distance.flagged(1.0)
    assert not bad.ok and "end leaves" in bad.note and bad.flagged(math.inf)
    rows[0]["distance"], rows[-1]["ok"], rows[-1]["note"] = 0.0, False, "payload differs"
    (step, _) = V.checks_of(rows)
    assert not step.ok and step.binding is False and step.note == "binding: payload differs"


def test_seeds_and_their_worst():
    """Bench seed 0 keeps the fixed beacon seed and Monte Carlo draws; others differ; the
    worst of a figure is its max or min as asked, the median beside it."""
    assert V.bench_seed(0) == SEED and V.seed_salt(0) == b""
    assert len({V.bench_seed(i) for i in range(3)}) == 3
    assert V.seed_rng(1, "x").random() != V.seed_rng(0, "x").random()
    assert V.worst_and_median([0.2, 0.5, 0.3]) == (0.5, 0.3)
    assert V.worst_and_median([0.97, 0.95, 0.99], min) == (0.95, 0.97)
    honest = V.Check(1e-7, True, "")
    seeds = [V.Results({"threads 1 -> 2, k=1": [honest] * 4},
                       {"lr_x2": [V.Check(d, True, "")], "free_rider": [V.Check(None, False, "x")]})
             for d in (1e-2, 1e-6)]
    figures = [V.seed_figures(res, 1, 1e-5, 2e-5, 0.04) for res in seeds]
    assert figures[0].detected == 1.0 and figures[0].weakest == "lr_x2"
    assert figures[1].detected == 0.0 and figures[1].cheat_min == 1e-6
    assert all(f.false_positives == 0 and f.honest == 4 for f in figures)
    pooled = V.merged(seeds)
    assert len(pooled.honest["threads 1 -> 2, k=1"]) == 8 and len(pooled.cheats["lr_x2"]) == 2


def test_threads_restore():
    before = torch.get_num_threads()
    with V.num_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
