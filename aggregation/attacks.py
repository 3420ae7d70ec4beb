"""Byzantine attacks on aggregation, for evaluation and for the demo's cheaters.

Every attack is a pure function of the honest updates ``honest`` [n_h, D]
(float32/float64) and the number ``f`` of Byzantine rows, returning those rows
[f, D] in the dtype and on the device of ``honest``.  Random attacks take an
explicit ``torch.Generator`` (on the device of ``honest``); none touches the
global random state.  Optimal attacks evaluate ``aggregator`` on the rows
``cat([honest, byzantine])`` (honest first).

mu = mean of the honest rows, sigma = their coordinate-wise standard deviation
(unbiased, n_h - 1 in the denominator; 0 for a single row).

Label flipping is a data attack run by a worker on its own batches (train on
label y -> (C - 1 - y) for C classes); it yields an honest-looking update, so it
has no tensor-level counterpart here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist

import torch
from torch import Tensor

from ._inputs import check_count, check_nonneg_real, check_updates
from .base import Aggregator
from .errors import AggregationInputError

__all__ = [
    "a_little_is_enough",
    "alie_z",
    "free_rider",
    "gaussian_noise",
    "inner_product_manipulation",
    "line_maximize",
    "mimic",
    "optimal_alie",
    "optimal_alie_factor",
    "optimal_ipm",
    "optimal_ipm_factor",
    "sign_flip",
]


def _honest(honest: Tensor, f: int) -> tuple[Tensor, int]:
    return check_updates(honest), check_count(f, "f", minimum=0)


def _repeat(row: Tensor, f: int) -> Tensor:
    return row.unsqueeze(0).repeat(f, 1)


def _sigma(honest: Tensor) -> Tensor:
    if honest.shape[0] < 2:
        return torch.zeros_like(honest[0])
    return honest.std(dim=0, correction=1)


def sign_flip(honest: Tensor, f: int) -> Tensor:
    """Sign flipping: every Byzantine row is -mu (the honest mean reversed)."""
    x, f = _honest(honest, f)
    return _repeat(-x.mean(dim=0), f)


def inner_product_manipulation(honest: Tensor, f: int, epsilon: float = 0.1) -> Tensor:
    """Inner-product manipulation (Xie, Koyejo, Gupta 2020, "Fall of Empires"): -epsilon * mu.

    With enough such rows the aggregate's inner product with mu turns negative
    while each row stays small.
    """
    x, f = _honest(honest, f)
    eps = check_nonneg_real(epsilon, "epsilon")
    return _repeat(x.mean(dim=0) * -eps, f)


def alie_z(n: int, f: int) -> float:
    """The z of "A Little Is Enough" (Baruch, Baruch, Goldberg, NeurIPS 2019).

        s = floor(n / 2 + 1) - f        (honest rows the attacker must "win over")
        z = Phi^{-1}((n - s) / n)

    n: all workers (honest + Byzantine); requires 1 <= s.
    """
    n = check_count(n, "n", minimum=1)
    f = check_count(f, "f", minimum=0)
    s = math.floor(n / 2 + 1) - f
    if s < 1 or s >= n:
        raise AggregationInputError(f"ALIE needs 1 <= floor(n/2 + 1) - f < n; got n={n}, f={f}")
    return NormalDist().inv_cdf((n - s) / n)


def a_little_is_enough(
    honest: Tensor, f: int, *, n: int | None = None, z: float | None = None
) -> Tensor:
    """ALIE: every Byzantine row is mu - z * sigma, coordinate-wise.

    z defaults to ``alie_z(n, f)`` with n = n_h + f: small enough that the rows
    stay within the honest spread on every coordinate, so distance- and
    rank-based rules keep them, yet all pull the same way.  (The sign follows
    the released code of Karimireddy, He, Jaggi 2021; ByzFL uses +.)
    """
    x, f = _honest(honest, f)
    if z is None:
        z = alie_z(x.shape[0] + f if n is None else n, f)
    elif not math.isfinite(float(z)):
        raise AggregationInputError(f"z must be finite, got {z!r}")
    return _repeat(x.mean(dim=0) - float(z) * _sigma(x), f)


def gaussian_noise(
    honest: Tensor, f: int, *, std: float = 1.0, generator: torch.Generator, centered: bool = False
) -> Tensor:
    """Gaussian rows: i.i.d. N(0, std^2) per coordinate (plus mu when ``centered``)."""
    x, f = _honest(honest, f)
    std = check_nonneg_real(std, "std")
    noise = torch.randn(f, x.shape[1], generator=generator, dtype=x.dtype, device=x.device)
    noise.mul_(std)
    return noise + x.mean(dim=0) if centered else noise


def free_rider(
    honest: Tensor, f: int, *, noise_std: float = 0.0, generator: torch.Generator | None = None
) -> Tensor:
    """Free rider: does no work.  Zeros, or N(0, noise_std^2) noise to look busy."""
    x, f = _honest(honest, f)
    noise_std = check_nonneg_real(noise_std, "noise_std")
    if noise_std == 0.0:
        return x.new_zeros(f, x.shape[1])
    if generator is None:
        raise AggregationInputError("free_rider with noise needs an explicit generator")
    return gaussian_noise(x, f, std=noise_std, generator=generator)


def mimic(honest: Tensor, f: int, *, target: int = 0) -> Tensor:
    """Mimic (Karimireddy, He, Jaggi 2022): every Byzantine row copies honest row ``target``.

    Over-represents one worker's data, hurting heterogeneous training.
    """
    x, f = _honest(honest, f)
    target = check_count(target, "target", minimum=0)
    if target >= x.shape[0]:
        raise AggregationInputError(f"target {target} out of range for {x.shape[0]} honest rows")
    return _repeat(x[target], f)


def line_maximize(
    objective: Callable[[float], float],
    *,
    evaluations: int = 16,
    start: float = 0.0,
    delta: float = 1.0,
    ratio: float = 0.8,
) -> float:
    """Best-effort argmax of ``objective`` over factors >= 0 (as ByzFL's LineMaximize).

    Expansion: from ``start``, step by ``delta`` (doubling) while the objective
    improves.  Contraction: probe around the best point with steps shrinking by
    ``ratio``, moving towards improvements.  Uses exactly ``evaluations`` calls;
    deterministic for a deterministic objective.
    """
    evaluations = check_count(evaluations, "evaluations", minimum=1)
    start = check_nonneg_real(start, "start")
    if not (delta > 0 and 0 < ratio < 1):
        raise AggregationInputError("line_maximize needs delta > 0 and 0 < ratio < 1")
    best_x, best_y = start, objective(start)
    left = evaluations - 1
    probe = best_x
    while left > 0:  # expansion
        probe = best_x + delta
        y = objective(probe)
        left -= 1
        if y > best_y:
            best_x, best_y = probe, y
            delta *= 2
        else:
            delta *= ratio
            break
    while left > 0:  # contraction
        probe = probe + delta if probe < best_x else max(probe - delta, 0.0)
        y = objective(probe)
        left -= 1
        if y > best_y:
            best_x, best_y = probe, y
        delta *= ratio
    return best_x


def _damage(aggregator: Aggregator, honest: Tensor, byzantine: Tensor) -> float:
    """||aggregator(honest + byzantine) - mu||: how far the attack moved the aggregate."""
    out = aggregator(torch.cat([honest, byzantine]))
    return float((out - honest.mean(dim=0)).norm())


def optimal_ipm_factor(
    honest: Tensor, f: int, aggregator: Aggregator, *, evaluations: int = 16
) -> float:
    """The epsilon >= 0 found by ``line_maximize`` for IPM against ``aggregator``."""
    x, f = _honest(honest, f)
    return line_maximize(
        lambda eps: _damage(aggregator, x, inner_product_manipulation(x, f, eps)),
        evaluations=evaluations,
    )


def optimal_ipm(honest: Tensor, f: int, aggregator: Aggregator, *, evaluations: int = 16) -> Tensor:
    """IPM with epsilon line-searched to maximize ||aggregate - mu|| (ByzFL's optimal IPM)."""
    eps = optimal_ipm_factor(honest, f, aggregator, evaluations=evaluations)
    return inner_product_manipulation(honest, f, eps)


def optimal_alie_factor(
    honest: Tensor, f: int, aggregator: Aggregator, *, evaluations: int = 16
) -> float:
    """The z >= 0 found by ``line_maximize`` for ALIE against ``aggregator``."""
    x, f = _honest(honest, f)
    return line_maximize(
        lambda z: _damage(aggregator, x, a_little_is_enough(x, f, z=z)),
        evaluations=evaluations,
    )


def optimal_alie(
    honest: Tensor, f: int, aggregator: Aggregator, *, evaluations: int = 16
) -> Tensor:
    """ALIE with z line-searched to maximize ||aggregate - mu|| (ByzFL's optimal ALIE)."""
    z = optimal_alie_factor(honest, f, aggregator, evaluations=evaluations)
    return a_little_is_enough(honest, f, z=z)
