"""Points of the span of the inputs: distances, error bounds, materialization.

The distance-based rules iterate on coefficients ``c`` over the points of a
``Gram`` (rows, extra points, origin) with ``sum(c) = 1``, so that
``v = sum_j c_j p_j``.  This module turns coefficients into distances and
their rounding-error bounds, materializes ``v``, and escalates the Gram's
precision when a rule's error bound is too large (``solve_precisely``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch
from torch import Tensor

from ._parallel import map_chunks
from .gram import REL_ERROR_F64, Gram, compute_gram

#: Columns per matrix-vector product when materializing a result.
COMBINE_CHUNK = 1 << 17

__all__ = [
    "Solution",
    "combine",
    "dists_with_error",
    "solve_precisely",
    "sq_dist_error",
    "sq_dists_to",
    "sq_norm",
]


def sq_dists_to(gram: Tensor, coef: Tensor) -> Tensor:
    """||p_i - v||^2 for every point i, where v = sum_j coef_j p_j and sum(coef) = 1."""
    gc = gram @ coef
    return (gram.diagonal() - 2.0 * gc + coef @ gc).clamp_(min=0.0)


def sq_dist_error(gram: Gram, coef: Tensor) -> Tensor:
    """Rounding-error bound on ``sq_dists_to(gram.matrix, coef)`` for every point.

    With |error of H_ij| <= rel e_i e_j, ||p_i - v||^2 = (u_i - c)^T H (u_i - c)
    (u_i: the i-th unit vector) is off by at most rel (e_i + sum_j |c_j| e_j)^2:
    small against the distance unless p_i and v are close to each other but far
    from where the errors are measured from (cancellation).
    """
    e = gram.err_scale
    return gram.rel_error * (e + coef.abs() @ e) ** 2


def dists_with_error(gram: Gram, coef: Tensor) -> tuple[Tensor, Tensor]:
    """Distances ||p_i - v|| and a bound on their rounding error, for every point.

    From |d~^2 - d^2| <= err: |d~ - d| <= min(sqrt(err), err / d~).
    """
    sq = sq_dists_to(gram.matrix, coef)
    err = sq_dist_error(gram, coef)
    dist = sq.sqrt()
    return dist, torch.minimum(err.sqrt(), err / dist.clamp(min=1e-300))


class Solution(Protocol):
    coef: Tensor  # coefficients of the result over the Gram points
    noise: float  # bound on the result's rounding error (same units as the updates)
    scale: float  # the size the noise is judged against (a median distance)


S = TypeVar("S", bound=Solution)


def solve_precisely(
    updates: Tensor,
    run: Callable[[Gram], S],
    *,
    extra: Tensor | None = None,
    include_origin: bool = False,
    candidates: Tensor | None = None,
    tolerance: float,
) -> tuple[Gram, S]:
    """Run ``run`` on a Gram matrix, escalating precision while its noise is too large.

    1. the Gram of ``compute_gram`` (raw or centered, float32 products for
       float32 inputs);
    2. if ``noise > tolerance * scale``: centered around the row nearest to the
       result (errors now scale with distances from there);
    3. if still too noisy: the same with float64 products (about 3x slower).

    Escalation is rare: it takes a result that lands close to some rows but far
    from the origin or from the chosen reference (cancellation).
    """
    gram = compute_gram(updates, extra=extra, include_origin=include_origin, candidates=candidates)
    solution = run(gram)
    for wide in (False, True):
        if solution.noise <= tolerance * solution.scale or gram.rel_error <= REL_ERROR_F64:
            break
        near = int(torch.argmin(sq_dists_to(gram.matrix, solution.coef)[: gram.n_rows]))
        gram = compute_gram(
            updates,
            extra=extra,
            include_origin=include_origin,
            candidates=candidates,
            wide=wide,
            center_at=near,
        )
        solution = run(gram)
    return gram, solution


def sq_norm(gram: Tensor, delta: Tensor) -> float:
    """||sum_j delta_j p_j||^2 for coefficients with sum(delta) = 0 (a displacement)."""
    return max(float(delta @ (gram @ delta)), 0.0)


def combine(updates: Tensor, coef: Tensor, extra: Tensor | None = None) -> Tensor:
    """Materialize v = sum_j coef_j p_j in the dtype of ``updates`` (one pass over it).

    ``coef`` is indexed like the Gram points: N rows, then the extra rows, then
    (optionally) the origin, which contributes nothing.
    """
    n, d = updates.shape
    c = coef[:n].to(device=updates.device, dtype=updates.dtype)
    out = torch.empty(d, dtype=updates.dtype, device=updates.device)

    def work(a: int, b: int, _: None) -> None:
        torch.mv(updates[:, a:b].T, c, out=out[a:b])

    map_chunks(work, d, COMBINE_CHUNK, device=updates.device, make_state=lambda: None)
    if extra is not None:
        for j in range(extra.shape[0]):
            cj = float(coef[n + j])
            if cj != 0.0:
                out.add_(extra[j].to(updates.dtype), alpha=cj)
    return out
