"""Krum and Multi-Krum (Blanchard, El Mhamdi, Guerraoui, Stainer, NeurIPS 2017).

Distances come from the Gram matrix of the rows (``streamed.gram_rows``): one pass
over the data, then O(N^2 log N) work on scores, then one row copy (Krum) or one
matrix-vector product (Multi-Krum).  ``krum_rows`` and ``multi_krum_rows`` are the
rules over a row source (what validators run); ``Krum`` and ``MultiKrum`` call them
on the rows in memory, with the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._inputs import Weights, active_rows, check_count, check_updates, check_weights
from .errors import AggregationInputError
from .gram import pairwise_sq_dists
from .rows import Rows, TensorRows
from .streamed import ROWS_CHUNK, check_rows, combine_rows, gram_rows, read_row

__all__ = ["Krum", "MultiKrum", "krum_rows", "krum_scores", "multi_krum_rows"]


def krum_scores(sq_dists: Tensor, f: int) -> Tensor:
    """score(i) = sum of the n - f - 2 smallest ||x_i - x_j||^2 over j != i.

    ``sq_dists``: [n, n] pairwise squared distances of the participating rows.
    """
    n = sq_dists.shape[0]
    masked = sq_dists.clone()
    masked.fill_diagonal_(float("inf"))
    return masked.sort(dim=1).values[:, : n - f - 2].sum(dim=1)


def _selection(
    rows: Rows, weights: Weights, f: int, rule: str, chunk: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Validate, then return (participating rows, their Krum scores, weights)."""
    rows = check_rows(rows)
    f = check_count(f, "f", minimum=0)
    n_rows = rows.n_rows
    w = check_weights(weights, n_rows)
    act = active_rows(w, n_rows)
    n = act.numel()
    if n <= 2 * f + 2:
        raise AggregationInputError(
            f"{rule} needs n > 2f + 2; got f={f}, n={n} rows with positive weight"
        )
    gram = gram_rows(rows, act, chunk=chunk)
    scores = krum_scores(pairwise_sq_dists(gram.matrix[act][:, act]), f)
    return act, scores, w


def krum_rows(rows: Rows, weights: Weights = None, *, f: int, chunk: int = ROWS_CHUNK) -> Tensor:
    """``Krum(f)`` over a row source: one Gram pass, then a copy of the chosen row."""
    act, scores, _ = _selection(rows, weights, f, "Krum", chunk)
    return read_row(rows, int(act[int(torch.argmin(scores))]), chunk=chunk)


def multi_krum_rows(
    rows: Rows, weights: Weights = None, *, f: int, m: int | None = None, chunk: int = ROWS_CHUNK
) -> Tensor:
    """``MultiKrum(f, m)`` over a row source: one Gram pass, one matrix-vector product."""
    if m is not None:
        m = check_count(m, "m", minimum=1)
    act, scores, w = _selection(rows, weights, f, "Multi-Krum", chunk)
    n = act.numel()
    m = n - f if m is None else m
    if m > n:
        raise AggregationInputError(f"Multi-Krum needs m <= n; got m={m}, n={n}")
    order = torch.sort(scores, stable=True).indices[:m]
    chosen = act[order]
    coef = torch.zeros(rows.n_rows, dtype=torch.float64)
    coef[chosen] = 1.0 if w is None else w[chosen]
    return combine_rows(rows, coef / coef.sum(), chunk=chunk)


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
        return krum_rows(TensorRows(check_updates(updates)), weights, f=self.f)


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
        return multi_krum_rows(TensorRows(check_updates(updates)), weights, f=self.f, m=self.m)
