"""Clipping and fixed-point encoding modulo 2^32 with seeded stochastic rounding.

A worker's update x (D floats) becomes D words of Z_(2^32):

    x'  = x * min(1, C / ||x||)                          (clip to norm C)
    y_k = x'_k * f * S   evaluated as  x_k * (min(1, C/||x||) * S)   in float64
    q_k = floor(y_k) + [ u_k < 2^16 (y_k - floor(y_k)) ]  mod 2^32

with S = 2^e the scale (``fixed_point_scale``), u_k the k-th little-endian
uint16 of the public rounding stream of (run, round, worker), and ``[.]`` 1 if
true.  Then P(round up) = ceil(2^16 frac) / 2^16, so

    y_k <= E[q_k] < y_k + 2^-16          (bias below 2^-16 of one step)
    |q_k - y_k| < 1                      (every coordinate, every draw)

and after dequantization |q_k / S - x'_k| < 1/S.  Because |x'_k| <= ||x'|| <= C,
every |q_k| <= C S + 1, and the scale is chosen so that a bucket of ``n`` such
words never wraps: n (C S + 1) <= 2^31 - 1.  A sum modulo 2^32 read as a signed
32-bit integer and divided by S is therefore the exact sum of the rounded values.

The rounding stream is public (anyone can reproduce q from x), so the
quantization of a spot-checked worker can be verified; it reveals nothing,
because q itself is only ever sent masked.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from .errors import SecureAggregationError
from .prg import CHUNK, _encryptor, default_threads, run_ranges

__all__ = [
    "MAX_ABS_SUM",
    "clip_factor",
    "dequantize",
    "fixed_point_scale",
    "quantize",
]

#: Largest magnitude a signed 32-bit sum may reach.
MAX_ABS_SUM = 2**31 - 1


def fixed_point_scale(clip_norm: float, bucket_size: int) -> float:
    """The largest power of two S with ``bucket_size * (clip_norm * S + 1) <= 2^31 - 1``.

    Resolution of one coordinate is 1/S, about ``clip_norm * bucket_size / 2^31``.
    """
    if not (isinstance(clip_norm, int | float) and math.isfinite(clip_norm) and clip_norm > 0):
        raise SecureAggregationError(
            f"clip_norm must be a positive finite number, got {clip_norm!r}"
        )
    if not isinstance(bucket_size, int) or isinstance(bucket_size, bool) or bucket_size < 1:
        raise SecureAggregationError(f"bucket_size must be a positive int, got {bucket_size!r}")
    room = MAX_ABS_SUM / bucket_size - 1
    if room <= 0:
        raise SecureAggregationError(f"bucket_size {bucket_size} leaves no room in 32 bits")
    e = math.floor(math.log2(room / clip_norm))
    scale = math.ldexp(1.0, e)
    while bucket_size * (clip_norm * scale + 1) > MAX_ABS_SUM:  # guard log2 rounding
        scale /= 2
    if scale * clip_norm < 1:
        raise SecureAggregationError(
            f"bucket_size {bucket_size} is too large for 32-bit fixed point (resolution >= clip_norm)"
        )
    return scale


def clip_factor(update: Tensor, clip_norm: float, *, threads: int | None = None) -> float:
    """min(1, C / ||x||) (1 for the zero vector).

    ||x||^2 = fsum_k (x_k . x_k) over fixed CHUNK-sized pieces x_k, each dot in
    float64: correctly rounded over the pieces, so the same whatever the
    thread count.
    """
    x = _as_float_array(update)
    starts = list(range(0, x.shape[0], CHUNK))
    partial = [0.0] * len(starts)

    def work(a: int, b: int) -> None:
        for k in range(a, b):
            c = x[starts[k] : starts[k] + CHUNK].astype(np.float64)
            partial[k] = float(np.dot(c, c))

    n_threads = max(1, min(threads or default_threads(), len(starts)))
    step = -(-len(starts) // n_threads)
    if n_threads == 1:
        work(0, len(starts))
    else:
        with ThreadPoolExecutor(n_threads) as pool:
            futs = [
                pool.submit(work, a, min(len(starts), a + step))
                for a in range(0, len(starts), step)
            ]
            for f in futs:
                f.result()
    sq = math.fsum(partial)
    if not math.isfinite(sq):
        raise SecureAggregationError("update contains NaN or Inf; it cannot be quantized")
    norm = math.sqrt(sq)
    return 1.0 if norm <= clip_norm else clip_norm / norm


def _as_float_array(update: Tensor) -> np.ndarray:
    if not isinstance(update, Tensor) or update.ndim != 1:
        raise SecureAggregationError("update must be a 1-D torch tensor")
    if update.dtype not in (torch.float32, torch.float64):
        raise SecureAggregationError(f"update must be float32 or float64, got {update.dtype}")
    return update.detach().to("cpu").contiguous().numpy()


def quantize(
    update: Tensor,
    *,
    clip_norm: float,
    scale: float,
    rounding_key: bytes,
    threads: int | None = None,
) -> np.ndarray:
    """Clip ``update`` to norm ``clip_norm`` and encode it as uint32 words; see the module docstring.

    Deterministic given (update, clip_norm, scale, rounding_key), whatever ``threads``.
    """
    x = _as_float_array(update)
    if not (math.isfinite(scale) and scale > 0):
        raise SecureAggregationError(f"scale must be positive and finite, got {scale!r}")
    factor = clip_factor(update, clip_norm, threads=threads) * scale
    n = x.shape[0]
    out = np.empty(n, dtype=np.uint32)

    def work(a: int, b: int) -> None:
        # uint16 k lives at byte 2k: block-aligned because a is a multiple of 32 words.
        enc = _encryptor(rounding_key, (2 * a) // 64)
        buf = np.empty(2 * CHUNK, dtype=np.uint8)
        zeros = np.zeros(2 * CHUNK, dtype=np.uint8)
        for s in range(a, b, CHUNK):
            e = min(b, s + CHUNK)
            enc.update_into(zeros[: 2 * (e - s)], buf)
            u = buf[: 2 * (e - s)].view("<u2")
            y = np.multiply(x[s:e], factor, dtype=np.float64)
            fl = np.floor(y)
            np.subtract(y, fl, out=y)  # the fraction, in [0, 1)
            np.multiply(y, 65536.0, out=y)
            np.add(fl, u < y, out=fl)  # round up with probability ~ fraction
            out[s:e] = fl.astype(np.int64)  # assignment wraps: q mod 2^32

    run_ranges(n, threads or default_threads(), work)
    return out


def dequantize(words: np.ndarray, scale: float) -> Tensor:
    """Read uint32 words as signed 32-bit integers and divide by S: a float64 tensor."""
    if not isinstance(words, np.ndarray) or words.dtype != np.uint32 or words.ndim != 1:
        raise SecureAggregationError("words must be a 1-D uint32 numpy array")
    return torch.from_numpy(words.view(np.int32).astype(np.float64) / scale)
