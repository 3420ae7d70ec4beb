"""CenteredClip over a row source in two passes: what a validator runs.

``centered_clip_rows`` computes CenteredClip from the coordinate median
(``CenteredClip(tau, start="median")``) without ever holding the N rows:

* pass 1, per column chunk X [N, L]: the coordinate median m of the chunk
  (column-wise, so chunk by chunk gives the whole median bit for bit) into one
  [D] vector, and the Gram of the rows centred at the median,
  ``H_ij = <x_i - m, x_j - m>`` (the median is point N, at the origin of H),
  from float64 differences and float64 products: errors of H are about 1e-15
  of ``||x_i - m|| ||x_j - m||``, so no precision escalation is ever needed.
  With ``tau_rel`` the same sorting network also gives the lower coordinate
  median m' (``torch.median``'s convention, what the run spec's radius is
  relative to; m' = m for an odd number of unweighted rows), one more point of
  H, so ``tau = tau_rel * lower_median_i ||x_i - m'||`` costs no pass of its
  own; then the coefficient iterations of ``centered_clip._iterate`` run on H
  from the median point;
* pass 2: ``v = sum_j c_j x_j + c_m m``, chunk by chunk in the rows' dtype.

The clip factors ``min(1, tau / ||x_i - v||)`` come from H as well.  Extra
memory: the median and the result (2 x 4 B per parameter for float32) plus
O(N * chunk) buffers per thread, whatever N.  ``TensorRows`` and ``FileRows``
hand the same contiguous buffers to the same code, so in-memory and streamed
rows give the same bytes; the result differs from ``CenteredClip`` in the last
bits only (another Gram).

The other rules need the rows in memory: ``aggregate_rows`` runs them on the
stack ``rows.read(0, D)``, so their memory grows with N.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from ._inputs import (
    Weights,
    check_count,
    check_nonneg_real,
    check_positive_real,
    check_weights,
)
from ._parallel import map_chunks
from .centered_clip import CenteredClipStats, _clip_factors, _iterate
from .coordinate import CHUNK, CoordinateMedian, median_and_lower
from .errors import AggregationInputError, NonFiniteUpdateError, OversizedUpdateError
from .gram import REL_ERROR_F64, SUBBLOCK, Gram, lower_median
from .mean import normalized_weights
from .registry import build_aggregator
from .rows import Rows, TensorRows
from .span import sq_dists_to

__all__ = [
    "ROWS_CHUNK",
    "MedianGram",
    "RowsAggregate",
    "RowsClipStats",
    "aggregate_rows",
    "centered_clip_rows",
    "clip_radius",
    "median_gram",
    "resolve_radius",
    "row_distances",
    "streams",
]

#: Columns per chunk of a streamed pass: two median chunks (``coordinate.CHUNK``).
#: Buffers per thread: N x this float32 (the rows), N (+1) x this float64 (centred).
ROWS_CHUNK = 2 * CHUNK
#: Smallest radius tau_rel resolves to (identical rows would otherwise give 0).
MIN_TAU = 1e-12


@dataclass(frozen=True)
class RowsClipStats(CenteredClipStats):
    """``CenteredClipStats`` plus the radius used (``tau``, or ``tau_rel`` resolved)."""

    tau: float


@dataclass(frozen=True)
class MedianGram:
    """Pass 1: the coordinate median m [D] and the Gram of the rows centred at m.

    ``gram``: points [x_1..x_N, m] (m at index N, so its row and column are 0),
    ``gram.reference`` = N.  ``lower_dists``: ||x_i - m'|| [N] float64 with m'
    the unweighted lower coordinate median of all rows (what ``tau_rel`` is
    relative to), or None when not asked for.
    """

    median: Tensor
    gram: Gram
    lower_dists: Tensor | None = None


def _centred_products(x: Tensor, m: Tensor, low: Tensor | None, buf: Tensor) -> Tensor:
    """Float64 Gram of [x_1..x_N, low] - m for a chunk ([N, N], or [N + 1, N + 1] with low).

    The differences are formed in float64 (exact for float32 inputs, up to one
    rounding otherwise); products run on blocks of ``SUBBLOCK`` columns (one
    batched product) summed in block order, so the bytes depend only on the
    chunk's values.
    """
    n, width = x.shape
    p = n + int(low is not None)
    c = buf[: p * width].view(p, width)
    c[:n].copy_(x)
    if low is not None:
        c[n].copy_(low)
    c.sub_(m)
    k = width // SUBBLOCK
    out = torch.zeros(p, p, dtype=torch.float64, device=x.device)
    if k:
        blocks = c[:, : k * SUBBLOCK].unflatten(1, (k, SUBBLOCK)).transpose(0, 1)
        out += torch.bmm(blocks, blocks.transpose(1, 2)).sum(dim=0)
    if k * SUBBLOCK < width:
        rest = c[:, k * SUBBLOCK :]
        out += rest @ rest.T
    return out


def _device(rows: Rows) -> torch.device:
    return getattr(rows, "device", torch.device("cpu"))


def _check_rows(rows: object) -> Rows:
    if not isinstance(rows, Rows):
        raise AggregationInputError(f"rows must be a Rows source, got {type(rows).__name__}")
    if rows.n_rows < 1 or rows.numel < 1:
        raise AggregationInputError(f"rows must be non-empty, got {rows.n_rows} x {rows.numel}")
    if rows.dtype not in (torch.float32, torch.float64):
        raise AggregationInputError(f"rows must be float32 or float64, got {rows.dtype}")
    return rows


def median_gram(
    rows: Rows, weights: Weights = None, *, lower: bool = False, chunk: int = ROWS_CHUNK
) -> MedianGram:
    """Pass 1 over ``rows``: the (weighted) coordinate median, the Gram centred at it and,
    with ``lower``, the distances to the lower median (see ``MedianGram``).

    Raises ``NonFiniteUpdateError`` naming every row that holds NaN/Inf.
    """
    rows = _check_rows(rows)
    chunk = check_count(chunk, "chunk", minimum=1)
    n, d = rows.n_rows, rows.numel
    w = check_weights(weights, n)
    dev = _device(rows)
    median = torch.empty(d, dtype=rows.dtype, device=dev)
    rule = CoordinateMedian()
    # odd n without weights: the lower median is the median itself (the same bytes)
    extra = lower and not (w is None and n % 2 == 1)
    p = n + int(extra)
    width = min(chunk, d)

    def buffers() -> tuple[Tensor, Tensor]:
        return (
            torch.empty(n * width, dtype=rows.dtype, device=dev),
            torch.empty(p * width, dtype=torch.float64, device=dev),
        )

    def work(a: int, b: int, state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[int, ...]]:
        x = rows.read(a, b, state[0][: n * (b - a)].view(n, b - a))
        low: Tensor | None = None
        try:
            if extra and w is None:
                median[a:b], low = median_and_lower(x)
            else:
                median[a:b] = rule(x, w)
                low = median_and_lower(x)[1] if extra else None
        except NonFiniteUpdateError as exc:
            return torch.zeros(p, p, dtype=torch.float64), exc.rows
        return _centred_products(x, median[a:b], low, state[1]).cpu(), ()

    parts = map_chunks(work, d, chunk, device=dev, make_state=buffers)
    bad = sorted({r for _, rs in parts for r in rs})
    if bad:
        raise NonFiniteUpdateError(bad)
    centred = torch.zeros(p, p, dtype=torch.float64)
    for part, _ in parts:  # in column order: the bytes do not depend on the thread count
        centred += part
    diag = centred.diagonal()
    if not bool(torch.isfinite(diag).all()):  # finite float64 rows whose squares overflow
        raise OversizedUpdateError(torch.nonzero(~torch.isfinite(diag[:n])).flatten().tolist())
    matrix = torch.zeros(n + 1, n + 1, dtype=torch.float64)
    matrix[:n, :n] = centred[:n, :n]
    gram = Gram(matrix, n, n, REL_ERROR_F64, matrix.diagonal().clamp(min=0.0).sqrt())
    lower_dists: Tensor | None = None
    if extra:  # ||x_i - m'||^2 = H_ii - 2 H_im' + H_m'm'
        sq = diag[:n] - 2.0 * centred[:n, n] + centred[n, n]
        lower_dists = sq.clamp(min=0.0).sqrt()
    elif lower:
        lower_dists = gram.matrix.diagonal()[:n].clamp(min=0.0).sqrt()
    return MedianGram(median, gram, lower_dists)


def _radius(mg: MedianGram, tau_rel: float) -> float:
    """tau_rel * lower median over all rows of ||x_i - m'|| (m': lower coordinate median),
    at least MIN_TAU: the convention of the run spec's ``tau_rel`` (protocol.md 7.5)."""
    assert mg.lower_dists is not None
    return max(tau_rel * lower_median(mg.lower_dists), MIN_TAU)


