"""Vectorised packing of unsigned integers into a little-endian bit stream.

Value ``i`` of ``bits`` bits occupies stream bits ``[i*bits, (i+1)*bits)``,
least significant bit first; stream bit ``j`` is bit ``j % 8`` of byte
``j // 8``. The stream is padded with zero bits to a whole byte, and the
unpacker refuses non-zero padding, so every value sequence has exactly one
encoding.
"""

from __future__ import annotations

import numpy as np

from ..errors import PayloadError

__all__ = ["MAX_BITS", "pack_bits", "packed_size", "unpack_bits"]

MAX_BITS = 32
#: Values handled per slice on the generic path (a multiple of 8, so each slice is whole bytes).
_SLICE = 1 << 16


def packed_size(count: int, bits: int) -> int:
    """Bytes taken by ``count`` values of ``bits`` bits."""
    return (count * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bit width {bits} outside [1, {MAX_BITS}]")


def pack_bits(values: np.ndarray, bits: int) -> bytes:
    """Pack non-negative integers below ``2**bits`` (any integer dtype) into bytes."""
    _check_bits(bits)
    v = np.ascontiguousarray(values).reshape(-1)
    if v.size == 0:
        return b""
    if int(v.min()) < 0 or int(v.max()) >= (1 << bits):
        raise ValueError(f"values do not fit in {bits} bits")
    if bits == 8:
        return v.astype(np.uint8).tobytes()
    if bits in (16, 32):
        return v.astype(f"<u{bits // 8}").tobytes()
    if bits in (1, 2, 4):
        per = 8 // bits
        padded = np.zeros(-(-v.size // per) * per, dtype=np.uint8)
        padded[: v.size] = v
        out = padded[0::per].copy()
        for s in range(1, per):
            out |= padded[s::per] << np.uint8(s * bits)
        return out.tobytes()
    if bits < 8:  # eight values fill ``bits`` bytes: or them into one little-endian word
        groups = -(-v.size // 8)
        wide = np.dtype("<u4") if bits <= 4 else np.dtype("<u8")
        if v.size == groups * 8:
            g = v.reshape(groups, 8)
        else:
            g = np.zeros((groups, 8), dtype=v.dtype)
            g.reshape(-1)[: v.size] = v
        acc = g[:, 0].astype(wide)
        for k in range(1, 8):
            acc |= g[:, k].astype(wide) << wide.type(k * bits)
        out = acc.view(np.uint8).reshape(groups, wide.itemsize)[:, :bits].reshape(-1)
        return out[: packed_size(v.size, bits)].tobytes()
    v32 = v.astype(np.uint32)
    shifts32 = np.arange(bits, dtype=np.uint32)
    parts = []
    for start in range(0, v32.size, _SLICE):
        chunk = v32[start : start + _SLICE]
        bitmat = ((chunk[:, None] >> shifts32) & 1).astype(np.uint8)
        parts.append(np.packbits(bitmat.reshape(-1), bitorder="little"))
    return np.concatenate(parts).tobytes()


def unpack_bits(data: bytes | memoryview, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``count`` values, unsigned.

    The dtype is ``uint8`` for ``bits <= 8``, ``uint16`` for 16, ``uint32``
    for 32 and ``int64`` otherwise.

    ``data`` must be exactly ``packed_size(count, bits)`` bytes with zero
    padding bits; anything else raises :class:`PayloadError`.
    """
    _check_bits(bits)
    raw = np.frombuffer(data, dtype=np.uint8)
    if raw.size != packed_size(count, bits):
        raise PayloadError(f"bit stream of {raw.size} bytes, expected {packed_size(count, bits)}")
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    tail_bits = count * bits % 8
    if tail_bits and int(raw[-1]) >> tail_bits:
        raise PayloadError("bit stream has non-zero padding bits")
    if bits == 8:
        return raw.copy()
    if bits in (16, 32):
        return raw.view(f"<u{bits // 8}").astype(f"u{bits // 8}")
    if bits in (1, 2, 4):
        per = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        vals = np.empty((raw.size, per), dtype=np.uint8)
        for s in range(per):
            np.bitwise_and(raw >> np.uint8(s * bits), mask, out=vals[:, s])
        return vals.reshape(-1)[:count]
    if bits < 8:
        groups = -(-count // 8)
        b8 = np.zeros((groups, 8), dtype=np.uint8)
        flat = np.zeros(groups * bits, dtype=np.uint8)
        flat[: raw.size] = raw
        b8[:, :bits] = flat.reshape(groups, bits)
        acc = b8.view("<u8").reshape(groups)
        mask = np.uint64((1 << bits) - 1)
        vals64 = np.empty((groups, 8), dtype=np.int64)
        for k in range(8):
            vals64[:, k] = (acc >> np.uint64(k * bits)) & mask
        return vals64.reshape(-1)[:count]
    weights = np.left_shift(np.uint32(1), np.arange(bits, dtype=np.uint32))
    out = np.empty(count, dtype=np.int64)
    step_bytes = _SLICE * bits // 8
    for i, start in enumerate(range(0, count, _SLICE)):
        n = min(_SLICE, count - start)
        chunk = raw[i * step_bytes : i * step_bytes + packed_size(n, bits)]
        bitmat = np.unpackbits(chunk, bitorder="little")[: n * bits].reshape(n, bits)
        out[start : start + n] = bitmat.astype(np.uint32) @ weights
    return out
