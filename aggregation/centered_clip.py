"""CenteredClip (Karimireddy, He, Jaggi 2021), iterated on Gram coefficients."""

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
from .errors import AggregationInputError
from .gram import Gram, lower_median
from .mean import normalized_weights
from .span import combine, dists_with_error, solve_precisely, sq_dists_to, sq_norm

__all__ = ["CenteredClip", "CenteredClipStats", "Start", "centered_clip_with_stats"]

Start = Literal["median", "mean", "zero"]
_STARTS: tuple[str, ...] = ("median", "mean", "zero")


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
    * ``start``: "median" (coordinate-wise median of the rows: robust to
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
    start: Start = "median"
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
    start: Start | Tensor = "median",
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