def clip_radius(rows: Rows, tau_rel: float, *, chunk: int = ROWS_CHUNK) -> float:
    """``tau = tau_rel * lower_median_i ||x_i - m'||`` (m': the unweighted lower coordinate
    median, ``torch.median``'s convention): pass 1 only.

    The radius ``centered_clip_rows(rows, tau_rel=tau_rel)`` uses, for callers that
    need it before or without aggregating.
    """
    tau_rel = check_positive_real(tau_rel, "tau_rel")
    return _radius(median_gram(rows, lower=True, chunk=chunk), tau_rel)


def centered_clip_rows(
    rows: Rows,
    weights: Weights = None,
    *,
    tau: float | None = None,
    tau_rel: float | None = None,
    iterations: int = 10,
    tol: float = 1e-6,
    chunk: int = ROWS_CHUNK,
) -> tuple[Tensor, RowsClipStats]:
    """CenteredClip from the coordinate median over a row source, in two passes.

        v_0 = m (coordinate median, weighted with weights)
        v_{t+1} = v_t + sum_i w_i (x_i - v_t) min(1, tau / ||x_i - v_t||) / sum_i w_i

    Exactly one of ``tau`` (the radius) or ``tau_rel``: tau = tau_rel * lower
    median over all rows of ||x_i - m'||, m' the unweighted lower coordinate
    median (``clip_radius``; the same float without weights).  At most
    ``iterations`` steps, stopping once a step is <= tol * tau.  Returns
    ``(v, RowsClipStats)``: v [D] in the rows' dtype, the clip factors at v
    and the radius used.  See the module docstring for cost and memory.
    """
    if (tau is None) == (tau_rel is None):
        raise AggregationInputError("give exactly one of tau and tau_rel")
    if tau is not None:
        tau = check_positive_real(tau, "tau")
    if tau_rel is not None:
        tau_rel = check_positive_real(tau_rel, "tau_rel")
    iterations = check_count(iterations, "iterations", minimum=1)
    tol = check_nonneg_real(tol, "tol")
    rows = _check_rows(rows)
    chunk = check_count(chunk, "chunk", minimum=1)
    n = rows.n_rows
    w = check_weights(weights, n)
    wn = normalized_weights(w, n)

    mg = median_gram(rows, w, lower=tau_rel is not None, chunk=chunk)
    radius = _radius(mg, tau_rel) if tau_rel is not None else float(tau)  # type: ignore[arg-type]
    coef0 = torch.zeros(n + 1, dtype=torch.float64)
    coef0[n] = 1.0  # the median point
    run = _iterate(mg.gram, coef0, wn, radius, iterations, tol)
    factors = _clip_factors(sq_dists_to(mg.gram.matrix, run.coef)[:n].sqrt(), radius)
    v = _combine_rows(rows, run.coef, mg.median, chunk)
    return v, RowsClipStats(iterations_run=run.iterations_run, clip_factors=factors, tau=radius)


