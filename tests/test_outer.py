"""The outer step and the broadcast update: workers reproduce the certified model exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.protocol.codecs import get_codec
from veritrain.protocol.errors import PayloadError
from veritrain.protocol.outer import OuterState, encode_update, outer_step
from veritrain.protocol.presets import run_preset
from veritrain.protocol.tensors import sha256_hex

from veritrain.swarm import Swarm


def test_nesterov_step_matches_its_formula():
    theta, m, g = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.0]), torch.tensor([0.1, 0.2])
    new_theta, new_m = outer_step(theta, m, g, lr=0.7, mu=0.9, nesterov=True)
    expected_m = 0.9 * m + g
    assert torch.allclose(new_m, expected_m)
    assert torch.allclose(new_theta, theta - 0.7 * (g + 0.9 * expected_m))
    plain, _ = outer_step(theta, m, g, lr=0.7, mu=0.9, nesterov=False)
    assert torch.allclose(plain, theta - 0.7 * expected_m)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 3000), st.integers(0, 2**32), st.sampled_from(["fp16", "int8", "topk"]))
def test_update_error_feedback_tracks_the_aggregate(numel, seed, codec_name):
    """sent + residual' == aggregate + residual: nothing is lost, only delayed."""
    codec = get_codec(codec_name)
    gen = torch.Generator().manual_seed(seed)
    aggregate, residual = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 0.1
    payload, sent, new_residual = encode_update(codec, aggregate, residual, seed=seed)
    assert torch.allclose(sent + new_residual, aggregate + residual, atol=1e-5)
    assert torch.equal(codec.decode(payload, numel, seed=seed), sent)


def test_outer_state_round_trips_and_refuses_other_sizes():
    state = OuterState(torch.randn(10), torch.randn(10))
    back = OuterState.from_bytes(state.to_bytes(), 10)
    assert torch.equal(back.momentum, state.momentum) and torch.equal(back.residual, state.residual)
    with pytest.raises(PayloadError):
        OuterState.from_bytes(state.to_bytes(), 11)


@pytest.mark.parametrize("codec", ["fp16", "topk"])
def test_worker_reproduces_certified_models_from_broadcast_updates(codec):
    """Three rounds: applying each round's update payload gives the validators' model bytes."""
    settings_ = run_preset("tiny")
    settings_["task"] = {"name": "synthetic", "preset": "tiny"}
    settings_["codec"] = {"name": codec, "params": {}}
    swarm = Swarm(settings_, n_workers=3, seed="outer-" + codec)
    run = swarm.run
    params, momentum = swarm.base.clone(), torch.zeros(run.numel)
    for r in range(3):
        outcome = swarm.step(r)
        params, momentum = run.apply_update(params, momentum, outcome.update_payload, r)
        assert sha256_hex(run.encode_model(params)) == sha256_hex(run.encode_model(swarm.base))
        assert torch.equal(momentum, swarm.outer.momentum)
    # And the update is small when the codec compresses.
    if codec == "topk":
        assert len(outcome.update_payload) * 10 < 4 * run.numel
