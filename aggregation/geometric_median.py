"""Geometric median by smoothed Weiszfeld iterations (RFA), on Gram coefficients.

``geometric_median_coef`` runs Weiszfeld on the [N, N] Gram of the rows (O(N^2) per
step): CenteredClip's default start and radius (``centered_clip``) and the
``geometric_median`` rule both use it.  The rule runs over a row source in two
passes (``geometric_median_rows``: ``streamed.gram_rows``, then one matrix-vector
product), in memory (``GeometricMedian``) as over a row file, with the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ._inputs import (
    Weights,
    check_count,
    check_nonneg_real,
    check_positive_real,
    check_updates,
    check_weights,
)
from .gram import Gram, lower_median, medoid, pairwise_sq_dists
from .mean import normalized_weights
from .rows import Rows, TensorRows
from .span import dists_with_error, sq_dists_to, sq_norm
from .streamed import ROWS_CHUNK, check_rows, combine_rows, solve_rows_precisely

__all__ = ["GeometricMedian", "geometric_median_coef", "geometric_median_rows"]

#: Defaults of ``geometric_median_coef`` (CenteredClip's start): at most this many
#: Weiszfeld steps, stopping at a step below GM_TOL times the median distance.
GM_ITERATIONS = 100
GM_TOL = 1e-6


@dataclass(frozen=True)
class GeometricMedian:
    """Approximate geometric median (Pillutla, Kakade, Harchaoui 2022, "Robust
    Aggregation for Federated Learning", RFA; Weiszfeld 1937).

        GM(x) = argmin_v sum_i w_i ||x_i - v||
        v_0 = sum_i w_i x_i / sum_i w_i
        beta_i = w_i / max(eps, ||x_i - v_t||)
        v_{t+1} = sum_i beta_i x_i / sum_i beta_i

    stopping after ``iterations`` steps or once
    ||v_{t+1} - v_t|| <= tol * median_i ||x_i - v_t||
    (lower median over rows of positive weight: scale free, and far outliers
    cannot inflate it into an early stop).
    eps > 0 smooths the objective near the data points (same units as the
    updates).  Breakdown point 1/2.

    Cost: one Gram pass over the data (O(N^2 D), ``streamed.gram_rows``), O(N^2)
    per iteration (``geometric_median_coef``), one matrix-vector product; extra
    memory O(N * chunk).  ``geometric_median_rows`` is the same rule over a row
    source (same bytes for the same rows).
    """

    iterations: int = 100
    tol: float = 1e-7
    eps: float = 1e-8
    name = "geometric_median"

    def __post_init__(self) -> None:
        check_count(self.iterations, "iterations", minimum=1)
        check_nonneg_real(self.tol, "tol")
        check_positive_real(self.eps, "eps")

    def __call__(self, updates: Tensor, weights: Weights = None) -> Tensor:
        return geometric_median_rows(
            TensorRows(check_updates(updates)),
            weights,
            iterations=self.iterations,
            tol=self.tol,
            eps=self.eps,
        )


def geometric_median_rows(
    rows: Rows,
    weights: Weights = None,
    *,
    iterations: int = 100,
    tol: float = 1e-7,
    eps: float = 1e-8,
    chunk: int = ROWS_CHUNK,
) -> Tensor:
    """``GeometricMedian(iterations, tol, eps)`` over a row source: one Gram pass
    (``streamed.solve_rows_precisely``: one more in the rare case its rounding-error
    bound is too large), Weiszfeld on coefficients from the weighted mean, one
    matrix-vector product (``streamed.combine_rows``).  [D] in the rows' dtype."""
    iterations = check_count(iterations, "iterations", minimum=1)
    tol = check_nonneg_real(tol, "tol")
    eps = check_positive_real(eps, "eps")
    rows = check_rows(rows)
    chunk = check_count(chunk, "chunk", minimum=1)
    n = rows.n_rows
    wn = normalized_weights(check_weights(weights, n), n)
    act = torch.nonzero(wn > 0).flatten()

    def run(gram: Gram) -> _Run:
        coef = geometric_median_coef(gram, wn, iterations=iterations, tol=tol, eps=eps, start=wn)
        return _with_noise(gram, wn, coef, eps)

    _, solution = solve_rows_precisely(rows, run, candidates=act, tolerance=_NOISE, chunk=chunk)
    return combine_rows(rows, solution.coef, chunk=chunk)


def geometric_median_coef(
    gram: Gram,
    wn: Tensor,
    *,
    iterations: int = GM_ITERATIONS,
    tol: float = GM_TOL,
    eps: float | None = None,
    start: Tensor | None = None,
) -> Tensor:
    """Coefficients over the Gram's points of the weighted geometric median of its rows.

        GM = argmin_v sum_i w_i ||x_i - v||,   v_{t+1} = sum_i b_i x_i / sum_i b_i,
        b_i = w_i / max(eps, ||x_i - v_t||)

    (Weiszfeld on coefficients, O(N^2) per step; ``wn``: the normalized weights [N]).
    v_0: ``start`` (coefficients over the rows, summing to 1), by default the weighted
    mean of the ``m - floor((m - 1) / 2)`` rows nearest the medoid (m rows of positive
    weight), already robust, and never a data point where the iteration would stall.
    ``eps`` (same units as the rows) defaults to 1e-9 times the median distance to v_0
    (scale free).  Stops after ``iterations`` steps or a step <= ``tol`` times the
    median distance from the current iterate.  Breakdown point 1/2; the extra points
    of the Gram get 0.
    """
    n, p = gram.n_rows, gram.n_points
    h = gram.matrix[:n, :n]
    act = torch.nonzero(wn > 0).flatten()
    coef = torch.zeros(p, dtype=torch.float64)
    if start is not None:
        c = start[:n].to(torch.float64).clone()
    elif act.numel() == 1:
        coef[act[0]] = 1.0
        return coef
    else:
        c = _robust_start(h, wn, act)
    dist = sq_dists_to(h, c).sqrt()
    if eps is None:
        eps = max(1e-9 * lower_median(dist[act]), 1e-300)
    for _ in range(iterations):
        beta = wn / dist.clamp(min=eps)
        new = beta / beta.sum()
        step = math.sqrt(sq_norm(h, new - c))
        scale = lower_median(dist[act])
        c = new
        dist = sq_dists_to(h, c).sqrt()
        if step <= tol * scale:
            break
    coef[:n] = c
    return coef


def _robust_start(h: Tensor, wn: Tensor, act: Tensor) -> Tensor:
    """Weighted mean of the ``m - floor((m - 1) / 2)`` active rows nearest the medoid."""
    m = act.numel()
    sub = pairwise_sq_dists(h[act][:, act])
    best, _ = medoid(sub)
    near = act[torch.sort(sub[best], stable=True).indices[: m - (m - 1) // 2]]
    c = torch.zeros(h.shape[0], dtype=torch.float64)
    c[near] = wn[near]
    return c / c.sum()


def _with_noise(gram: Gram, wn: Tensor, coef: Tensor, eps: float) -> _Run:
    """``coef`` with a bound on the result's rounding error.

    beta_i = w_i / max(eps, d~_i) has relative error <= delta_i / d~_i, so v is off by
    at most sum_i beta_i delta_i / sum_i beta_i (for d~_i > eps).
    """
    dist, delta = dists_with_error(gram, coef)
    beta = wn / dist.clamp(min=eps)
    noise = float((beta / beta.sum()) @ torch.where(dist + delta > eps, delta, 0.0))
    return _Run(coef, noise, lower_median(dist[wn > 0]))


@dataclass(frozen=True)
class _Run:
    coef: Tensor
    noise: float
    scale: float


#: Tolerated bound on the result's rounding error, relative to the median
#: distance to it (a pessimistic bound, see centered_clip._NOISE).
_NOISE = 1e-4
