"""Shared machinery of the sparse codecs (topk, cocktail).

A sparse body describes ``rows`` chunks, each with exactly ``k`` selected
positions among ``width`` candidates::

    scales   rows * n_scales float32 (little-endian), row-major
    indices  rows * k values of index_bits bits (bitpack stream), each row
             strictly increasing and < width
    codes    rows * k values of value_bits bits (bitpack stream)

Value codes (``b = value_bits``, ``L = 2^(b-1)`` magnitude levels): the top
bit of a code is the sign (1 = negative), the low ``b - 1`` bits a level
``j``. With ``b = 1`` a row has one scale ``m`` (the mean magnitude of its
selected values) and values ``+-m``. With ``b >= 2`` a row has two scales
``lo <= hi`` (the smallest and largest selected magnitude) and values
``+-(lo + j * d)`` with ``d = (hi - lo) / (L - 1)``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import PayloadError
from .base import check_f32_scales
from .bitpack import pack_bits, packed_size, unpack_bits

__all__ = [
    "SparseLayout",
    "dequantize",
    "index_bits",
    "level_scales",
    "ordered_mean",
    "pairwise_row_sums",
    "quantize",
    "select_topk",
    "split_codes",
]

MAX_VALUE_BITS = 8


def index_bits(width: int) -> int:
    """Bits per index: ceil(log2(width)), at least 1."""
    return max(1, (width - 1).bit_length())


def select_topk(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the positions of the ``k`` largest entries, ascending; ties go to the lower index.

    The chosen set is a function of the values alone, whatever algorithm
    ``torch.topk`` uses: the k+1 largest are found; where the k-th is strictly
    above the (k+1)-th the top k are unambiguous, otherwise (a tie at the
    boundary) every entry above the k-th value is taken and equal entries
    fill the rest in index order.
    """
    rows, width = mag.shape
    if k >= width:
        return torch.arange(width).expand(rows, width).clone()
    vals, idx = torch.topk(mag, k + 1, dim=1, sorted=False)
    order = torch.argsort(vals, dim=1, descending=True, stable=True)
    vals = vals.gather(1, order)
    chosen = idx.gather(1, order)[:, :k].sort(dim=1).values
    tied = (vals[:, k - 1] == vals[:, k]).nonzero().reshape(-1)
    if tied.numel():
        m = mag[tied]
        t = vals[tied, k - 1 : k]
        above = m > t
        equal = m == t
        need = k - above.sum(dim=1, keepdim=True)
        keep = above | (equal & (equal.cumsum(dim=1) <= need))
        chosen[tied] = keep.nonzero()[:, 1].reshape(-1, k)
    return chosen


def pairwise_row_sums(values: np.ndarray) -> np.ndarray:
    """Row sums in float64 by a fixed pairwise tree (rows zero-padded to a power of two,
    then ``acc[2i] + acc[2i+1]`` level by level): the same bits on every machine."""
    rows, k = values.shape
    width = 1 << max(0, (k - 1).bit_length())
    acc = np.zeros((rows, width), dtype=np.float64)
    acc[:, :k] = values
    while acc.shape[1] > 1:
        acc = acc[:, 0::2] + acc[:, 1::2]
    return acc[:, 0]


def ordered_mean(values: np.ndarray) -> np.ndarray:
    """Row means in float64 by :func:`pairwise_row_sums`, rounded to float32."""
    return (pairwise_row_sums(values) / np.float64(values.shape[1])).astype(np.float32)


def quantize(values: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 (rows, k) -> codes uint8 (rows, k) and scales float32 (rows, 1 or 2)."""
    neg = (values < 0).astype(np.uint8)
    mag = np.abs(values).astype(np.float32)
    if bits == 1:
        return neg, ordered_mean(mag)[:, None]
    levels = 1 << (bits - 1)
    lo = mag.min(axis=1, keepdims=True)
    hi = mag.max(axis=1, keepdims=True)
    step = (hi - lo) / np.float32(levels - 1)
    j = np.zeros_like(mag)
    np.divide(mag - lo, step, out=j, where=step > 0)
    j = np.clip(np.rint(j), 0, levels - 1).astype(np.uint8)
    codes = (neg << np.uint8(bits - 1)) | j
    return codes, np.concatenate([lo, hi], axis=1).astype(np.float32)


def split_codes(codes: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes -> (negative flags bool, levels int)."""
    neg = (codes >> (bits - 1)) & 1
    level = codes & ((1 << (bits - 1)) - 1)
    return neg.astype(bool), level


def level_scales(scales: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row (base, step) float32 with magnitude = base + level * step."""
    if bits == 1:
        return scales[:, :1], np.zeros_like(scales[:, :1])
    levels = 1 << (bits - 1)
    lo, hi = scales[:, :1], scales[:, 1:2]
    return lo, (hi - lo) / np.float32(levels - 1)


def dequantize(codes: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`quantize`: float32 (rows, k)."""
    neg, level = split_codes(codes, bits)
    base, step = level_scales(scales, bits)
    with np.errstate(over="ignore"):  # overflow to Inf is refused by the caller
        mag = base + level.astype(np.float32) * step
    return np.where(neg, -mag, mag).astype(np.float32)


class SparseLayout:
    """Sizes and (de)serialisation of a sparse body: rows x k picks among ``width``."""

    def __init__(self, rows: int, k: int, width: int, value_bits: int) -> None:
        self.rows = rows
        self.k = k
        self.width = width
        self.value_bits = value_bits
        self.index_bits = index_bits(width)
        self.n_scales = 1 if value_bits == 1 else 2

    @property
    def scales_size(self) -> int:
        return 4 * self.rows * self.n_scales

    @property
    def indices_size(self) -> int:
        return packed_size(self.rows * self.k, self.index_bits)

    @property
    def codes_size(self) -> int:
        return packed_size(self.rows * self.k, self.value_bits)

    @property
    def size(self) -> int:
        return self.scales_size + self.indices_size + self.codes_size

    def pack(self, idx: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> bytes:
        return (
            scales.astype("<f4").tobytes()
            + pack_bits(idx, self.index_bits)
            + pack_bits(codes, self.value_bits)
        )

    def unpack(self, body: memoryview, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Parse and check a body of exactly ``size`` bytes -> (idx int64, codes, scales)."""
        a = self.scales_size
        b = a + self.indices_size
        scale_bits = np.frombuffer(body[:a], dtype="<u4")
        check_f32_scales(scale_bits, f"{what} scales")
        scales = scale_bits.view("<f4").astype(np.float32).reshape(self.rows, self.n_scales)
        if self.n_scales == 2 and bool((scales[:, 0] > scales[:, 1]).any()):
            raise PayloadError(f"{what} scales: lo exceeds hi")
        idx = unpack_bits(body[a:b], self.index_bits, self.rows * self.k).astype(np.int64)
        idx = idx.reshape(self.rows, self.k)
        if bool((idx >= self.width).any()):
            raise PayloadError(f"{what} index out of range (>= {self.width})")
        if self.k > 1 and bool((np.diff(idx, axis=1) <= 0).any()):
            raise PayloadError(
                f"{what} indices in a chunk must be strictly increasing (duplicate or unsorted)"
            )
        codes = unpack_bits(body[b:], self.value_bits, self.rows * self.k).reshape(
            self.rows, self.k
        )
        return idx, codes.astype(np.uint8), scales
