"""Weighted mean: the non-robust baseline."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._inputs import Weights, check_updates, check_weights, is_finite, nonfinite_rows
from .errors import NonFiniteUpdateError
from .span import combine

__all__ = ["Mean", "normalized_weights"]


def normalized_weights(weights: Tensor | None, n: int) -> Tensor:
    """w / sum(w) as float64 (uniform 1/n without weights)."""
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    return weights / weights.sum()


@dataclass(frozen=True)
class Mean:
    """Weighted arithmetic mean.

    ``mean(x_1..x_N; w) = sum_i w_i x_i / sum_i w_i``  (w_i = 1 without weights)

    * x_i: update rows [D]; w_i >= 0 weights, sum > 0.
    * Breakdown point 0: one row of large magnitude moves it without bound.
    * Cost: one matrix-vector product, O(N D) time, no extra memory beyond the
      result.  The coefficients w_i / sum(w) form a convex combination, so the
      accumulation cannot overflow for finite inputs; a non-finite result
      therefore means a NaN/Inf row, found by an exact scan only in that case
      (rows of weight 0 are always scanned: they do not reach the result).
    """

    name = "mean"

    def __call__(self, updates: Tensor, weights: Weights = None) -> Tensor:
        x = check_updates(updates)
        w = check_weights(weights, x.shape[0])
        out = combine(x, normalized_weights(w, x.shape[0]))
        # BLAS may skip zero coefficients, so rows of weight 0 are scanned directly.
        suspects = [] if w is None else torch.nonzero(w == 0).flatten().tolist()
        if not is_finite(out):
            suspects = list(range(x.shape[0]))
        bad = nonfinite_rows(x, suspects) if suspects else []
        if bad:
            raise NonFiniteUpdateError(bad)
        return out
