"""Coordinate-wise rules: trimmed mean and median.

Both work column by column, on chunks of ``CHUNK`` columns so the extra memory
is a few [N, CHUNK] blocks, whatever D.  Without weights (or with equal weights)
a pruned sorting network computes the needed order statistics with vectorized
min/max; with unequal weights each chunk is sorted with ``torch.sort`` and the
weights follow their values (slower, about 30x a mean at N = 16).

Ties between equal values are broken by row index (stable sort), which only
matters for which weight is trimmed away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._inputs import (
    Weights,
    active_rows,
    check_count,
    check_updates,
    check_weights,
    nonfinite_rows,
    raise_if_nonfinite,
)
from ._parallel import map_chunks
from .errors import AggregationInputError, NonFiniteUpdateError
from .sorting_network import apply_network, pruned_network

__all__ = ["CHUNK", "CoordinateMedian", "TrimmedMean", "median_and_lower"]

#: Columns per chunk on CPU: below torch's parallel grain (32768 elements), so
#: each elementwise op runs on one thread; N + 1 such buffers per thread.
CHUNK = 32752  # a multiple of 16: chunks start 64-byte aligned

#: Cumulative weights within this fraction of W/2 count as exactly W/2.
_TIE = 1e-12

Reducer = Callable[[Tensor], Tensor]  # [n, L] block (a copy) -> [L]


@dataclass(frozen=True)
class TrimmedMean:
    """Coordinate-wise trimmed mean (Yin, Chen, Ramchandran, Bartlett 2018).

    For each coordinate k, sort the n values x_(1)[k] <= ... <= x_(n)[k] of the
    rows with positive weight, drop the f smallest and the f largest, and return
    the weighted mean of the rest:

        TM_f(x)[k] = sum_{j=f+1}^{n-f} w_(j) x_(j)[k] / sum_{j=f+1}^{n-f} w_(j)

    (w_(j): the weight of the row holding the j-th smallest value; all 1 without
    weights.)  Requires 2f < n.  f outliers per coordinate cannot push a value
    outside the range of the honest values at that coordinate.

    Cost: O(N log^2 N * D) elementwise min/max (unweighted) or an O(N log N * D)
    sort (weighted); extra memory O(N * CHUNK).
    """

    f: int
    name = "trimmed_mean"

    def __post_init__(self) -> None:
        check_count(self.f, "f", minimum=0)

    def __call__(self, updates: Tensor, weights: Weights = None) -> Tensor:
        x = check_updates(updates)
        w = check_weights(weights, x.shape[0])
        act = active_rows(w, x.shape[0])
        n = act.numel()
        if 2 * self.f >= n:
            raise AggregationInputError(
                f"trimmed mean needs 2f < n; got f={self.f}, n={n} rows with positive weight"
            )
        if not _is_uniform(w, act):
            assert w is not None
            return _sorted_rule(x, act, _trimmed_sorted(w[act], self.f, x.dtype))
        # Only the f smallest and f largest must reach their wires; the middle
        # wires then hold the kept multiset in some order, which a sum ignores.
        f, scale = self.f, 1.0 / (n - 2 * self.f)

        def finish(wires: list[Tensor], outs: list[Tensor]) -> None:
            out = outs[0]
            torch.mul(wires[f], scale, out=out)  # scaled terms: a convex sum, no overflow
            for j in range(f + 1, n - f):
                out.add_(wires[j], alpha=scale)

        extremes = tuple(range(f)) + tuple(range(n - f, n))
        return _network_rule(x, w, act, extremes, finish)[0]


@dataclass(frozen=True)
class CoordinateMedian:
    """Coordinate-wise (weighted) median (Yin et al. 2018).

    Unweighted: for each coordinate the middle value x_((n+1)/2) for odd n, the
    average (x_(n/2) + x_(n/2+1)) / 2 for even n.  Weighted: with the values
    sorted and S_j the cumulative weight up to the j-th, W = S_n, take
    j1 = min{j : S_j >= W/2}, j2 = min{j : S_j > W/2} and return
    (x_(j1) + x_(j2)) / 2 (equal weights give the unweighted median); S_j within
    1e-12 W of W/2 counts as equal, so float rounding of the sums cannot decide.  Rows of
    weight 0 take no part.  Breakdown point 1/2: fewer than n/2 outliers cannot
    move any coordinate outside the range of the honest values.

    Cost: as ``TrimmedMean`` (the network is pruned to the middle wires: 53
    comparators for N = 16).
    """

    name = "median"

    def __call__(self, updates: Tensor, weights: Weights = None) -> Tensor:
        x = check_updates(updates)
        w = check_weights(weights, x.shape[0])
        act = active_rows(w, x.shape[0])
        if not _is_uniform(w, act):
            assert w is not None
            return _sorted_rule(x, act, _median_sorted(w[act]))
        return _median_network(x, w, act, lower=False)[0]


def median_and_lower(updates: Tensor) -> tuple[Tensor, Tensor]:
    """The unweighted coordinate median and the lower median, from one sorting network.

    lower[k] = x_(floor((n+1)/2))[k], the lower of the two middle values for even n
    (``torch.median``'s convention; for odd n both are the middle value).
    """
    x = check_updates(updates)
    median, lower = _median_network(x, None, active_rows(None, x.shape[0]), lower=True)
    return median, lower


def _median_network(x: Tensor, weights: Tensor | None, act: Tensor, *, lower: bool) -> list[Tensor]:
    """The median of the active rows (and, with ``lower``, their lower median)."""
    n = act.numel()
    mid = (n - 1) // 2

    def finish(wires: list[Tensor], outs: list[Tensor]) -> None:
        out = outs[0]
        if n % 2:
            out.copy_(wires[mid])
        else:  # a/2 + b/2 cannot overflow where (a + b)/2 could
            torch.mul(wires[mid], 0.5, out=out)
            out.add_(wires[mid + 1], alpha=0.5)
        if lower:
            outs[1].copy_(wires[mid])

    needed = (mid,) if n % 2 else (mid, mid + 1)
    return _network_rule(x, weights, act, needed, finish, outputs=2 if lower else 1)


def _is_uniform(weights: Tensor | None, act: Tensor) -> bool:
    if weights is None:
        return True
    w = weights[act]
    return bool((w == w[0]).all())


def _network_rule(
    x: Tensor,
    weights: Tensor | None,
    act: Tensor,
    needed: tuple[int, ...],
    finish: Callable[[list[Tensor], list[Tensor]], None],
    outputs: int = 1,
) -> list[Tensor]:
    """Unweighted order statistics of the active rows, chunk by chunk.

    A sorting network pruned to the ``needed`` ranks (plus the minimum and the
    maximum) runs on views of the input; ``finish(wires, outs)`` writes the
    chunk's part of the ``outputs`` [D] results.  Finiteness comes almost for
    free: min and max propagate NaN, and a +-Inf ends on the max or min wire,
    so only the sums of those two wires are checked.

    On CPU the chunks are small enough for each elementwise op to run on one
    thread, and ``torch.get_num_threads()`` Python threads take every k-th
    chunk: hundreds of tiny multi-threaded ops would each wait for the slowest
    thread, which on a busy machine costs more than the work.  Each chunk is
    computed the same way whichever thread runs it.
    """
    n_all, d = x.shape
    rows = act.tolist()
    n = len(rows)
    network = pruned_network(n, tuple(sorted({0, n - 1, *needed})))
    outs = [torch.empty(d, dtype=x.dtype, device=x.device) for _ in range(outputs)]
    # an accelerator wants few, large ops (four chunks: scratch stays < the input)
    chunk = CHUNK if x.device.type == "cpu" else max(CHUNK, -(-d // 4))

    def scratch() -> Tensor:
        return torch.empty(n + 1, min(chunk, d), dtype=x.dtype, device=x.device)

    def work(a: int, b: int, pool: Tensor) -> Tensor:
        wires = apply_network([x[i, a:b] for i in rows], network, [buf[: b - a] for buf in pool])
        finish(wires, [out[a:b] for out in outs])
        return wires[0].sum() + wires[n - 1].sum()

    checks = map_chunks(work, d, chunk, device=x.device, make_state=scratch)
    # Finite sums of the min and max wires mean finite rows (a large finite sum
    # may overflow: then the exact scan below finds nothing and all is well).
    if bool(torch.isfinite(torch.stack(checks).sum())):
        suspects = [] if weights is None else torch.nonzero(weights == 0).flatten().tolist()
    else:
        suspects = list(range(n_all))
    bad = nonfinite_rows(x, suspects) if suspects else []
    if bad:
        raise NonFiniteUpdateError(bad)
    return outs


def _sorted_rule(x: Tensor, act: Tensor, reduce: Reducer) -> Tensor:
    """Apply ``reduce`` to the active rows of every column chunk; check finiteness."""
    n, d = x.shape
    out = torch.empty(d, dtype=x.dtype, device=x.device)
    rows = act.to(x.device)

    def work(a: int, b: int, _: None) -> Tensor:
        chunk = x[:, a:b]
        out[a:b] = reduce(chunk.index_select(0, rows))
        return chunk.sum(dim=1)  # non-finite for a NaN/Inf row: checked below

    sums = map_chunks(work, d, CHUNK, device=x.device, make_state=lambda: None)
    raise_if_nonfinite(x, torch.stack(sums).double().sum(dim=0))
    return out


def _sorted_with_weights(block: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    """Columns of ``block`` sorted ascending, ties by row: values [L, n] and their weights."""
    values, order = torch.sort(block.T, dim=1, stable=True)
    return values, weights.to(block.device)[order]


def _median_sorted(weights: Tensor) -> Reducer:
    def reduce(block: Tensor) -> Tensor:
        values, w = _sorted_with_weights(block, weights)
        cum = w.cumsum(dim=1)
        half = cum[:, -1:] * 0.5
        slack = cum[:, -1:] * _TIE  # rounding of the cumulative sums is not a tie-breaker
        j1 = (cum < half - slack).sum(dim=1, keepdim=True)  # first j with S_j >= W/2
        j2 = (cum <= half + slack).sum(dim=1, keepdim=True)  # first j with S_j > W/2
        j2.clamp_(max=values.shape[1] - 1)
        lo = values.gather(1, j1).squeeze(1)
        hi = values.gather(1, j2).squeeze(1)
        return lo.mul(0.5).add_(hi, alpha=0.5)

    return reduce


def _trimmed_sorted(weights: Tensor, f: int, dtype: torch.dtype) -> Reducer:
    wn = weights / weights.sum()

    def reduce(block: Tensor) -> Tensor:
        values, w = _sorted_with_weights(block, wn)
        n = values.shape[1]
        kept_v = values[:, f : n - f].to(torch.float64)
        kept_w = w[:, f : n - f]
        return ((kept_v * kept_w).sum(dim=1) / kept_w.sum(dim=1)).to(dtype)

    return reduce
