"""Geometric median by smoothed Weiszfeld iterations (RFA), on Gram coefficients."""

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
from .gram import Gram, lower_median
from .mean import normalized_weights
from .span import combine, dists_with_error, solve_precisely, sq_dists_to, sq_norm

__all__ = ["GeometricMedian"]


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

    Cost: one Gram pass over the data (O(N^2 D)), O(N^2) per iteration, one
    matrix-vector product; extra memory O(N * CHUNK).
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
        x = check_updates(updates)
        n = x.shape[0]
        w = check_weights(weights, n)
        wn = normalized_weights(w, n)
        act = torch.nonzero(wn > 0).flatten()
        _, run = solve_precisely(
            x, lambda g: self._iterate(g, wn), candidates=act, tolerance=_NOISE
        )
        return combine(x, run.coef)

    def _iterate(self, gram: Gram, wn: Tensor) -> _Run:
        """Weiszfeld on coefficients, with a bound on the result's rounding error.

        beta_i = w_i / max(eps, d~_i) has relative error <= delta_i / d~_i, so v
        is off by at most sum_i beta_i delta_i / sum_i beta_i (for d~_i > eps).
        """
        act = wn > 0
        coef = wn.clone()
        for _ in range(self.iterations):
            dist = sq_dists_to(gram.matrix, coef).sqrt()
            beta = wn / dist.clamp(min=self.eps)
            new = beta / beta.sum()
            step = math.sqrt(sq_norm(gram.matrix, new - coef))
            coef = new
            if step <= self.tol * lower_median(dist[act]):
                break
        dist, delta = dists_with_error(gram, coef)
        beta = wn / dist.clamp(min=self.eps)
        noise = float((beta / beta.sum()) @ torch.where(dist + delta > self.eps, delta, 0.0))
        return _Run(coef, noise, lower_median(dist[act]))


@dataclass(frozen=True)
class _Run:
    coef: Tensor
    noise: float
    scale: float


#: Tolerated bound on the result's rounding error, relative to the median
#: distance to it (a pessimistic bound, see centered_clip._NOISE).
_NOISE = 1e-4
