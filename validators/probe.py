"""Probe filter: drop updates that make the model clearly worse on a batch nobody foresaw.

For each admitted update ``u_i`` (a pseudo-gradient, ``base - end``) the
validator evaluates the worker's implied end model ``base - u_i`` on a probe
batch of training windows drawn with the round's beacon seed, which nobody
knows before the round closes, so no update can be tuned to it:

    gain_i = L_probe(base) - L_probe(base - u_i)

An update is rejected (``loss_regression``) when its gain falls far below the
round's:

    gain_i < median(gain) - max(factor * MAD(gain), RELATIVE_MARGIN * |median(gain)|)

with MAD the median absolute deviation. While the round's updates improve the
model (a positive median), the relative term puts the floor at or below zero: an
update is only rejected if it makes the probe loss *worse*, and by more than the
honest spread, so an honest worker whose shard happens to help less is never
rejected for it. The MAD term keeps honest updates that cost a little probe loss
late in training, when gains straddle zero. Label flipping, sign flipping,
inner-product manipulation and noise raise the probe loss well beyond that and
are removed before the robust aggregate.
This is suspicion-based filtering in the manner of Zeno (Xie, Koyejo and Gupta,
ICML 2019); with the median it holds while fewer than half of the updates are
Byzantine, which is what lets CenteredClip keep its guarantee at f close to
n / 2, where clipping alone lets a coordinated minority drag the center.
"""

from __future__ import annotations

import statistics

import torch
from veritrain.protocol.beacon import derive_seed
from veritrain.protocol.runtime import RunContext
from veritrain.protocol.tensors import load_flat_params
from veritrain.protocol.training import deterministic_mode

#: Fewer updates than this have no spread to be far from.
MIN_UPDATES = 3
#: The floor is never above (1 - RELATIVE_MARGIN) times the median gain: with a
#: positive median, only an update that makes the probe loss worse can be rejected.
RELATIVE_MARGIN = 1.0


def probe_rows(run: RunContext, beacon_seed: bytes, round_index: int, examples: int
               ) -> torch.Tensor:
    """The probe's training-window indices for this round (a pure function of the beacon)."""
    gen = torch.Generator().manual_seed(derive_seed(beacon_seed, "probe", round_index))
    return torch.randint(run.task.num_train_examples(run.dataset), (examples,), generator=gen)


def probe_gains(run: RunContext, base_flat: torch.Tensor, updates: dict[str, torch.Tensor],
                rows: torch.Tensor, *, device: str = "cpu") -> dict[str, float]:
    """``gain_i = L(base) - L(base - u_i)`` on the probe windows ``rows`` (float64 losses)."""
    dev = torch.device(device)
    with deterministic_mode(dev, True), torch.no_grad():
        model = run.task.make_model().to(dev).eval()
        batch = run.task.make_batch(run.dataset, rows, device=dev)

        def loss_of(flat: torch.Tensor) -> float:
            load_flat_params(model, flat.to(dev))
            return float(run.task.loss(model, batch).double())

        base = base_flat.detach().to(torch.float32).cpu()
        reference = loss_of(base)
        gains: dict[str, float] = {}
        for worker in sorted(updates):
            loss = loss_of(base - updates[worker].to(torch.float32).cpu())
            gains[worker] = reference - loss if loss == loss else float("-inf")
    return gains


def loss_regressions(gains: dict[str, float], factor: float) -> dict[str, str]:
    """Workers whose gain is more than ``factor`` MADs, and the median itself, below the median."""
    if factor <= 0 or len(gains) < MIN_UPDATES:
        return {}
    median = statistics.median(gains.values())
    mad = statistics.median(abs(g - median) for g in gains.values())
    floor = median - max(factor * mad, RELATIVE_MARGIN * abs(median))
    return {w: f"probe loss gain {g:.4g} vs round median {median:.4g} (MAD {mad:.3g}, "
               f"factor {factor:g}, floor {floor:.4g})"
            for w, g in gains.items() if g < floor}
