"""Probe filter: drop updates that make the model clearly worse on a batch nobody foresaw.

For each admitted update ``u_i`` (a pseudo-gradient, ``base - end``) the
validator evaluates the worker's implied end model ``base - u_i`` on a probe
batch of training windows drawn with the round's beacon seed, which nobody
knows before the round closes, so no update can be tuned to it:

    gain_i = L_probe(base) - L_probe(base - u_i)

An update is excluded from the aggregate (``loss_regression``, verdict status
``excluded``: suspicion is not proof, so the worker is still paid, specs/scoring.md)
when its gain falls far below the round's, by more than the probe batch's own
sampling noise:

    gain_i < median(gain) - max(factor * MAD(gain), RELATIVE_MARGIN * |median(gain)|,
                                NOISE_Z * median(se))

with the median, MAD (median absolute deviation) and median ``se`` taken over the
round's distinct (gain, se) values, each counted once: identical updates share one
probe gain, and a coordinated group sending one vector inside the honest spread
would otherwise set the median and shrink the MAD until honest rows at the edge of
the spread fell below the floor (issue 24: up to 10 of 90 honest rows at f = 7 of
16). Honest updates are never bit-identical (distinct data), so without copies
nothing changes. ``se_i`` is the standard error of
``gain_i`` over the probe windows (``std_w(d_iw) / sqrt(m)``, ``d_iw`` the
loss difference on window w). Late in training honest gains are a few
hundredths of a nat, comparable to what 16 windows can resolve; with few
updates the MAD can then be small by chance, and without the noise term an
honest update that happened to cost a little probe loss was rejected (seen with
4 workers and lossy 110x payloads). The noise term only bounds the margin from
below, where the MAD is smaller than the probe can resolve; added on top of the
MAD it gave tuned attacks room at f = 7 of 16 (optimal IPM +5.2% instead of
+3.2%). It is the round's median standard error, not the update's own: an
update's own ``se`` grows with its scale as its gain does, so an attacker could
scale a bad direction up without ever leaving its own noise (+6.4%); the median,
like the MAD, is set by the honest majority. While the round's updates improve the
model (a positive median), the relative term puts the floor at or below zero: an
update is only rejected if it makes the probe loss *worse*, and by more than the
honest spread, so an honest worker whose shard happens to help less is never
rejected for it. The MAD term keeps honest updates that cost a little probe loss
late in training, when gains straddle zero. Label flipping, sign flipping,
inner-product manipulation and noise raise the probe loss well beyond that and,
when they are a group, are removed before the robust aggregate.
The filter acts against groups: it excludes only when more than an eighth of the
round's rows fall below the floor (``GROUP_SHARE``; three or more of 16). One or two
suspects are left to CenteredClip, whose clip bound already holds them (k rows move
the center by at most ``k / n * tau`` per step): the filter is there for what
clipping cannot absorb, a group near n / 2 (seven label flippers of 16), and a lone
honest update gone bad (0.4% of honest submissions in the robustness bench, once at
-1.6 nats against a median of +0.26) no longer costs the honest majority a row while
attackers sit unseen inside the spread (issue 24: the attackers' share of the
aggregated rows then rose above their share of the submissions).
This is suspicion-based filtering in the manner of Zeno (Xie, Koyejo and Gupta,
ICML 2019); with the median it holds while fewer than half of the updates are
Byzantine, which is what lets CenteredClip keep its guarantee at f close to
n / 2, where clipping alone lets a coordinated minority drag the center.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

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
#: The margin below the median is at least this many of the round's median probe
#: standard errors.
NOISE_Z = 3.0
#: The filter acts against groups: it excludes only when more than this share of the
#: round's rows fall below the floor (at 16 rows: three or more).
GROUP_SHARE = 1 / 8


def min_group(rows: int) -> int:
    """Suspects needed before the filter excludes any: more than ``GROUP_SHARE`` of the
    round's rows (1 below 8 rows)."""
    return int(rows * GROUP_SHARE) + 1


