"""Low-rank (PowerSGD-style) factors of the model's matrices, with low-bit codes.

The run spec gives the parameter layout as the ``layout`` param: ``"model"``
(the shapes of the model the run's task builds, bound by :meth:`LowRankCodec.bind_model`
when the run context is built) or a comma separated list of ``RxC`` (a
row-major matrix) and ``N`` (a vector) entries in flat order; elements after
the listed ones are vectors too. Each matrix ``M``
is sent as ``M ~= P @ X`` with ``P`` of shape ``(R, r)`` and ``X`` of shape
``(r, C)``, ``r = min(rank, R, C)``, found by ``iters`` steps of subspace
iteration; the vectors are sent with blockwise absmax codes.

Everything that reaches the bytes or the decoded vector is exact integer
arithmetic in float64 (matrix products of integers whose partial sums stay
below 2^53, so any BLAS gives the same result), elementwise IEEE operations
or fixed-order scalar loops. Per matrix (all integers are float64-exact):

1. ``e`` with ``max|M| < 2^e``; ``Mi = rint(M * 2^(20 - e))``, so ``|Mi| <= 2^20``.
2. ``Q0[c, j] = +-1`` from SplitMix64 (fixed, not seeded).
3. ``iters`` times: ``P = gs(Mi @ Q)``, and, except after the last,
   ``Q = norm15(Mi^T @ P)``. ``norm15`` scales each column by a power of two
   to ``max|col|`` in ``[2^14, 2^15)`` and rounds; ``gs`` is Gram-Schmidt in
   column order on ``norm15`` columns, rounding after each projection
   (``v = rint(v - (v.u / u.u) * u)``) and applying ``norm15`` at the end.
4. ``P`` codes: ``rint(P[:, j] * qmax / max|P[:, j]|)`` (zero columns stay zero).
5. ``X`` solves ``(P^T P) X = P^T Mi`` by Gaussian elimination in index order
   (a pivot that is not above ``2^-20`` times the largest entry of its row, or
   1, drops that component).
6. ``X`` codes: with ``a_j = max|X[j]|`` and ``A = max_j a_j``, row ``j`` gets
   the exponent ``k_j`` (0..15), the largest with ``a_j <= A * 2^-k_j``, and
   codes ``clip(rint(X[j] * (qmax * 2^k_j) / A), -qmax, qmax)``.
7. ``t = float32(A * 2^(e - 20) / (qmax * 2^15))``.

Decoding: ``Y = Pc @ (Xc * 2^(15 - k))`` (exact integers, below 2^36) and
``M' = float32(Y * t)``.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from functools import lru_cache

import numpy as np
import torch

from ..errors import PayloadError
from .base import MAX_NUMEL, BaseCodec, ParamValue, check_f32_scales
from .bitpack import pack_bits, packed_size, unpack_bits
from .cocktail import mix64
from .topk import check_int_param

__all__ = [
    "MAX_DIM", "MAX_LAYOUT_CHARS", "MAX_RANK", "MODEL_LAYOUT", "LowRankCodec", "layout_for",
    "parse_layout",
]

#: Largest matrix side: 2^17 * 2^20 * 2^15 = 2^52 keeps every product sum exact.
MAX_DIM = 1 << 17
MAX_RANK = 64
MAX_LAYOUT_CHARS = 4000
#: ``layout`` value meaning "the shapes of the run's model" (no length limit, nothing to copy).
MODEL_LAYOUT = "model"
MAX_VEC_BLOCK = 1 << 20
INPUT_BITS = 20
FACTOR_BITS = 15
MAX_SHIFT = 15
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ENTRY = re.compile(r"(?:[1-9][0-9]{0,12})(?:x[1-9][0-9]{0,12})?")


def parse_layout(layout: str) -> tuple[tuple[int, ...], ...]:
    """``"256x128,128"`` -> ``((256, 128), (128,))``; ValueError for anything non-canonical."""
    if not isinstance(layout, str) or len(layout) > MAX_LAYOUT_CHARS:
        raise ValueError(f"lowrank: layout must be a str of at most {MAX_LAYOUT_CHARS} chars")
    if layout == "":
        return ()
    out: list[tuple[int, ...]] = []
    total = 0
    for entry in layout.split(","):
        if not _ENTRY.fullmatch(entry):
            raise ValueError(f"lowrank: bad layout entry {entry!r} (want RxC or N, no zeros)")
        dims = tuple(int(d) for d in entry.split("x"))
        if len(dims) == 2 and max(dims) > MAX_DIM:
            raise ValueError(f"lowrank: matrix {entry} has a side above {MAX_DIM}")
        total += int(np.prod(dims, dtype=object))
        if total > MAX_NUMEL:
            raise ValueError(f"lowrank: layout covers more than {MAX_NUMEL} elements")
        out.append(dims)
    return tuple(out)


def layout_dims_for(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[tuple[int, ...], ...]:
    """The parsed layout of a model's ``param_shapes`` (in flat order).

    2-D tensors are matrices, tensors of higher rank are matrices of their
    first dimension by the rest; everything else (and any matrix with a side
    above :data:`MAX_DIM`) is a vector, and consecutive vectors are merged.
    """
    dims: list[tuple[int, ...]] = []
    pending = 0
    for _, shape in shapes:
        size = int(np.prod(shape, dtype=object)) if shape else 1
        rows = shape[0] if len(shape) >= 2 else 0
        cols = size // rows if rows else 0
        if len(shape) >= 2 and 0 < rows <= MAX_DIM and 0 < cols <= MAX_DIM:
            if pending:
                dims.append((pending,))
                pending = 0
            dims.append((rows, cols))
        else:
            pending += size
    if pending:
        dims.append((pending,))
    return tuple(dims)


def layout_for(shapes: Sequence[tuple[str, tuple[int, ...]]]) -> str:
    """The explicit ``layout`` param for a model's ``param_shapes``: :func:`layout_dims_for`
    written out (``"model"`` says the same without the length limit)."""
    return ",".join("x".join(str(d) for d in dims) for dims in layout_dims_for(shapes))


Plan = tuple[tuple[tuple[int, int, int, int], ...], tuple[tuple[int, int], ...], int]


@lru_cache(maxsize=64)
def _plan(layout: tuple[tuple[int, ...], ...], rank: int, numel: int) -> Plan:
    """(matrices as (offset, R, C, r), vector runs as (offset, length), vector elements).

    Allocates nothing sized by ``numel``: sizes are known before a payload is read.
    """
    mats: list[tuple[int, int, int, int]] = []
    vec_parts: list[tuple[int, int]] = []
    off = 0
    for dims in layout:
        size = int(np.prod(dims))
        if off + size > numel:
            raise ValueError(f"lowrank: layout covers more than numel {numel} elements")
        if len(dims) == 2:
            mats.append((off, dims[0], dims[1], min(rank, dims[0], dims[1])))
        else:
            vec_parts.append((off, size))
        off += size
    if off < numel:
        vec_parts.append((off, numel - off))
    return tuple(mats), tuple(vec_parts), sum(n for _, n in vec_parts)


def _vec_positions(vec_parts: tuple[tuple[int, int], ...], numel: int) -> np.ndarray | None:
    """Flat positions of the vector elements, or None when they are the whole vector."""
    if len(vec_parts) == 1 and vec_parts[0] == (0, numel):
        return None
    if not vec_parts:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(o, o + n, dtype=np.int64) for o, n in vec_parts])


def _norm15(a: np.ndarray) -> np.ndarray:
    """Scale each column by a power of two so max|col| is in [2^14, 2^15), then rint."""
    amax = np.abs(a).max(axis=0)
    _, exps = np.frexp(amax)
    return np.rint(a * np.ldexp(1.0, FACTOR_BITS - exps.astype(np.int64))[None, :])


def _gram_schmidt(p: np.ndarray) -> np.ndarray:
    """Column-order Gram-Schmidt on integer columns, exact dot products, rounded steps."""
    cols = _norm15(p)
    out = np.zeros_like(cols)
    norms: list[float] = []
    for j in range(cols.shape[1]):
        v = cols[:, j].copy()
        for i in range(j):
            if norms[i] > 0.0:
                c = float(v @ out[:, i]) / norms[i]
                v = np.rint(v - c * out[:, i])
        if float(np.abs(v).max()) > 0.0:
            v = _norm15(v[:, None])[:, 0]
        out[:, j] = v
        norms.append(float(v @ v))
    return out


def _start(cols: int, r: int, index: int) -> np.ndarray:
    """Fixed +-1 start vectors (SplitMix64 of the matrix index and position)."""
    n = np.arange(cols * r, dtype=np.uint64) + np.uint64(1) + np.uint64(index) * np.uint64(
        1 << 32)
    with np.errstate(over="ignore"):
        bits = mix64(n * _GOLDEN) >> np.uint64(63)
    return (1.0 - 2.0 * bits.astype(np.float64)).reshape(cols, r)


def _solve(g: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Solve g x = b (g symmetric PSD, r x r) by elimination in index order; singular parts drop."""
    r = g.shape[0]
    g = g.copy()
    b = b.copy()
    keep = [True] * r
    for i in range(r):
        piv = float(g[i, i])
        if not piv > 0.0 or piv <= 2.0**-20 * max(float(np.abs(g[i]).max()), 1.0):
            keep[i] = False
            g[i, :] = 0.0
            g[:, i] = 0.0
            b[i] = 0.0
            continue
        for j in range(i + 1, r):
            f = float(g[j, i]) / piv
            if f != 0.0:
                g[j] = g[j] - f * g[i]
                b[j] = b[j] - f * b[i]
    x = np.zeros_like(b)
    for i in range(r - 1, -1, -1):
        if not keep[i]:
            continue
        acc = b[i].copy()
        for j in range(i + 1, r):
            if keep[j] and float(g[i, j]) != 0.0:
                acc = acc - float(g[i, j]) * x[j]
        x[i] = acc / float(g[i, i])
    return x


