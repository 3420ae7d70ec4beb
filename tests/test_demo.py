"""The demo's picture: the undefended baseline it draws, and labels that can be read."""

from __future__ import annotations

from veritrain.protocol.presets import run_preset

from veritrain.demo import CHEATERS, _plot, caught_labels, undefended_run
from veritrain.swarm import deterministic_identity


def _caught(*rounds: int | None) -> dict[str, dict]:
    return {name: {"caught_in_round": r} for name, r in zip(CHEATERS, rounds, strict=True)}


def test_cheaters_caught_in_one_round_share_one_label():
    assert caught_labels(_caught(0, 0)) == [(1, 0.96, "free rider and sign flip caught in "
                                                      "round 0")]


def test_labels_of_different_rounds_are_staggered():
    labels = caught_labels(_caught(3, 1))
    assert [(x, text) for x, _, text in labels] == [(2, "sign flip caught in round 1"),
                                                    (4, "free rider caught in round 3")]
    assert labels[0][1] - labels[1][1] >= 0.08  # one label's height apart: no overlap


def test_a_cheater_never_caught_gets_no_label():
    assert caught_labels(_caught(None, 2)) == [(3, 0.96, "sign flip caught in round 2")]


def test_undefended_run_averages_the_cheaters_in():
    """No check, no filter: nobody is rejected, and the cheaters' updates move the model
    (the same workers on the same data without them end lower)."""
    settings = run_preset("tiny")
    keys = [deterministic_identity("worker", "demo-test", i) for i in range(4)]
    with_cheaters = undefended_run(settings, keys, {2: CHEATERS[0], 3: CHEATERS[1]}, 2,
                                   run_seed="ab" * 32)
    without = undefended_run(settings, keys, {}, 2, run_seed="ab" * 32)
    assert with_cheaters.caught == {} and len(with_cheaters.eval_loss) == 2
    assert all(v["status"] == "accepted" for o in with_cheaters.outcomes for v in o.verdicts)
    assert sum(len(o.verdicts) for o in with_cheaters.outcomes) == 8
    assert with_cheaters.eval_loss[-1] > without.eval_loss[-1]
    assert settings["aggregator"]["name"] == "centered_clip"  # the caller's copy is untouched


def test_plot_draws_every_curve(tmp_path):
    """Both curves' colours (tab:red and tab:blue) are in the picture."""
    path = tmp_path / "eval_loss.png"
    _plot(path, [("a", [5.0, 4.0, 3.0], {"color": "tab:blue"}),
                 ("b", [5.0, 4.5, 4.4], {"color": "tab:red"})], _caught(0, 0))
    from PIL import Image

    raw = Image.open(path).convert("RGB").tobytes()
    colours = {raw[k:k + 3] for k in range(0, len(raw), 3)}
    assert bytes((0xD6, 0x27, 0x28)) in colours and bytes((0x1F, 0x77, 0xB4)) in colours


def test_a_swarm_given_another_runs_keys_and_seed_trains_on_that_runs_data():
    """The undefended curve is comparable with the demo's runs: the same keys and run seed
    give every worker the same data assignment (protocol/data.py)."""
    from veritrain.swarm import Swarm

    keys = [deterministic_identity("worker", "other-run", i) for i in range(3)]
    a = Swarm(run_preset("tiny"), n_workers=3, workers=keys, run_seed="cd" * 32, seed="x")
    b = Swarm(run_preset("tiny"), n_workers=3, workers=keys, run_seed="cd" * 32, seed="y")
    assert a.run.spec.seed == b.run.spec.seed == "cd" * 32
    for i, key in enumerate(keys):
        assert a.workers[i] is key
        assert a.run.assignment(1, key.public_key.hex()).equal(
            b.run.assignment(1, key.public_key.hex()))
