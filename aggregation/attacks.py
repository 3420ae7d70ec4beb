"""Byzantine attacks on aggregation, for evaluation and for the demo's cheaters.

Every attack is a pure function of the honest updates ``honest`` [n_h, D]
(float32/float64) and the number ``f`` of Byzantine rows, returning those rows
[f, D] in the dtype and on the device of ``honest``.  Random attacks take an
explicit ``torch.Generator`` (on the device of ``honest``); none touches the
global random state.  Optimal attacks evaluate ``aggregator`` on the rows
``cat([honest, byzantine])`` (honest first).

mu = mean of the honest rows, sigma = their coordinate-wise standard deviation
(unbiased, n_h - 1 in the denominator; 0 for a single row).

The aggregator-agnostic optimization attacks of Shejwalkar and Houmansadr
(NDSS 2021, "Manipulating the Byzantine"), :func:`min_max` and :func:`min_sum`,
send mu - gamma * p for a perturbation direction p (``"unit"``: mu / ||mu||,
``"sign"``: sign(mu), ``"std"``: sigma) with the largest gamma whose rows still
look like the honest ones by distance; gamma is solved in closed form (the limit
of the paper's bisection).

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
    "DIRECTIONS",
    "a_little_is_enough",
    "alie_z",
    "free_rider",
    "gaussian_noise",
    "inner_product_manipulation",
    "line_maximize",
    "mimic",
    "min_max",
    "min_max_gamma",
    "min_sum",
    "min_sum_gamma",
    "perturbation",
    "optimal_alie",
    "optimal_alie_factor",
    "optimal_ipm",
    "optimal_ipm_factor",
    "optimal_sign",
    "optimal_sign_factor",
    "sign_flip",
    "sign_perturbation",
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


def mimic(honest: Tensor, f: int, *, target: int = 0, jitter: float = 0.0,
          generator: torch.Generator | None = None) -> Tensor:
    """Mimic (Karimireddy, He, Jaggi 2022): every Byzantine row copies honest row ``target``.

    Over-represents one worker's data, hurting heterogeneous training.  ``jitter`` > 0
    adds to each copy its own Gaussian noise of norm ``jitter`` times the honest rows'
    median pairwise distance, so the copies are no longer copies (``copies.py`` counts
    rows within a quarter of that distance once; a little more evades it).
    """
    x, f = _honest(honest, f)
    target = check_count(target, "target", minimum=0)
    if target >= x.shape[0]:
        raise AggregationInputError(f"target {target} out of range for {x.shape[0]} honest rows")
    rows = _repeat(x[target], f)
    if jitter > 0 and f:
        spread = torch.pdist(x.double()).median() if x.shape[0] > 1 else x[target].norm()
        noise = torch.randn(rows.shape, generator=generator, dtype=torch.float64)
        noise *= float(jitter) * float(spread) / noise.norm(dim=1, keepdim=True)
        rows = (rows.double() + noise).to(x.dtype)
    return rows


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


def sign_perturbation(honest: Tensor, f: int, z: float = 1.0) -> Tensor:
    """``mu - z * s * sign(mu)``, f copies, with ``s`` the root mean square of sigma: the
    sign direction of Shejwalkar and Houmansadr in the units of ALIE's z (z = 1 moves
    every coordinate by a typical honest standard deviation)."""
    x, f = _honest(honest, f)
    mu = x.mean(dim=0)
    scale = _sigma(x).square().mean().sqrt()
    return _repeat(mu - z * scale * torch.sign(mu), f)


def optimal_sign_factor(
    honest: Tensor, f: int, aggregator: Aggregator, *, evaluations: int = 16
) -> float:
    """The z >= 0 found by ``line_maximize`` for :func:`sign_perturbation` against
    ``aggregator``."""
    x, f = _honest(honest, f)
    return line_maximize(
        lambda z: _damage(aggregator, x, sign_perturbation(x, f, z)), evaluations=evaluations
    )


def optimal_sign(
    honest: Tensor, f: int, aggregator: Aggregator, *, evaluations: int = 16
) -> Tensor:
    """The AGR-tailored attack of Shejwalkar and Houmansadr (NDSS 2021) in the sign
    direction: ``mu - gamma sign(mu)`` with gamma line-searched to maximize
    ||aggregate - mu|| against ``aggregator`` (the unit direction is the optimal IPM's
    family, the std direction the optimal ALIE's)."""
    z = optimal_sign_factor(honest, f, aggregator, evaluations=evaluations)
    return sign_perturbation(honest, f, z)


#: Perturbation directions of :func:`min_max` / :func:`min_sum` (Shejwalkar, Houmansadr 2021).
DIRECTIONS = ("unit", "sign", "std")


def perturbation(honest: Tensor, direction: str = "unit") -> Tensor:
    """The direction p the malicious row moves against: ``unit`` mu / ||mu|| (0 if mu = 0),
    ``sign`` sign(mu), ``std`` sigma (coordinate-wise honest standard deviation)."""
    x = check_updates(honest)
    mu = x.mean(dim=0)
    if direction == "unit":
        norm = mu.norm()
        return mu / norm if float(norm) > 0 else torch.zeros_like(mu)
    if direction == "sign":
        return torch.sign(mu)
    if direction == "std":
        return _sigma(x)
    raise AggregationInputError(f"unknown direction {direction!r}; expected one of {DIRECTIONS}")


def _distance_terms(honest: Tensor, p: Tensor) -> tuple[Tensor, Tensor, float, Tensor]:
    """In float64, with d_i = mu - x_i: a_i = ||d_i||^2, b_i = <d_i, p>, c = ||p||^2, and
    the pairwise squared distances of the honest rows (||x_i - x_j||^2)."""
    x = honest.to(torch.float64)
    p = p.to(torch.float64)
    d = x.mean(dim=0) - x
    gram = x @ x.T
    sq = gram.diagonal()
    pair = (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0.0)
    return (d * d).sum(dim=1), d @ p, float(p @ p), pair


def min_max_gamma(honest: Tensor, direction: str = "unit") -> float:
    """The largest gamma >= 0 with max_i ||mu - gamma p - x_i|| <= max_{i,j} ||x_i - x_j||
    (min-max: the malicious row is no farther from any honest row than the two farthest
    honest rows are from each other). Each constraint is a quadratic in gamma that holds
    at 0, so gamma = min_i (b_i + sqrt(b_i^2 + c (T - a_i))) / c with T the largest squared
    pairwise distance; 0 when p = 0."""
    x = check_updates(honest)
    a, b, c, pair = _distance_terms(x, perturbation(x, direction))
    if c <= 0:
        return 0.0
    t = float(pair.max())
    roots = (b + torch.sqrt((b * b + c * (t - a)).clamp_min(0.0))) / c
    return max(0.0, float(roots.min()))


def min_sum_gamma(honest: Tensor, direction: str = "unit") -> float:
    """The largest gamma >= 0 with sum_i ||mu - gamma p - x_i||^2 <= max_i sum_j
    ||x_i - x_j||^2 (min-sum: the malicious row's summed squared distance to the honest
    rows is no larger than an honest row's). Since sum_i (mu - x_i) = 0 the left side is
    A + n gamma^2 c, so gamma = sqrt((T - A) / (n c)); 0 when p = 0."""
    x = check_updates(honest)
    a, _, c, pair = _distance_terms(x, perturbation(x, direction))
    if c <= 0:
        return 0.0
    slack = float(pair.sum(dim=1).max()) - float(a.sum())
    return math.sqrt(max(0.0, slack) / (x.shape[0] * c))


def min_max(honest: Tensor, f: int, direction: str = "unit") -> Tensor:
    """Min-max (Shejwalkar, Houmansadr, NDSS 2021), aggregator-agnostic: every Byzantine
    row is mu - gamma * p with gamma = :func:`min_max_gamma`."""
    x, f = _honest(honest, f)
    gamma = min_max_gamma(x, direction)
    return _repeat(x.mean(dim=0) - gamma * perturbation(x, direction), f)


def min_sum(honest: Tensor, f: int, direction: str = "unit") -> Tensor:
    """Min-sum (Shejwalkar, Houmansadr, NDSS 2021), aggregator-agnostic: every Byzantine
    row is mu - gamma * p with gamma = :func:`min_sum_gamma`."""
    x, f = _honest(honest, f)
    gamma = min_sum_gamma(x, direction)
    return _repeat(x.mean(dim=0) - gamma * perturbation(x, direction), f)
