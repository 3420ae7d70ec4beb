"""The aggregation benchmark's headline times what ``process_round`` runs (issue #19).

``bench/aggregation_speed.py`` times every headline rule through
``aggregation.aggregate_rows(name, params, rows)``.  These tests fail if that and the
call ``process_round`` makes ever diverge: another function, other parameters, or the
presets' aggregator no longer the one the benchmark reads.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import veritrain.validators.round as round_mod
from bench_scripts import load_bench
from test_validator_memory import SEED, round_inputs  # noqa: F401  (a fixture)
from veritrain.aggregation import TensorRows, registry
from veritrain.protocol.outer import OuterState
from veritrain.protocol.presets import RUN_PRESETS

B = load_bench("aggregation_speed")


class Recorder:
    """Wraps ``aggregate_rows``: every (name, params) it is called with, and its results."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.results: list[Any] = []

    def __call__(self, name: str, params: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append((name, dict(params)))
        out = registry.aggregate_rows(name, params, rows, *args, **kwargs)
        self.results.append(out)
        return out


def test_every_preset_aggregates_as_the_benchmark_headline():
    for name, preset in RUN_PRESETS.items():
        assert preset["aggregator"] == B.PRESET_AGGREGATOR, name
    cc_name, cc_params = B.headline_specs(3)["centered_clip"]
    assert {"name": cc_name, "params": cc_params} == B.PRESET_AGGREGATOR


def test_the_benchmark_and_process_round_call_the_same_function():
    assert B.aggregate_rows is registry.aggregate_rows
    assert round_mod.aggregate_rows is registry.aggregate_rows


@pytest.mark.parametrize("rule", B.HEADLINE)
def test_headline_rules_run_their_production_path(monkeypatch, rule):
    recorder = Recorder()
    monkeypatch.setattr(B, "aggregate_rows", recorder)
    x = B.make_inputs(9, 3000, 0)
    out = B.make_rules(3000, 2)[rule](x)
    assert recorder.calls == [B.headline_specs(2)[rule]]
    assert torch.equal(out, recorder.results[0].aggregate)


def test_process_round_aggregates_as_the_benchmark_headline(monkeypatch, round_inputs):  # noqa: F811
    run, base, candidates, registered, reveals, _ = round_inputs
    assert run.spec.aggregator == B.PRESET_AGGREGATOR  # the tiny preset's
    recorder = Recorder()
    monkeypatch.setattr(round_mod, "aggregate_rows", recorder)
    outcome = round_mod.process_round(
        run, 0, run.spec.genesis_model_hash, base, OuterState.zeros(run.numel), candidates,
        registered, set(), SEED, reveals=reveals)
    name, params = B.headline_specs(3)["centered_clip"]
    assert recorder.calls == [(name, params)]
    # the benchmark's headline rule on the same accepted rows gives the round's bytes
    rows = recorder.results[0]
    accepted = torch.stack([
        row for row in _accepted_rows(run, base, candidates, registered, reveals)])
    assert torch.equal(B.make_rules(run.numel, 3)["centered_clip"](accepted),
                       rows.aggregate)
    assert torch.equal(outcome.aggregate, rows.aggregate.to(torch.float32))


def _accepted_rows(run, base, candidates, registered, reveals) -> list[torch.Tensor]:
    filtered = round_mod.filter_round(run, 0, run.spec.genesis_model_hash, base, candidates,
                                      registered, set(), SEED, reveals=reveals,
                                      rows_in_memory=True)
    source = filtered.source()
    assert isinstance(source, TensorRows)
    return list(source.updates)
