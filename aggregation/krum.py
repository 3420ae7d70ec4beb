"""Krum and Multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS 2017).

Distances come from the centered Gram matrix (``gram.py``): one pass over the
data, then O(N^2 log N) work on scores, then one row copy (Krum) or one
matrix-vector product (Multi-Krum).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._inputs import Weights, active_rows, check_count, check_updates, check_weights
from .errors import AggregationInputError
from .gram import compute_gram, pairwise_sq_dists
from .span import combine

__all__ = ["Krum", "MultiKrum", "krum_scores"]


def krum_scores(sq_dists: Tensor, f: int) -> Tensor:
    """score(i) = sum of the n - f - 2 smallest ||x_i - x_j||^2 over j != i.

    ``sq_dists``: [n, n] pairwise squared distances of the participating rows.
    """
    n = sq_dists.shape[0]
    masked = sq_dists.clone()
    masked.fill_diagonal_(float("inf"))
    return masked.sort(dim=1).values[:, : n - f - 2].sum(dim=1)


def _selection(
    updates: Tensor, weights: Weights, f: int, rule: str
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Validate, then return (updates, participating rows, their Krum scores, weights)."""
    x = check_updates(updates)
    w = check_weights(weights, x.shape[0])
    act = active_rows(w, x.shape[0])
    n = act.numel()
    if n <= 2 * f + 2:
        raise AggregationInputError(
            f"{rule} needs n > 2f + 2; got f={f}, n={n} rows with positive weight"
        )
    gram = compute_gram(x, candidates=act)
    scores = krum_scores(pairwise_sq_dists(gram.matrix[act][:, act]), f)
    return x, act, scores, w


@dataclass(frozen=True)
class Krum:
    """Krum: the row closest to its n - f - 2 nearest neighbours.

        Krum(x) = x_{i*},  i* = argmin_i sum_{j in N_i} ||x_i - x_j||^2

    N_i: the n - f - 2 rows nearest to x_i (j != i); n: rows with positive
    weight; f: Byzantine rows tolerated, requires n > 2f + 2.  Weights only
    select the participating rows (weight 0 excludes a row).  Ties go to the
    lowest row index.  Returns a copy of one input row.

    Cost: one Gram pass over the data (O(N^2 D)) plus O(N^2 log N).
    """

    f: int
    name = "krum"

    def __post_init__(self) -> None:
        check_count(self.f, "f", minimum=0)

    def __call__(self, updates: Tensor, weights: Weights = None) -> Tensor:
        x, act, scores, _ = _selection(updates, weights, self.f, "Krum")
        return x[int(act[int(torch.argmin(scores))])].clone()


@dataclass(frozen=True)
class MultiKrum:
    """Multi-Krum: weighted mean of the m rows with the lowest Krum scores.

        MultiKrum(x) = sum_{i in S} w_i x_i / sum_{i in S} w_i

    S: the m rows with the smallest Krum scores (see ``Krum``; ties by lowest
    index); m defaults to n - f.  Requires n > 2f + 2 and 1 <= m <= n.

    Cost: one Gram pass, O(N^2 log N), one matrix-vector product.
    """

    f: int
    m: int | None = None
    name = "multi_krum"

    def __post_init__(self) -> None:
        check_count(self.f, "f", minimum=0)
        if self.m is not None:
            check_count(self.m, "m", minimum=1)

    def __call__(self, updates: Tensor, weights: Weights = None) -> Tensor:
        x, act, scores, w = _selection(updates, weights, self.f, "Multi-Krum")
        n = act.numel()
        m = n - self.f if self.m is None else self.m
        if m > n:
            raise AggregationInputError(f"Multi-Krum needs m <= n; got m={m}, n={n}")
        order = torch.sort(scores, stable=True).indices[:m]
        chosen = act[order]
        coef = torch.zeros(x.shape[0], dtype=torch.float64)
        coef[chosen] = 1.0 if w is None else w[chosen]
        return combine(x, coef / coef.sum())
