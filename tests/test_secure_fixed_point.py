"""Fixed-point encoding modulo 2^32: round-trip bounds, unbiased rounding, determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.aggregation.secure import (
    SecureAggregationError,
    clip_factor,
    dequantize,
    fixed_point_scale,
    quantize,
)
from veritrain.aggregation.secure.prg import (
    combine_streams,
    derive_key,
    keystream,
    parallel_ranges,
    uniform_indices,
)

KEY = derive_key(b"test", "rounding", "run", 1, b"w")

floats = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False, width=32)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(floats, min_size=1, max_size=200),
    clip=st.floats(min_value=1e-3, max_value=1e4),
    bucket=st.integers(min_value=1, max_value=64),
)
def test_round_trip_error_below_one_step(values, clip, bucket):
    x = torch.tensor(values, dtype=torch.float32)
    scale = fixed_point_scale(clip, bucket)
    q = quantize(x, clip_norm=clip, scale=scale, rounding_key=KEY)
    back = dequantize(q, scale)
    clipped = x.double() * clip_factor(x, clip)
    assert float((back - clipped).abs().max()) < 1.0 / scale
    # the clip holds: ||q / S|| <= C + sqrt(D) / S
    assert float(back.norm()) <= clip + math.sqrt(len(values)) / scale


@settings(max_examples=40, deadline=None)
@given(
    clip=st.floats(min_value=1e-6, max_value=1e6), bucket=st.integers(min_value=1, max_value=4096)
)
def test_scale_never_lets_a_bucket_sum_wrap(clip, bucket):
    scale = fixed_point_scale(clip, bucket)
    assert bucket * (clip * scale + 1) <= 2**31 - 1
    assert math.log2(scale).is_integer()
    # and it is the largest such power of two
    assert bucket * (clip * scale * 2 + 1) > 2**31 - 1


def test_bucket_sum_of_extreme_inputs_is_exact():
    """s workers each with a one-hot update of norm C: the worst case for overflow."""
    clip, s = 3.0, 8
    scale = fixed_point_scale(clip, s)
    total = np.zeros(4, dtype=np.uint32)
    for i in range(s):
        x = torch.tensor([-clip * (1 + i), 0.0, 0.0, 0.0])  # clipped to -C
        total += quantize(x, clip_norm=clip, scale=scale, rounding_key=derive_key(b"k", str(i)))
    assert float(dequantize(total, scale)[0]) == pytest.approx(-clip * s, abs=s / scale)


def test_stochastic_rounding_is_unbiased():
    """E[q] = y within 2^-16 of a step: the mean over many coordinates converges to y."""
    scale = 1.0
    y = 0.3125  # fraction 5/16
    x = torch.full((200_000,), y)
    q = quantize(x, clip_norm=1e9, scale=scale, rounding_key=KEY)
    ups = q.astype(np.int64).mean()
    # Bernoulli(0.3125) mean over 2e5 draws: sd 1.04e-3
    assert abs(ups - y) < 6e-3
    assert set(np.unique(q).tolist()) == {0, 1}


def test_quantize_is_deterministic_and_thread_independent():
    x = torch.randn(300_001, generator=torch.Generator().manual_seed(1))
    a = quantize(x, clip_norm=10.0, scale=2.0**20, rounding_key=KEY, threads=1)
    b = quantize(x, clip_norm=10.0, scale=2.0**20, rounding_key=KEY, threads=3)
    c = quantize(
        x, clip_norm=10.0, scale=2.0**20, rounding_key=derive_key(b"other", "x"), threads=2
    )
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)  # the rounding stream matters


def test_negative_values_wrap_as_twos_complement():
    scale = 4.0
    q = quantize(torch.tensor([-1.0, 1.0, 0.0]), clip_norm=100.0, scale=scale, rounding_key=KEY)
    assert q.tolist() == [2**32 - 4, 4, 0]
    assert dequantize(q, scale).tolist() == [-1.0, 1.0, 0.0]


def test_keystream_offsets_and_parallel_combination_agree():
    key = derive_key(b"ikm", "label", 1, "two", b"three")
    full = keystream(key, 4096)
    assert np.array_equal(full[1024:], keystream(key, 3072, offset=1024))
    out1 = np.arange(100_003, dtype=np.uint32)
    out2 = out1.copy()
    combine_streams(out1, [(key, 1), (KEY, -1)], threads=1)
    combine_streams(out2, [(key, 1), (KEY, -1)], threads=4)
    assert np.array_equal(out1, out2)
    ref = (
        np.arange(100_003, dtype=np.uint64)
        + keystream(key, 4 * 100_003).view("<u4")
        - keystream(KEY, 4 * 100_003).view("<u4")
    ) % 2**32
    assert np.array_equal(out1, ref.astype(np.uint32))
    assert all(a % 32 == 0 for a, _ in parallel_ranges(100_003, 7))


def test_derived_keys_are_domain_separated():
    base = derive_key(b"ikm", "pair-mask", "run", 1)
    assert base != derive_key(b"ikm", "pair-mask", "run", 2)
    assert base != derive_key(b"ikm", "self-mask", "run", 1)
    assert derive_key(b"ikm", "x", "ab", "c") != derive_key(
        b"ikm", "x", "a", "bc"
    )  # length prefixes


def test_uniform_indices_cover_the_range_evenly():
    idx = uniform_indices(KEY, 50_000, 10)
    counts = np.bincount(idx, minlength=10)
    assert idx.min() >= 0 and idx.max() < 10
    assert np.all(np.abs(counts - 5000) < 6 * math.sqrt(5000 * 0.9))


def test_invalid_scale_parameters():
    with pytest.raises(SecureAggregationError):
        fixed_point_scale(0.0, 8)
    with pytest.raises(SecureAggregationError):
        fixed_point_scale(float("nan"), 8)
    with pytest.raises(SecureAggregationError):
        fixed_point_scale(1.0, 0)
    with pytest.raises(SecureAggregationError):
        fixed_point_scale(1.0, 2**31)


def test_invalid_updates_are_refused():
    with pytest.raises(SecureAggregationError, match="NaN or Inf"):
        quantize(torch.tensor([1.0, float("inf")]), clip_norm=1.0, scale=4.0, rounding_key=KEY)
    with pytest.raises(SecureAggregationError, match="1-D"):
        quantize(torch.zeros(2, 2), clip_norm=1.0, scale=4.0, rounding_key=KEY)
    with pytest.raises(SecureAggregationError, match="float32 or float64"):
        quantize(torch.zeros(3, dtype=torch.int32), clip_norm=1.0, scale=4.0, rounding_key=KEY)
    with pytest.raises(SecureAggregationError):
        dequantize(np.zeros(3, dtype=np.int64), 4.0)
