"""Each attack produces what its definition says."""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch
from veritrain.aggregation import (
    AggregationInputError,
    CenteredClip,
    CoordinateMedian,
    Krum,
    Mean,
    TrimmedMean,
)
from veritrain.aggregation import attacks as atk

N_H, F, D = 10, 3, 40


def honest(dtype: torch.dtype = torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(D, generator=gen) + 0.3 * torch.randn(N_H, D, generator=gen)).to(dtype)


def assert_rows(out: torch.Tensor, row: torch.Tensor, f: int = F) -> None:
    assert out.shape == (f, D) and out.dtype == row.dtype
    for r in out:
        torch.testing.assert_close(r, row, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sign_flip_is_minus_the_honest_mean(dtype):
    x = honest(dtype)
    assert_rows(atk.sign_flip(x, F), -x.mean(0))


def test_ipm_is_minus_epsilon_times_the_mean():
    x = honest()
    assert_rows(atk.inner_product_manipulation(x, F), -0.1 * x.mean(0))
    assert_rows(atk.inner_product_manipulation(x, F, epsilon=2.5), -2.5 * x.mean(0))
    # with epsilon > (n_h / f) the mean of all rows points against mu
    bad = atk.inner_product_manipulation(x, F, epsilon=5.0)
    assert float(Mean()(torch.cat([x, bad])) @ x.mean(0)) < 0


@pytest.mark.parametrize(
    "n, f, s",
    [(25, 5, 8), (16, 3, 6), (10, 0, 6), (7, 3, 1)],
)
def test_alie_z_follows_baruch_et_al(n, f, s):
    assert math.floor(n / 2 + 1) - f == s
    assert atk.alie_z(n, f) == pytest.approx(NormalDist().inv_cdf((n - s) / n), rel=1e-12)


def test_alie_z_known_value():
    # n = 25, f = 5: s = 8, z = Phi^-1(17/25) = 0.4677...
    assert atk.alie_z(25, 5) == pytest.approx(0.46770, abs=1e-4)


def test_invalid_alie_z():
    with pytest.raises(AggregationInputError):
        atk.alie_z(10, 6)  # s = 0: no honest row to win over
    with pytest.raises(AggregationInputError):
        atk.alie_z(0, 0)


def test_alie_is_mean_minus_z_sigma():
    x = honest()
    z = atk.alie_z(N_H + F, F)
    expected = x.mean(0) - z * x.std(0, correction=1)
    assert_rows(atk.a_little_is_enough(x, F), expected)
    assert_rows(atk.a_little_is_enough(x, F, z=1.5), x.mean(0) - 1.5 * x.std(0))
    assert_rows(atk.a_little_is_enough(x, F, n=50), x.mean(0) - atk.alie_z(50, F) * x.std(0))
    # within the honest spread on every coordinate: a median cannot exclude it
    bad = atk.a_little_is_enough(x, F)[0]
    assert bool(((bad >= x.min(0).values) & (bad <= x.max(0).values)).all())


def test_gaussian_noise_is_seeded_and_has_the_requested_scale():
    x = honest()
    a = atk.gaussian_noise(x, F, std=2.0, generator=torch.Generator().manual_seed(1))
    b = atk.gaussian_noise(x, F, std=2.0, generator=torch.Generator().manual_seed(1))
    c = atk.gaussian_noise(x, F, std=2.0, generator=torch.Generator().manual_seed(2))
    assert a.shape == (F, D) and torch.equal(a, b) and not torch.equal(a, c)
    big = atk.gaussian_noise(
        torch.zeros(2, 20_000, dtype=torch.float64), 2, std=2.0, generator=torch.Generator()
    )
    assert float(big.mean()) == pytest.approx(0.0, abs=0.05)
    assert float(big.std()) == pytest.approx(2.0, rel=0.02)
    centered = atk.gaussian_noise(x, F, std=0.0, generator=torch.Generator(), centered=True)
    assert_rows(centered, x.mean(0))


def test_free_rider_sends_zeros_or_noise():
    x = honest(torch.float32)
    zeros = atk.free_rider(x, F)
    assert zeros.dtype == torch.float32 and torch.equal(zeros, torch.zeros(F, D))
    noisy = atk.free_rider(x, F, noise_std=0.01, generator=torch.Generator().manual_seed(3))
    assert 0 < float(noisy.abs().max()) < 0.1
    with pytest.raises(AggregationInputError):
        atk.free_rider(x, F, noise_std=0.01)


def test_mimic_copies_one_honest_row():
    x = honest()
    assert_rows(atk.mimic(x, F, target=4), x[4])
    with pytest.raises(AggregationInputError):
        atk.mimic(x, F, target=N_H)


def test_zero_byzantine_rows():
    x = honest()
    for rows in [atk.sign_flip(x, 0), atk.a_little_is_enough(x, 0), atk.mimic(x, 0)]:
        assert rows.shape == (0, D)


def test_line_maximize_finds_the_peak():
    calls = []

    def objective(t: float) -> float:
        calls.append(t)
        return -((t - 3.3) ** 2)

    best = atk.line_maximize(objective, evaluations=30)
    assert len(calls) == 30
    assert best == pytest.approx(3.3, abs=0.1)
    assert atk.line_maximize(lambda t: -t, evaluations=5) == 0.0


def damage(agg, x, bad) -> float:
    return float((agg(torch.cat([x, bad])) - x.mean(0)).norm())


@pytest.mark.parametrize(
    "agg", [Mean(), CoordinateMedian(), TrimmedMean(F), CenteredClip(1.0)], ids=repr
)
def test_optimal_attacks_beat_their_default_scales(agg):
    x = honest()
    for optimal, fixed in [
        (atk.optimal_ipm(x, F, agg), atk.inner_product_manipulation(x, F)),
        (atk.optimal_alie(x, F, agg), atk.a_little_is_enough(x, F)),
        (atk.optimal_sign(x, F, agg), atk.sign_perturbation(x, F)),
    ]:
        assert optimal.shape == (F, D)
        assert damage(agg, x, optimal) >= damage(agg, x, fixed) - 1e-12


def test_optimal_factors_are_the_argmax_of_the_damage():
    x = honest()
    agg = CoordinateMedian()
    z = atk.optimal_alie_factor(x, F, agg, evaluations=20)
    assert_rows(atk.optimal_alie(x, F, agg, evaluations=20), x.mean(0) - z * x.std(0))
    best = damage(agg, x, atk.a_little_is_enough(x, F, z=z))
    for probe in [0.0, 0.5, 1.0, 2.0, 4.0, 8.0]:
        assert best >= damage(agg, x, atk.a_little_is_enough(x, F, z=probe)) - 1e-12
    eps = atk.optimal_ipm_factor(x, F, Mean(), evaluations=10)
    # against the mean, a larger epsilon always hurts more: the search keeps expanding
    assert eps > 100


def test_attacks_do_what_they_are_for_against_krum():
    # ALIE rows sit inside the honest spread: Krum happily selects one of them.
    x = honest()
    bad = atk.a_little_is_enough(x, 4, z=0.3)
    out = Krum(4)(torch.cat([x, bad]))
    assert torch.equal(out, bad[0])


def test_attacks_are_deterministic():
    x = honest()
    for fn in [
        lambda: atk.optimal_ipm(x, F, TrimmedMean(F)),
        lambda: atk.optimal_alie(x, F, CenteredClip(1.0)),
        lambda: atk.gaussian_noise(x, F, generator=torch.Generator().manual_seed(9)),
    ]:
        assert fn().numpy().tobytes() == fn().numpy().tobytes()


# --- Shejwalkar & Houmansadr (NDSS 2021): min-max and min-sum ------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _pairwise_sq(x: torch.Tensor) -> torch.Tensor:
    return torch.cdist(x.double(), x.double()) ** 2


def _min_max_ok(x: torch.Tensor, row: torch.Tensor) -> bool:
    far = float(((x.double() - row.double()) ** 2).sum(dim=1).max())
    return far <= float(_pairwise_sq(x).max()) * (1 + 1e-9) + 1e-12


def _min_sum_ok(x: torch.Tensor, row: torch.Tensor) -> bool:
    total = float(((x.double() - row.double()) ** 2).sum())
    return total <= float(_pairwise_sq(x).sum(dim=1).max()) * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("direction", atk.DIRECTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_min_max_and_min_sum_are_mean_minus_gamma_p(direction, dtype):
    x = honest(dtype)
    p = atk.perturbation(x, direction)
    expected = {"unit": x.mean(0) / x.mean(0).norm(), "sign": torch.sign(x.mean(0)),
                "std": x.std(0)}[direction]
    torch.testing.assert_close(p, expected)
    for attack, gamma_of in ((atk.min_max, atk.min_max_gamma), (atk.min_sum, atk.min_sum_gamma)):
        gamma = gamma_of(x, direction)
        assert gamma > 0
        assert_rows(attack(x, F, direction), x.mean(0) - gamma * p)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(2, 12), d=st.integers(1, 30), seed=st.integers(0, 2**31 - 1),
       offset=st.floats(-3, 3), direction=st.sampled_from(atk.DIRECTIONS))
def test_gamma_is_the_largest_that_satisfies_the_constraint(n, d, seed, offset, direction):
    gen = torch.Generator().manual_seed(seed)
    x = (offset + torch.randn(n, d, generator=gen, dtype=torch.float64))
    p = atk.perturbation(x, direction)
    mu = x.mean(0)
    for gamma_of, ok in ((atk.min_max_gamma, _min_max_ok), (atk.min_sum_gamma, _min_sum_ok)):
        gamma = gamma_of(x, direction)
        assert gamma >= 0 and math.isfinite(gamma)
        assert ok(x, mu - gamma * p)  # the constraint holds at gamma ...
        if float(p.norm()) > 0:  # ... and fails just beyond it (gamma is the largest)
            assert not ok(x, mu - (gamma * 1.01 + 1e-6) * p)


def test_min_max_and_min_sum_edge_cases():
    x = honest()
    assert atk.min_max(x, 0).shape == (0, D) and atk.min_sum(x, 0, "sign").shape == (0, D)
    # a zero mean: the unit direction is 0, so is gamma; the rows are the mean
    centred = torch.cat([x[:3], -x[:3]])  # mean exactly 0
    assert atk.min_max_gamma(centred, "unit") == 0.0
    torch.testing.assert_close(atk.min_sum(centred, 2, "unit"), centred.mean(0).repeat(2, 1))
    # one honest row: no spread, nothing to hide in
    assert atk.min_max_gamma(x[:1], "sign") == 0.0 and atk.min_sum_gamma(x[:1], "std") == 0.0
    with pytest.raises(AggregationInputError):
        atk.min_max(x, F, "nope")


def test_min_max_moves_the_mean_against_the_honest_direction():
    x = honest()
    mu = x.mean(0)
    for direction in atk.DIRECTIONS:
        rows = torch.cat([x, atk.min_max(x, F, direction)])
        assert float(Mean()(rows) @ mu) < float(mu @ mu)


def test_sign_perturbation_moves_every_coordinate_against_the_mean():
    x = honest()
    mu, scale = x.mean(0), x.std(0).square().mean().sqrt()
    rows = atk.sign_perturbation(x, F, z=2.0)
    assert_rows(rows, mu - 2.0 * scale * torch.sign(mu))
    z = atk.optimal_sign_factor(x, F, CoordinateMedian(), evaluations=20)
    best = damage(CoordinateMedian(), x, atk.sign_perturbation(x, F, z))
    for probe in [0.0, 0.5, 1.0, 2.0, 4.0]:
        assert best >= damage(CoordinateMedian(), x, atk.sign_perturbation(x, F, probe)) - 1e-12


def test_jittered_mimic_rows_are_near_the_target_but_no_longer_copies():
    x = honest()
    gen = torch.Generator().manual_seed(3)
    rows = atk.mimic(x, F, target=1, jitter=0.03, generator=gen)
    spread = float(torch.pdist(x.double()).median())
    offsets = (rows.double() - x[1].double()).norm(dim=1)
    assert torch.allclose(offsets, torch.full_like(offsets, 0.03 * spread), rtol=1e-4)
    assert float(torch.pdist(rows.double()).min()) > 0.01 * spread  # beyond the copy radius
    assert torch.equal(atk.mimic(x, F, target=1), x[1].expand(F, D))
