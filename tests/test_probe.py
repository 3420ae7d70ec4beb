"""The probe filter: updates that clearly worsen the model on the round's probe batch go."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.protocol.identity import Identity
from veritrain.protocol.organiser import build_run
from veritrain.protocol.presets import run_preset
from veritrain.protocol.runtime import RunContext
from veritrain.validators.probe import ProbeGain, loss_regressions, probe_gains, probe_rows


def test_far_negative_gains_are_rejected_and_the_honest_spread_is_kept():
    gains = {"h1": 0.30, "h2": 0.28, "h3": 0.31, "h4": 0.25, "h5": 0.29, "b1": -0.5, "b2": -0.02,
             "h6": 0.01}
    # Below the spread and worse than doing nothing: rejected; helping little: kept.
    assert set(loss_regressions(gains, 5.0)) == {"b1", "b2"}
    # Late in training honest gains straddle zero: a small loss inside the spread stays.
    late = {"h1": 0.004, "h2": -0.002, "h3": 0.001, "h4": 0.003, "h5": -0.001}
    assert loss_regressions(late, 5.0) == {}
    # All improve alike (tiny MAD): one that improves a little less still stays.
    assert loss_regressions({"a": 0.300, "b": 0.301, "c": 0.299, "d": 0.2}, 5.0) == {}


def test_too_few_updates_or_factor_zero_reject_nothing():
    assert loss_regressions({"a": 0.3, "b": -5.0}, 5.0) == {}
    assert loss_regressions({"a": 0.3, "b": 0.3, "c": 0.3, "d": -5.0}, 0.0) == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=3, max_size=40),
       st.floats(0.5, 20))
def test_rule_rejects_only_below_the_median_and_never_a_majority(values, factor):
    import statistics

    gains = {f"w{i}": v for i, v in enumerate(values)}
    out = loss_regressions(gains, factor)
    # Identical gains count once: the rule's median is that of the distinct values.
    distinct = sorted(set(values))
    assert all(gains[w] < statistics.median(distinct) for w in out)
    flagged = {gains[w] for w in out}  # at most the distinct values below the median
    assert len(flagged) <= (len(distinct) - 1) // 2 + (len(distinct) % 2 == 0)
    if len(distinct) == len(values):  # no copies: never a majority of the rows
        assert len(out) <= (len(gains) - 1) // 2 + (len(gains) % 2 == 0)
    # Scale-free: gains in other units reject the same workers.
    assert loss_regressions({w: 3.0 * v for w, v in gains.items()}, factor).keys() == out.keys()


HONEST_LATE = [0.02, 0.015, 0.01, 0.008, 0.005, 0.0, -0.005, -0.01, -0.02]


def test_identical_coordinated_rows_inside_the_honest_spread_do_not_exclude_honest_rows():
    """Issue 24: f = 7 of 16 attackers send one vector whose probe gain sits inside the
    honest spread. Counted seven times, that gain would be the round's median and seven
    zero deviations would shrink the MAD, pushing the honest rows at the low edge of
    the spread below the floor; counted once, the round looks as it does without them."""
    honest = {f"h{i}": ProbeGain(g, 0.001) for i, g in enumerate(HONEST_LATE)}
    assert loss_regressions(honest, 5.0) == {}
    for inside in (0.006, 0.0, -0.004, 0.012):
        copies = {f"b{i}": ProbeGain(inside, 0.001) for i in range(7)}
        assert loss_regressions({**honest, **copies}, 5.0) == {}, inside
    # Plain floats (no noise term) too, and at f = 3.
    plain = dict(zip(honest, HONEST_LATE, strict=True))
    assert loss_regressions({**plain, **{f"b{i}": 0.006 for i in range(7)}}, 5.0) == {}
    assert loss_regressions({**plain, **{f"b{i}": 0.006 for i in range(3)}}, 5.0) == {}


def test_identical_rows_that_regress_are_all_excluded():
    """Counting copies once does not shield them: every copy below the floor goes."""
    honest = {f"h{i}": ProbeGain(g, 0.001) for i, g in enumerate(HONEST_LATE)}
    copies = {f"b{i}": ProbeGain(-0.5, 0.001) for i in range(7)}
    assert set(loss_regressions({**honest, **copies}, 5.0)) == set(copies)


def _tiny_run() -> RunContext:
    settings = run_preset("tiny")
    bundle = build_run(Identity.generate("organiser"), "probe-run", settings,
                       [Identity.generate("validator").public])
    return RunContext.build(bundle.signed.message, bundle.dataset)


def test_gains_separate_trained_updates_from_flipped_and_noise():
    run = _tiny_run()
    base = run.genesis_flat()
    workers = [Identity.generate("worker").public_key.hex() for _ in range(4)]
    honest = {w: run.train(base, 0, w).delta for w in workers}
    mean = torch.stack(list(honest.values())).mean(0)
    updates = dict(honest)
    updates["flip"] = -mean
    updates["noise"] = torch.randn_like(mean) * float(mean.norm()) / mean.numel() ** 0.5
    rows = probe_rows(run, b"beacon seed", 0, 64)
    assert torch.equal(rows, probe_rows(run, b"beacon seed", 0, 64))
    assert not torch.equal(rows, probe_rows(run, b"beacon seed", 1, 64))
    probed = probe_gains(run, base, updates, rows)
    assert all(g.se > 0 for g in probed.values()), probed
    # trained updates gain on nearly every window: far more than their noise
    assert all(probed[w].gain > 5 * probed[w].se for w in workers), probed
    gains = {w: g.gain for w, g in probed.items()}
    assert all(gains[w] > 0 for w in workers), gains
    # At genesis even the flipped update lowers the loss (the random model is far from
    # anything), by much less than the trained ones; noise does not help.
    assert gains["flip"] < 0.6 * min(gains[w] for w in workers) and gains["noise"] < 0.1
    assert not set(loss_regressions(probed, 5.0)) & set(workers)
    # A round later, from the averaged model, the flipped update makes the loss worse.
    base2 = base - mean
    honest2 = {w: run.train(base2, 1, w).delta for w in workers}
    flip2 = -torch.stack(list(honest2.values())).mean(0)
    probed2 = probe_gains(run, base2, {**honest2, "flip": flip2},
                          probe_rows(run, b"beacon seed", 1, 64))
    gains2 = {w: g.gain for w, g in probed2.items()}
    assert gains2["flip"] < 0 < min(gains2[w] for w in workers), gains2
    # The flip loses on nearly every window: far more than its noise.
    assert gains2["flip"] < -10 * probed2["flip"].se
    assert set(loss_regressions(probed2, 5.0)) == {"flip"}


def test_a_regression_within_the_probes_noise_is_kept_and_own_noise_buys_nothing():
    """Late in training, few updates, a small MAD (the round seen with 4 workers and 110x
    lowrank payloads): an update a little below zero is kept while the probe windows
    cannot resolve it, and rejected when they can; its own spread does not widen it."""
    gains = {"a": 0.01059, "b": 0.01414, "c": 0.01484, "d": -0.01637}

    def with_se(se: dict[str, float]) -> dict[str, ProbeGain]:
        return {w: ProbeGain(g, se[w]) for w, g in gains.items()}

    assert loss_regressions(with_se(dict.fromkeys(gains, 0.0143)), 5.0) == {}
    # plain floats carry no noise: the old rule, which rejected it
    assert set(loss_regressions(gains, 5.0)) == {"d"}
    sharp = dict.fromkeys(gains, 0.002)
    out = loss_regressions(with_se(sharp), 5.0)
    assert set(out) == {"d"} and "median se 0.002" in out["d"]
    assert set(loss_regressions(with_se({**sharp, "d": 1.0}), 5.0)) == {"d"}


def test_charlm_example_losses_average_to_the_loss():
    run = _tiny_run()
    model = run.task.make_model().eval()
    batch = run.task.make_batch(run.dataset, torch.arange(8), device=torch.device("cpu"))
    with torch.no_grad():
        per = run.task.example_losses(model, batch)
        whole = run.task.loss(model, batch)
    assert per.shape == (8,) and float(per.std()) > 0
    assert abs(float(per.double().mean()) - float(whole)) < 1e-5


def test_synthetic_example_losses_average_to_the_loss():
    from veritrain.protocol.tasks import load_task

    task = load_task("synthetic", {})
    data = task.load_dataset(task.pack_dataset())
    model = task.make_model().eval()
    batch = task.make_batch(data, torch.arange(6), device="cpu")
    with torch.no_grad():
        per = task.example_losses(model, batch)
        whole = task.loss(model, batch)
    assert per.shape == (6,)
    assert abs(float(per.double().mean()) - float(whole)) < 1e-5


def test_one_or_two_suspects_are_left_to_centered_clip_a_group_is_excluded():
    """Issue 24: the filter acts against groups. At 16 rows one or two updates below the
    floor (a lone honest update gone bad, while attackers sit inside the spread) are
    aggregated, clipped; three or more are excluded, all of them."""
    from veritrain.validators.probe import min_group

    assert [min_group(n) for n in (4, 7, 8, 15, 16, 24, 64)] == [1, 1, 2, 2, 3, 4, 9]
    honest = {f"h{i}": ProbeGain(0.02 + 0.001 * (i % 5), 0.002) for i in range(13)}
    bad = [ProbeGain(-1.6, 0.1), ProbeGain(-0.2, 0.01), ProbeGain(-0.5, 0.02)]
    for k in (1, 2):
        out = loss_regressions({**honest, **{f"o{j}": bad[j] for j in range(k)},
                                **{f"p{j}": ProbeGain(0.021, 0.002) for j in range(3 - k)}}, 5.0)
        assert out == {}, k
    three = {**honest, **{f"o{j}": bad[j] for j in range(3)}}
    out = loss_regressions(three, 5.0)
    assert set(out) == {"o0", "o1", "o2"}
    assert "3 of 16 rows below it" in out["o0"] and "(se 0.1)" in out["o0"]
