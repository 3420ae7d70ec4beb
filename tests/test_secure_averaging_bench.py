"""The masked-bucket simulation of ``bench/secure_averaging.py --robustness``, without a swarm.

Honest rows are clipped to C; Byzantine rows (unopened masked inputs) are not
L2-clipped but saturate per coordinate where the bucket sum would otherwise
wrap; the result is CenteredClip over the exact bucket means of those values.
"""

from __future__ import annotations

import pytest
import torch
from bench_scripts import load_bench
from veritrain.aggregation import CenteredClip
from veritrain.aggregation.secure import aggregate_bucket_means, fixed_point_scale
from veritrain.aggregation.secure.fixed_point import MAX_ABS_SUM

B = load_bench("secure_averaging")

N, D = 8, 64
BYZ = {1, 2}  # with seed 7: buckets of 2 [[0, 1], [4, 7], [2, 6], [3, 5]], of 3 [[0, 1, 2, 6], ...]


def _rows() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(N, D, generator=gen) + 0.3).double()
    c = float(torch.linalg.vector_norm(x, dim=1).median())
    x[5] *= 40  # an honest outlier: clipped to C
    x[1, :4] = 0.0
    x[1, 4:] = 0.9 * c * torch.sign(torch.randn(D - 4, generator=gen))  # ~7 C in L2, < C per coordinate
    x[2] = 0.0
    x[2, :4] = torch.tensor([1e9, -1e9, 1e3 * c, -1e3 * c])  # unbounded: would wrap the sum
    return x


def _reference(x: torch.Tensor, sim, byz: set[int]) -> tuple[torch.Tensor, list[int]]:
    """Bucket sums in exact arithmetic: clip(x_i) for honest rows, x_i saturated for Byzantine."""
    clip = sim.clip_norm(x)
    sums, counts = [], []
    for b in sim.buckets(x.shape[0]):
        scale = fixed_point_scale(clip, len(b))
        k = sum(i in byz for i in b)
        total = torch.zeros(x.shape[1], dtype=torch.float64)
        for i in b:
            if i in byz:
                cap = sim.saturation(clip, scale, len(b), k) / scale
                total += x[i].clamp(-cap, cap)
            else:
                total += x[i] * min(1.0, clip / float(torch.linalg.vector_norm(x[i])))
        sums.append(total)
        counts.append(len(b))
    return torch.stack(sums), counts


