"""Chunked top-k with low-bit values, optionally in a DCT domain (DeMo / Templar family).

The vector is zero-padded to ``rows = ceil(numel / chunk)`` chunks of
``chunk`` elements. With ``dct_block = 0`` the candidates are the elements
themselves; otherwise each chunk is transformed by the exact integer DCT-II
of :mod:`.dct` over consecutive blocks of ``dct_block`` elements and the
candidates are the coefficients. In each chunk the ``k`` candidates of
largest magnitude are kept (ties to the lower index), their positions sent
with ``ceil(log2(chunk))`` bits each and their values with ``value_bits``
bits (see :mod:`.sparse`). Everything else decodes to zero; decoded values at
padding positions are dropped.
"""

from __future__ import annotations

import numpy as np
import torch

from .base import BaseCodec, ParamValue
from .dct import INPUT_BITS as _INPUT_BITS
from .dct import MAX_DCT_BLOCK, int_basis, to_fixed, transform_norm
from .sparse import (
    MAX_VALUE_BITS,
    SparseLayout,
    dequantize,
    level_scales,
    quantize,
    select_topk,
    split_codes,
)

__all__ = ["MAX_CHUNK", "TopKCodec", "check_int_param"]

MAX_CHUNK = 1 << 20


def check_int_param(codec: str, name: str, value: object, lo: int, hi: int) -> int:
    """An int parameter (bool refused) within [lo, hi], or a clear ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{codec}: {name} must be an int in [{lo}, {hi}], got {value!r}")
    return value


def pad_rows(x: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``x`` zero-padded to ``rows * width`` elements, viewed as (rows, width)."""
    padded = torch.zeros(rows * width, dtype=torch.float32)
    padded[: x.numel()] = x
    return padded.view(rows, width)


class TopKCodec(BaseCodec):
    """Keep the k largest (coefficients) per chunk; see the module docstring."""

    name = "topk"
    codec_id = 6

    def __init__(
        self, *, chunk: int = 4096, k: int = 64, value_bits: int = 1, dct_block: int = 0
    ) -> None:
        self.chunk = check_int_param(self.name, "chunk", chunk, 2, MAX_CHUNK)
        self.k = check_int_param(self.name, "k", k, 1, chunk)
        self.value_bits = check_int_param(self.name, "value_bits", value_bits, 1, MAX_VALUE_BITS)
        self.dct_block = check_int_param(
            self.name, "dct_block", dct_block, 0, min(chunk, MAX_DCT_BLOCK)
        )
        if dct_block and (dct_block < 2 or chunk % dct_block):
            raise ValueError(
                f"{self.name}: dct_block {dct_block} must be 0 or >= 2 and divide chunk {chunk}"
            )

    def region_unit(self) -> int:
        return self.chunk  # its own k values, positions and scales per chunk

    def params(self) -> dict[str, ParamValue]:
        return {
            "chunk": self.chunk,
            "dct_block": self.dct_block,
            "k": self.k,
            "value_bits": self.value_bits,
        }

    def layout(self, numel: int) -> SparseLayout:
        return SparseLayout(-(-numel // self.chunk), self.k, self.chunk, self.value_bits)

    def body_size(self, numel: int) -> int:
        return self.layout(numel).size

    # -- encode --------------------------------------------------------------

    def _encode_body(self, x: torch.Tensor, seed: int) -> bytes:
        lay = self.layout(x.numel())
        chunks = pad_rows(x, lay.rows, self.chunk)
        if self.dct_block:
            idx, vals = self._pick_dct(chunks)
        else:
            idx = select_topk(chunks.abs(), self.k)
            vals = chunks.gather(1, idx).numpy()
        codes, scales = quantize(vals, self.value_bits)
        return lay.pack(idx.numpy(), codes, scales)

    def _pick_dct(self, chunks: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
        n = self.dct_block
        xi, exps = to_fixed(chunks)
        coef_int = (xi.view(-1, n) @ int_basis(n).T).view(chunks.shape)  # exact integers
        idx = select_topk(coef_int.abs(), self.k)
        picked = coef_int.gather(1, idx).numpy()
        # real coefficient = Y * 2^(e - INPUT_BITS - BASIS_BITS) / sqrt(n/2): one exact, one rounded product
        row_scale = np.ldexp(1.0, exps - _INPUT_BITS)[:, None]
        vals = (picked * row_scale) * (1.0 / transform_norm(n))
        return idx, vals.astype(np.float32)

    # -- decode --------------------------------------------------------------

    def _decode_body(self, body: memoryview, numel: int, seed: int) -> torch.Tensor:
        lay = self.layout(numel)
        idx, codes, scales = lay.unpack(body, self.name)
        idx_t = torch.from_numpy(idx)
        if self.dct_block:
            out = self._inverse_dct(idx_t, codes, scales, lay.rows)
        else:
            out = torch.zeros(lay.rows, self.chunk, dtype=torch.float32)
            out.scatter_(1, idx_t, torch.from_numpy(dequantize(codes, scales, self.value_bits)))
        return out.view(-1)[:numel].clone()

    def _inverse_dct(
        self, idx: torch.Tensor, codes: np.ndarray, scales: np.ndarray, rows: int
    ) -> torch.Tensor:
        """x = (base * B^T(sign) + step * B^T(sign * level)) / norm, integer sums exact."""
        n = self.dct_block
        neg, level = split_codes(codes, self.value_bits)
        sign = np.where(neg, -1.0, 1.0)
        z = torch.zeros(2, rows, self.chunk, dtype=torch.float64)
        z[0].scatter_(1, idx, torch.from_numpy(sign))
        z[1].scatter_(1, idx, torch.from_numpy(sign * level.astype(np.float64)))
        s = (z.view(-1, n) @ int_basis(n)).view(2, rows, self.chunk)
        base, step = level_scales(scales, self.value_bits)
        base_t = torch.from_numpy(base.astype(np.float64))
        step_t = torch.from_numpy(step.astype(np.float64))
        with torch.no_grad():
            x = (base_t * s[0] + step_t * s[1]) * (1.0 / transform_norm(n))
        return x.to(torch.float32)