@dataclass(frozen=True)
class ProbeGain:
    """An update's probe gain (mean over windows) and its standard error."""

    gain: float
    se: float = 0.0


def _as_gain(value: ProbeGain | float) -> ProbeGain:
    return value if isinstance(value, ProbeGain) else ProbeGain(float(value))


def probe_rows(run: RunContext, beacon_seed: bytes, round_index: int, examples: int
               ) -> torch.Tensor:
    """The probe's training-window indices for this round (a pure function of the beacon)."""
    gen = torch.Generator().manual_seed(derive_seed(beacon_seed, "probe", round_index))
    return torch.randint(run.task.num_train_examples(run.dataset), (examples,), generator=gen)


def probe_gains(run: RunContext, base_flat: torch.Tensor, updates: Mapping[str, torch.Tensor],
                rows: torch.Tensor, *, device: str = "cpu") -> dict[str, ProbeGain]:
    """``gain_i = mean_w (L_w(base) - L_w(base - u_i))`` over the probe windows ``rows``
    (float64), with its standard error; a non-finite loss is a gain of -inf.

    Each update is looked up once, in worker order, and dropped after its forward
    pass: a lazy mapping (validators.round.StoredRows) keeps one in memory at a time.
    """
    dev = torch.device(device)
    with deterministic_mode(dev, True), torch.no_grad():
        model = run.task.make_model().to(dev).eval()
        batch = run.task.make_batch(run.dataset, rows, device=dev)

        def losses_of(flat: torch.Tensor) -> torch.Tensor:
            load_flat_params(model, flat.to(dev))
            return run.task.example_losses(model, batch).double().cpu()

        base = base_flat.detach().to(torch.float32).cpu()
        reference = losses_of(base)
        gains: dict[str, ProbeGain] = {}
        for worker in sorted(updates):
            diff = reference - losses_of(base - updates[worker].to(torch.float32).cpu())
            if not bool(torch.isfinite(diff).all()):
                gains[worker] = ProbeGain(float("-inf"))
                continue
            se = float(diff.std()) / math.sqrt(diff.numel()) if diff.numel() > 1 else 0.0
            gains[worker] = ProbeGain(float(diff.mean()), se)
    return gains


def loss_regressions(gains: Mapping[str, ProbeGain | float], factor: float) -> dict[str, str]:
    """Workers whose gain is below the median by more than ``factor`` MADs, the median
    itself and ``NOISE_Z`` median standard errors (plain floats: no noise), when they are
    at least ``min_group`` of the rows (fewer: none); the median, MAD and median
    standard error are over the distinct (gain, se) values, each once."""
    if factor <= 0 or len(gains) < MIN_UPDATES:
        return {}
    probe = {w: _as_gain(g) for w, g in gains.items()}
    # Identical updates have identical probe gains (the probe is deterministic): each
    # distinct gain is counted once in the round's statistics, so copies of one row
    # cannot set the median or shrink the MAD to push honest rows below the floor.
    distinct = sorted(set(probe.values()), key=lambda g: (g.gain, g.se))
    median = statistics.median(g.gain for g in distinct)
    mad = statistics.median(abs(g.gain - median) for g in distinct)
    noise = statistics.median(g.se for g in distinct)
    floor = median - max(factor * mad, RELATIVE_MARGIN * abs(median), NOISE_Z * noise)
    below = {w: g for w, g in probe.items() if g.gain < floor}
    if len(below) < min_group(len(probe)):
        return {}  # a lone outlier or two: CenteredClip's clip bound holds them
    return {w: f"probe loss gain {g.gain:.4g} (se {g.se:.2g}) vs round median {median:.4g} "
               f"(MAD {mad:.3g}, median se {noise:.2g}, factor {factor:g}, floor {floor:.4g}; "
               f"{len(below)} of {len(probe)} rows below it)"
            for w, g in below.items()}
