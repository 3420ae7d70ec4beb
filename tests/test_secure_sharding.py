"""Sharded CenteredClip: fixed-point results, sampled projection checks, adjudication."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.aggregation import AggregationInputError, centered_clip_with_stats
from veritrain.aggregation.secure import (
    NonFiniteShardError,
    ShardResult,
    aggregate_shard,
    assemble_shards,
    check_shard_result,
    default_sample_blocks,
    fixed_point_coefficients,
    recompute_shard,
    sample_blocks,
    shard_bounds,
    shard_tau,
    verify_shard_exact,
)
from veritrain.aggregation.secure.projection import BLOCK
from veritrain.aggregation.secure.sharding import _combine64
from veritrain.protocol.beacon import compute_check_seed, shard_check_body

N, D, V = 12, 48_000, 3  # shards of 16,000 coordinates = 1,000 blocks; 256 sampled


def make_updates(seed: int = 0, heavy: bool = False, n: int = N, d: int = D) -> torch.Tensor:
    """Honest rows around a common direction, 3 Byzantine rows far away."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(d, generator=g) * 0.5
    if heavy:  # Student-t with 3 degrees of freedom: heavy-tailed coordinates
        chi = (torch.randn(n, d, 3, generator=g) ** 2).sum(-1) / 3
        noise = torch.randn(n, d, generator=g) / chi.sqrt()
    else:
        noise = torch.randn(n, d, generator=g)
    x = common + noise
    x[:3] = -4 * common + 2 * torch.randn(3, d, generator=g)
    return x.float()


def full_tau(x: torch.Tensor) -> float:
    return float((x - x.median(0).values).norm(dim=1).median())


@pytest.fixture(scope="module")
def setup():
    x = make_updates()
    w = torch.linspace(1, 2, N, dtype=torch.float64)
    bounds = shard_bounds(D, V)
    taus = [shard_tau(full_tau(x), D, b) for b in bounds]
    results = [aggregate_shard(x, w, shard=j, num_shards=V, tau=taus[j]) for j in range(V)]
    return x, w, taus, results


def shifted(r: ShardResult, agg: torch.Tensor, dist: torch.Tensor | None = None) -> ShardResult:
    return dataclasses.replace(
        r, aggregate=agg.float(), distances=r.distances if dist is None else dist
    )


def check(r, x, w, tau, seed=b"seed", checker=1, **kw):
    return check_shard_result(
        r, x, w, num_shards=V, tau=tau, check_seed=seed, checker=checker, **kw
    )


# -- the shard result ----------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(d=st.integers(1, 10_000), data=st.data())
def test_shard_bounds_partition_the_coordinates(d, data):
    v = data.draw(st.integers(1, min(d, 64)))
    b = shard_bounds(d, v)
    assert b[0][0] == 0 and b[-1][1] == d and len(b) == v
    assert all(b[i][1] == b[i + 1][0] for i in range(v - 1))
    sizes = [stop - start for start, stop in b]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_shard_result_is_the_centered_clip_fixed_point(setup):
    """Same point as the lead's CenteredClip iterated to convergence; honest result is valid."""
    x, w, taus, results = setup
    for j, r in enumerate(results):
        start, stop = r.start, r.stop
        v_cc, _ = centered_clip_with_stats(
            x[:, start:stop], w, tau=taus[j], iterations=300, tol=0.0, start="mean"
        )
        scale = float(r.aggregate.abs().max())
        assert float((v_cc - r.aggregate).abs().max()) < 1e-5 * scale
        # equation (1): v = sum_i a_i x_i with a from the published distances
        a = fixed_point_coefficients(r.distances, w, taus[j])
        assert torch.allclose(
            _combine64(x[:, start:stop], a), r.aggregate, rtol=0, atol=1e-6 * scale
        )
        true_d = (x[:, start:stop].double() - r.aggregate.double()).norm(dim=1)
        assert torch.allclose(r.distances, true_d, rtol=1e-6)
        assert verify_shard_exact(r, x, w, num_shards=V, tau=taus[j]).valid
    # Byzantine rows are clipped, honest rows mostly not
    assert bool(
        (
            fixed_point_coefficients(results[0].distances, w, taus[0])[:3] < 0.5 * w[:3] / w.sum()
        ).all()
    )
    assert assemble_shards(list(reversed(results)), D).shape == (D,)


