"""Robust aggregation of masked buckets' means.

Which workers share a bucket is a protocol rule (``veritrain.protocol.secagg``,
``round_buckets``: drawn from the round's beacon); here a validator that has unmasked
each bucket's sum aggregates the bucket means, each weighted by its member count.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..base import Aggregator
from .errors import SecureAggregationError

__all__ = ["aggregate_bucket_means"]


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
