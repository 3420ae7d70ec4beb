"""lloyd: Gaussian Lloyd-Max codes with an RMS scale per block."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from veritrain.protocol.codecs import HEADER_SIZE, get_codec
from veritrain.protocol.codecs.lloyd import LEVELS

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
F32_MAX = float(np.finfo(np.float32).max)
#: Mean squared error of the Lloyd-Max quantiser of N(0, 1), by bits (Max, 1960).
GAUSSIAN_MSE = {2: 0.1175, 3: 0.03454, 4: 0.009497}

finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


def reference_decode(x: np.ndarray, scales: np.ndarray, bits: int, block: int) -> np.ndarray:
    """The rule of specs/codecs.md, written out element by element from the scales."""
    levels = LEVELS[bits]
    mids = [np.float32((a + b) / 2) for a, b in zip(levels, levels[1:], strict=False)]
    out = np.empty(x.size, dtype=np.float32)
    for i, v in enumerate(x):
        s = scales[i // block]
        z = np.float32(abs(v) / s) if s > 0 else np.float32(0)
        m = sum(1 for t in mids if z > t)
        value = -levels[m] * float(s) if v < 0 else levels[m] * float(s)
        out[i] = np.float32(min(max(value, -F32_MAX), F32_MAX))
    return out


@FAST
@given(
    x=arrays(np.float32, st.integers(1, 200), elements=finite),
    bits=st.sampled_from([2, 3, 4]),
    block=st.integers(1, 70),
)
def test_decode_follows_the_nearest_level_rule_and_the_scale_is_the_block_rms(
    x: np.ndarray, bits: int, block: int
) -> None:
    codec = get_codec("lloyd", {"bits": bits, "block": block})
    payload = codec.encode(torch.from_numpy(x))
    nb = -(-x.size // block)
    scales = np.frombuffer(payload[HEADER_SIZE : HEADER_SIZE + 4 * nb], dtype="<f4")
    padded = np.zeros(nb * block)
    padded[: x.size] = x.astype(np.float64)
    for j in range(nb):
        rms = math.sqrt(math.fsum(v * v for v in padded[j * block : (j + 1) * block]) / block)
        assert abs(float(scales[j]) - rms) <= 2.0**-22 * rms + 1e-45
    out = codec.decode(payload, x.size).numpy()
    assert np.array_equal(out, reference_decode(x, scales, bits, block))
    assert np.isfinite(out).all()
    assert not (np.sign(out) * np.sign(x) < 0).any()  # never flips a sign


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_error_on_gaussian_data_is_the_lloyd_max_optimum(bits: int) -> None:
    """Within 3% of the optimal quantiser's error, and below evenly spaced absmax codes of
    the same width and block (int4 for 4 bits)."""
    x = torch.randn(400_000, generator=torch.Generator().manual_seed(bits))
    codec = get_codec("lloyd", {"bits": bits, "block": 128})
    y = codec.decode(codec.encode(x), x.numel())
    rel = float((y - x).norm() / x.norm())
    assert abs(rel / math.sqrt(GAUSSIAN_MSE[bits]) - 1) < 0.03
    if bits == 4:
        int4 = get_codec("int4", {"block": 128})
        assert rel < 0.95 * float((int4.decode(int4.encode(x), x.numel()) - x).norm() / x.norm())


def test_size_ratio_and_zero_blocks() -> None:
    codec = get_codec("lloyd", {"bits": 3, "block": 128})
    numel = 1_000_003
    assert codec.max_encoded_size(numel) == HEADER_SIZE + 4 * 7813 + (3 * numel + 7) // 8
    assert 4 * numel / codec.max_encoded_size(numel) > 9.8
    x = torch.zeros(300)
    x[200] = -3.0
    x[0] = 1e-45  # its block's RMS rounds to a zero scale: field 0, decoded 0
    payload = codec.encode(x)
    assert payload[HEADER_SIZE : HEADER_SIZE + 4] == bytes(4)
    assert payload[HEADER_SIZE + 4 * 3] & 0b111 == 0
    y = codec.decode(payload, 300)
    assert torch.equal(y[:128], torch.zeros(128))
    assert float(y[200]) < 0


def test_huge_values_saturate_instead_of_overflowing() -> None:
    codec = get_codec("lloyd", {"bits": 4, "block": 4})
    x = torch.tensor([F32_MAX, -F32_MAX, F32_MAX, F32_MAX], dtype=torch.float32)
    y = codec.decode(codec.encode(x), 4)
    assert bool(torch.isfinite(y).all())
    assert float(y[1]) < 0 < float(y[0])


@FAST
@given(data=st.binary(min_size=0, max_size=200))
def test_any_code_stream_with_valid_scales_decodes_finite(data: bytes) -> None:
    """Every field is a code: a stream of any bits decodes (bad padding aside) to values
    that are levels times scales."""
    codec = get_codec("lloyd", {"bits": 3, "block": 8})
    numel = 40
    header = codec.encode(torch.zeros(numel))[:HEADER_SIZE]
    scales = np.full(5, 0.5, dtype="<f4").tobytes()
    codes = (data + bytes(15))[:15]
    out = codec.decode(header + scales + codes, numel)
    allowed = {np.float32(s * v * 0.5) for v in LEVELS[3] for s in (1, -1)}
    assert {np.float32(v) for v in out.numpy()} <= allowed
