"""Copies carry one vote: CenteredClip counts a group of identical rows as one row."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from veritrain.aggregation import TensorRows, aggregate_rows, clip_radius
from veritrain.aggregation.copies import COPY_RADIUS, copy_groups, share_copies
from veritrain.aggregation.streamed import gram_rows

PRESET = {"tau_rel": 1.0, "iterations": 10}


def honest_rows(n: int, d: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(d, generator=gen) + torch.randn(n, d, generator=gen)).to(dtype)


def cc(x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    return aggregate_rows("centered_clip", PRESET, TensorRows(x), weights).aggregate.double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@settings(max_examples=25, deadline=None)
@given(n=st.integers(3, 12), d=st.integers(64, 300), seed=st.integers(0, 2**31 - 1))
def test_distinct_honest_rows_are_never_copies(n: int, d: int, seed: int) -> None:
    x = honest_rows(n, d, seed)
    gram = gram_rows(TensorRows(x))
    wn = torch.full((n,), 1.0 / n, dtype=torch.float64)
    assert copy_groups(gram, wn) == []
    assert share_copies(gram, wn)[0] is wn


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(5, 12),
    d=st.integers(16, 400),
    copies=st.integers(1, 8),
    target=st.integers(0, 9),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_adding_copies_of_a_row_leaves_the_aggregate_unchanged(
    n: int, d: int, copies: int, target: int, seed: int, dtype: torch.dtype
) -> None:
    """The mimic attack (every Byzantine row copies one honest row) moves CenteredClip
    by no more than rounding while the copies and the row they copy are under half the
    rows (beyond that the rows' typical distance is 0 and nothing is a copy: past the
    breakdown point anyway): the group weighs as the one row it copies."""
    assume(copies < n - 2)  # the copied row's group stays under half the rows
    x = honest_rows(n, d, seed, dtype)
    target %= n
    mimic = torch.cat([x, x[target].expand(copies, d)])
    tol = 1e-5  # iterations stop within 1e-6 of the radius; starts differ by the copies
    assert rel(cc(mimic), cc(x)) <= tol
    assert abs(clip_radius(TensorRows(mimic), 1.0) / clip_radius(TensorRows(x), 1.0) - 1) <= tol
    wn = torch.full((n + copies,), 1.0 / (n + copies), dtype=torch.float64)
    group = [target, *range(n, n + copies)]
    assert copy_groups(gram_rows(TensorRows(mimic)), wn) == [group]


def test_without_sharing_the_copies_would_have_pulled_the_aggregate() -> None:
    """The same copies just outside the copy radius count one by one and drag the
    aggregate toward the copied row: what the rule removes is real weight."""
    n, d, copies = 9, 2000, 7
    x = honest_rows(n, d, 7, torch.float64)
    spread = float(torch.cdist(x, x).median())
    gen = torch.Generator().manual_seed(8)
    jitter = torch.randn(copies, d, generator=gen, dtype=torch.float64)
    jitter *= 3 * COPY_RADIUS * spread / jitter.norm(dim=1, keepdim=True)
    near = torch.cat([x, x[0] + jitter])
    exact = torch.cat([x, x[0].expand(copies, d)])
    clean = cc(x)
    assert rel(cc(exact), clean) < 1e-5
    pulled = float((cc(near) - clean).norm())
    assert pulled > 0.2 * float((x[0] - clean).norm())


def test_copies_group_transitively_and_weights_stay_normalized() -> None:
    n, d = 6, 500
    x = honest_rows(n, d, 3, torch.float64)
    rows = torch.cat([x, x[2:3], x[4:5], x[2:3]])  # rows 6, 8 copy row 2; row 7 copies row 4
    wn = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=torch.float64)
    wn = wn / wn.sum()
    gram = gram_rows(TensorRows(rows))
    groups = copy_groups(gram, wn)
    assert groups == [[2, 6], [4, 7]]  # row 8 has weight 0: it takes no part
    shared, _ = share_copies(gram, wn)
    assert abs(float(shared.sum()) - 1.0) < 1e-12
    # each group weighs as one row, all of it on its first row
    assert torch.allclose(shared[2], shared[0]) and torch.allclose(shared[4], shared[0])
    assert float(shared[6]) == float(shared[7]) == float(shared[8]) == 0.0


def test_weighted_copies_weigh_as_their_heaviest_row() -> None:
    x = honest_rows(5, 100, 4, torch.float64)
    rows = torch.cat([x, x[1:2]])
    weights = torch.tensor([1.0, 3.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    # the copies (weights 3 and 1) weigh as their heaviest row: a light copy takes nothing
    expected = cc(x, torch.tensor([1.0, 3.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    assert rel(cc(rows, weights), expected) < 1e-5


def test_distances_the_gram_cannot_resolve_are_never_copies() -> None:
    """Three rows pushed 1e4 away on every coordinate, a few units apart, beside two rows
    near the origin: the Gram (centred near the origin) rounds their distances by more
    than they are, so they must stay three rows (taken for copies, they would weigh as
    one and hand the aggregate to the two: issue #27's breakdown test)."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 16, generator=g)
    rows[:3] += 1e4
    wn = torch.full((5,), 0.2, dtype=torch.float64)
    assert copy_groups(gram_rows(TensorRows(rows)), wn) == []
    assert float(cc(rows).sub(1e4).abs().max()) < 10.0  # the three spoiled rows prevail
