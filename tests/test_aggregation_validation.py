"""Input validation: malformed inputs and hyperparameters are refused clearly."""

from __future__ import annotations

import math

import pytest
import torch
from veritrain.aggregation import (
    AggregationInputError,
    Bucketing,
    CenteredClip,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Mean,
    MultiKrum,
    NonFiniteUpdateError,
    OversizedUpdateError,
    TrimmedMean,
    centered_clip_with_stats,
)

ALL = [
    Mean(),
    CenteredClip(1.0),
    CenteredClip(1.0, start="mean"),
    CenteredClip(1.0, start="zero"),
    Krum(1),
    MultiKrum(1),
    TrimmedMean(1),
    CoordinateMedian(),
    GeometricMedian(),
    Bucketing(Mean(), 2, 0),
]
IDS = [
    "mean",
    "cclip_median",
    "cclip_mean",
    "cclip_zero",
    "krum",
    "multi_krum",
    "trimmed_mean",
    "median",
    "geometric_median",
    "bucketing",
]


def rows(n: int = 8, d: int = 5, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(n * 100 + d), dtype=dtype)


# --- shapes and dtypes ----------------------------------------------------------


@pytest.mark.parametrize("agg", ALL, ids=IDS)
@pytest.mark.parametrize(
    "bad",
    [
        [[1.0, 2.0], [3.0, 4.0]],  # not a tensor
        torch.zeros(5, dtype=torch.float64),  # 1-D
        torch.zeros(2, 3, 4, dtype=torch.float64),  # 3-D
        torch.zeros(0, 4, dtype=torch.float64),  # no rows
        torch.zeros(4, 0, dtype=torch.float64),  # no columns
        torch.zeros(4, 3, dtype=torch.int64),  # integers
        torch.zeros(4, 3, dtype=torch.float16),  # would need a silent cast
        torch.zeros(4, 3, dtype=torch.bfloat16),
    ],
    ids=["list", "1d", "3d", "no_rows", "no_cols", "int64", "float16", "bfloat16"],
)
def test_invalid_updates_are_refused(agg, bad):
    with pytest.raises(AggregationInputError):
        agg(bad)


@pytest.mark.parametrize("agg", ALL, ids=IDS)
@pytest.mark.parametrize(
    "weights, message",
    [
        (torch.ones(7, dtype=torch.float64), "shape"),
        (torch.ones(8, 1, dtype=torch.float64), "shape"),
        (torch.tensor([1.0] * 7 + [-1.0]), "negative"),
        (torch.tensor([1.0] * 7 + [math.nan]), "finite"),
        (torch.tensor([1.0] * 7 + [math.inf]), "finite"),
        (torch.zeros(8), "positive sum"),
        (["a"] * 8, "numbers"),
    ],
    ids=["short", "2d", "negative", "nan", "inf", "all_zero", "strings"],
)
def test_invalid_weights_are_refused(agg, weights, message):
    with pytest.raises(AggregationInputError, match=message):
        agg(rows(), weights)


# --- non-finite rows ------------------------------------------------------------------