def _combine_rows(rows: Rows, coef: Tensor, extra: Tensor, chunk: int) -> Tensor:
    """Pass 2: ``v = sum_j coef_j x_j + coef_N extra`` chunk by chunk, in the rows' dtype."""
    n, d = rows.n_rows, rows.numel
    dev = _device(rows)
    c = coef[:n].to(device=dev, dtype=rows.dtype)
    c_extra = float(coef[n])
    out = torch.empty(d, dtype=rows.dtype, device=dev)
    width = min(chunk, d)

    def buffer() -> Tensor:
        return torch.empty(n * width, dtype=rows.dtype, device=dev)

    def work(a: int, b: int, buf: Tensor) -> None:
        x = rows.read(a, b, buf[: n * (b - a)].view(n, b - a))
        torch.mv(x.T, c, out=out[a:b])
        if c_extra != 0.0:
            out[a:b].add_(extra[a:b], alpha=c_extra)

    map_chunks(work, d, chunk, device=dev, make_state=buffer)
    return out


def row_distances(rows: Rows, v: Tensor, *, chunk: int = ROWS_CHUNK) -> Tensor:
    """||x_i - v|| for every row, float64 [N], chunk by chunk (differences in float64).

    For an aggregate that did not come with clip factors (e.g. assembled from
    shards): O(N * chunk) extra memory where ``(x - v).double()`` takes N x D.
    """
    rows = _check_rows(rows)
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