def test_shard_results_are_deterministic(setup):
    x, w, taus, results = setup
    again = aggregate_shard(x, w, shard=1, num_shards=V, tau=taus[1])
    assert again.digest() == results[1].digest()
    assert dataclasses.replace(again, publisher=5).digest() != again.digest()


# -- sampled checks ------------------------------------------------------------


def test_honest_results_pass_over_many_check_seeds(setup):
    """False alarms: 40 seeds x 3 shards, none expected (z = 8); the bench runs more."""
    x, w, taus, results = setup
    worst = 0.0
    for s in range(40):
        for j, r in enumerate(results):
            c = check(r, x, w, taus[j], seed=s.to_bytes(4, "big"))
            assert c.ok, c
            assert (
                c.sampled_blocks
                == default_sample_blocks(r.stop - r.start)
                < (r.stop - r.start) / BLOCK
            )
            assert 0 < c.heavy_blocks <= 4 * N
            worst = max(worst, c.worst_distance)
            assert c.worst_stationarity < 0.25  # 4x margin on (V2)
    assert worst < 0.8


def test_honest_results_pass_on_heavy_tailed_updates():
    """Student-t(3) coordinates: each row's spikes go to the heavy blocks, no false alarms."""
    x = make_updates(seed=4, heavy=True)
    tau = shard_tau(full_tau(x), D, shard_bounds(D, V)[1])
    r = aggregate_shard(x, None, shard=1, num_shards=V, tau=tau)
    worst = max(check(r, x, None, tau, seed=s.to_bytes(4, "big")).worst_distance for s in range(60))
    assert worst < 0.8
    # without declaring them, the same spikes raise false alarms on most seeds
    bare = dataclasses.replace(r, heavy_blocks=torch.zeros(0, dtype=torch.int64))
    alarms = sum(not check(bare, x, None, tau, seed=s.to_bytes(4, "big")).ok for s in range(60))
    assert alarms > 10


def test_spikes_are_declared_heavy_and_always_read(setup):
    x, w, taus, results = setup
    y = x.clone()
    y[5, 16_000 + 777] = 500.0  # a spike in shard 1, block 48
    tau = taus[1]
    r = aggregate_shard(y, w, shard=1, num_shards=V, tau=tau)
    assert 777 // BLOCK in r.heavy_blocks.tolist()
    bad = r.aggregate.clone()
    bad[777] += 1e-3  # a cheat inside a heavy block: read by every checker
    for c in range(20):
        assert not check(shifted(r, bad), y, w, tau, checker=c).ok


@pytest.mark.parametrize("kind", ["scale", "direction"])
def test_a_tiny_shift_is_caught_on_every_seed(setup, kind):
    """1e-3 relative shifts of v: (V2) fails on most sampled coordinates for every seed."""
    x, w, taus, results = setup
    r = results[2]
    g = torch.Generator().manual_seed(7)
    if kind == "scale":
        bad = r.aggregate.double() * (1 + 1e-3)
    else:
        u = torch.randn(r.stop - r.start, generator=g, dtype=torch.float64)
        bad = r.aggregate.double() + 1e-3 * r.aggregate.double().norm() * u / u.norm()
    # the cheater may also publish the true distances to its shifted point
    true_d = (x[:, r.start : r.stop].double() - bad.float().double()).norm(dim=1)
    for dist in (None, true_d):
        cheat = shifted(r, bad, dist)
        for s in range(20):
            c = check(cheat, x, w, taus[2], seed=s.to_bytes(4, "big"))
            assert not c.ok and c.reason == "stationarity"
            assert c.stationarity_violations > 0.5 * c.sampled_blocks * BLOCK
            assert c.suspect_coordinates and all(
                r.start <= i < r.stop for i in c.suspect_coordinates
            )


