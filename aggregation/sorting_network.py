"""Sorting networks: coordinate-wise order statistics as a fixed sequence of min/max.

Sorting each column of an [N, L] block with ``torch.sort`` along dim 0 is
slow for small N (strided, index bookkeeping).  A sorting network is a fixed
list of compare-exchange pairs (i, j), i < j: ``(w_i, w_j) <- (min, max)``.
Applied to whole rows it sorts every column at once with two vectorized
elementwise ops per pair, and is pruned to the comparators that feed the
output wires a rule needs (the middle for a median, the extremes for a
trimmed mean).  Results are bitwise reproducible: min and max are exact.

Batcher's odd-even merge sort uses O(N log^2 N) comparators (63 for N = 16).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
from torch import Tensor

__all__ = ["apply_network", "pruned_network", "sorting_network"]

Network = tuple[tuple[int, int], ...]


@lru_cache(maxsize=256)
def sorting_network(n: int) -> Network:
    """Batcher odd-even merge sort on ``n`` wires, ascending (wire 0 gets the minimum).

    Built for the next power of two; comparators touching the padding wires
    (conceptually +inf, which never move) are dropped.
    """
    size = 1
    while size < n:
        size *= 2
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    a, b = i + j, i + j + k
                    if a // (2 * p) == b // (2 * p) and b < n:
                        pairs.append((a, b))
            k //= 2
        p *= 2
    return tuple(pairs)


@lru_cache(maxsize=256)
def pruned_network(n: int, needed: tuple[int, ...]) -> Network:
    """The comparators of ``sorting_network(n)`` that influence the ``needed`` wires.

    After applying it, each needed wire holds the same value as after a full
    sort (its rank statistic); the other wires hold the remaining values in an
    unspecified order (the multiset is preserved: comparators only swap).
    """
    want = set(needed)
    kept: list[tuple[int, int]] = []
    for a, b in reversed(sorting_network(n)):
        if a in want or b in want:
            kept.append((a, b))
            want.update((a, b))
    return tuple(reversed(kept))


def apply_network(
    rows: Sequence[Tensor], network: Network, scratch: Sequence[Tensor]
) -> list[Tensor]:
    """Apply ``network`` to ``rows`` and return the wires (indexed like ``rows``).

    ``rows`` are read, never written: results go to the ``scratch`` buffers
    (same shape as the rows; ``len(rows) + 1`` of them always suffice), so the
    input needs no defensive copy.  Wires no comparator touched are returned as
    the input tensors themselves.
    """
    wires = list(rows)
    owned = [False] * len(wires)
    free = list(scratch)
    for a, b in network:
        lo = free.pop()
        torch.minimum(wires[a], wires[b], out=lo)
        if owned[b]:
            torch.maximum(wires[a], wires[b], out=wires[b])
        else:
            hi = free.pop()
            torch.maximum(wires[a], wires[b], out=hi)
            wires[b], owned[b] = hi, True
        if owned[a]:
            free.append(wires[a])
        wires[a], owned[a] = lo, True
    return wires
