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
    # tau_rel: the clipping radius is tau_rel times the median distance of the
    # updates from their coordinate-wise median, so it follows the update scale.
    "aggregator": {"name": "centered_clip", "params": {"tau_rel": 1.0, "iterations": 10}},
    "limits": {"max_payload_bytes": 64 << 20},
    "rewards": {"per_round": 100.0},
}


def _preset(task: str, *, steps: int, batch: int, lr: float, k: int, round_seconds: float,
            rounds: int, challenges: float, always_last: bool, reveal_seconds: float,
            tolerance: float, ban_rounds: int, vesting_rounds: int) -> dict[str, Any]:
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
                         # Probe filter (validators/probe.py): drop an update whose implied
                         # model makes the loss on 16 beacon-drawn windows worse, by more
                         # than 5 MADs of the round's gains below their median.
                         "probe_examples": 16, "probe_factor": 5.0},
    }


# Tolerances from bench/verification.py (specs/protocol.md section 10): with k = 1 honest
# recomputations differ by at most 7.2e-8 (1 vs 2 threads) and the weakest cheat (1% noise
# on the update) by 2.1e-3, so 2e-5; with k = 5 honest reach 6.7e-5 across thread counts,
# so 1e-3 (the tiny and demo swarms recompute with the same thread count: distance 0).
RUN_PRESETS: dict[str, dict[str, Any]] = {
    # S = 2 segments and 2 challenges each: every worker is recomputed in full.
    "tiny": _preset("tiny", steps=10, batch=8, lr=3e-3, k=5, round_seconds=60.0, rounds=4,
                    challenges=2.0, always_last=True, reveal_seconds=30.0, tolerance=1e-3,
                    ban_rounds=3, vesting_rounds=2),
    # S = 4: the last segment, which binds the payload to the trail, is always
    # recomputed, so a payload cheat is caught at once and a free rider (no trail
    # to reveal) in its first round; each of the 3 validators recomputes 25%.
    "demo": _preset("demo", steps=20, batch=16, lr=2e-3, k=5, round_seconds=120.0, rounds=8,
                    challenges=1.0, always_last=True, reveal_seconds=15.0, tolerance=1e-3,
                    ban_rounds=100, vesting_rounds=3),
    # S = 30, c = 1.15: a check measured 1.26 training steps (state parsing, model build;
    # both since made cheaper), so recomputation is 1.15 / 30 * 1.26 = 4.8% of training
    # at most; a free rider is caught in its first round, a worker faking 7 of 30
    # segments within 10 rounds with p = 0.951, 8 of 30 with p = 0.970.
    "bench": _preset("bench", steps=30, batch=16, lr=2e-3, k=1, round_seconds=600.0, rounds=30,
                     challenges=1.15, always_last=False, reveal_seconds=120.0, tolerance=2e-5,
                     ban_rounds=100, vesting_rounds=5),
}


def run_preset(name: str) -> dict[str, Any]:
    """A deep copy of a preset's settings (safe to modify)."""
    if name not in RUN_PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(RUN_PRESETS)}")
    return copy.deepcopy(RUN_PRESETS[name])