def test_a_reweighting_is_caught_by_the_distance_check(setup):
    """Up-weighting a clipped Byzantine row consistently passes (V2); its distance lie does not."""
    x, w, taus, results = setup
    r, tau = results[0], taus[0]
    xs = x[:, r.start : r.stop]

    def reweighted(row: int, factor: float) -> ShardResult:
        """A self-consistent cheat: v = X^T a(d), d true except row's, scaled by factor."""
        v = r.aggregate
        for _ in range(15):
            dist = (xs.double() - v.double()).norm(dim=1)
            dist[row] *= factor
            v = _combine64(xs, fixed_point_coefficients(dist, w, tau))
        return shifted(r, v, dist)

    for row, factor, side in ((0, 0.8, "closer"), (5, 1.3, "farther")):
        cheat = reweighted(row, factor)
        assert verify_shard_exact(cheat, x, w, num_shards=V, tau=tau).reason == "distance"
        for s in range(15):
            c = check(cheat, x, w, tau, seed=s.to_bytes(4, "big"))
            assert not c.ok and c.reason == "distance" and c.suspect_rows == (row,), (side, c)
            assert c.worst_stationarity < 1  # (V2) holds: only the distances give it away


def test_a_one_block_cheat_is_caught_at_the_predicted_rate(setup):
    """Soundness bound: one corrupted block escapes one checker w.p. (1 - 1/n_b)^m."""
    x, w, taus, results = setup
    r = results[1]
    n = r.stop - r.start
    heavy = set(r.heavy_blocks.tolist())
    rest, m = n // BLOCK - len(heavy), default_sample_blocks(n)
    target = min(set(range(n // BLOCK)) - heavy)
    bad = r.aggregate.clone()
    bad[target * BLOCK : (target + 1) * BLOCK] += 1e-2
    cheat = shifted(r, bad)
    trials = 200
    caught = sum(not check(cheat, x, w, taus[1], seed=b"s", checker=c).ok for c in range(trials))
    p = 1 - (1 - 1 / rest) ** m
    assert abs(caught - trials * p) < 4 * math.sqrt(trials * p * (1 - p))


def test_checkers_draw_independent_samples_from_one_seed():
    kw = dict(shard=0, result_digest=b"d" * 32, n=100_000, count=64)
    a = sample_blocks(b"seed", checker=1, **kw)
    assert np.array_equal(a, sample_blocks(b"seed", checker=1, **kw))
    assert not np.array_equal(a, sample_blocks(b"seed", checker=2, **kw))
    assert not np.array_equal(a, sample_blocks(b"seed2", checker=1, **kw))
    assert np.all(np.diff(a) >= 0) and a.max() < 100_000 // BLOCK


def test_check_seed_binds_every_result(setup):
    _, _, _, results = setup
    digests = [r.digest() for r in results]
    seed = compute_check_seed(b"beacon", digests)
    assert seed != compute_check_seed(b"beacon", [digests[0], digests[2], digests[1]])
    assert seed != compute_check_seed(b"beacon2", digests)
    assert shard_check_body(digests) != shard_check_body(digests[:2])


def test_small_shards_are_checked_exactly():
    x = make_updates(seed=2, d=3000)
    tau = shard_tau(full_tau(x), 3000, (0, 1000))
    r = aggregate_shard(x, None, shard=0, num_shards=3, tau=tau)
    c = check_shard_result(r, x, None, num_shards=3, tau=tau, check_seed=b"s", checker=0)
    assert c.ok and c.sampled_blocks + c.heavy_blocks == -(-1000 // BLOCK)
    bad = r.aggregate.clone()
    bad[999] += 1e-4  # a single coordinate in the partial last block
    c = check_shard_result(
        shifted(r, bad), x, None, num_shards=3, tau=tau, check_seed=b"s", checker=0
    )
    assert not c.ok and c.suspect_coordinates == (999,)


# -- adjudication --------------------------------------------------------------


def test_recompute_blames_a_cheating_publisher(setup):
    x, w, taus, results = setup
    r = results[1]
    cheat = shifted(r, r.aggregate * (1 + 1e-3))
    trigger = check(cheat, x, w, taus[1])
    replacement, finding = recompute_shard(
        cheat, x, w, num_shards=V, tau=taus[1], recomputed_by=2, trigger=trigger
    )
    assert finding.faulty and finding.reason == "stationarity" and finding.publisher == r.publisher
    assert finding.published_digest == cheat.digest() and finding.trigger is trigger
    assert finding.max_abs_deviation > 0
    assert replacement.publisher == 2 and torch.equal(replacement.aggregate, r.aggregate)
    assert check(replacement, x, w, taus[1]).ok


def test_recompute_clears_an_honest_publisher_after_a_false_alarm(setup):
    x, w, taus, results = setup
    r = results[0]
    _, finding = recompute_shard(r, x, w, num_shards=V, tau=taus[0], recomputed_by=1)
    assert not finding.faulty and finding.reason == "ok" and finding.max_abs_deviation == 0.0


def test_invalid_results_fail_checks_without_raising(setup):
    x, w, taus, results = setup
    r, tau = results[0], taus[0]
    cases = {
        "tau": dataclasses.replace(r, tau=tau * 1.01),
        "bounds": dataclasses.replace(r, stop=r.stop - 1),
        "shard": dataclasses.replace(r, shard=7),
        "heavy": dataclasses.replace(r, heavy_blocks=r.heavy_blocks.flip(0)),
        "heavy range": dataclasses.replace(r, heavy_blocks=torch.tensor([10**9])),
        "dtype": dataclasses.replace(r, aggregate=r.aggregate.double()),
        "rows": dataclasses.replace(r, distances=r.distances[:-1]),
        "negative": dataclasses.replace(r, distances=-r.distances),
        "type": "not a result",
    }
    for name, bad in cases.items():
        c = check(bad, x, w, tau)
        assert not c.ok and c.reason.startswith("malformed"), name
        assert not verify_shard_exact(bad, x, w, num_shards=V, tau=tau).valid, name


def test_invalid_nan_in_a_shard_is_caught_by_assembly_or_the_heavy_blocks(setup):
    """A NaN off the sample passes the sampled check; assembly, which reads all of v, refuses it."""
    x, w, taus, results = setup
    r = results[0]
    hidden = r.aggregate.clone()
    target = min(set(range(1000)) - set(r.heavy_blocks.tolist()))
    hidden[target * BLOCK] = float("nan")
    bad = shifted(r, hidden)
    with pytest.raises(NonFiniteShardError) as exc:
        assemble_shards([bad, *results[1:]], D)
    assert exc.value.shards == (0,)
    assert (
        verify_shard_exact(bad, x, w, num_shards=V, tau=taus[0]).reason
        == "malformed: non-finite aggregate"
    )
    _, finding = recompute_shard(bad, x, w, num_shards=V, tau=taus[0], recomputed_by=1)
    assert finding.faulty
    in_heavy = r.aggregate.clone()
    in_heavy[int(r.heavy_blocks[0]) * BLOCK] = float("nan")
    c = check(shifted(r, in_heavy), x, w, taus[0])
    assert not c.ok and c.reason == "stationarity"


def test_invalid_aggregation_inputs():
    x = make_updates(d=1000)
    with pytest.raises(AggregationInputError):
        shard_bounds(3, 4)
    with pytest.raises(AggregationInputError):
        aggregate_shard(x, None, shard=3, num_shards=3, tau=1.0)
    with pytest.raises(AggregationInputError):
        aggregate_shard(x, None, shard=0, num_shards=3, tau=0.0)
    bad = x.clone()
    bad[4, 10] = float("inf")
    with pytest.raises(ValueError, match=r"\[4\]"):
        aggregate_shard(bad, None, shard=0, num_shards=3, tau=1.0)
    with pytest.raises(AggregationInputError):
        assemble_shards([aggregate_shard(x, None, shard=0, num_shards=3, tau=1.0)], 1000)
