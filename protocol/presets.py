"""Run presets: the reference scales of the project as complete run settings.

``tiny`` is for tests (seconds), ``demo`` for ``veritrain demo`` (minutes on
two CPU cores), ``bench`` for the benchmarks. Every value can be overridden
at ``veritrain run create``.
"""

from __future__ import annotations

import copy
from typing import Any

from .codecs import DEFAULT_CODEC, DEFAULT_CODEC_PARAMS

_COMMON: dict[str, Any] = {
    # DiLoCo's outer optimizer: Nesterov momentum, lr 0.7, mu 0.9.
    "outer": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    # The default codec (protocol/codecs/registry.py): chosen by end-to-end quality.
    "codec": {"name": DEFAULT_CODEC, "params": dict(DEFAULT_CODEC_PARAMS)},
    # tau_rel: the clipping radius is tau = tau_rel * lower_median_i ||x_i - GM(x)||,
    # GM the weighted geometric median of the updates (also CenteredClip's start),
    # so it follows the update scale.
    "aggregator": {"name": "centered_clip", "params": {"tau_rel": 1.0, "iterations": 10}},
    "limits": {"max_payload_bytes": 64 << 20},
    "rewards": {"per_round": 100.0},
}


def _preset(task: str, *, steps: int, batch: int, lr: float, k: int, round_seconds: float,
            rounds: int, challenges: float, always_last: bool, reveal_seconds: float,
            tolerance: float, ban_rounds: int, vesting_rounds: int,
            opened_chunks: int = 16) -> dict[str, Any]:
    return {
        **_COMMON,
        "task": {"name": "charlm", "preset": task},
        # beta2 0.95 adapts fast in short rounds; weight decay is left to the outer step.
        "inner": {"steps": steps, "batch_size": batch, "lr": lr, "beta1": 0.9, "beta2": 0.95,
                  "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 1.0, "trail_every": k},
        "schedule": {"round_seconds": round_seconds, "min_submissions": 1, "max_rounds": rounds},
        "verification": {"spot_checks_per_round": 0, "challenges_per_worker": challenges,
                         "always_last": always_last, "reveal_seconds": reveal_seconds,
                         "tolerance": tolerance, "norm_factor": 10.0, "ban_rounds": ban_rounds,
                         "vesting_rounds": vesting_rounds,
                         # Chunks of 16,384 values a segment check and the payload binding
                         # open (protocol/commitments.py): 16 of each vector, ~5 MB a check.
                         "opened_chunks": opened_chunks, "binding_chunks": opened_chunks,
                         # Probe filter (validators/probe.py): drop an update whose implied
                         # model makes the loss on 16 beacon-drawn windows worse, by more
                         # than 5 MADs of the round's gains below their median.
                         "probe_examples": 16, "probe_factor": 5.0},
    }


# Tolerances from bench/verification.py (specs/protocol.md section 10): with k = 1 honest
# recomputations differ by at most 6.2e-7 (1 vs 2 threads) and the weakest cheat (1% noise
# on the update) by 1.9e-3, so 2e-5; k = 5 has no such gap across thread counts (honest up
# to 8.2e-3), so tiny's 1e-3 holds only for its in-process validators, which recompute on
# the workers' thread count (distance 0). Every worker's payload binding is checked every
# round (at the binding chunks).
RUN_PRESETS: dict[str, dict[str, Any]] = {
    # S = 2 segments of k = 5 steps and 2 challenges each: every worker is recomputed in
    # full from whole start states (the k > 1 path of a check).
    "tiny": _preset("tiny", steps=10, batch=8, lr=3e-3, k=5, round_seconds=60.0, rounds=4,
                    challenges=2.0, always_last=True, reveal_seconds=30.0, tolerance=1e-3,
                    ban_rounds=3, vesting_rounds=2),
    # S = 20 one-step segments, one challenged per worker and round: a free rider (no
    # states to open) is caught in its first round, a payload forged on an honest trail by
    # the binding; each of the 3 validators recomputes 1/20 of the training.
    "demo": _preset("demo", steps=20, batch=16, lr=2e-3, k=1, round_seconds=120.0, rounds=8,
                    challenges=1.0, always_last=False, reveal_seconds=15.0, tolerance=2e-5,
                    ban_rounds=100, vesting_rounds=3),
    # S = 30, c = 1: a reveal is one whole start (4 bytes per parameter, none for the first
    # step) plus 16 opened chunks of 7 vectors (10.75 bytes per parameter in all at 1M
    # parameters, where 16 chunks are a quarter of the model; about 4 at 85M); validators
    # recompute 1/30 = 3.3% of the training (4.0% measured); a free rider is caught in its
    # first round and a worker faking 8 of 30 segments (a quarter) within the 11-round
    # vesting window with p = 1 - (22/30)^11 = 0.97 (specs/protocol.md section 10).
    "bench": _preset("bench", steps=30, batch=16, lr=2e-3, k=1, round_seconds=600.0, rounds=30,
                     challenges=1.0, always_last=False, reveal_seconds=120.0, tolerance=2e-5,
                     ban_rounds=100, vesting_rounds=11),
}


def run_preset(name: str) -> dict[str, Any]:
    """A deep copy of a preset's settings (safe to modify)."""
    if name not in RUN_PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(RUN_PRESETS)}")
    return copy.deepcopy(RUN_PRESETS[name])
