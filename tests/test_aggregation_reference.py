"""Every aggregator against a plain float64 reference implementation.

The references below are the textbook formulas written the obvious way (no
Gram tricks, no sorting networks, per-coordinate Python loops where that is
simplest).  Agreement is measured translation-invariantly in float64
(relative to the spread of the rows, so nearly equal inputs are a real test of
cancellation) and relative to max(||ref||, spread) in float32.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from veritrain.aggregation import (
    Bucketing,
    CenteredClip,
    CoordinateMedian,
    GeometricMedian,
    Krum,
    Mean,
    MultiKrum,
    TrimmedMean,
    centered_clip_with_stats,
)
from veritrain.aggregation.bucketing import bucket_assignment

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------
# Reference implementations (float64, straightforward)
# ----------------------------------------------------------------------------


def ref_weights(w: torch.Tensor | None, n: int) -> np.ndarray:
    return np.ones(n) if w is None else w.double().numpy().copy()


def ref_mean(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return (w[:, None] * x).sum(0) / w.sum()


def ref_median(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted median with exact cumulative sums; |S_j - W/2| <= 1e-12 W is a tie."""
    keep = w > 0
    x, w = x[keep], w[keep]
    out = np.empty(x.shape[1])
    for k in range(x.shape[1]):
        order = np.argsort(x[:, k], kind="stable")
        v = x[order, k]
        s = list(itertools.accumulate(Fraction(float(t)) for t in w[order]))
        half, slack = s[-1] / 2, s[-1] * Fraction(1e-12)
        j1 = next(j for j, sj in enumerate(s) if sj >= half - slack)
        j2 = next(j for j, sj in enumerate(s) if sj > half + slack)
        out[k] = (v[j1] + v[j2]) / 2
    return out


def ref_trimmed_mean(x: np.ndarray, w: np.ndarray, f: int) -> np.ndarray:
    keep = w > 0
    x, w = x[keep], w[keep]
    n = x.shape[0]
    out = np.empty(x.shape[1])
    for k in range(x.shape[1]):
        order = np.argsort(x[:, k], kind="stable")[f : n - f]
        out[k] = (w[order] * x[order, k]).sum() / w[order].sum()
    return out


def ref_centered_clip(x, w, tau, iterations, tol, start):
    wn = w / w.sum()
    if isinstance(start, np.ndarray):
        v = start.copy()
    elif start == "median":
        v = ref_median(x, w)
    elif start == "mean":
        v = ref_mean(x, w)
    else:
        v = np.zeros(x.shape[1])
    ran = 0
    for _ in range(iterations):
        diff = x - v
        norm = np.linalg.norm(diff, axis=1)
        clip = np.where(norm > tau, tau / np.maximum(norm, tau), 1.0)
        step = (wn * clip) @ diff
        v = v + step
        ran += 1
        if np.linalg.norm(step) <= tol * tau:
            break
    norm = np.linalg.norm(x - v, axis=1)
    return v, ran, np.where(norm > tau, tau / np.maximum(norm, tau), 1.0)


def ref_krum_scores(x: np.ndarray, w: np.ndarray, f: int):
    act = np.nonzero(w > 0)[0]
    n = len(act)
    d = ((x[act, None, :] - x[None, act, :]) ** 2).sum(-1)
    scores = np.array([np.sort(np.delete(d[i], i))[: n - f - 2].sum() for i in range(n)])
    return act, scores


def ref_geometric_median(x, w, iterations, tol, eps):
    wn = w / w.sum()
    v = wn @ x
    for _ in range(iterations):
        dist = np.linalg.norm(x - v, axis=1)
        beta = wn / np.maximum(dist, eps)
        new = (beta / beta.sum()) @ x
        step = np.linalg.norm(new - v)
        v = new
        active = np.sort(dist[wn > 0])
        if step <= tol * active[(len(active) - 1) // 2]:
            break
    return v


# ----------------------------------------------------------------------------
# Inputs and the agreement check
# ----------------------------------------------------------------------------


@st.composite
def matrices(draw, min_rows: int = 1, max_rows: int = 9, max_dim: int = 6):
    n = draw(st.integers(min_rows, max_rows))
    d = draw(st.integers(1, max_dim))
    kind = draw(st.sampled_from(["gauss", "nearly_equal", "outliers", "grid", "raw"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if kind == "gauss":
        x = rng.standard_normal((n, d)) * 10.0 ** rng.uniform(-3, 3)
    elif kind == "nearly_equal":  # agree to ~6 significant digits
        base = rng.standard_normal(d) * 10.0 ** rng.uniform(-3, 3) + 1e-3
        x = base + rng.standard_normal((n, d)) * np.abs(base).max() * 1e-6
    elif kind == "outliers":
        x = rng.standard_normal((n, d))
        bad = rng.random(n) < 0.3
        x[bad] *= 10.0 ** rng.uniform(2, 8)
    elif kind == "grid":  # many exact ties
        x = rng.integers(-2, 3, (n, d)).astype(np.float64)
    else:
        x = draw(
            arrays(
                np.float64,
                (n, d),
                elements=st.floats(-1e4, 1e4, allow_nan=False, allow_subnormal=False),
            )
        )
    return x


@st.composite
def weight_vectors(draw, n: int):
    if draw(st.booleans()):
        return None
    w = np.array(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.7]), min_size=n, max_size=n)))
    if w.sum() == 0:
        w[0] = 1.0
    return torch.tensor(w)


