"""Breakdown properties: what f outliers of any magnitude can and cannot do."""

from __future__ import annotations

import pytest
import torch
from veritrain.aggregation import (
    Bucketing,
    CenteredClip,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Mean,
    MultiKrum,
    TrimmedMean,
)

N_HONEST, F, D = 9, 4, 32
MAGNITUDES = [1e1, 1e3, 1e8, 1e15, 1e30]


def honest_rows(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(D, generator=gen) + 0.5 * torch.randn(N_HONEST, D, generator=gen)).to(dtype)


def attacked(honest: torch.Tensor, magnitude: float, *, spread: bool = False) -> torch.Tensor:
    """honest rows followed by F outliers of the given magnitude (the same direction,
    or F different directions when ``spread``), placed first so they would be
    the reference row or first tie if that mattered."""
    gen = torch.Generator().manual_seed(2)
    direction = torch.randn(F if spread else 1, D, generator=gen, dtype=torch.float64)
    bad = (direction / direction.norm(dim=1, keepdim=True) * magnitude).expand(F, D)
    return torch.cat([bad.to(honest.dtype), honest])


def shift(agg, honest: torch.Tensor, magnitude: float, **kw) -> float:
    clean = agg(honest).double()
    return float((agg(attacked(honest, magnitude, **kw)).double() - clean).norm())


DTYPES = [torch.float64, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_moves_without_bound(dtype):
    x = honest_rows(dtype)
    shifts = [shift(Mean(), x, m) for m in MAGNITUDES]
    # the shift is about F / (N_HONEST + F) of the magnitude: unbounded
    for m, s in zip(MAGNITUDES[1:], shifts[1:], strict=True):
        assert s == pytest.approx(m * F / (N_HONEST + F), rel=0.05)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", [False, True])
def test_centered_clip_moves_a_bounded_amount(dtype, spread):
    tau, iterations = 1.0, 10
    agg = CenteredClip(tau, iterations=iterations)
    x = honest_rows(dtype)
    honest_diameter = float(torch.cdist(x.double(), x.double()).max())
    # The median start stays within the honest range; each step moves v by at
    # most tau.  So the shift is at most diameter + iterations * tau (loose).
    bound = honest_diameter * 2 + iterations * tau
    shifts = [shift(agg, x, m, spread=spread) for m in MAGNITUDES]
    assert max(shifts) <= bound
    # Once outliers are farther than tau, their pull is tau whatever their size.
    assert shifts[-1] == pytest.approx(shifts[-2], rel=1e-3, abs=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", [False, True])
def test_krum_picks_an_honest_row(dtype, spread):
    x = honest_rows(dtype)
    for m in MAGNITUDES[1:]:
        out = Krum(F)(attacked(x, m, spread=spread))
        assert any(torch.equal(out, row) for row in x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_krum_averages_honest_rows(dtype):
    x = honest_rows(dtype)
    out = MultiKrum(F, m=N_HONEST)(attacked(x, 1e30))
    torch.testing.assert_close(out, x.mean(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "agg", [CoordinateMedian(), TrimmedMean(F)], ids=["median", "trimmed_mean"]
)
def test_coordinate_rules_stay_in_the_honest_range(dtype, agg):
    x = honest_rows(dtype)
    lo, hi = x.min(0).values, x.max(0).values
    for m in [-1e30, -1e3, 1e3, 1e30]:
        out = agg(attacked(x, m, spread=True))
        assert bool(((out >= lo) & (out <= hi)).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_geometric_median_moves_a_bounded_amount(dtype):
    x = honest_rows(dtype)
    honest_diameter = float(torch.cdist(x.double(), x.double()).max())
    shifts = [shift(GeometricMedian(), x, m) for m in MAGNITUDES]
    # breakdown point 1/2: F < N/2 outliers move it by O(diameter) at most.
    assert max(shifts) <= 2 * honest_diameter
    assert shifts[-1] == pytest.approx(shifts[-2], rel=1e-2, abs=1e-3)


def test_bucketing_keeps_centered_clip_bounded():
    # 2 outliers among 11 rows pollute at most 2 of the 6 buckets of size 2.
    x = honest_rows(torch.float64)
    agg = Bucketing(CenteredClip(1.0), bucket_size=2, seed=3)
    for m in MAGNITUDES:
        out = agg(attacked(x, m)[F - 2 :])
        assert float((out - agg(x)).norm()) <= 2 * float(torch.cdist(x, x).max()) + 10.0


def test_zero_weight_rows_take_no_part():
    x = honest_rows(torch.float64)
    bad = attacked(x, 1e30)
    w = torch.cat([torch.zeros(F), torch.ones(N_HONEST)]).double()
    for agg in [
        Mean(),
        CenteredClip(1.0),
        Krum(1),
        MultiKrum(1),
        TrimmedMean(1),
        CoordinateMedian(),
        GeometricMedian(),
    ]:
        torch.testing.assert_close(agg(bad, w), agg(x), rtol=1e-9, atol=1e-9)
