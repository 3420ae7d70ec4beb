"""Contribution scores and the per-round reward split (specs/scoring.md).

    work_i    = verified samples of worker i (0 if rejected)
    quality_i = share of its update that survived robust aggregation, in [0, 1]
                (CenteredClip's final clip factor min(1, tau / ||x_i - v||))
    score_i   = work_i * quality_i
    reward_i  = R * score_i / sum_j score_j        (R: the run's reward per round)

A rejected, free-riding or banned worker scores 0 and earns nothing. An update a
statistical filter excluded (status ``excluded``, protocol/rules.py
``FILTER_REASONS``) is suspicion, not proof: its work counts and its quality is
the same clip factor at the round's tau and aggregate, as if it had been
aggregated. Pure functions: no torch, no database.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def compute_scores(
    samples: Mapping[str, int], quality: Mapping[str, float]
) -> dict[str, float]:
    """score_i = samples_i * clamp(quality_i, 0, 1) for every worker in ``samples``."""
    out: dict[str, float] = {}
    for worker, n in samples.items():
        q = quality.get(worker, 0.0)
        q = 0.0 if not math.isfinite(q) else min(1.0, max(0.0, q))
        out[worker] = float(n) * q
    return out


def split_rewards(scores: Mapping[str, float], per_round: float) -> dict[str, float]:
    """reward_i = per_round * score_i / sum(score); nothing is paid if nobody scored."""
    total = math.fsum(scores.values())
    if total <= 0:
        return {worker: 0.0 for worker in scores}
    return {worker: per_round * score / total for worker, score in scores.items()}
