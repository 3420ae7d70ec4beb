"""CenteredClip (Karimireddy, He, Jaggi 2021), iterated on Gram coefficients.

``centered_clip_rows`` is the rule over a row source in two passes (what validators
run, ``registry.aggregate_rows``); ``CenteredClip`` with its default start (the
geometric median) calls it on the rows in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ._inputs import (
    Weights,
    check_count,
    check_nonneg_real,
    check_positive_real,
    check_updates,
    check_weights,
    is_finite,
)
from .coordinate import CoordinateMedian
from .copies import share_copies
from .errors import AggregationInputError
from .geometric_median import geometric_median_coef
from .gram import Gram, lower_median
from .mean import normalized_weights
from .rows import Rows, TensorRows
from .span import combine, dists_with_error, solve_precisely, sq_dists_to, sq_norm
from .streamed import (
    ROWS_CHUNK,
    check_rows,
    combine_rows,
    gram_rows,
    median_gram,
    solve_rows_precisely,
)

__all__ = [
    "CenteredClip",
    "CenteredClipStats",
    "RowsClipStats",
    "Start",
    "centered_clip_rows",
    "centered_clip_with_stats",
    "clip_radius",
]

Start = Literal["geometric_median", "median", "mean", "zero"]
_STARTS: tuple[str, ...] = ("geometric_median", "median", "mean", "zero")
#: Starts ``centered_clip_rows`` streams.
STREAMED_STARTS = ("geometric_median", "median")
#: Smallest radius tau_rel resolves to (identical rows would otherwise give 0).
MIN_TAU = 1e-12


@dataclass(frozen=True)
class CenteredClipStats:
    """What the validator needs to score contributions.

    ``iterations_run``: updates of v actually applied (<= ``iterations``).
    ``clip_factors``: [N] float64, min(1, tau / ||x_i - v||) at the returned v
    (1 where x_i = v): the fraction of each row's deviation that survived.
    """

    iterations_run: int
    clip_factors: Tensor


@dataclass(frozen=True)
class CenteredClip:
    """Centered clipping (Karimireddy, He, Jaggi, ICML 2021, "Learning from History").

        v_0 = start
        v_{t+1} = v_t + sum_i w_i (x_i - v_t) * min(1, tau / ||x_i - v_t||) / sum_i w_i

    * x_i: update rows, w_i: weights (1 without), tau > 0: clipping radius
      (same units as the updates), at most ``iterations`` steps, stopping early
      once ||v_{t+1} - v_t|| <= tol * tau.
    * ``start``: "geometric_median" (the default: argmin_v sum_i w_i ||x_i - v||,
      Weiszfeld on the Gram's coefficients, breakdown point 1/2, no pass of its
      own; ``centered_clip_rows``, the very function validators run),
      "median" (coordinate-wise median of the rows: robust to
      outliers of any size, costs a median), "mean" (weighted mean: cheap, but
      far outliers drag it and each step moves v by at most tau), "zero" (the
      origin, the choice of the paper's code without momentum: cheapest, fine
      when updates are small compared to iterations * tau).
    * Each step moves v by at most tau; f outliers move it by at most
      f/n * tau per step whatever their magnitude.
    * Cost: one Gram pass over the data (O(N^2 D) flops, about one mean),
      iterations on length-N coefficient vectors (O(N^2) each), one
      matrix-vector product to form v, plus the median for start="median".
      Extra memory: O(N * CHUNK) plus one [D] vector for the median start.
    """

    tau: float
    iterations: int = 10
    tol: float = 1e-6
    start: Start = "geometric_median"
    name = "centered_clip"

    def __post_init__(self) -> None:
        check_positive_real(self.tau, "tau")
        check_count(self.iterations, "iterations", minimum=1)
        check_nonneg_real(self.tol, "tol")
        if self.start not in _STARTS:
            raise AggregationInputError(f"start must be one of {list(_STARTS)}, got {self.start!r}")

    def __call__(self, updates: Tensor, weights: Weights = None) -> Tensor:
        return self.with_stats(updates, weights)[0]

    def with_stats(
        self, updates: Tensor, weights: Weights = None
    ) -> tuple[Tensor, CenteredClipStats]:
        """The aggregate and its ``CenteredClipStats``."""
        return centered_clip_with_stats(
            updates,
            weights,
            tau=self.tau,
            iterations=self.iterations,
            tol=self.tol,
            start=self.start,
        )


def centered_clip_with_stats(
    updates: Tensor,
    weights: Weights = None,
    *,
    tau: float,
    iterations: int = 10,
    tol: float = 1e-6,
    start: Start | Tensor = "geometric_median",
) -> tuple[Tensor, CenteredClipStats]:
    """CenteredClip returning ``(v, CenteredClipStats)``; see ``CenteredClip``.

    ``start`` may also be a finite [D] tensor (used in the dtype of
    ``updates``), e.g. the previous round's aggregate (the paper's momentum
    start) or a coordinate-wise median the caller already has: state is passed
    in, never kept.
    """
    tau = check_positive_real(tau, "tau")
    iterations = check_count(iterations, "iterations", minimum=1)
    tol = check_nonneg_real(tol, "tol")
    x = check_updates(updates)
    if isinstance(start, str) and start == "geometric_median":
        v, rs = centered_clip_rows(
            TensorRows(x), weights, tau=tau, iterations=iterations, tol=tol, start=start
        )
        return v, CenteredClipStats(iterations_run=rs.iterations_run, clip_factors=rs.clip_factors)
    n, d = x.shape
    w = check_weights(weights, n)
    wn = normalized_weights(w, n)
    act = torch.nonzero(wn > 0).flatten()

    extra: Tensor | None = None
    include_origin = False
    if isinstance(start, Tensor):
        if start.shape != (d,):
            raise AggregationInputError(
                f"start vector must have shape [{d}], got {tuple(start.shape)}"
            )
        if not is_finite(start):
            raise AggregationInputError("start vector contains NaN or Inf")
        extra = start.to(device=x.device, dtype=x.dtype).unsqueeze(0)
    elif start == "median":
        extra = CoordinateMedian()(x, w).unsqueeze(0)  # also refuses NaN/Inf rows
    elif start == "zero":
        include_origin = True
    elif start != "mean":
        raise AggregationInputError(
            f"start must be one of {list(_STARTS)} or a tensor, got {start!r}"
        )

    if not isinstance(start, Tensor) and start == "mean":
        coef0 = torch.cat([wn, torch.zeros(int(include_origin), dtype=torch.float64)])
    else:
        coef0 = torch.zeros(n + 1, dtype=torch.float64)
        coef0[n] = 1.0  # the single extra point: start vector, median or origin

    gram, run = solve_precisely(
        x,
        lambda g: _iterate(g, coef0, wn, tau, iterations, tol),
        extra=extra,
        include_origin=include_origin,
        candidates=act,
        tolerance=_NOISE,
    )
    factors = _clip_factors(sq_dists_to(gram.matrix, run.coef)[:n].sqrt(), tau)
    stats = CenteredClipStats(iterations_run=run.iterations_run, clip_factors=factors)
    return combine(x, run.coef, extra), stats


#: Tolerated bound on the rounding drift of v, relative to the median distance
#: of the rows from v.  The bound is pessimistic (worst-case alignment of every
#: rounding error); observed errors are 30-500x smaller.
_NOISE = 1e-4


@dataclass(frozen=True)
class _Run:
    coef: Tensor
    noise: float
    scale: float
    iterations_run: int


def _iterate(gram: Gram, coef: Tensor, wn: Tensor, tau: float, iterations: int, tol: float) -> _Run:
    """Run the iterations on coefficients.

    Row i pulls v by w_i clip(d_i) (x_i - v); the direction is exact in
    coefficient space, only clip(d~_i) is computed from a rounded distance.
    With |d~_i - d_i| <= delta_i the pull is off by at most
    w_i delta_i min(1, tau / d~_i), and by nothing when d~_i + delta_i <= tau;
    ``noise`` adds these up over rows and steps.
    """
    g = gram.matrix
    n = gram.n_rows
    ran = 0
    noise = 0.0
    for _ in range(iterations):
        dist, delta = dists_with_error(gram, coef)
        dist, delta = dist[:n], delta[:n]
        factors = _clip_factors(dist, tau)
        pull_error = torch.where(dist + delta > tau, delta * factors, torch.zeros_like(delta))
        noise += float(wn @ pull_error)
        alpha = wn * factors
        step = -alpha.sum() * coef
        step[:n] += alpha
        coef = coef + step
        ran += 1
        if math.sqrt(sq_norm(g, step)) <= tol * tau:
            break
    scale = lower_median(sq_dists_to(g, coef)[:n][wn > 0].sqrt())
    return _Run(coef, noise, scale, ran)


def _clip_factors(dist: Tensor, tau: float) -> Tensor:
    """min(1, tau / ||x_i - v||), and 1 where the distance is 0."""
    return torch.where(dist > tau, tau / dist.clamp(min=tau), torch.ones_like(dist))


# --- over a row source: what validators run ---------------------------------------


@dataclass(frozen=True)
class RowsClipStats(CenteredClipStats):
    """``CenteredClipStats`` plus the radius used (``tau``, or ``tau_rel`` resolved)."""

    tau: float


def _gm_radius(gram: Gram, wn: Tensor, tau_rel: float) -> tuple[Tensor, float]:
    """The geometric-median coefficients and ``tau = max(tau_rel * lower_median_i
    ||x_i - GM||, MIN_TAU)`` over the rows of positive weight."""
    n = gram.n_rows
    gm = geometric_median_coef(gram, wn)
    dist = sq_dists_to(gram.matrix, gm)[:n].sqrt()
    return gm, max(tau_rel * lower_median(dist[wn > 0]), MIN_TAU)


def clip_radius(
    rows: Rows, tau_rel: float, weights: Weights = None, *, chunk: int = ROWS_CHUNK
) -> float:
    """``tau = max(tau_rel * lower_median_i ||x_i - GM(x)||, 1e-12)``, GM the (weighted)
    geometric median, over the rows of positive weight: one Gram pass.

    The radius ``centered_clip_rows(rows, weights, tau_rel=tau_rel)`` uses from the
    geometric-median start when its Gram needs no escalation (the same float), for callers
    that need it before or without aggregating; copies count once (``copies.py``).
    """
    tau_rel = check_positive_real(tau_rel, "tau_rel")
    rows = check_rows(rows)
    n = rows.n_rows
    wn = normalized_weights(check_weights(weights, n), n)
    gram = gram_rows(rows, torch.nonzero(wn > 0).flatten(), chunk=chunk)
    return _gm_radius(gram, share_copies(gram, wn)[0], tau_rel)[1]


@dataclass(frozen=True)
class _ClipRun:
    coef: Tensor
    noise: float
    scale: float
    iterations_run: int
    tau: float


def centered_clip_rows(
    rows: Rows,
    weights: Weights = None,
    *,
    tau: float | None = None,
    tau_rel: float | None = None,
    iterations: int = 10,
    tol: float = 1e-6,
    start: str = "geometric_median",
    chunk: int = ROWS_CHUNK,
) -> tuple[Tensor, RowsClipStats]:
    """CenteredClip over a row source, in two passes (``streamed``): the Gram of the rows
    (``streamed.gram_rows``), the start, radius and steps on its coefficients, then
    ``v = sum_j c_j x_j`` (``streamed.combine_rows``); ``start="median"``: the coordinate
    median and the Gram centred at it (``streamed.median_gram``, float64), then the same.

        v_0 = s   (start="geometric_median": GM(x) = argmin_v sum_i w_i ||x_i - v||;
                   start="median": the coordinate-wise median)
        v_{t+1} = v_t + sum_i w_i (x_i - v_t) min(1, tau / ||x_i - v_t||) / sum_i w_i

    with copies weighing as one row (``copies.share_copies``: rows within 1% of the
    rows' typical distance) in the geometric median, the radius and the steps; the
    coordinate median is taken before the Gram and counts them in full.  Exactly one of
    ``tau`` (the radius) or ``tau_rel``: tau = tau_rel * lower median over the rows of
    positive weight of ||x_i - GM(x)|| (``clip_radius``, the same float when the
    geometric-median start needs no escalation; the median start's Gram rounds it
    differently, to about 1e-6).  At most ``iterations`` steps, stopping once a step is
    <= tol * tau.  Returns ``(v, RowsClipStats)``: v [D] in the rows' dtype, the clip
    factors at v and the radius used.
    """
    if (tau is None) == (tau_rel is None):
        raise AggregationInputError("give exactly one of tau and tau_rel")
    if tau is not None:
        tau = check_positive_real(tau, "tau")
    if tau_rel is not None:
        tau_rel = check_positive_real(tau_rel, "tau_rel")
    iterations = check_count(iterations, "iterations", minimum=1)
    tol = check_nonneg_real(tol, "tol")
    if start not in STREAMED_STARTS:
        raise AggregationInputError(f"start must be one of {list(STREAMED_STARTS)}, got {start!r}")
    rows = check_rows(rows)
    chunk = check_count(chunk, "chunk", minimum=1)
    n = rows.n_rows
    w = check_weights(weights, n)
    wn = normalized_weights(w, n)

    def radius_of(gram: Gram, ws: Tensor) -> tuple[Tensor, float]:
        if tau_rel is not None:
            return _gm_radius(gram, ws, tau_rel)
        return geometric_median_coef(gram, ws), float(tau)  # type: ignore[arg-type]

    if start == "median":
        mg = median_gram(rows, w, chunk=chunk)
        ws = share_copies(mg.gram, wn)[0]
        radius = radius_of(mg.gram, ws)[1] if tau_rel is not None else float(tau)  # type: ignore[arg-type]
        coef0 = torch.zeros(n + 1, dtype=torch.float64)
        coef0[n] = 1.0  # the median point
        med = _iterate(mg.gram, coef0, ws, radius, iterations, tol)
        run = _ClipRun(med.coef, med.noise, med.scale, med.iterations_run, radius)
        gram, extra = mg.gram, mg.median
    else:

        def solve(g: Gram) -> _ClipRun:
            ws = share_copies(g, wn)[0]
            coef, radius = radius_of(g, ws)
            r = _iterate(g, coef, ws, radius, iterations, tol)
            return _ClipRun(r.coef, r.noise, r.scale, r.iterations_run, radius)

        candidates = torch.nonzero(wn > 0).flatten()
        gram, run = solve_rows_precisely(
            rows, solve, candidates=candidates, tolerance=_NOISE, chunk=chunk
        )
        extra = None
    factors = _clip_factors(sq_dists_to(gram.matrix, run.coef)[:n].sqrt(), run.tau)
    v = combine_rows(rows, run.coef, extra, chunk=chunk)
    return v, RowsClipStats(iterations_run=run.iterations_run, clip_factors=factors, tau=run.tau)