@pytest.mark.parametrize("size", [2, 3])
def test_byzantine_rows_saturate_honest_rows_clip_and_the_aggregate_is_exact(size: int) -> None:
    x = _rows()
    sim = B.MaskedBucketsSimulation(1.0, size, seed=7, byzantine=BYZ)
    clip = sim.clip_norm(x)
    norms = torch.linalg.vector_norm(x, dim=1)
    assert norms[1] > 5 * clip and norms[5] > 5 * clip  # the L2 clip would bite on both
    sums, counts = sim.bucket_sums(x)
    ref, ref_counts = _reference(x, sim, BYZ)
    buckets = sim.buckets(N)
    assert counts == ref_counts == [len(b) for b in buckets]
    for j, b in enumerate(buckets):
        scale = fixed_point_scale(clip, len(b))
        # the simulation's sum is the exact one up to rounding (< 1/S per member):
        # row 1 unclipped, row 5 clipped to C, row 2 saturated
        assert float((sums[j] - ref[j]).abs().max()) < len(b) / scale
        # no wrap: every bucket sum is a signed 32-bit value
        assert float((sums[j] * scale).abs().max()) <= MAX_ABS_SUM
        if 1 in b:  # row 1 is not L2-clipped, nor saturated (below the cap everywhere)
            cap = sim.saturation(clip, scale, len(b), len(BYZ & set(b))) / scale
            assert clip <= cap < 2 * len(b) * clip  # S is a power of two: 2^31 / S < 2 s C
            assert float(x[1].abs().max()) < cap
        if 2 in b:  # the saturated row sets the sign of its coordinates (a wrap would flip it)
            cap = sim.saturation(clip, scale, len(b), len(BYZ & set(b))) / scale
            assert sums[j, 0] > 0.5 * cap and sums[j, 1] < -0.5 * cap
            assert sums[j, 2] > 0.5 * cap and sums[j, 3] < -0.5 * cap
        if 5 in b:  # honest rows are clipped: at most C each
            assert float(torch.linalg.vector_norm(sums[j])) <= len(b) * clip + len(b) * D**0.5 / scale

    got = sim(x.float())
    means = ref / torch.tensor(ref_counts, dtype=torch.float64)[:, None]
    tau = float(torch.linalg.vector_norm(means - means.median(0).values, dim=1).median())
    want = aggregate_bucket_means(ref, ref_counts, CenteredClip(tau=tau))
    assert torch.allclose(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


def test_without_byzantine_rows_every_row_is_clipped() -> None:
    x = _rows()
    sim = B.MaskedBucketsSimulation(1.0, 2, seed=7)
    clip = sim.clip_norm(x)
    sums, counts = sim.bucket_sums(x)
    ref, _ = _reference(x, sim, set())
    assert (torch.linalg.vector_norm(sums, dim=1) <= torch.tensor(counts) * clip + 1e-6).all()
    assert torch.allclose(sums, ref, rtol=0, atol=1e-6)


def test_saturation_never_wraps_with_several_byzantine_members() -> None:
    clip = 3.0
    for members in (2, 3, 5):
        scale = fixed_point_scale(clip, members)
        honest_word = int(clip * scale) + 1
        for k in range(1, members + 1):
            bound = B.MaskedBucketsSimulation.saturation(clip, scale, members, k)
            assert k * bound + (members - k) * honest_word <= MAX_ABS_SUM
            assert k * (bound + 1) + (members - k) * honest_word > MAX_ABS_SUM - k
            assert bound >= honest_word  # never tighter than an honest member


def test_byzantine_rows_found_by_value() -> None:
    class Cand:
        def __init__(self, worker: str) -> None:
            self.worker = worker

    rows = B.ByzantineRows({"b"})
    admit = rows.wrap(lambda c, run, r, *rest: torch.full((3,), float(ord(c.worker))))
    decoded = {w: admit(Cand(w), None, 0) for w in "abc"}
    stacked = torch.stack([decoded[w] for w in sorted(decoded)])
    assert rows(stacked) == {1}
    admit(Cand("a"), None, 1)  # a new round forgets the last one's rows
    assert rows(stacked) == set() and rows.aggregated == 1


def test_a_masked_swarm_cell_aggregates_bucket_means_with_the_byzantine_rows_in_them() -> None:
    """One real masked cell (the node's ``process_round``, its ``aggregate_locally``
    replaced by the simulation): every Byzantine row reaches the bucket sums (no filter
    sees single updates), and the validator's own aggregation is back afterwards."""
    import veritrain.validators.round as round_mod

    before = round_mod.aggregate_locally
    run = B.robustness_cell("masked", "alie", rounds=2, preset="tiny", f=2, size=4,
                            spot_checks=False)
    assert run.byzantine_aggregated == 2 * 2 and run.rejected == {}
    assert run.eval_loss == run.eval_loss  # finite, not NaN
    assert round_mod.aggregate_locally is before


def test_the_masked_table_takes_the_worst_seed_and_marks_refused_settings() -> None:
    def res(seed: str, f: int, size: int, attack: str | None, loss: float):
        job = {"seed": seed, "f": f, "size": size, "attack": attack,
               "variant": "masked" if size else "cc"}
        return job, {"eval_loss": loss}

    results = [res("a", 0, 0, None, 2.0), res("b", 0, 0, None, 1.0), res("c", 0, 0, None, 1.0)]
    results += [res("a", 1, 2, "alie", 2.2), res("b", 1, 2, "alie", 1.05),
                res("c", 1, 2, "alie", 1.01)]  # +10%, +5%, +1%: worst +10%, median +5%
    results += [res(k, 4, 2, "alie", 1.5 * c) for k, c in (("a", 2.0), ("b", 1.0), ("c", 1.0))]
    results += [res(k, 1, 0, "alie", c) for k, c in (("a", 2.0), ("b", 1.0), ("c", 1.0))]
    table, summary = B.masked_table(results, fs=(1, 4), sizes=(2,), attacks=("alie",))
    rows = table.splitlines()
    assert rows[2] == "| alie | 1 | +0.0% (+0.0%) | +10.0% (+5.0%) |"
    assert rows[3] == "| alie | 4 | n/a | +50.0% (+50.0%) † |"  # 2 f < floor(16 / 2) fails
    assert summary["worst_masked_accepted"] == pytest.approx(0.10)
    assert summary["worst_masked_beyond"] == pytest.approx(0.50)
    assert summary["worst_unmasked"] == pytest.approx(0.0)
