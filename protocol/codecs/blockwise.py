"""Blockwise absmax quantisation: int8 and int4 with one float32 scale per block.

The vector is cut into ``ceil(numel / block)`` blocks (the last one may be
short). For block ``b``: ``scale_b = max|x| / qmax`` (float32), and each
element becomes ``q = clip(rint(x / scale_b), -qmax, qmax)`` (``q = 0`` where
``scale_b = 0``). Decoding gives ``q * scale_b``, so the error per element is
at most ``scale_b / 2``.

Body: ``n_blocks`` float32 scales (little-endian), then the codes: int8 as
one two's-complement byte each (-128 is refused), int4 as 4-bit fields
``q + 8`` packed low nibble first (the field 0 is refused).
"""

from __future__ import annotations

from abc import abstractmethod

import numpy as np
import torch

from ..errors import PayloadError
from .base import BaseCodec, ParamValue, check_f32_scales
from .bitpack import pack_bits, packed_size, unpack_bits
from .topk import check_int_param

__all__ = ["BlockwiseCodec", "Int4Codec", "Int8Codec", "ScaledBlocksCodec"]

MAX_BLOCK = 1 << 20


class ScaledBlocksCodec(BaseCodec):
    """Body layout shared by codecs with one float32 scale per ``block`` values followed by
    ``bits``-bit codes (int8, int4, lloyd)."""

    bits: int
    block: int

    def n_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def region_unit(self) -> int:
        return self.block  # one scale and its codes per block

    def body_size(self, numel: int) -> int:
        return 4 * self.n_blocks(numel) + packed_size(numel, self.bits)

    def _blocks(self, values: np.ndarray) -> np.ndarray:
        """``values`` zero-padded to whole blocks, shape (n_blocks, block)."""
        nb = self.n_blocks(values.size)
        if values.size == nb * self.block:
            return values.reshape(nb, self.block)
        padded = np.zeros(nb * self.block, dtype=values.dtype)
        padded[: values.size] = values
        return padded.reshape(nb, self.block)


class BlockwiseCodec(ScaledBlocksCodec):
    """Absmax codes; subclasses fix ``bits`` and ``qmax``."""

    qmax: int

    def __init__(self, *, block: int = 64) -> None:
        self.block = check_int_param(self.name, "block", block, 1, MAX_BLOCK)

    def params(self) -> dict[str, ParamValue]:
        return {"block": self.block}

    def _encode_body(self, x: torch.Tensor, seed: int) -> bytes:
        blocks = self._blocks(x.numpy())
        # max |x| per block from the row extremes: no |x| temporary of the vector's size
        absmax = np.maximum(blocks.max(axis=1), -blocks.min(axis=1))
        # An all-zero block gives -0.0 (the negation of its minimum 0.0); adding +0.0 makes
        # it +0.0, the only zero scale a decoder accepts (a set sign bit is refused).
        scales = (absmax / np.float32(self.qmax)).astype(np.float32) + np.float32(0.0)
        q = np.zeros(blocks.shape, dtype=np.float32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            np.divide(blocks, scales[:, None], out=q, where=scales[:, None] > 0)
        q = np.clip(np.rint(q, out=q), -self.qmax, self.qmax, out=q).astype(np.int8)
        return scales.astype("<f4").tobytes() + self._pack_codes(q.reshape(-1)[: x.numel()])

    def _decode_body(self, body: memoryview, numel: int, seed: int) -> torch.Tensor:
        nb = self.n_blocks(numel)
        scale_bits = np.frombuffer(body[: 4 * nb], dtype="<u4")
        check_f32_scales(scale_bits, f"{self.name} scales")
        scales = scale_bits.view("<f4").astype(np.float32)
        q = self._blocks(self._unpack_codes(body[4 * nb :], numel))
        out = q.astype(np.float32)
        with np.errstate(over="ignore"):  # overflow to Inf is caught as NonFiniteError by decode()
            out *= scales[:, None]  # in place: one float32 vector, not two
        return torch.from_numpy(
            out.reshape(-1)[:numel].copy() if nb * self.block != numel else out.reshape(-1)
        )

    @abstractmethod
    def _pack_codes(self, q: np.ndarray) -> bytes:
        """Integer codes [blocks, block] to their packed bytes."""

    @abstractmethod
    def _unpack_codes(self, data: memoryview, numel: int) -> np.ndarray:
        """Packed bytes back to integer codes."""


class Int8Codec(BlockwiseCodec):
    """8-bit symmetric codes in [-127, 127], a float32 scale per block."""

    name = "int8"
    codec_id = 4
    bits = 8
    qmax = 127

    def _pack_codes(self, q: np.ndarray) -> bytes:
        return q.astype(np.int8).tobytes()

    def _unpack_codes(self, data: memoryview, numel: int) -> np.ndarray:
        q = np.frombuffer(data, dtype=np.int8)
        if bool((q == -128).any()):
            raise PayloadError("int8 code -128 is outside [-127, 127]")
        return q


class Int4Codec(BlockwiseCodec):
    """4-bit symmetric codes in [-7, 7] stored as q + 8, a float32 scale per block."""

    name = "int4"
    codec_id = 5
    bits = 4
    qmax = 7

    def _pack_codes(self, q: np.ndarray) -> bytes:
        return pack_bits(q.astype(np.int16) + 8, 4)

    def _unpack_codes(self, data: memoryview, numel: int) -> np.ndarray:
        fields = unpack_bits(data, 4, numel)
        if not bool(fields.all()):
            raise PayloadError("int4 field 0 (code -8) is outside [-7, 7]")
        return fields.view(np.int8) - np.int8(8)
