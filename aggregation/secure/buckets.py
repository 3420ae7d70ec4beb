"""Beacon-drawn buckets for masked averaging, and robust aggregation of bucket means.

``assign_buckets(seed, workers, s)`` orders the workers by

    rank(w) = SHA-256("veritrain/v1/secure/bucket" || seed || w)

(ties impossible: SHA-256 of distinct inputs), makes B = floor(n / s) buckets
and deals the ranked workers round-robin (rank position p goes to bucket
p mod B), so every bucket has s or s + 1 members (more when n / s is not an
integer: at most s + ceil((n mod s) / B)).  Members are listed in ascending
byte order of their ids, the canonical order for masks and shares.

The seed is the round's beacon, fixed after submissions close and not
grindable, and worker ids are registered before it exists, so nobody chooses
whom they share a bucket with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from veritrain.protocol.secagg import bucket_rank, deal_ranked

from ..base import Aggregator
from .errors import SecureAggregationError

__all__ = ["aggregate_bucket_means", "assign_buckets", "bucket_rank"]


def assign_buckets(seed: bytes, workers: Sequence[bytes], size: int) -> list[tuple[bytes, ...]]:
    """Partition ``workers`` (ids as bytes) into buckets of at least ``size``; see module docstring.

    Requires distinct ids, ``size >= 2`` and at least ``size`` workers.
    """
    if not isinstance(seed, bytes) or not seed:
        raise SecureAggregationError("seed must be non-empty bytes (the round's beacon)")
    if not isinstance(size, int) or isinstance(size, bool) or size < 2:
        raise SecureAggregationError(f"bucket size must be an int >= 2, got {size!r}")
    ids = list(workers)
    if any(not isinstance(w, bytes) or not w for w in ids):
        raise SecureAggregationError("worker ids must be non-empty bytes")
    if len(set(ids)) != len(ids):
        raise SecureAggregationError("worker ids must be distinct")
    if len(ids) < size:
        raise SecureAggregationError(
            f"{len(ids)} workers cannot fill one bucket of size {size}: masked averaging "
            "needs at least one full bucket (fall back to plain aggregation)"
        )
    return deal_ranked(seed, ids, size)


def aggregate_bucket_means(
    sums: Tensor | Sequence[Tensor],
    counts: Sequence[int],
    aggregator: Aggregator,
) -> Tensor:
    """Robust aggregate of bucket means, each weighted by its member count.

        m_b = sum_b / n_b,    result = aggregator([m_1 .. m_B], weights = [n_1 .. n_B])

    ``sums`` is a [B, D] tensor (or B tensors of shape [D]) of bucket sums, e.g.
    ``BucketSum.total``; ``counts`` the number of members summed in each.
    """
    x = torch.stack(list(sums)) if not isinstance(sums, Tensor) else sums
    if x.ndim != 2:
        raise SecureAggregationError(f"bucket sums must be [B, D], got shape {tuple(x.shape)}")
    n = [int(c) for c in counts]
    if len(n) != x.shape[0] or any(c < 1 for c in n):
        raise SecureAggregationError("need one positive member count per bucket")
    c = torch.tensor(n, dtype=x.dtype)
    return aggregator(x / c[:, None], weights=c.to(torch.float64))
