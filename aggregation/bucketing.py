"""Bucketing (Karimireddy, He, Jaggi, ICLR 2022): average random buckets, then aggregate."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ._inputs import (
    Weights,
    active_rows,
    check_count,
    check_updates,
    check_weights,
    raise_if_nonfinite,
)
from ._parallel import map_chunks
from .base import Aggregator
from .errors import AggregationInputError

__all__ = ["Bucketing", "bucket_assignment"]


def bucket_assignment(rows: Tensor, bucket_size: int, seed: int) -> list[Tensor]:
    """Shuffle ``rows`` with ``torch.randperm`` under a CPU generator seeded by
    ``seed`` and cut the result into consecutive buckets of ``bucket_size`` (the
    last one may be smaller)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    perm = rows[torch.randperm(rows.numel(), generator=gen)]
    return list(perm.split(bucket_size))


@dataclass(frozen=True)
class Bucketing:
    """Bucketing pre-aggregation: ``inner`` applied to means of random buckets.

        pi = randperm(n; seed)                       (rows with positive weight)
        B_b = {pi(b s + 1), ..., pi(b s + s)},        b = 0 .. ceil(n / s) - 1
        y_b = sum_{i in B_b} w_i x_i / sum_{i in B_b} w_i
        Bucketing(x) = inner(y_1 .. y_B; weights = sum_{i in B_b} w_i)

    (Without weights the bucket means are plain means and ``inner`` gets no
    weights.)  s = ``bucket_size`` >= 1; the permutation comes from a
    ``torch.Generator`` seeded with ``seed`` (derive it from the round's public
    randomness, so every validator draws the same buckets).  Averaging s rows
    shrinks honest heterogeneity by ~sqrt(s) while f Byzantine rows still reach at
    most f buckets, so ``inner``'s f counts Byzantine buckets.

    Cost: one [B, N] x [N, D] product (one pass) plus ``inner`` on B = ceil(n/s)
    rows; extra memory B x D (1/s of the input).
    """

    inner: Aggregator
    bucket_size: int
    seed: int
    name = "bucketing"

    def __post_init__(self) -> None:
        check_count(self.bucket_size, "bucket_size", minimum=1)
        check_count(self.seed, "seed", minimum=0)
        if not callable(self.inner):
            raise AggregationInputError(f"inner must be an aggregator, got {self.inner!r}")

    def __call__(self, updates: Tensor, weights: Weights = None) -> Tensor:
        x = check_updates(updates)
        n = x.shape[0]
        w = check_weights(weights, n)
        act = active_rows(w, n)
        buckets = bucket_assignment(act, self.bucket_size, self.seed)
        mix = torch.zeros(len(buckets), n, dtype=torch.float64)
        for b, members in enumerate(buckets):
            share = torch.ones(members.numel(), dtype=torch.float64) if w is None else w[members]
            mix[b, members] = share / share.sum()
        mix_x = mix.to(device=x.device, dtype=x.dtype)
        means = torch.empty(len(buckets), x.shape[1], dtype=x.dtype, device=x.device)

        def work(a: int, b: int, _: None) -> None:
            torch.mm(mix_x, x[:, a:b], out=means[:, a:b])

        map_chunks(work, x.shape[1], 1 << 17, device=x.device, make_state=lambda: None)
        # A NaN/Inf row makes its bucket's mean non-finite; rows of weight 0 are
        # in no bucket, so they are checked directly.
        bucket_sums = means.sum(dim=1).to(device="cpu", dtype=torch.float64)
        row_stat = torch.zeros(n, dtype=torch.float64)
        for b, members in enumerate(buckets):
            row_stat[members] = bucket_sums[b]
        if w is not None:
            for r in torch.nonzero(w == 0).flatten().tolist():
                row_stat[r] = float(x[r].sum())
        raise_if_nonfinite(x, row_stat)
        bucket_weights = None if w is None else torch.stack([w[m].sum() for m in buckets])
        return self.inner(means, bucket_weights)
