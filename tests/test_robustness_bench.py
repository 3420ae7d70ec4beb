"""Smoke test of the robustness benchmark's helpers (``bench/robustness.py``).

The benchmark itself trains ~150 swarms; this checks, without training, the
grid builder (shared clean runs, f-dependent parameters), the run settings
(verification off, fp32) and the table / heatmap / summary-line writers on a
2-cell grid.
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
    line = R.summary_line(table, ["sign_flip"])
    assert line == ("robustness: centered_clip_worst_vs_clean f3=+1.0% f7=n/a "
                    "mean_worst_vs_clean f7=+inf%")
    assert re.fullmatch(r"robustness: centered_clip_worst_vs_clean f3=\S+ f7=\S+ "
                        r"mean_worst_vs_clean f7=\S+", line)