def assert_agrees(
    out: torch.Tensor, ref: np.ndarray, x: torch.Tensor, rel: float = 1e-5, magnitude: float = 0.0
) -> None:
    """||out - ref|| <= rel * scale + rounding, scale as in the module docstring.

    ``magnitude``: norm of any other vector the rule combines (a start point).
    """
    assert out.dtype == x.dtype and out.shape == (x.shape[1],)
    x64 = x.double().numpy()
    center = x64.mean(0)
    spread = math.sqrt(((x64 - center) ** 2).sum(1).mean())
    eps = torch.finfo(x.dtype).eps
    if x.dtype == torch.float64:
        scale = spread + float(np.linalg.norm(ref - center))
    else:
        scale = max(float(np.linalg.norm(ref)), spread)
    atol = 4 * x.shape[0] * eps * max(float(np.linalg.norm(x64, axis=1).max()), magnitude)
    # subnormal results are spaced tiny * eps apart, whatever their size
    atol += 8 * x.shape[0] * math.sqrt(x.shape[1]) * torch.finfo(x.dtype).tiny * eps
    err = float(np.linalg.norm(out.double().numpy() - ref))
    assert err <= rel * scale + atol, (err, scale, atol)


def inputs(data, dtype=torch.float64, min_rows: int = 1):
    x64 = data.draw(matrices(min_rows=min_rows))
    x = torch.tensor(x64, dtype=dtype)
    w = data.draw(weight_vectors(x.shape[0]))
    return x, w, x.double().numpy(), ref_weights(w, x.shape[0])


DTYPES = [torch.float64, torch.float32]

# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_mean_matches_reference(dtype, data):
    x, w, xr, wr = inputs(data, dtype)
    assert_agrees(Mean()(x, w), ref_mean(xr, wr), x)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_median_matches_reference(dtype, data):
    x, w, xr, wr = inputs(data, dtype)
    assert_agrees(CoordinateMedian()(x, w), ref_median(xr, wr), x)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_trimmed_mean_matches_reference(dtype, data):
    x, w, xr, wr = inputs(data, dtype)
    n = int((wr > 0).sum())
    f = data.draw(st.integers(0, (n - 1) // 2))
    assert_agrees(TrimmedMean(f)(x, w), ref_trimmed_mean(xr, wr, f), x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("start", ["median", "mean", "zero"])
@SETTINGS
@given(data=st.data())
def test_centered_clip_matches_reference(dtype, start, data):
    x, w, xr, wr = inputs(data, dtype)
    spread = float(np.linalg.norm(xr - xr.mean(0), axis=1).max()) + 1e-12
    tau = spread * data.draw(st.sampled_from([0.01, 0.3, 1.0, 5.0]))
    iterations = data.draw(st.integers(1, 12))
    out, stats = centered_clip_with_stats(
        x, w, tau=tau, iterations=iterations, tol=0.0, start=start
    )
    ref, ran, clip = ref_centered_clip(xr, wr, tau, iterations, 0.0, start)
    assert_agrees(out, ref, x)
    # (the count may differ by rounding when a step is ~0: a fixed point either way)
    assert 1 <= stats.iterations_run <= iterations
    assert stats.clip_factors.shape == (x.shape[0],)
    # Clip factors are well conditioned only where distances exceed rounding
    # of the inputs (a float32 median is itself rounded to the float32 grid).
    dist = np.linalg.norm(xr - ref, axis=1)
    if dtype == torch.float64 and dist.min() > 1e-6 * np.abs(xr).max():
        np.testing.assert_allclose(stats.clip_factors.numpy(), clip, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_centered_clip_tensor_start_matches_reference(dtype, data):
    x, w, xr, wr = inputs(data, dtype)
    start = xr[0] + 1.0
    out, _ = centered_clip_with_stats(
        x, w, tau=1.0, iterations=5, tol=0.0, start=torch.tensor(start, dtype=dtype)
    )
    ref = ref_centered_clip(xr, wr, 1.0, 5, 0.0, start)[0]
    assert_agrees(out, ref, x, magnitude=float(np.linalg.norm(start)))


def test_centered_clip_stats_report_clipping_at_the_result():
    # Four rows at 0 and one at 10 (1-D), tau = 1, started at the median 0 (a given
    # start: the paper's rule, where the four copies count four times; the streamed
    # starts count copies once, test_copies.py): the outlier is clipped to a pull of
    # 1/5 per step; v creeps up 0.2 per step.
    x = torch.tensor([[0.0], [0.0], [0.0], [0.0], [10.0]], dtype=torch.float64)
    out, stats = centered_clip_with_stats(
        x, tau=1.0, iterations=3, tol=0.0, start=torch.zeros(1, dtype=torch.float64)
    )
    assert stats.iterations_run == 3
    # each step: four honest rows at distance v pull back by -v*4/5 (unclipped),
    # the outlier pulls +1/5.
    v = 0.0
    for _ in range(3):
        v = v + (-4 * v + 1.0) / 5
    assert out.item() == pytest.approx(v, rel=1e-12)
    expected = [1.0, 1.0, 1.0, 1.0, 1.0 / (10.0 - v)]
    assert stats.clip_factors.tolist() == pytest.approx(expected, rel=1e-12)


def test_centered_clip_tolerance_stops_early_like_reference():
    rng = np.random.default_rng(3)
    xr = rng.standard_normal((12, 50))
    x = torch.tensor(xr)
    out, stats = centered_clip_with_stats(x, tau=100.0, iterations=50, tol=1e-6, start="zero")
    ref, ran, _ = ref_centered_clip(xr, np.ones(12), 100.0, 50, 1e-6, "zero")
    # tau above every distance: v jumps to the mean, then the next step is ~0.
    assert stats.iterations_run == ran == 2
    assert_agrees(out, ref, x)
    assert CenteredClip(100.0, 50, 1e-6, "zero")(x).equal(out)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_krum_matches_reference(dtype, data):
    x, w, xr, wr = inputs(data, dtype, min_rows=3)
    n = int((wr > 0).sum())
    if n < 3:
        return
    f = data.draw(st.integers(0, (n - 3) // 2))
    out = Krum(f)(x, w)
    act, scores = ref_krum_scores(xr, wr, f)
    # Exact ties (or near ties below rounding) may resolve either way.
    tie = 1e-6 if dtype == torch.float32 else 1e-9
    ok = scores <= scores.min() * (1 + tie) + tie * float((xr**2).sum())
    assert any(torch.equal(out, x[i]) for i in act[ok])


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_multi_krum_matches_reference(dtype, data):
    x, w, xr, wr = inputs(data, dtype, min_rows=3)
    n = int((wr > 0).sum())
    if n < 3:
        return
    f = data.draw(st.integers(0, (n - 3) // 2))
    m = data.draw(st.integers(1, n))
    act, scores = ref_krum_scores(xr, wr, f)
    order = np.argsort(scores, kind="stable")
    if m < n:  # the selected set is ambiguous at a (near) tie on its boundary
        lo, hi = scores[order[m - 1]], scores[order[m]]
        if hi - lo <= 1e-6 * max(abs(hi), 1e-300):
            return
    chosen = act[order[:m]]
    ref = ref_mean(xr[chosen], wr[chosen])
    assert_agrees(MultiKrum(f, m)(x, w), ref, x)


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data())
def test_geometric_median_matches_reference(dtype, data):
    x, w, xr, wr = inputs(data, dtype)
    iterations = data.draw(st.integers(1, 30))
    out = GeometricMedian(iterations=iterations, tol=0.0, eps=1e-8)(x, w)
    assert_agrees(out, ref_geometric_median(xr, wr, iterations, 0.0, 1e-8), x)


def test_geometric_median_converges_to_the_minimizer():
    rng = np.random.default_rng(0)
    xr = rng.standard_normal((9, 4))
    out = GeometricMedian(iterations=1000, tol=1e-12)(torch.tensor(xr)).numpy()

    def objective(v):
        return np.linalg.norm(xr - v, axis=1).sum()

    for _ in range(200):  # no random direction improves the objective
        probe = out + rng.standard_normal(4) * 1e-4
        assert objective(probe) >= objective(out) - 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
@SETTINGS
@given(data=st.data(), bucket_size=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_bucketing_matches_reference(dtype, data, bucket_size, seed):
    x, w, xr, wr = inputs(data, dtype)
    act = torch.nonzero(torch.tensor(wr) > 0).flatten()
    buckets = [b.numpy() for b in bucket_assignment(act, bucket_size, seed)]
    means = np.stack([ref_mean(xr[b], wr[b]) for b in buckets])
    bw = np.array([wr[b].sum() for b in buckets]) if w is not None else np.ones(len(buckets))
    out = Bucketing(CoordinateMedian(), bucket_size, seed)(x, w)
    assert_agrees(out, ref_median(means, bw), x)
    # The weighted mean survives bucketing exactly when weights are given.
    if w is not None:
        assert_agrees(Bucketing(Mean(), bucket_size, seed)(x, w), ref_mean(xr, wr), x)


def test_bucket_assignment_is_a_seeded_partition():
    rows = torch.arange(11)
    a = bucket_assignment(rows, 3, 7)
    assert [b.numel() for b in a] == [3, 3, 3, 2]
    assert sorted(torch.cat(a).tolist()) == list(range(11))
    assert all(torch.equal(p, q) for p, q in zip(a, bucket_assignment(rows, 3, 7), strict=True))
    assert any(not torch.equal(p, q) for p, q in zip(a, bucket_assignment(rows, 3, 8), strict=True))