class LowRankCodec(BaseCodec):
    """Rank-r factors of each matrix in ``layout``, blockwise codes for the rest."""

    name = "lowrank"
    codec_id = 8

    def __init__(
        self,
        *,
        layout: str = "",
        rank: int = 4,
        bits: int = 4,
        iters: int = 2,
        vec_bits: int = 4,
        vec_block: int = 64,
    ) -> None:
        self.layout = layout
        #: None until :meth:`bind_model` when the layout is :data:`MODEL_LAYOUT`.
        self.layout_dims: tuple[tuple[int, ...], ...] | None = (
            None if layout == MODEL_LAYOUT else parse_layout(layout))
        self.rank = check_int_param(self.name, "rank", rank, 1, MAX_RANK)
        self.bits = check_int_param(self.name, "bits", bits, 2, 8)
        self.iters = check_int_param(self.name, "iters", iters, 1, 8)
        self.vec_bits = check_int_param(self.name, "vec_bits", vec_bits, 2, 8)
        self.vec_block = check_int_param(self.name, "vec_block", vec_block, 1, MAX_VEC_BLOCK)

    def params(self) -> dict[str, ParamValue]:
        return {
            "bits": self.bits,
            "iters": self.iters,
            "layout": self.layout,
            "rank": self.rank,
            "vec_bits": self.vec_bits,
            "vec_block": self.vec_block,
        }

    # -- sizes -----------------------------------------------------------------

    def bind_model(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> LowRankCodec:
        """This codec with a ``"model"`` layout resolved to ``shapes`` (the run's model).
        The params, hence the header digest, still say ``"model"``; an explicit layout
        is kept as it is."""
        if self.layout != MODEL_LAYOUT:
            return self
        bound = copy.copy(self)
        bound.layout_dims = layout_dims_for(shapes)
        return bound

    def _plan(self, numel: int) -> Plan:
        if self.layout_dims is None:
            raise ValueError('lowrank: layout "model" needs the run\'s model shapes '
                             "(bind_model, done when the run context is built)")
        return _plan(self.layout_dims, self.rank, numel)

    def _sections(self, numel: int) -> tuple[int, int, int, int, int]:
        """Byte sizes: scales t, exponents k, factor codes, vector scales, vector codes."""
        mats, _, n_vec = self._plan(numel)
        n_k = sum(r for *_, r in mats)
        n_f = sum(r * (rows + cols) for _, rows, cols, r in mats)
        n_vb = -(-n_vec // self.vec_block)
        return (
            4 * len(mats),
            packed_size(n_k, 4),
            packed_size(n_f, self.bits),
            4 * n_vb,
            packed_size(n_vec, self.vec_bits),
        )

    def body_size(self, numel: int) -> int:
        return sum(self._sections(numel))

    # -- encode ----------------------------------------------------------------

    def _encode_body(self, x: torch.Tensor, seed: int) -> bytes:
        numel = x.numel()
        mats, vec_parts, _ = self._plan(numel)
        vec_pos = _vec_positions(vec_parts, numel)
        flat = x.numpy()
        qmax = (1 << (self.bits - 1)) - 1
        ts: list[float] = []
        ks: list[np.ndarray] = []
        codes: list[np.ndarray] = []
        for index, (off, rows, cols, r) in enumerate(mats):
            m = flat[off : off + rows * cols].reshape(rows, cols)
            t, k, pc, xc = self._factor(m, r, qmax, index)
            ts.append(t)
            ks.append(k)
            codes.extend((pc.reshape(-1), xc.reshape(-1)))
        vec = flat if vec_pos is None else flat[vec_pos]
        v_scales, v_codes = self._encode_vec(vec)
        off_k = np.concatenate(ks) if ks else np.zeros(0, dtype=np.int64)
        fac = (np.concatenate(codes) + qmax + 1) if codes else np.zeros(0, dtype=np.int64)
        return (
            np.asarray(ts, dtype="<f4").tobytes()
            + pack_bits(off_k.astype(np.int64), 4)
            + pack_bits(fac.astype(np.int64), self.bits)
            + v_scales.astype("<f4").tobytes()
            + pack_bits(v_codes, self.vec_bits)
        )

    def _factor(
        self, m: np.ndarray, r: int, qmax: int, index: int
    ) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
        rows, cols = m.shape
        amax = float(np.abs(m).max())
        zero = (0.0, np.zeros(r, dtype=np.int64), np.zeros((rows, r)), np.zeros((r, cols)))
        if amax == 0.0:
            return zero
        _, e = np.frexp(amax)
        mi = np.rint(m.astype(np.float64) * np.ldexp(1.0, INPUT_BITS - int(e)))
        q = _start(cols, r, index)
        for it in range(self.iters):
            p = _gram_schmidt(mi @ q)
            if it < self.iters - 1:
                q = _norm15(mi.T @ p)
        pmax = np.abs(p).max(axis=0)
        pc = np.zeros_like(p)
        np.divide(p * float(qmax), pmax[None, :], out=pc, where=pmax[None, :] > 0)
        pc = np.clip(np.rint(pc), -qmax, qmax)
        xs = _solve(pc.T @ pc, pc.T @ mi)
        a = np.abs(xs).max(axis=1)
        big = float(a.max())
        if not big > 0.0 or not np.isfinite(big):
            return zero
        k = np.zeros(r, dtype=np.int64)
        for j in range(r):
            while k[j] < MAX_SHIFT and float(a[j]) <= big * 2.0 ** -(int(k[j]) + 1):
                k[j] += 1
        mult = (float(qmax) * np.ldexp(1.0, k)).astype(np.float64)
        xc = np.clip(np.rint(xs * mult[:, None] / big), -qmax, qmax)
        t = big * np.ldexp(1.0, int(e) - INPUT_BITS) / (qmax * 2.0**FACTOR_BITS)
        # The decoded matrix is at most r * qmax^2 * 2^15 * t: keep it finite in float32.
        if not r * qmax * qmax * 2.0**FACTOR_BITS * t < float(np.finfo(np.float32).max):
            return zero
        return float(np.float32(t)), k, pc, xc

    def _encode_vec(self, vec: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        qmax = (1 << (self.vec_bits - 1)) - 1
        n = vec.size
        if n == 0:
            return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.int64)
        nb = -(-n // self.vec_block)
        blocks = np.zeros(nb * self.vec_block, dtype=np.float32)
        blocks[:n] = vec
        blocks = blocks.reshape(nb, self.vec_block)
        scales = (np.abs(blocks).max(axis=1) / np.float32(qmax)).astype(np.float32)
        q = np.zeros(blocks.shape, dtype=np.float32)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            np.divide(blocks, scales[:, None], out=q, where=scales[:, None] > 0)
        q = np.clip(np.rint(q), -qmax, qmax).astype(np.int64)
        return scales, q.reshape(-1)[:n] + (qmax + 1)

    # -- decode ----------------------------------------------------------------

    def _decode_body(self, body: memoryview, numel: int, seed: int) -> torch.Tensor:
        mats, vec_parts, n_vec = self._plan(numel)
        vec_pos = _vec_positions(vec_parts, numel)
        s_t, s_k, s_f, s_vs, _ = self._sections(numel)
        a = s_t
        b = a + s_k
        c = b + s_f
        d = c + s_vs
        t_bits = np.frombuffer(body[:a], dtype="<u4")
        check_f32_scales(t_bits, f"{self.name} factor scales")
        ts = t_bits.view("<f4").astype(np.float64)
        n_k = sum(r for *_, r in mats)
        ks = unpack_bits(body[a:b], 4, n_k).astype(np.int64)
        n_f = sum(r * (rows + cols) for _, rows, cols, r in mats)
        qmax = (1 << (self.bits - 1)) - 1
        fields = unpack_bits(body[b:c], self.bits, n_f)
        if n_f and not bool(fields.all()):
            raise PayloadError(f"{self.name} factor code field 0 is outside [-{qmax}, {qmax}]")
        fac = fields.astype(np.float64) - float(qmax + 1)
        out = np.zeros(numel, dtype=np.float32)
        pos_f = 0
        pos_k = 0
        for index, (off, rows, cols, r) in enumerate(mats):
            pc = fac[pos_f : pos_f + rows * r].reshape(rows, r)
            xc = fac[pos_f + rows * r : pos_f + r * (rows + cols)].reshape(r, cols)
            pos_f += r * (rows + cols)
            shift = np.ldexp(1.0, MAX_SHIFT - ks[pos_k : pos_k + r])
            pos_k += r
            y = pc @ (xc * shift[:, None])  # integers below 2^36: exact
            with np.errstate(over="ignore"):  # Inf is refused as NonFiniteError by decode()
                out[off : off + rows * cols] = (y * ts[index]).astype(np.float32).reshape(-1)
        if n_vec:
            vals = self._decode_vec(body[c:d], body[d:], n_vec)
            if vec_pos is None:
                out[:] = vals
            else:
                out[vec_pos] = vals
        return torch.from_numpy(out)

    def _decode_vec(self, scale_data: memoryview, code_data: memoryview, n: int) -> np.ndarray:
        qmax = (1 << (self.vec_bits - 1)) - 1
        scale_bits = np.frombuffer(scale_data, dtype="<u4")
        check_f32_scales(scale_bits, f"{self.name} vector scales")
        scales = scale_bits.view("<f4").astype(np.float32)
        fields = unpack_bits(code_data, self.vec_bits, n)
        if not bool(fields.all()):
            raise PayloadError(f"{self.name} vector code field 0 is outside [-{qmax}, {qmax}]")
        q = fields.astype(np.float32) - np.float32(qmax + 1)
        nb = scales.size
        padded = np.zeros(nb * self.vec_block, dtype=np.float32)
        padded[:n] = q
        with np.errstate(over="ignore"):
            vals = padded.reshape(nb, self.vec_block) * scales[:, None]
        return vals.reshape(-1)[:n]
