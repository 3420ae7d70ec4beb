"""Segment checks: recompute a challenged stretch of a worker's training.

For a challenged segment j (steps jk+1 .. (j+1)k) the validator has the
revealed start state (segment 0 starts from the base model with zero AdamW
moments, which it rebuilds itself) and end state, each content-addressed by
its trail entry. It recomputes the k steps from the start state on the
worker's assigned batches with deterministic kernels and accepts when

    max over (params, exp_avg, exp_avg_sq) of ||recomputed - claimed|| / ||claimed|| <= tolerance.

For the last segment the payload must also re-derive byte for byte:
``payload == encode(base - end.params + e)`` with the worker's committed
error-feedback residual ``e`` and its codec seed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from veritrain.protocol.codecs import ErrorFeedback
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.messages import Submission
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.training import TrainingState, state_distance, train_segment


@dataclass
class SegmentResult:
    segment: int
    start: str | None
    end: str
    ef: str | None
    distance: float | None
    ok: bool
    note: str

    def to_json(self) -> dict[str, Any]:
        distance = self.distance
        if distance is not None and not math.isfinite(distance):
            distance = 1e300
        return {"segment": self.segment, "start": self.start, "end": self.end, "ef": self.ef,
                "distance": distance, "ok": self.ok, "note": self.note[:200]}


def _state(evidence: Mapping[str, bytes], digest: str, numel: int) -> TrainingState:
    data = evidence.get(digest)
    if data is None:
        raise RejectedInput(f"state {digest[:12]} was not revealed", "missing_reveal")
    return TrainingState.from_bytes(data, numel=numel)


def check_segment(
    run: RunContext,
    base_flat: torch.Tensor,
    sub: Submission,
    payload: bytes,
    j: int,
    evidence: Mapping[str, bytes],
    *,
    device: str = "cpu",
) -> SegmentResult:
    """Judge one challenged segment of one submission; never raises on bad evidence."""
    k = run.inner.trail_every
    last = len(sub.trail) - 1
    start_hash = sub.trail[j - 1] if j > 0 else None
    ef_hash = sub.ef_hash if j == last else None
    result = SegmentResult(j, start_hash, sub.trail[j], ef_hash, None, False, "")
    try:
        start = (TrainingState.initial(base_flat) if j == 0
                 else _state(evidence, sub.trail[j - 1], run.numel))
        claimed = _state(evidence, sub.trail[j], run.numel)
        if start.step != j * k or claimed.step != (j + 1) * k:
            result.note = f"revealed states are at steps {start.step} and {claimed.step}"
            return result
        rows = run.assignment(sub.round, sub.worker)[j * k:(j + 1) * k]
        recomputed = train_segment(run.task, run.dataset, start, rows, run.inner, device=device)
        result.distance = state_distance(recomputed, claimed)
        if not result.distance <= run.spec.verification["tolerance"]:
            result.note = f"recomputed state differs by {result.distance:.4g}"
            return result
        if j == last:
            ef_bytes = evidence.get(sub.ef_hash)
            if ef_bytes is None:
                result.note = "error-feedback residual was not revealed"
                return result
            ef = ErrorFeedback.from_bytes(ef_bytes, run.numel)
            expected, _ = ef.step(run.codec, base_flat - claimed.params,
                                  seed=run.codec_seed(sub.round, sub.worker))
            if expected != payload:
                result.note = "payload does not re-derive from the revealed end state"
                return result
        result.ok = True
        return result
    except RejectedInput as exc:
        result.note = str(exc)
        return result
