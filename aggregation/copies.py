"""Copies carry one vote: rows at (numerically) one point share one row's weight.

Distinct honest workers train on distinct data, so no two of their pseudo-gradients
are the same vector.  Rows that are add weight to one point and no information: the
mimic attack (Karimireddy, He and Jaggi, ICLR 2022), where the Byzantine rows copy one
honest row to over-represent its data, or one owner's Sybil identities sending one
update.  CenteredClip (the run default: ``centered_clip_rows``, and ``clip_radius``)
counts each group of copies as one row, from the Gram it already has (no pass); the
coordinate-median start (``start="median"``) is computed before the Gram and counts
them in full, and so do the in-memory starts (``"mean"``, ``"zero"``, a vector):

    copies:  ||x_i - x_j||^2 <= COPY_RADIUS^2 * lower_median_k lower_median_{l != k} ||x_k - x_l||^2,
             COPY_RADIUS = 1/4
    groups:  connected components of "copies"
    w'_g = max_{i in g} w_i  on the group's first row, 0 on the others; normalized

(the squared distance plus its rounding bound ``rel (e_i + e_j)^2`` under the limit: a
distance the Gram cannot resolve is never taken for a copy; so copies that are most of
the rows, whose typical distance is 0, stay rows: beyond the breakdown point anyway)

over the rows of positive weight.  Honest rows sit at about the median distance from
each other (distances between high-dimensional noisy vectors concentrate), four times
farther than a copy may be; the Gram's rounding error is far below it.  A quarter, not
less: copies made "distinct" by noise of their own (the jittered mimic) must carry
noise of more than a quarter of the honest spread to escape, and noise that large
dilutes the weight they add (issue #24: at f = 7 of 16 the worst escaping noise costs
+4.3% against +7.0% with a radius of 1%).  Rows spread wider than that count one by one
and are left to the rule's own robustness (the clip radius): this removes the weight
copies add, not every coordinated group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .gram import Gram, lower_median, pairwise_sq_dists

__all__ = ["COPY_RADIUS", "copy_groups", "share_copies", "spread_sq"]

#: Rows closer than this fraction of the median distance between rows are copies.
COPY_RADIUS = 0.25


def spread_sq(sq: Tensor) -> float:
    """The rows' typical squared distance, robust while most rows are honest:
    ``lower_median_i lower_median_{j != i} ||x_i - x_j||^2``.

    An honest row's own median is an honest distance (most of the others are honest)
    or smaller, so the result is at most the largest honest distance whatever the
    other rows do (a median over all pairs is not: at f = 7 of 16 most pairs hold a
    Byzantine row, and far ones would make every honest pair look like copies)."""
    m = sq.shape[0]
    others = sq.masked_fill(torch.eye(m, dtype=torch.bool), float("inf")).sort(dim=1).values
    return lower_median(others[:, (m - 2) // 2])


def copy_groups(gram: Gram, wn: Tensor) -> list[list[int]]:
    """Groups (two rows or more, ascending indices, ordered by first index) of rows of
    positive weight ``wn`` that are copies of each other (transitively)."""
    active = torch.nonzero(wn[: gram.n_rows] > 0).flatten()
    m = int(active.numel())
    if m < 2:
        return []
    sq = pairwise_sq_dists(gram.matrix[active][:, active])
    scale = gram.err_scale[active]
    # What the Gram cannot resolve is never called a copy: the distance's rounding bound
    # rel (e_i + e_j)^2 must fit under the limit too (rows far from the Gram's reference,
    # with tiny differences, would otherwise round to 0 and look like copies).
    rounding = gram.rel_error * (scale[:, None] + scale[None, :]) ** 2
    close = (sq + rounding <= COPY_RADIUS**2 * spread_sq(sq)).tolist()
    label = list(range(m))
    for i in range(m):  # connected components, labelled by their smallest member
        for j in range(i + 1, m):
            if close[i][j] and label[j] != label[i]:
                old, new = max(label[i], label[j]), min(label[i], label[j])
                label = [new if x == old else x for x in label]
    members: dict[int, list[int]] = {}
    for k, lab in enumerate(label):
        members.setdefault(lab, []).append(int(active[k]))
    return [group for _, group in sorted(members.items()) if len(group) > 1]


def share_copies(gram: Gram, wn: Tensor) -> tuple[Tensor, list[list[int]]]:
    """``(w', groups)``: the normalized weights with each group of copies weighing as its
    heaviest row (copies add no weight and take none), all of it on the group's first row
    (the others, the same point, get 0: every "row of positive weight" count, median and
    start then sees the group once), and the groups; ``wn`` itself when there are none."""
    groups = copy_groups(gram, wn)
    if not groups:
        return wn, []
    shared = wn.clone()
    for group in groups:
        shared[group[0]] = wn[group].max()
        shared[group[1:]] = 0.0
    return shared / shared.sum(), groups
