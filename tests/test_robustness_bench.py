"""Smoke test of the robustness benchmark's helpers (``bench/robustness.py``).

The benchmark itself trains ~800 swarms (3 seeds); this checks, without training, the
grid builder (shared clean runs, f-dependent parameters, seeds), the run settings
(verification off, fp32), the attacker-share and honest-verdict counts, and the
table / heatmap / summary-line writers on small grids; and, with one 4-worker round,
that the swarm sends the min-max row.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from bench_scripts import load_bench

R = load_bench("robustness")


def test_grid_shares_clean_runs_and_fills_in_f() -> None:
    cells, clean_of = R.build_grid(["centered_clip", "krum"], ["alie"], [3, 7], 16)
    keys = [c.key for c in cells]
    assert len(keys) == len(set(keys))
    # centered_clip does not depend on f: one clean run; krum does: one per f;
    # the mean's clean run (the reference) is always there.
    assert {k for k in keys if "/clean/" in k} == {
        "centered_clip/clean/f0", "krum/clean/f3", "krum/clean/f7", "mean/clean/f0"}
    assert clean_of[("centered_clip", 7)] == "centered_clip/clean/f0"
    assert clean_of[("krum", 7)] == "krum/clean/f7"
    assert "krum/alie/f7" in keys and "centered_clip/alie/f3" in keys
    # Krum needs n > 2f + 2: at f = 7 of 16 it gets 6; trimmed mean keeps 7.
    assert R.aggregator_spec("krum", 7, 16)["params"] == {"f": 6}
    assert R.aggregator_spec("trimmed_mean", 7, 16)["params"] == {"f": 7}
    assert R.aggregator_spec("cc_bucketing", 3, 16) == {
        "name": "centered_clip", "params": {"tau_rel": 1.0, "iterations": 10, "bucket_size": 2}}


def test_settings_isolate_the_aggregator() -> None:
    import torch
    from veritrain.aggregation import build_aggregator
    from veritrain.validators.round import resolve_aggregator_params

    spec = R.aggregator_spec("cc_bucketing", 3, 16)
    s = R.bench_settings(spec, task_preset="tiny", steps=10, batch=8, rounds=4)
    assert s["aggregator"] == spec and s["codec"] == {"name": "fp32", "params": {}}
    v = s["verification"]
    assert v["challenges_per_worker"] == 0.0 and v["spot_checks_per_round"] == 0
    assert v["always_last"] is False and v["norm_factor"] >= 1e6
    assert s["inner"]["steps"] == 10 and s["schedule"]["max_rounds"] == 4
    updates = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))
    for label in R.AGGREGATORS:  # every row's parameters work as the validator uses them
        spec = R.aggregator_spec(label, 7, 16)
        params = resolve_aggregator_params(spec["params"], updates)
        assert build_aggregator(spec["name"], params, seed=1)(updates).shape == (5,)


def test_table_heatmap_and_summary_line(tmp_path: Path) -> None:
    cells, clean_of = R.build_grid(["mean", "centered_clip"], ["sign_flip"], [3, 7], 16)
    finals = {"mean/clean/f0": 2.0, "centered_clip/clean/f0": 2.01,
              "mean/sign_flip/f3": 2.1, "mean/sign_flip/f7": math.inf,
              "centered_clip/sign_flip/f3": 2.02}  # centered_clip f7 missing
    results = {k: {"final": v, "error": None} for k, v in finals.items()}
    assert {c.key for c in cells} >= set(finals)
    table = R.relative_table(results, ["mean", "centered_clip"], ["sign_flip"], [3, 7],
                             clean_of)
    assert math.isclose(table["mean"]["sign_flip@3"], 0.05)
    assert math.isclose(table["centered_clip"]["clean@7"], 0.005)
    assert math.isinf(table["mean"]["sign_flip@7"])
    assert math.isnan(table["centered_clip"]["sign_flip@7"])
    md = R.markdown_table(table, ["sign_flip"], [3, 7])
    assert "| mean | +0.0% | +5.0% | +5.0% |" in md and "+inf%" in md and "n/a" in md
    png = tmp_path / "h.png"
    R.write_heatmap(table, ["sign_flip"], [3, 7], png, "smoke")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    line = R.summary_line(table, ["sign_flip"], seeds=1,
                          honest={"honest": 20, "honest_rejected": 0, "honest_excluded": 2},
                          max_gain=-0.0625)
    assert line == ("robustness: seeds=1 worst_f7=n/a worst_f3=+1.0% honest_lost_pay=0/20 "
                    "honest_excluded=2/20 max_attacker_share_gain=-0.062")
    assert re.fullmatch(r"robustness: seeds=\d+ worst_f7=\S+ worst_f3=\S+ "
                        r"honest_lost_pay=\d+/\d+ honest_excluded=\d+/\d+ "
                        r"max_attacker_share_gain=\S+", line)


def test_seeds_multiply_the_grid_and_tables_take_worst_and_median() -> None:
    cells, clean_of = R.build_grid(["centered_clip"], ["alie"], [7], 16, seeds=3)
    keys = {c.key for c in cells}
    assert len(cells) == 3 * 3 == len(keys)  # (mean clean, cc clean, cc alie) x 3 seeds
    assert {"centered_clip/alie/f7", "centered_clip/alie/f7/s1", "centered_clip/alie/f7/s2",
            "mean/clean/f0/s2"} <= keys
    assert R.swarm_seed(0) == R.SEED and R.swarm_seed(2) == f"{R.SEED}-2"
    jobs = R.make_jobs(cells, n=16, rounds=2, task_preset="tiny", steps=2, batch=2, threads=1)
    assert sorted(j["seed"] for j in jobs) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # each seed against its own clean mean run
    finals = {"mean/clean/f0": 2.0, "centered_clip/clean/f0": 2.0, "centered_clip/alie/f7": 2.02,
              "mean/clean/f0/s1": 3.0, "centered_clip/clean/f0/s1": 3.0,
              "centered_clip/alie/f7/s1": 3.15,
              "mean/clean/f0/s2": 2.0, "centered_clip/clean/f0/s2": 2.0,
              "centered_clip/alie/f7/s2": 2.06}
    results = {k: {"final": v} for k, v in finals.items()}
    tables = [R.relative_table(results, ["centered_clip"], ["alie"], [7], clean_of, seed=k)
              for k in range(3)]
    assert [round(t["centered_clip"]["alie@7"], 6) for t in tables] == [0.01, 0.05, 0.03]
    worst_t, median_t = R.over_seeds(tables)
    assert math.isclose(worst_t["centered_clip"]["alie@7"], 0.05)
    assert math.isclose(median_t["centered_clip"]["alie@7"], 0.03)
    tables[1]["centered_clip"]["alie@7"] = math.nan  # a failed seed is left out
    assert math.isclose(R.over_seeds(tables)[0]["centered_clip"]["alie@7"], 0.03)


def test_attacker_share_of_the_aggregated_rows() -> None:
    def verdict(worker: str, status: str) -> dict[str, str]:
        return {"worker": worker, "status": status}

    attackers = {"a1", "a2"}
    # 2 of 8 submissions are attackers; the filter excludes 2 honest rows: 2 of 6 aggregated
    helped = [verdict("a1", "accepted"), verdict("a2", "accepted"),
              verdict("h1", "excluded"), verdict("h2", "excluded"), verdict("h3", "rejected"),
              *(verdict(f"h{i}", "accepted") for i in range(4, 7))]
    c = R.round_shares(helped, attackers)
    assert c == {"submitted": 8, "attacker_submitted": 2, "aggregated": 5,
                 "attacker_aggregated": 2, "honest_rejected": 1, "honest_excluded": 2}
    assert math.isclose(R.share_gain(c), 2 / 5 - 2 / 8)
    # the filter keeps an attacker out: the share drops
    fair = R.round_shares([verdict("a1", "excluded"), verdict("a2", "accepted"),
                           verdict("h1", "accepted"), verdict("h2", "accepted")], attackers)
    assert math.isclose(R.share_gain(fair), 1 / 3 - 1 / 2)
    assert math.isclose(R.max_share_gain([c, fair]), 2 / 5 - 2 / 8)
    clean = R.round_shares([verdict("h1", "accepted")], attackers)
    assert R.share_gain(clean) == 0.0 and math.isnan(R.max_share_gain([clean]))
    results = {"x": {"rounds": [c, fair]}, "y": {"rounds": [clean]}, "z": {"error": "boom"}}
    assert R.honest_verdicts(results) == {"honest": 6 + 2 + 1, "honest_rejected": 1,
                                          "honest_excluded": 2}
    gains = R.share_gain_table({"cc/alie/f3": {"max_attacker_share_gain": 0.1},
                                "cc/alie/f3/s1": {"max_attacker_share_gain": -0.2}},
                               ["cc"], ["alie"], [3], seeds=2)
    assert gains["cc"]["alie@3"] == 0.1 and math.isnan(gains["cc"]["clean@3"])
    assert "| cc | n/a | +0.100 | +0.100 |" in R.markdown_table(gains, ["alie"], [3],
                                                                 fmt=R.fmt_gain)


def test_every_bench_attack_is_a_swarm_attack() -> None:
    from veritrain.swarm import ATTACKS

    assert set(R.ATTACKS) <= set(ATTACKS)
    assert {"min_max_unit", "min_max_sign", "min_max_std", "min_sum_unit", "min_sum_sign",
            "min_sum_std"} <= set(R.ATTACKS) & R.NON_TRAINING


def test_swarm_sends_the_min_max_row() -> None:
    """The swarm's wiring of a Shejwalkar-Houmansadr attack: the Byzantine worker's update is
    min_max over the round's honest updates, with the named direction."""
    import torch
    from veritrain.aggregation import attacks as A

    from veritrain.swarm import Swarm

    settings = R.bench_settings(R.aggregator_spec("centered_clip", 1, 4), task_preset="tiny",
                                steps=2, batch=2, rounds=1)
    swarm = Swarm(settings, n_workers=4, byzantine={3: "min_max_sign"}, seed="min-max-test",
                  keep_updates=True)
    outcome = swarm.step(0)
    honest = torch.stack([swarm.updates[i] for i in range(3)])
    expected = A.min_max(honest, 1, "sign")[0]
    torch.testing.assert_close(swarm.updates[3].float(), expected.float())
    assert A.min_max_gamma(honest, "sign") > 0
    assert {v["status"] for v in outcome.verdicts} == {"accepted"}
