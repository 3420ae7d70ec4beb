"""Gram matrices: distance-based rules on N x N numbers instead of N x D.

CenteredClip, Krum, Multi-Krum and the geometric median only ever look at
distances between the inputs and points of their affine span.  Writing every
iterate as ``v = sum_j c_j p_j`` (coefficients ``c`` summing to 1 over the
points ``p_j``: the update rows plus optional extra points such as a start
vector or the origin), all those distances follow from the Gram matrix

    H_ij = <p_i - x_r, p_j - x_r>            (x_r: a reference row)
    ||p_i - v||^2 = H_ii - 2 (H c)_i + c^T H c

so any number of iterations costs one pass over the data to build H (one
matmul over D), iterations on length-N vectors, and one more pass to
materialize ``v = sum_j c_j p_j`` (one matrix-vector product).

Precision.  Entries of H carry rounding errors of about ``rel_error * e_i e_j``
(``Gram.err_scale``); distances between points near each other but far from
where the errors are measured from cancel.  Two ways to build H:

* raw (the fast path): G = [p_i . p_j] straight from the input (views, no
  copy), then H = G - G_r 1^T - 1 G_r^T + G_rr in float64.  Errors scale with
  ||p_i|| + ||x_r||: fine while the rows are not nearly equal compared with
  their norms (the ratio ``kappa`` is estimated on a column sample).
* centered: rows minus the reference row, chunk by chunk into a buffer, then
  the products.  Errors scale with ||p_i - x_r||, so nearly equal rows keep
  full relative precision.  The reference must sit inside the cluster: it is
  the medoid of the column sample, checked against the full Gram and recomputed
  once if it was a bad pick.

float32 products are summed over at most ``SUBBLOCK`` columns, then in float64.
``span.solve_precisely`` runs a rule on the Gram and, when the rule's own
error bound is too large, redoes the Gram centered near the result, then with
float64 products (about 3x slower).  This is rare.

Memory: a few [P, P] matrices per chunk, plus one [P, chunk] buffer per thread
when centered or when extra points are stacked on the rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._inputs import raise_if_nonfinite
from ._parallel import map_chunks
from .errors import AggregationInputError, OversizedUpdateError

__all__ = [
    "REL_ERROR_F32",
    "REL_ERROR_F64",
    "Gram",
    "KAPPA_F32",
    "KAPPA_F64",
    "compute_gram",
    "lower_median",
    "medoid",
    "pairwise_sq_dists",
    "reference_of_sample",
    "sample_starts",
]

#: Columns per step of the raw Gram (views of the input: no copy, unless extra
#: points are stacked on; the batched product holds RAW_CHUNK / SUBBLOCK small
#: [P, P] float32 results).  Large: one batched product over 4M columns runs
#: about 15% faster than 32 chunks shared by Python threads (measured at
#: N = 16 on 2 cores), since the product is compute-bound, not memory-bound.
RAW_CHUNK = 1 << 22
#: Columns per step of the centered Gram; its buffer is P x this.
CENTERED_CHUNK = 1 << 16
#: float32 products are summed over at most this many columns before float64.
SUBBLOCK = 1024
#: Columns of one float64 partial of a streamed Gram (``unit_products``): 64 subblocks.
#: Passes read whole units, so their partials, added in column order, give the same
#: bytes however the columns were chunked.
UNIT = 64 * SUBBLOCK
#: Values sampled (evenly spaced runs of 64 columns of every row) to pick the
#: reference row and estimate kappa: 1024 columns for 16 rows.
SAMPLE = 16384
#: Largest kappa = (||x_i|| + ||x_r||)^2 / ||x_i - x_r||^2 (median over rows)
#: for which the raw Gram is precise enough: relative error ~ rel_error * kappa.
KAPPA_F32 = 16.0
KAPPA_F64 = 1e6
#: A reference farther than this factor times the medoid's typical squared
#: distance from the medoid costs precision; the centered Gram is then redone.
_FAR = 16.0
#: Error of a Gram entry relative to e_i e_j: float32 products (a product alone
#: rounds by 6e-8) summed over SUBBLOCK columns (measured ~3e-8 on random
#: data), versus float64 throughout.
REL_ERROR_F32 = 1e-6
REL_ERROR_F64 = 1e-15
#: Squared distances above this are refused (sums of a few still fit float64).
_HUGE = 1e300


@dataclass(frozen=True)
class Gram:
    """Inner products of the points relative to a reference row.

    Points are ordered: the N update rows, then the extra points given to
    ``compute_gram`` (in order), then the origin if it was included.
    """

    matrix: Tensor  # [P, P] float64, CPU: H_ij = <p_i - x_r, p_j - x_r>
    reference: int  # index r of the update row used as reference x_r
    n_rows: int  # N: the first N points are the update rows
    rel_error: float  # |error of H_ij| <= rel_error * err_scale_i * err_scale_j
    err_scale: Tensor  # [P] float64

    @property
    def n_points(self) -> int:
        return int(self.matrix.shape[0])


def compute_gram(
    updates: Tensor,
    *,
    extra: Tensor | None = None,
    include_origin: bool = False,
    candidates: Tensor | None = None,
    wide: bool = False,
    center_at: int | None = None,
) -> Gram:
    """Gram matrix of the update rows, ``extra`` rows and optionally the origin.

    ``candidates`` (row indices, default all) are the rows the reference may be
    chosen from: the rows that take part in the rule.  Raises
    ``NonFiniteUpdateError`` naming the rows holding NaN/Inf (the Gram diagonal
    flags them at no extra cost) and ``OversizedUpdateError`` for float64 rows
    whose squares overflow.  Extra points must be finite (caller's duty).
    ``wide=True`` forces float64 products for float32 inputs; ``center_at``
    forces a centered Gram around that row (see ``solve_precisely``).
    """
    n = updates.shape[0]
    if candidates is None:
        candidates = torch.arange(n)
    if center_at is not None:
        return _centered_gram(
            updates, center_at, extra, include_origin, candidates, wide=wide, movable=False
        )
    ref, kappa = _sample_reference(updates, candidates)
    is64 = updates.dtype == torch.float64
    if not wide and kappa <= (KAPPA_F64 if is64 else KAPPA_F32):
        raw = _accumulate_raw(updates, extra, include_origin)
        raise_if_nonfinite(updates, raw.diagonal()[:n])  # rows really holding NaN/Inf
        if bool(torch.isfinite(raw).all()) and float(raw.diagonal().max()) <= _HUGE:
            # Distances are differences (coefficients summing to 0), for which
            # the shift to a reference cancels exactly: errors scale with norms.
            g_r = raw[:, ref]
            matrix = raw - g_r[:, None] - g_r[None, :] + raw[ref, ref]
            rel = REL_ERROR_F64 if is64 else REL_ERROR_F32
            return Gram(matrix, ref, n, rel, raw.diagonal().clamp(min=0.0).sqrt())
        # squares overflowed: the centered path sorts that out
    return _centered_gram(updates, ref, extra, include_origin, candidates, wide=wide, movable=True)


def _centered_gram(
    updates: Tensor,
    ref: int,
    extra: Tensor | None,
    include_origin: bool,
    candidates: Tensor,
    *,
    wide: bool,
    movable: bool,
) -> Gram:
    n = updates.shape[0]
    repicked = False
    result: Gram | None = None
    for _attempt in range(4):
        gram = _accumulate_centered(updates, ref, extra, include_origin, wide=wide)
        diag = gram.diagonal()
        raise_if_nonfinite(updates, diag[:n])  # rows really holding NaN/Inf
        exact = wide or updates.dtype == torch.float64
        huge = ~torch.isfinite(diag) | (diag > _HUGE)
        if bool(huge.any()) or not bool(torch.isfinite(gram).all()):
            if not exact:
                wide = True  # finite float32 values whose squares overflow: redo in float64
                continue
            huge_rows = torch.nonzero(huge[:n]).flatten()
            if (
                2 * int(torch.isin(huge_rows, candidates).sum()) >= candidates.numel()
                and not repicked
            ):
                ref = _small_reference(updates, candidates)  # the reference itself was huge
                repicked = True
                continue
            if huge_rows.numel() == 0:
                raise AggregationInputError(
                    "the start vector is too large (its squared norm overflows float64)"
                )
            raise OversizedUpdateError(huge_rows.tolist())
        rel = REL_ERROR_F64 if exact else REL_ERROR_F32
        result = Gram(gram, ref, n, rel, diag.clamp(min=0.0).sqrt())
        if candidates.numel() < 3 or not movable:
            return result
        # The reference is always a candidate row; is it inside the cluster?
        sub = pairwise_sq_dists(gram[candidates][:, candidates])
        best, spread = medoid(sub)
        ref_pos = int(torch.nonzero(candidates == ref).flatten()[0])
        if int(candidates[best]) == ref or float(sub[best, ref_pos]) <= _FAR * spread:
            return result
        ref = int(candidates[best])
    assert result is not None  # overflow is retried wide, a huge reference replaced, once each
    return result


def _sample_reference(updates: Tensor, candidates: Tensor) -> tuple[int, float]:
    """Medoid of an evenly spaced column sample of the candidate rows, and kappa.

    kappa: lower median over the other candidates of
    (||x_i|| + ||x_ref||)^2 / ||x_i - x_ref||^2 on the sample: how much precision
    a raw (uncentered) Gram would lose.
    """
    rows = candidates.to(updates.device)
    starts = sample_starts(updates.shape[1], rows.numel())
    if starts is None:
        sample = updates.index_select(0, rows)
    else:
        sample = torch.cat([updates[:, a : a + 64] for a in starts], dim=1).index_select(0, rows)
    return reference_of_sample(sample.to(device="cpu", dtype=torch.float64), candidates)


def sample_starts(d: int, m: int) -> list[int] | None:
    """First columns of the evenly spaced runs of 64 columns sampled from m rows of D
    (None: take every column).

    At most SAMPLE values in all (runs of 64: a few cache lines each, where single
    strided columns would cost one cache miss each; small tensors stay below
    torch's parallel grain, so these ops never wait on other threads).
    """
    width = max(64, SAMPLE // max(1, m) // 64 * 64)
    if d <= width:
        return None
    return torch.linspace(0, d - 64, width // 64).long().tolist()


def reference_of_sample(sample: Tensor, candidates: Tensor) -> tuple[int, float]:
    """``_sample_reference`` on a float64 CPU sample [len(candidates), S] of the candidates."""
    if not bool(torch.isfinite(sample.sum(dim=1)).all()):
        return int(candidates[0]), math.inf  # NaN/Inf rows: the Gram will name them
    if candidates.numel() < 2:
        return int(candidates[0]), 1.0
    centered = sample - sample.median(dim=0).values
    dist = pairwise_sq_dists(centered @ centered.T)
    best, _ = medoid(dist)
    norms = sample.norm(dim=1)
    others = torch.arange(candidates.numel()) != best
    ratio = (norms[others] + norms[best]) ** 2 / dist[best, others]
    return int(candidates[best]), lower_median(ratio.nan_to_num(nan=math.inf))


def _small_reference(updates: Tensor, candidates: Tensor) -> int:
    """The candidate row of lower-median max-abs value (one pass; pathological inputs only)."""
    amax = torch.stack([updates[int(r)].abs().max() for r in candidates]).double().cpu()
    order = torch.sort(amax, stable=True).indices
    return int(candidates[order[(candidates.numel() - 1) // 2]])


def lower_median(values: Tensor) -> float:
    """The lower median of a non-empty 1-D tensor (a robust scale: outliers cannot inflate it)."""
    return float(values.sort().values[(values.numel() - 1) // 2])


def medoid(sq_dists: Tensor) -> tuple[int, float]:
    """Row whose lower-median squared distance to the other rows is smallest.

    Returns ``(index, that median)``; ties go to the lowest index.  Robust while
    fewer than half the rows are outliers.
    """
    m = sq_dists.shape[0]
    if m == 1:
        return 0, 0.0
    masked = sq_dists.clone()
    masked.fill_diagonal_(float("inf"))
    others = masked.sort(dim=1).values[:, : m - 1]
    scores = others[:, (m - 2) // 2]
    best = int(torch.argmin(scores))  # first minimal index
    return best, float(scores[best])


def _accumulate_raw(updates: Tensor, extra: Tensor | None, include_origin: bool) -> Tensor:
    """[p_i . p_j] for the rows, the extra points and the origin (zeros), float64."""
    n, d = updates.shape
    e = 0 if extra is None else extra.shape[0]

    def work(a: int, b: int, _: None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        rows = updates[:, a:b]
        if extra is None:
            return _products(rows, rows), None, None
        ex = extra[:, a:b].to(updates.dtype)
        return _products(rows, rows), _products(rows, ex), _products(ex, ex)

    parts = map_chunks(work, d, RAW_CHUNK, device=updates.device, make_state=lambda: None)
    p = n + e + int(include_origin)
    gram = torch.zeros(p, p, dtype=torch.float64)
    for xx, xe, ee in parts:  # in column order: the bytes do not depend on the thread count
        gram[:n, :n] += xx.cpu()
        if xe is not None and ee is not None:
            gram[:n, n : n + e] += xe.cpu()
            gram[n : n + e, :n] += xe.cpu().T
            gram[n : n + e, n : n + e] += ee.cpu()
    return gram


def _accumulate_centered(
    updates: Tensor, ref: int, extra: Tensor | None, include_origin: bool, *, wide: bool
) -> Tensor:
    n, d = updates.shape
    e = 0 if extra is None else extra.shape[0]
    p = n + e + int(include_origin)
    work_dtype = torch.float64 if wide else updates.dtype

    def buffer() -> Tensor:
        return torch.empty(p * min(CENTERED_CHUNK, d), dtype=work_dtype, device=updates.device)

    def work(a: int, b: int, buf: Tensor) -> Tensor:
        c = buf[: p * (b - a)].view(p, b - a)
        r = updates[ref, a:b].to(work_dtype)
        if wide:  # convert before subtracting: the float32 difference may overflow
            c[:n].copy_(updates[:, a:b])
            c[:n].sub_(r)
        else:
            torch.sub(updates[:, a:b], r, out=c[:n])
        if extra is not None:
            c[n : n + e].copy_(extra[:, a:b])
            c[n : n + e].sub_(r)
        if include_origin:
            torch.neg(r, out=c[p - 1])
        return _products(c, c)

    parts = map_chunks(work, d, CENTERED_CHUNK, device=updates.device, make_state=buffer)
    gram = torch.zeros(p, p, dtype=torch.float64)
    for part in parts:  # in column order
        gram += part.cpu()
    return gram


def _products(a: Tensor, b: Tensor) -> Tensor:
    """a @ b.T in float64; float32 products summed over SUBBLOCK columns at most."""
    if a.dtype == torch.float64:
        return a @ b.T
    w = a.shape[1]
    k = w // SUBBLOCK
    out = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float64, device=a.device)
    if k:
        # k independent [rows, SUBBLOCK] blocks: one batched matmul (it also
        # parallelizes better than one long matmul with a tiny output).
        ab = a[:, : k * SUBBLOCK].unflatten(1, (k, SUBBLOCK)).transpose(0, 1)
        bb = b[:, : k * SUBBLOCK].unflatten(1, (k, SUBBLOCK)).transpose(0, 1)
        out += torch.bmm(ab, bb.transpose(1, 2)).sum(dim=0, dtype=torch.float64)
    if k * SUBBLOCK < w:
        out += (a[:, k * SUBBLOCK :] @ b[:, k * SUBBLOCK :].T).to(torch.float64)
    return out


def unit_products(x: Tensor) -> Tensor:
    """``x_u x_u^T`` in float64 for each run ``x_u`` of ``UNIT`` columns of ``x`` [n, L]
    (the last run may be shorter): [units, n, n].

    float32 products are summed over ``SUBBLOCK`` columns (one batched product for
    all of ``x``), then the 64 subblocks of a unit in float64; float64 rows take one
    product per unit.  A unit's partial is computed alike wherever it sits in ``x``,
    so a pass whose chunks are whole units gets the same partials for any chunking.
    """
    n, width = x.shape
    full = width // UNIT
    parts: list[Tensor] = []
    if x.dtype == torch.float64:
        if full:
            blocks = x[:, : full * UNIT].unflatten(1, (full, UNIT)).transpose(0, 1)
            parts.extend(torch.bmm(blocks, blocks.transpose(1, 2)).unbind(0))
        if full * UNIT < width:
            tail = x[:, full * UNIT :]
            parts.append(tail @ tail.T)
        return torch.stack(parts)
    k = width // SUBBLOCK
    if k:
        blocks = x[:, : k * SUBBLOCK].unflatten(1, (k, SUBBLOCK)).transpose(0, 1)
        sub = torch.bmm(blocks, blocks.transpose(1, 2))
        per_unit = UNIT // SUBBLOCK
        parts.extend(sub[a : a + per_unit].sum(dim=0, dtype=torch.float64)
                     for a in range(0, k, per_unit))
    if k * SUBBLOCK < width:
        tail = x[:, k * SUBBLOCK :]
        rest = (tail @ tail.T).to(torch.float64)
        if k % (UNIT // SUBBLOCK):
            parts[-1] = parts[-1] + rest  # the short last unit: its subblocks, then the rest
        else:
            parts.append(rest)
    return torch.stack(parts)


def pairwise_sq_dists(gram: Tensor) -> Tensor:
    """||p_i - p_j||^2 for all pairs, from a Gram matrix; clamped at 0."""
    diag = gram.diagonal()
    dist = diag[:, None] + diag[None, :] - 2.0 * gram
    dist.clamp_(min=0.0)
    dist.fill_diagonal_(0.0)
    return dist
