"""The breakdown point of masked buckets (issue #27 item 4).

Validators of a masked run see bucket sums only, so a Byzantine worker spoils its
whole bucket: f of them spoil up to ``min(f, B)`` of the ``B = floor(N / s)`` buckets,
and the aggregate (CenteredClip over bucket means, the run default's parameters)
holds while fewer than half are spoiled. ``masked_withstands`` states that rule, the
run spec refuses a declared Byzantine share at or above its limit ``1 / (2 s)``, and
the demo refuses a worker count its two cheaters could overwhelm.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fakes import validator_identities
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.aggregation import TensorRows, aggregate_rows
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import RunSpec, masked_breakdown, masked_withstands
from veritrain.protocol.organiser import build_run
from veritrain.protocol.presets import run_preset

RUN_DEFAULT = {"tau_rel": 1.0, "iterations": 10}


def _bucket_means(n_workers: int, bucket_size: int, byzantine: int, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Bucket means of honest updates near the origin, with ``byzantine`` workers placed
    one per bucket (the worst the beacon's deal can do), each adding a huge vector."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n_workers, 16, generator=g)
    honest_mean = rows.mean(0)
    buckets = n_workers // bucket_size
    members = [list(range(b * bucket_size, (b + 1) * bucket_size)) for b in range(buckets)]
    members[-1].extend(range(buckets * bucket_size, n_workers))  # the last bucket's extra
    for b in range(min(byzantine, buckets)):
        rows[members[b][0]] += 1e4  # the same direction on every coordinate
    return torch.stack([rows[m].mean(0) for m in members]), honest_mean


def _aggregate(means: torch.Tensor) -> torch.Tensor:
    """What a masked run's validators compute over the bucket means (the run default)."""
    return aggregate_rows("centered_clip", RUN_DEFAULT, TensorRows(means), None,
                          seed=0).aggregate


@settings(max_examples=60, deadline=None)
@given(n=st.integers(4, 64), s=st.integers(2, 8), f=st.integers(1, 8), seed=st.integers(0, 99))
def test_within_the_rule_the_spoiled_buckets_cannot_move_the_aggregate_far(n, s, f, seed):
    if n // s < 1 or not masked_withstands(f, n, s):
        return
    means, honest = _bucket_means(n, s, f, seed)
    agg = _aggregate(means)
    # Each spoiled mean sits ~1e4 / s away per coordinate; held, the aggregate stays
    # within a few honest spreads of the honest mean, not thousands away.
    assert float((agg - honest).norm()) < 20.0


@pytest.mark.parametrize(("n", "s", "f"), [(6, 3, 2), (8, 2, 3), (20, 4, 3)])
def test_beyond_the_rule_a_majority_of_spoiled_buckets_takes_the_aggregate(n, s, f):
    assert not masked_withstands(f, n, s) and min(f, n // s) * 2 > n // s
    means, honest = _bucket_means(n, s, f, seed=0)
    agg = _aggregate(means)
    assert float((agg - honest).norm()) > 1000.0


@pytest.fixture(scope="module")
def masked_spec() -> RunSpec:
    """A masked tiny-preset run spec (synthetic task) declaring no Byzantine share."""
    settings_ = run_preset("tiny")
    settings_["task"] = {"name": "synthetic", "preset": "tiny"}
    settings_["aggregator"]["params"].pop("bucket_size", None)
    settings_["aggregator"]["masked"] = {"bucket_size": 2, "max_dropouts": 0,
                                         "clip_norm": 1.0, "phase_seconds": 1.0}
    settings_["verification"]["probe_examples"] = 0
    settings_["schedule"]["min_submissions"] = 2
    bundle = build_run(Identity.generate("organiser"), "breakdown-run", settings_,
                       [validator_identities(1)[0].public])
    return bundle.signed.message


@settings(max_examples=100, deadline=None)
@given(s=st.integers(2, 64), share=st.floats(0.0, 0.5, allow_nan=False))
def test_the_run_spec_refuses_a_declared_share_at_or_above_the_breakdown(masked_spec, s,
                                                                         share):
    spec = dataclasses.replace(
        masked_spec,
        aggregator={**masked_spec.aggregator,
                    "masked": {**masked_spec.aggregator["masked"], "bucket_size": s}},
        verification={**masked_spec.verification, "byzantine_share": share})
    problem = spec.masking_problem()
    if share >= 1 / (2 * s):
        assert problem is not None and "withstand a Byzantine share below" in problem
    else:
        assert problem is None, problem
    # 1 / (2 s) is the limit of the per-round rule: a share a little below it holds in a
    # large round wherever the beacon deals the Byzantine workers.
    n = 1000 * s
    f = int(share * n)
    if f > 0 and share < masked_breakdown(s) * (1 - s / n):
        assert masked_withstands(f, n, s)
