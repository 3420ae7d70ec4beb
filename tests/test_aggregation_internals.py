"""The building blocks: sorting networks and the centered Gram matrix."""

from __future__ import annotations

import itertools

import pytest
import torch
from veritrain.aggregation import CenteredClip, GeometricMedian, centered_clip_with_stats
from veritrain.aggregation.gram import compute_gram, pairwise_sq_dists
from veritrain.aggregation.sorting_network import apply_network, pruned_network, sorting_network


@pytest.mark.parametrize("n", range(1, 21))
def test_sorting_network_sorts(n):
    net = sorting_network(n)
    assert all(0 <= a < b < n for a, b in net)
    # 0-1 principle: sorting every 0/1 input proves the network (n <= 14 here)
    if n <= 14:
        inputs = torch.tensor(list(itertools.product([0.0, 1.0], repeat=n))).T
    else:
        gen = torch.Generator().manual_seed(n)
        inputs = torch.randn(n, 20_000, generator=gen)
    before = inputs.clone()
    wires = apply_network(inputs.unbind(0), net, torch.empty(n + 1, inputs.shape[1]).unbind(0))
    assert torch.equal(torch.stack(wires), inputs.sort(dim=0).values)
    assert torch.equal(inputs, before)  # the rows are read, never written


def test_sorting_network_size_for_16():
    assert len(sorting_network(16)) == 63


@pytest.mark.parametrize("n", [5, 8, 13, 16])
def test_pruned_network_keeps_the_needed_ranks(n):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 5000, generator=gen)
    ranks = x.sort(dim=0).values
    for needed in [(n // 2,), (0, n - 1), tuple(range(2)) + tuple(range(n - 2, n))]:
        net = pruned_network(n, needed)
        assert len(net) <= len(sorting_network(n))
        wires = apply_network(x.unbind(0), net, torch.empty(n + 1, 5000).unbind(0))
        for k in needed:
            assert torch.equal(wires[k], ranks[k])
        # comparators only swap: the multiset of every column is preserved
        assert torch.equal(torch.stack(wires).sort(dim=0).values, ranks)


def test_gram_of_nearly_equal_float32_rows_is_accurate():
    # rows agree to ~5 digits: an uncentered float32 Gram would lose everything
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(300_000, generator=gen) * 10
    x = (base + 1e-4 * torch.randn(8, 300_000, generator=gen)).float()
    gram = compute_gram(x)
    x64 = x.double()
    exact = torch.cdist(x64, x64) ** 2
    got = pairwise_sq_dists(gram.matrix)
    assert float(((got - exact).abs() / exact.clamp(min=1e-30)).fill_diagonal_(0).max()) < 1e-5


def test_gram_reference_is_moved_off_an_outlier():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(7, 10_000, generator=gen, dtype=torch.float64)
    x[0] += 1e9  # the outlier is row 0, and it matches the others on the sampled columns
    x[0, ::2] = x[1, ::2]
    gram = compute_gram(x)
    assert gram.reference != 0
    exact = torch.cdist(x[1:], x[1:]) ** 2
    got = pairwise_sq_dists(gram.matrix)[1:, 1:]
    assert float(((got - exact).abs() / exact.clamp(min=1e-30)).fill_diagonal_(0).max()) < 1e-9


def test_far_start_falls_back_to_float64_products():
    # v stays near row 0 and the start, far from the reference cluster (rows 1, 2):
    # distances near v cancel in a float32 Gram, so the rule redoes it in float64.
    x = torch.tensor([[0.0], [4097.0], [4097.0]])
    out, stats = centered_clip_with_stats(
        x, tau=1.0, iterations=5, tol=0.0, start=torch.tensor([1.0])
    )
    v = torch.tensor([1.0], dtype=torch.float64)
    x64 = x.double()
    for _ in range(5):
        d = (x64 - v).norm(dim=1)
        clip = torch.where(d > 1.0, 1.0 / d.clamp(min=1.0), torch.ones_like(d))
        v = v + (clip / 3) @ (x64 - v)
    assert float((out.double() - v).abs()) < 1e-4
    assert stats.iterations_run == 5


def test_clipping_outliers_in_float32_matches_float64():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(12, 50_000, generator=gen)
    x[:3] *= 1e20  # squares overflow float32: the Gram is formed in float64
    for agg in [CenteredClip(100.0, start="zero"), GeometricMedian()]:
        out32 = agg(x).double()
        out64 = agg(x.double())
        assert float((out32 - out64).norm() / out64.norm()) < 1e-5


def test_concurrent_callers_share_the_chunk_pool_and_get_their_own_results():
    """Validators may aggregate from several threads at once: the shared pool of
    column workers must neither mix their chunks nor deadlock."""
    from concurrent.futures import ThreadPoolExecutor

    from veritrain.aggregation import build_aggregator

    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(9, 300_000, generator=gen) * (k + 1) for k in range(6)]
    rules = [CenteredClip(tau=50.0, iterations=5), GeometricMedian(),
             build_aggregator("krum", {"f": 2})]
    jobs = [(rule, x) for rule in rules for x in inputs]
    alone = [rule(x) for rule, x in jobs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda job: job[0](job[1]), jobs))
    for a, b in zip(alone, together, strict=True):
        assert torch.equal(a, b)
