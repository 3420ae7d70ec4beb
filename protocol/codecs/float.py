"""Dense floating-point codecs: fp32 (identity), fp16 and bf16.

Bodies are ``numel`` little-endian values. fp16 and bf16 round to nearest
even and saturate finite inputs beyond their range to the largest finite
value, so a finite update never encodes to Inf. Decoding refuses any NaN or
Inf bit pattern.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import NonFiniteError
from .base import BaseCodec, ParamValue

__all__ = ["Bf16Codec", "Fp16Codec", "Fp32Codec"]

FP16_MAX = 65504.0
#: Largest finite bfloat16 (bit pattern 0x7F7F), exactly representable in float32.
BF16_MAX = float(np.array([0x7F7F0000], dtype=np.uint32).view(np.float32)[0])


def _to_tensor(arr: np.ndarray) -> torch.Tensor:
    """A float32 tensor owning writable memory (arrays over received bytes are read-only)."""
    out = np.ascontiguousarray(arr, dtype=np.float32)
    return torch.from_numpy(out if out.flags.writeable else out.copy())


class Fp32Codec(BaseCodec):
    """Identity: the raw float32 vector (the uncompressed baseline)."""

    name = "fp32"
    codec_id = 1

    def params(self) -> dict[str, ParamValue]:
        return {}

    def region_unit(self) -> int:
        return 1  # every value on its own

    def body_size(self, numel: int) -> int:
        return 4 * numel

    def _encode_body(self, x: torch.Tensor, seed: int) -> bytes:
        return x.numpy().astype("<f4", copy=False).tobytes()

    def _decode_body(self, body: memoryview, numel: int, seed: int) -> torch.Tensor:
        bits = np.frombuffer(body, dtype="<u4")
        if bool(((bits & 0x7F800000) == 0x7F800000).any()):
            raise NonFiniteError("fp32 payload holds NaN or Inf")
        return _to_tensor(bits.view("<f4"))


class Fp16Codec(BaseCodec):
    """IEEE half precision; inputs saturate to +-65504."""

    name = "fp16"
    codec_id = 2

    def params(self) -> dict[str, ParamValue]:
        return {}

    def region_unit(self) -> int:
        return 1  # every value on its own

    def body_size(self, numel: int) -> int:
        return 2 * numel

    def _encode_body(self, x: torch.Tensor, seed: int) -> bytes:
        clipped = np.clip(x.numpy(), -FP16_MAX, FP16_MAX)
        return clipped.astype("<f2").tobytes()

    def _decode_body(self, body: memoryview, numel: int, seed: int) -> torch.Tensor:
        bits = np.frombuffer(body, dtype="<u2")
        if bool(((bits & 0x7C00) == 0x7C00).any()):
            raise NonFiniteError("fp16 payload holds NaN or Inf")
        return _to_tensor(bits.view("<f2").astype(np.float32))


class Bf16Codec(BaseCodec):
    """bfloat16: the top 16 bits of float32 after round-to-nearest-even."""

    name = "bf16"
    codec_id = 3

    def params(self) -> dict[str, ParamValue]:
        return {}

    def region_unit(self) -> int:
        return 1  # every value on its own

    def body_size(self, numel: int) -> int:
        return 2 * numel

    def _encode_body(self, x: torch.Tensor, seed: int) -> bytes:
        clipped = np.clip(x.numpy(), -BF16_MAX, BF16_MAX).astype(np.float32)
        b = clipped.view(np.uint32)
        # round to nearest, ties to even, on the 16 dropped bits; cannot carry into Inf after clipping
        rounded = (b + (np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
        return rounded.astype("<u2").tobytes()

    def _decode_body(self, body: memoryview, numel: int, seed: int) -> torch.Tensor:
        bits = np.frombuffer(body, dtype="<u2")
        if bool(((bits & 0x7F80) == 0x7F80).any()):
            raise NonFiniteError("bf16 payload holds NaN or Inf")
        return _to_tensor((bits.astype(np.uint32) << np.uint32(16)).view(np.float32))