@pytest.mark.parametrize("agg", ALL, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bad_rows", [(0,), (2, 5), (7,)])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_invalid_nonfinite_rows_are_named(agg, dtype, bad_rows, value):
    x = rows(dtype=dtype)
    for r in bad_rows:
        x[r, 3] = value
    with pytest.raises(NonFiniteUpdateError) as info:
        agg(x)
    assert info.value.rows == bad_rows
    assert str(list(bad_rows)) in str(info.value)


@pytest.mark.parametrize("agg", ALL, ids=IDS)
def test_invalid_nonfinite_row_with_zero_weight_is_still_refused(agg):
    x = rows()
    x[4, 0] = math.nan
    w = torch.ones(8, dtype=torch.float64)
    w[4] = 0.0
    with pytest.raises(NonFiniteUpdateError) as info:
        agg(x, w)
    assert info.value.rows == (4,)


def test_invalid_nonfinite_row_in_a_long_vector_is_found():
    # beyond one chunk of columns, in the last partial chunk
    x = rows(6, 200_003, torch.float32)
    x[3, -1] = math.nan
    for agg in [Mean(), CenteredClip(1.0), Krum(1), CoordinateMedian(), TrimmedMean(1)]:
        with pytest.raises(NonFiniteUpdateError) as info:
            agg(x)
        assert info.value.rows == (3,)


@pytest.mark.parametrize("first", [True, False])
def test_invalid_float64_rows_too_large_for_distances_are_named(first):
    x = rows()
    r = 0 if first else 6
    x[r] *= 1e200
    for agg in [CenteredClip(1.0), Krum(1), MultiKrum(1), GeometricMedian()]:
        with pytest.raises(OversizedUpdateError) as info:
            agg(x)
        assert info.value.rows == (r,)
    # rules without squared distances are fine
    for agg in [Mean(), TrimmedMean(1), CoordinateMedian()]:
        assert bool(torch.isfinite(agg(x)).all())


def test_huge_but_finite_float32_rows_are_aggregated():
    x = rows(dtype=torch.float32)
    x[0] = 3e38
    x[1] = -3e38
    for agg in ALL:
        out = agg(x)
        assert out.dtype == torch.float32
        assert bool(torch.isfinite(out).all()), agg


# --- breakdown conditions ------------------------------------------------------------


@pytest.mark.parametrize(
    "agg, n_ok, n_bad",
    [
        (Krum(2), 7, 6),  # n > 2f + 2
        (MultiKrum(2), 7, 6),
        (TrimmedMean(2), 5, 4),  # 2f < n
        (TrimmedMean(0), 1, 0),
    ],
    ids=["krum", "multi_krum", "trimmed_mean", "trimmed_mean_f0"],
)
def test_invalid_f_too_large(agg, n_ok, n_bad):
    agg(rows(n_ok))
    if n_bad:
        with pytest.raises(AggregationInputError, match="needs"):
            agg(rows(n_bad))
    # rows of weight 0 do not count
    w = torch.ones(n_ok, dtype=torch.float64)
    w[0] = 0.0
    if n_bad:
        with pytest.raises(AggregationInputError, match="positive weight"):
            agg(rows(n_ok), w)


def test_invalid_multi_krum_m_above_n():
    MultiKrum(1, m=6)(rows(6))
    with pytest.raises(AggregationInputError, match="m <= n"):
        MultiKrum(1, m=7)(rows(6))


# --- hyperparameters ------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: CenteredClip(0.0),
        lambda: CenteredClip(-1.0),
        lambda: CenteredClip(math.nan),
        lambda: CenteredClip(math.inf),
        lambda: CenteredClip(True),
        lambda: CenteredClip("1"),
        lambda: CenteredClip(1.0, iterations=0),
        lambda: CenteredClip(1.0, iterations=2.5),
        lambda: CenteredClip(1.0, tol=-1.0),
        lambda: CenteredClip(1.0, start="origin"),
        lambda: Krum(-1),
        lambda: Krum(1.5),
        lambda: Krum(True),
        lambda: MultiKrum(1, m=0),
        lambda: TrimmedMean(-1),
        lambda: GeometricMedian(iterations=0),
        lambda: GeometricMedian(eps=0.0),
        lambda: GeometricMedian(tol=math.nan),
        lambda: Bucketing(Mean(), 0, 0),
        lambda: Bucketing(Mean(), 2, -1),
        lambda: Bucketing("mean", 2, 0),
    ],
)
def test_invalid_hyperparameters_are_refused_at_construction(make):
    with pytest.raises(AggregationInputError):
        make()


def test_invalid_start_vector():
    x = rows()
    with pytest.raises(AggregationInputError, match="shape"):
        centered_clip_with_stats(x, tau=1.0, start=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(AggregationInputError, match="NaN"):
        centered_clip_with_stats(x, tau=1.0, start=torch.full((5,), math.nan, dtype=torch.float64))
    with pytest.raises(AggregationInputError):
        centered_clip_with_stats(x, tau=1.0, start="previous")


# --- dtype and device -----------------------------------------------------------------


@pytest.mark.parametrize("agg", ALL, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_result_keeps_input_dtype_and_shape(agg, dtype):
    x = rows(dtype=dtype)
    out = agg(x)
    assert out.dtype == dtype and out.shape == (5,) and out.device == x.device


@pytest.mark.parametrize("agg", ALL, ids=IDS)
def test_non_contiguous_input_gives_the_same_result(agg):
    x = rows(8, 10)
    strided = torch.empty(10, 8, dtype=torch.float64).T
    strided.copy_(x)
    assert not strided.is_contiguous()
    torch.testing.assert_close(agg(strided), agg(x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("agg", ALL, ids=IDS)
def test_input_requiring_grad_is_used_detached(agg):
    x = rows().requires_grad_(True)
    out = agg(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, agg(x.detach()), rtol=0, atol=0)
