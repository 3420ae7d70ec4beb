"""Spot checks: which workers are recomputed, and how the result is judged.

Selection is a function of the round's beacon seed, known to nobody before
the round closed: candidates are ranked by sha256(seed || "spot-check" ||
worker) and the first ``spot_checks_per_round`` are taken. Judgement
recomputes the worker's whole local training from the base model on its
deterministic data assignment and compares the decoded payload with the
recomputed pseudo-gradient:

    distance = ||decoded - recomputed|| / ||recomputed||  <=  tolerance
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.training import relative_distance


def select_spot_checks(seed: bytes, workers: Iterable[str], count: int) -> list[str]:
    """The ``count`` workers the beacon picks, lowest rank first."""
    ranked = sorted(
        workers, key=lambda w: hashlib.sha256(seed + b"spot-check" + bytes.fromhex(w)).digest()
    )
    return ranked[: max(0, count)]


def recompute_distance(
    run: RunContext,
    base_flat: torch.Tensor,
    round_index: int,
    worker: str,
    decoded: torch.Tensor,
    *,
    device: str = "cpu",
) -> float:
    """Relative distance between a submitted update and an honest recomputation of it."""
    honest = run.train(base_flat, round_index, worker, device=device).delta
    return relative_distance(decoded, honest)
