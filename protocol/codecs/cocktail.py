"""CocktailSGD-style: seeded random subset, then top-k, then low-bit values.

The vector is zero-padded to ``rows`` chunks of ``chunk`` elements; each chunk
is cut into ``width = chunk / sample`` strata of ``sample`` consecutive
elements and one element per stratum is drawn from the seed (stratified
sampling: a random subset of ``1/sample`` of the coordinates that is spread
evenly and needs no transmitted indices). Stratum ``g`` (global, row-major)
contributes position ``g * sample + r_g`` with

    key = mix64(seed + G)            (mod 2^64)
    r_g = mix64(key + (g + 1) * G) mod sample

where ``G = 0x9E3779B97F4A7C15`` and ``mix64`` is the SplitMix64 finaliser.
Among the ``width`` sampled values of a chunk the ``k`` largest in magnitude
are kept; their positions within the sample use ``ceil(log2(width))`` bits.
Body layout as in :mod:`.sparse`; the header records the seed.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import BaseCodec, ParamValue
from .sparse import MAX_VALUE_BITS, SparseLayout, dequantize, quantize, select_topk
from .topk import MAX_CHUNK, check_int_param, pad_rows

__all__ = ["CocktailCodec", "mix64", "sample_positions"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def sample_positions(seed: int, strata: int, sample: int) -> np.ndarray:
    """Global positions (int64, ascending) of one seeded pick per stratum of ``sample`` elements."""
    with np.errstate(over="ignore"):
        key = mix64(np.array([seed], dtype=np.uint64) + _GOLDEN)
        g = np.arange(strata, dtype=np.uint64)
        r = mix64(key + (g + np.uint64(1)) * _GOLDEN) % np.uint64(sample)
    return np.arange(strata, dtype=np.int64) * sample + r.astype(np.int64)


class CocktailCodec(BaseCodec):
    """Random subset (1 in ``sample``), top-``k`` of it per chunk, ``value_bits`` values."""

    name = "cocktail"
    codec_id = 7
    uses_seed = True

    def __init__(
        self, *, chunk: int = 4096, sample: int = 8, k: int = 96, value_bits: int = 4
    ) -> None:
        self.chunk = check_int_param(self.name, "chunk", chunk, 2, MAX_CHUNK)
        self.sample = check_int_param(self.name, "sample", sample, 1, chunk)
        if chunk % sample:
            raise ValueError(f"{self.name}: sample {sample} must divide chunk {chunk}")
        self.width = chunk // sample
        if self.width < 2:
            raise ValueError(f"{self.name}: chunk / sample must be at least 2, got {self.width}")
        self.k = check_int_param(self.name, "k", k, 1, self.width)
        self.value_bits = check_int_param(self.name, "value_bits", value_bits, 1, MAX_VALUE_BITS)

    def region_unit(self) -> int:
        return self.chunk  # its own k values, positions and scales per chunk

    def params(self) -> dict[str, ParamValue]:
        return {
            "chunk": self.chunk,
            "k": self.k,
            "sample": self.sample,
            "value_bits": self.value_bits,
        }

    def layout(self, numel: int) -> SparseLayout:
        return SparseLayout(-(-numel // self.chunk), self.k, self.width, self.value_bits)

    def body_size(self, numel: int) -> int:
        return self.layout(numel).size

    def _positions(self, rows: int, seed: int) -> torch.Tensor:
        return torch.from_numpy(sample_positions(seed, rows * self.width, self.sample))

    def _encode_body(self, x: torch.Tensor, seed: int) -> bytes:
        lay = self.layout(x.numel())
        flat = pad_rows(x, lay.rows, self.chunk).view(-1)
        sub = flat[self._positions(lay.rows, seed)].view(lay.rows, self.width)
        idx = select_topk(sub.abs(), self.k)
        codes, scales = quantize(sub.gather(1, idx).numpy(), self.value_bits)
        return lay.pack(idx.numpy(), codes, scales)

    def _decode_body(self, body: memoryview, numel: int, seed: int) -> torch.Tensor:
        lay = self.layout(numel)
        idx, codes, scales = lay.unpack(body, self.name)
        sub = torch.zeros(lay.rows, self.width, dtype=torch.float32)
        sub.scatter_(
            1, torch.from_numpy(idx), torch.from_numpy(dequantize(codes, scales, self.value_bits))
        )
        out = torch.zeros(lay.rows * self.chunk, dtype=torch.float32)
        out[self._positions(lay.rows, seed)] = sub.view(-1)
        return out[:numel].clone()