# --- the run's aggregator over a row source ---------------------------------------


@dataclass(frozen=True)
class RowsAggregate:
    """An aggregate over a row source and what scoring needs from it.

    ``tau``: the radius used (None for rules without one); ``clip_factors``:
    [N] float64 min(1, tau / ||x_i - v||) from the rule's own Gram, or None
    (then compute them from the rows if needed).
    """

    aggregate: Tensor
    tau: float | None
    clip_factors: Tensor | None


def streams(name: str, params: Mapping[str, object]) -> bool:
    """Whether ``aggregate_rows`` runs (name, params) streamed: CenteredClip from the
    median (the default start), without bucketing."""
    return (
        name == "centered_clip"
        and params.get("start", "median") == "median"
        and _no_buckets(params.get("bucket_size"))
        and set(params) <= {"tau", "tau_rel", "iterations", "tol", "start", "bucket_size"}
    )


def _no_buckets(size: object) -> bool:
    return size is None or (type(size) is int and size == 1)


def resolve_radius(params: Mapping[str, object], rows: Rows) -> dict[str, object]:
    """``params`` with a scale-free ``tau_rel`` turned into this round's ``tau`` (clip_radius)."""
    out = dict(params)
    tau_rel = out.pop("tau_rel", None)
    if tau_rel is not None:
        out["tau"] = clip_radius(rows, tau_rel)  # type: ignore[arg-type]
    return out


def aggregate_rows(
    name: str,
    params: Mapping[str, object],
    rows: Rows,
    weights: Weights = None,
    *,
    seed: int = 0,
) -> RowsAggregate:
    """The run's aggregator ``(name, params)`` over a row source.

    CenteredClip from the median (the run default) streams: ``centered_clip_rows``,
    memory independent of N.  Every other rule, bucketing included, runs on the
    in-memory stack ``rows.read(0, D)`` (``build_aggregator``), so its memory
    grows with N; ``tau_rel`` is resolved with ``clip_radius`` first.
    """
    rows = _check_rows(rows)
    if streams(name, params):
        kwargs = {k: params[k] for k in ("tau", "tau_rel", "iterations", "tol") if k in params}
        v, stats = centered_clip_rows(rows, weights, **kwargs)  # type: ignore[arg-type]
        return RowsAggregate(v, stats.tau, stats.clip_factors)
    stacked = rows.read(0, rows.numel)
    resolved = resolve_radius(params, TensorRows(stacked))
    agg = build_aggregator(name, resolved, seed=seed)
    tau = resolved.get("tau")
    return RowsAggregate(agg(stacked, weights), None if tau is None else float(tau), None)  # type: ignore[arg-type]
