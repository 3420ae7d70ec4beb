"""Passes over a row source: what the rules that never hold the N rows are made of.

A ``Rows`` source (``rows.py``) hands out column chunks of the N update rows; the
distance-based rules need only their Gram matrix (``gram.py``) and one
matrix-vector product, so they run in two passes over it, whatever N:

* pass 1, ``gram_rows``, per column chunk X [N, L]: the Gram ``G = X X^T`` (float32
  products summed over ``SUBBLOCK`` columns, then in float64, chunks added in
  column order), relative to a reference row picked on a column sample
  (``gram.compute_gram``'s raw path; rows nearly equal compared with their norms
  get ``H = (X - x_r)(X - x_r)^T`` instead);
* the rule iterates on the [N, N] Gram, O(N^2) per step (CenteredClip from the
  geometric median: ``centered_clip.centered_clip_rows``; the geometric median:
  ``geometric_median.geometric_median_rows``);
* pass 2, ``combine_rows``: ``v = sum_j c_j x_j``, chunk by chunk in the rows' dtype.

``solve_rows_precisely`` runs a rule on ``gram_rows`` and, as ``span.solve_precisely``
does in memory, redoes the Gram centred near the result (then in float64) when the
rule's rounding-error bound is too large: a rare extra pass.  Extra memory: the
result plus O(N * chunk) buffers per thread.  Rows in memory are used in place when
a chunk's rows start on 64-byte boundaries (BLAS kernels then give the bytes they
give on the aligned chunk buffers that ``FileRows`` fills), otherwise copied into
such a buffer, so ``TensorRows`` and ``FileRows`` give the same bytes.

``median_gram`` is pass 1 of CenteredClip's ``start="median"`` (the coordinate
median, a second [D] vector, and the Gram centred at it, in float64);
``row_distances`` gives ||x_i - v|| for an aggregate that came without them.
Which rule runs on which path: ``registry.aggregate_rows``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from ._inputs import Weights, check_count, check_weights
from ._parallel import map_chunks
from .coordinate import CHUNK, CoordinateMedian
from .errors import AggregationInputError, NonFiniteUpdateError, OversizedUpdateError
from .gram import (
    KAPPA_F32,
    KAPPA_F64,
    REL_ERROR_F32,
    REL_ERROR_F64,
    SUBBLOCK,
    UNIT,
    Gram,
    reference_of_sample,
    sample_starts,
    unit_products,
)
from .rows import Rows, TensorRows
from .span import Solution, sq_dists_to

__all__ = [
    "ROWS_CHUNK",
    "MedianGram",
    "check_rows",
    "combine_rows",
    "gram_rows",
    "median_gram",
    "read_row",
    "row_distances",
    "solve_rows_precisely",
]

#: Columns per chunk of a streamed pass: two median chunks (``coordinate.CHUNK``).
#: Buffers per thread: N x this float32 (the rows), N (+1) x this float64 (centred).
ROWS_CHUNK = 2 * CHUNK
#: Bytes of float32 subblock products one step of a raw Gram pass over rows in CPU
#: memory (read in place) may hold: (chunk / SUBBLOCK) * N^2 * 4.  One batched product
#: over many units costs less per column than one per unit (at N = 16 the whole of a
#: 4M-parameter update is one product, about 10% faster than a product per unit).
IN_MEMORY_GRAM_BYTES = 16 << 20
#: Squared norms above this are refused (as in ``gram``).
_HUGE = 1e300

S = TypeVar("S", bound=Solution)


@dataclass(frozen=True)
class MedianGram:
    """Pass 1 of ``start="median"``: the coordinate median m [D] and the Gram of the rows
    centred at m (points [x_1..x_N, m], m at index N, so its row and column are 0;
    ``gram.reference`` = N)."""

    median: Tensor
    gram: Gram


def _device(rows: Rows) -> torch.device:
    return getattr(rows, "device", torch.device("cpu"))


def check_rows(rows: object) -> Rows:
    """``rows`` if it is a non-empty float32/float64 ``Rows`` source, else
    ``AggregationInputError``."""
    if not isinstance(rows, Rows):
        raise AggregationInputError(f"rows must be a Rows source, got {type(rows).__name__}")
    if rows.n_rows < 1 or rows.numel < 1:
        raise AggregationInputError(f"rows must be non-empty, got {rows.n_rows} x {rows.numel}")
    if rows.dtype not in (torch.float32, torch.float64):
        raise AggregationInputError(f"rows must be float32 or float64, got {rows.dtype}")
    return rows


def _aligned(t: Tensor) -> bool:
    """Whether every row of the [N, L] block starts on a 64-byte boundary with L a multiple
    of 64 bytes: the layout of a chunk buffer, on which BLAS rounds the same way."""
    size = t.element_size()
    return (
        t.stride(1) == 1
        and (t.stride(0) * size) % 64 == 0
        and (t.shape[1] * size) % 64 == 0
        and t.data_ptr() % 64 == 0
    )


def _columns(rows: Rows, a: int, b: int, buf: Tensor) -> Tensor:
    """Columns a..b of every row: rows in memory in place when aligned (``_aligned``) or on
    an accelerator, otherwise read into ``buf`` (a new block of the same layout where
    rows in memory outgrow it)."""
    n = rows.n_rows
    if isinstance(rows, TensorRows):
        view = rows.read(a, b)
        if view.device.type != "cpu" or _aligned(view):
            return view
        if buf.numel() < n * (b - a):
            return view.contiguous()  # the layout of a chunk buffer

    return rows.read(a, b, buf[: n * (b - a)].view(n, b - a))


def _gram_chunk(rows: Rows, chunk: int, *, in_place: bool) -> tuple[int, bool]:
    """Columns per step of a Gram pass, and whether the rows are read in place (no buffer):
    whole ``UNIT``s (at least ``chunk`` rounded up); for aligned rows in CPU memory read in
    place, as many units as ``IN_MEMORY_GRAM_BYTES`` of products allow (counted as float32
    subblock products: float64 rows, one product per unit, hold fewer)."""
    units = max(1, -(-chunk // UNIT)) * UNIT
    if in_place and isinstance(rows, TensorRows) and _device(rows).type == "cpu":
        whole = rows.updates
        size = whole.element_size()
        if (whole.stride(0) * size) % 64 == 0 and whole.data_ptr() % 64 == 0:
            per_unit = (UNIT // SUBBLOCK) * rows.n_rows**2 * 4
            return max(units, IN_MEMORY_GRAM_BYTES // per_unit * UNIT), True
    return units, False


def _gram_pass(rows: Rows, *, ref: int | None, wide: bool, chunk: int) -> Tensor:
    """One pass: the [N, N] float64 Gram ``[x_i . x_j]`` (``ref`` None) or
    ``[(x_i - x_ref) . (x_j - x_ref)]``: the partials of every ``UNIT`` of columns
    (``gram.unit_products``) added in column order, so the bytes depend neither on the
    chunking nor on the thread count.

    Products in the rows' dtype (float64 with ``wide``), float32 ones summed over
    ``SUBBLOCK`` columns before float64.
    """
    n, d = rows.n_rows, rows.numel
    dev = _device(rows)
    work_dtype = torch.float64 if wide else rows.dtype
    centred = ref is not None
    chunk, in_place = _gram_chunk(rows, chunk, in_place=not centred)
    width = min(chunk, d)

    def buffers() -> tuple[Tensor, Tensor | None, Tensor | None]:
        if not centred:
            # rows read in place need none (a short unaligned last chunk is copied)
            size = 0 if in_place else n * width
            return torch.empty(size, dtype=rows.dtype, device=dev), None, None
        return (
            torch.empty(n * width, dtype=rows.dtype, device=dev),
            torch.empty(n * width, dtype=work_dtype, device=dev),
            torch.empty(width, dtype=work_dtype, device=dev),
        )

    def work(a: int, b: int, state: tuple[Tensor, Tensor | None, Tensor | None]) -> Tensor:
        x = _columns(rows, a, b, state[0])
        if state[1] is None or state[2] is None:
            return unit_products(x).cpu()
        c = state[1][: n * (b - a)].view(n, b - a)
        r = state[2][: b - a]
        r.copy_(x[ref])
        c.copy_(x)  # converted first (wide): a float32 difference may overflow
        c.sub_(r)
        return unit_products(c).cpu()

    parts = map_chunks(work, d, chunk, device=dev, make_state=buffers)
    total = torch.zeros(n, n, dtype=torch.float64)
    for part in parts:  # unit by unit, in column order
        for unit in part:
            total += unit
    return total


def _nonfinite_rows(rows: Rows, suspects: list[int], chunk: int) -> list[int]:
    """Exact scan (one more pass, only when a Gram diagonal is not finite): which of
    ``suspects`` hold NaN/Inf."""
    n, d = rows.n_rows, rows.numel
    dev = _device(rows)
    picked = torch.tensor(suspects, dtype=torch.long, device=dev)

    def work(a: int, b: int, buf: Tensor) -> Tensor:
        x = _columns(rows, a, b, buf)
        return torch.isfinite(x.index_select(0, picked)).all(dim=1).cpu()

    parts = map_chunks(
        work, d, chunk, device=dev,
        make_state=lambda: torch.empty(n * min(chunk, d), dtype=rows.dtype, device=dev),
    )
    finite = torch.stack(parts).all(dim=0)
    return [r for r, ok in zip(suspects, finite.tolist(), strict=True) if not ok]


def _raise_if_nonfinite(rows: Rows, diag: Tensor, chunk: int) -> None:
    """``NonFiniteUpdateError`` naming the rows that really hold NaN/Inf, among those
    whose Gram diagonal is not finite; nothing if they are finite (squares overflowed)."""
    suspects = torch.nonzero(~torch.isfinite(diag)).flatten().tolist()
    bad = _nonfinite_rows(rows, suspects, chunk) if suspects else []
    if bad:
        raise NonFiniteUpdateError(bad)


def _sample_reference(rows: Rows, candidates: Tensor) -> tuple[int, float]:
    """``gram._sample_reference`` over a row source: the medoid of evenly spaced runs of
    64 columns of the candidate rows (a few small reads), and kappa."""
    starts = sample_starts(rows.numel, candidates.numel())
    if starts is None:
        sample = rows.read(0, rows.numel)
    elif isinstance(rows, TensorRows):  # one gather instead of a slice per run
        dev = _device(rows)
        runs = torch.tensor(starts, device=dev)[:, None] + torch.arange(64, device=dev)
        sample = rows.updates.index_select(1, runs.flatten())
    else:
        sample = torch.cat([rows.read(a, a + 64) for a in starts], dim=1)
    sample = sample.index_select(0, candidates.to(sample.device))
    return reference_of_sample(sample.to(device="cpu", dtype=torch.float64), candidates)


def gram_rows(
    rows: Rows,
    candidates: Tensor | None = None,
    *,
    center_at: int | None = None,
    wide: bool = False,
    chunk: int = ROWS_CHUNK,
) -> Gram:
    """``gram.compute_gram`` of the rows (no extra points) over a row source: one pass.

    Raw ``G = [x_i . x_j]`` turned into ``H = G - G_r 1^T - 1 G_r^T + G_rr`` while the
    column sample's kappa allows it (errors ~ 1e-6 ||x_i|| ||x_j||), otherwise the rows
    minus the reference ``x_r`` (``center_at`` forces that reference; ``wide`` float64
    products).  ``candidates``: the rows the reference is picked from (default all).
    Raises ``NonFiniteUpdateError`` naming the rows holding NaN/Inf and
    ``OversizedUpdateError`` for float64 rows whose squares overflow.
    """
    rows = check_rows(rows)
    n = rows.n_rows
    is64 = rows.dtype == torch.float64
    if candidates is None:
        candidates = torch.arange(n)
    if center_at is None:
        ref, kappa = _sample_reference(rows, candidates)
        if not wide and kappa <= (KAPPA_F64 if is64 else KAPPA_F32):
            raw = _gram_pass(rows, ref=None, wide=False, chunk=chunk)
            diag = raw.diagonal()
            if bool(torch.isfinite(raw).all()) and float(diag.max()) <= _HUGE:
                g_r = raw[:, ref]
                matrix = raw - g_r[:, None] - g_r[None, :] + raw[ref, ref]
                rel = REL_ERROR_F64 if is64 else REL_ERROR_F32
                return Gram(matrix, ref, n, rel, diag.clamp(min=0.0).sqrt())
            _raise_if_nonfinite(rows, diag, chunk)  # else squares overflowed: centred below
    else:
        ref = center_at
    huge = torch.zeros(n, dtype=torch.bool)
    for wide_now in [True] if (wide or is64) else [False, True]:
        centred = _gram_pass(rows, ref=ref, wide=wide_now, chunk=chunk)
        diag = centred.diagonal()
        huge = ~torch.isfinite(diag) | (diag > _HUGE)
        if not bool(huge.any()) and bool(torch.isfinite(centred).all()):
            rel = REL_ERROR_F64 if (wide_now or is64) else REL_ERROR_F32
            return Gram(centred, ref, n, rel, diag.clamp(min=0.0).sqrt())
        _raise_if_nonfinite(rows, diag, chunk)
    raise OversizedUpdateError(torch.nonzero(huge).flatten().tolist())


def solve_rows_precisely(
    rows: Rows,
    run: Callable[[Gram], S],
    *,
    candidates: Tensor,
    tolerance: float,
    chunk: int = ROWS_CHUNK,
) -> tuple[Gram, S]:
    """``span.solve_precisely`` over a row source: ``run`` on ``gram_rows``, then, while
    its ``noise > tolerance * scale``, on the Gram centred at the row nearest to the
    result, with float32 then float64 products (one more pass each; rare)."""
    gram = gram_rows(rows, candidates, chunk=chunk)
    solution = run(gram)
    for wide in (False, True):
        if solution.noise <= tolerance * solution.scale or gram.rel_error <= REL_ERROR_F64:
            break
        near = int(torch.argmin(sq_dists_to(gram.matrix, solution.coef)[: gram.n_rows]))
        gram = gram_rows(rows, candidates, center_at=near, wide=wide, chunk=chunk)
        solution = run(gram)
    return gram, solution


def median_gram(rows: Rows, weights: Weights = None, *, chunk: int = ROWS_CHUNK) -> MedianGram:
    """Pass 1 of ``start="median"``: the (weighted) coordinate median and the Gram centred
    at it, differences and products in float64 (errors ~1e-15 of
    ``||x_i - m|| ||x_j - m||``: no escalation needed).

    Raises ``NonFiniteUpdateError`` naming every row that holds NaN/Inf.
    """
    rows = check_rows(rows)
    chunk = check_count(chunk, "chunk", minimum=1)
    n, d = rows.n_rows, rows.numel
    w = check_weights(weights, n)
    dev = _device(rows)
    median = torch.empty(d, dtype=rows.dtype, device=dev)
    rule = CoordinateMedian()
    width = min(chunk, d)

    def buffers() -> tuple[Tensor, Tensor]:
        return (
            torch.empty(n * width, dtype=rows.dtype, device=dev),
            torch.empty(n * width, dtype=torch.float64, device=dev),
        )

    def work(a: int, b: int, state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[int, ...]]:
        x = rows.read(a, b, state[0][: n * (b - a)].view(n, b - a))
        try:
            median[a:b] = rule(x, w)
        except NonFiniteUpdateError as exc:
            return torch.zeros(n, n, dtype=torch.float64), exc.rows
        c = state[1][: n * (b - a)].view(n, b - a)
        c.copy_(x)
        c.sub_(median[a:b])
        return c.matmul(c.T).cpu(), ()

    parts = map_chunks(work, d, chunk, device=dev, make_state=buffers)
    bad = sorted({r for _, rs in parts for r in rs})
    if bad:
        raise NonFiniteUpdateError(bad)
    centred = torch.zeros(n, n, dtype=torch.float64)
    for part, _ in parts:  # in column order: the bytes do not depend on the thread count
        centred += part
    diag = centred.diagonal()
    if not bool(torch.isfinite(diag).all()):  # finite float64 rows whose squares overflow
        raise OversizedUpdateError(torch.nonzero(~torch.isfinite(diag)).flatten().tolist())
    matrix = torch.zeros(n + 1, n + 1, dtype=torch.float64)
    matrix[:n, :n] = centred
    gram = Gram(matrix, n, n, REL_ERROR_F64, matrix.diagonal().clamp(min=0.0).sqrt())
    return MedianGram(median, gram)


def combine_rows(
    rows: Rows, coef: Tensor, extra: Tensor | None = None, *, chunk: int = ROWS_CHUNK
) -> Tensor:
    """Pass 2: ``v = sum_j coef_j x_j (+ coef_N extra)`` chunk by chunk, in the rows' dtype
    (``coef`` indexed like the Gram's points, as ``span.combine``)."""
    n, d = rows.n_rows, rows.numel
    dev = _device(rows)
    c = coef[:n].to(device=dev, dtype=rows.dtype)
    c_extra = 0.0 if extra is None else float(coef[n])
    out = torch.empty(d, dtype=rows.dtype, device=dev)
    width = min(chunk, d)

    def buffer() -> Tensor:
        return torch.empty(n * width, dtype=rows.dtype, device=dev)

    def work(a: int, b: int, buf: Tensor) -> None:
        x = _columns(rows, a, b, buf)
        torch.mv(x.T, c, out=out[a:b])
        if extra is not None and c_extra != 0.0:
            out[a:b].add_(extra[a:b], alpha=c_extra)

    map_chunks(work, d, chunk, device=dev, make_state=buffer)
    return out


def read_row(rows: Rows, i: int, *, chunk: int = ROWS_CHUNK) -> Tensor:
    """A copy of row ``i`` [D] (the very bytes): in place for rows in memory, otherwise
    chunk by chunk (one pass)."""
    rows = check_rows(rows)
    if isinstance(rows, TensorRows):
        return rows.updates[i].clone()
    n, d = rows.n_rows, rows.numel
    dev = _device(rows)
    out = torch.empty(d, dtype=rows.dtype, device=dev)
    width = min(chunk, d)

    def work(a: int, b: int, buf: Tensor) -> None:
        out[a:b] = rows.read(a, b, buf[: n * (b - a)].view(n, b - a))[i]

    map_chunks(
        work, d, chunk, device=dev,
        make_state=lambda: torch.empty(n * width, dtype=rows.dtype, device=dev),
    )
    return out


def row_distances(rows: Rows, v: Tensor, *, chunk: int = ROWS_CHUNK) -> Tensor:
    """||x_i - v|| for every row, float64 [N], chunk by chunk (differences in float64).

    For an aggregate that did not come with clip factors (e.g. assembled from
    shards): O(N * chunk) extra memory where ``(x - v).double()`` takes N x D.
    """
    rows = check_rows(rows)
    n, d = rows.n_rows, rows.numel
    if v.shape != (d,):
        raise AggregationInputError(f"v must have shape [{d}], got {tuple(v.shape)}")
    dev = _device(rows)
    width = min(chunk, d)
    v = v.detach().to(device=dev)

    def buffers() -> tuple[Tensor, Tensor]:
        return (
            torch.empty(n * width, dtype=rows.dtype, device=dev),
            torch.empty(n * width, dtype=torch.float64, device=dev),
        )

    def work(a: int, b: int, state: tuple[Tensor, Tensor]) -> Tensor:
        x = rows.read(a, b, state[0][: n * (b - a)].view(n, b - a))
        c = state[1][: n * (b - a)].view(n, b - a)
        c.copy_(x)
        c.sub_(v[a:b])
        return c.square_().sum(dim=1).cpu()

    parts = map_chunks(work, d, chunk, device=dev, make_state=buffers)
    return torch.stack(parts).sum(dim=0).sqrt()


