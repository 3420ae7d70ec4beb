"""Error feedback: the sum of what was sent tracks the sum of the true updates."""

from __future__ import annotations

import pytest
import torch
from veritrain.protocol.codecs import ErrorFeedback, get_codec
from veritrain.protocol.errors import NonFiniteError, OversizedError, PayloadError

LOSSY = [
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {"block": 32}),
    ("int4", {"block": 32}),
    ("topk", {"chunk": 64, "k": 4, "value_bits": 1}),
    ("topk", {"chunk": 64, "k": 4, "value_bits": 2, "dct_block": 16}),
    ("cocktail", {"chunk": 64, "sample": 2, "k": 4, "value_bits": 4}),
    ("lloyd", {"bits": 2, "block": 64}),
    ("lloyd", {"bits": 3, "block": 128}),
]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(LOSSY)]
NUMEL = 4000


def updates(steps: int, *, shared: float = 0.8, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(NUMEL // 100, generator=gen)).repeat_interleave(100)
    base = torch.randn(NUMEL, generator=gen) * scale
    return [
        (shared * base + (1 - shared) * torch.randn(NUMEL, generator=gen) * scale).float()
        for _ in range(steps)
    ]


@pytest.mark.parametrize(("name", "params"), LOSSY, ids=IDS)
def test_sum_of_decoded_equals_sum_of_true_minus_residual(
    name: str, params: dict[str, object]
) -> None:
    codec = get_codec(name, params)
    ef = ErrorFeedback(NUMEL)
    sum_true = torch.zeros(NUMEL, dtype=torch.float64)
    sum_sent = torch.zeros(NUMEL, dtype=torch.float64)
    for step, delta in enumerate(updates(30)):
        payload, decoded = ef.step(codec, delta, seed=step)
        assert torch.equal(decoded, codec.decode(payload, NUMEL, seed=step))
        sum_true += delta.double()
        sum_sent += decoded.double()
        gap = (sum_sent - sum_true).norm()
        # ||sum(decoded) - sum(true)|| = ||e|| (up to float32 rounding of the residual updates)
        assert abs(float(gap) - ef.norm()) <= 1e-4 * float(sum_true.norm())


@pytest.mark.parametrize(("name", "params"), LOSSY, ids=IDS)
def test_error_feedback_beats_no_feedback_and_stays_bounded(
    name: str, params: dict[str, object]
) -> None:
    codec = get_codec(name, params)
    steps = updates(60, shared=0.9)
    ef = ErrorFeedback(NUMEL)
    sum_true = torch.zeros(NUMEL, dtype=torch.float64)
    sum_noef = torch.zeros(NUMEL, dtype=torch.float64)
    norms = []
    for step, delta in enumerate(steps):
        ef.step(codec, delta, seed=step)
        sum_true += delta.double()
        sum_noef += codec.decode(codec.encode(delta, seed=step), NUMEL, seed=step).double()
        norms.append(ef.norm())
    noef_err = float((sum_noef - sum_true).norm() / sum_true.norm())
    ef_err = ef.norm() / float(sum_true.norm())
    assert ef_err <= noef_err + 1e-7
    # the residual does not grow like the sum (linearly): it levels off
    assert norms[-1] <= 1.5 * max(norms[: len(norms) // 2]) + 1e-6
    if name in ("topk", "cocktail"):
        assert ef_err < 0.5 * noef_err


def test_fp32_has_zero_residual() -> None:
    ef = ErrorFeedback(NUMEL)
    for step, delta in enumerate(updates(3)):
        _, decoded = ef.step(get_codec("fp32"), delta, seed=step)
        assert torch.equal(decoded, delta)
    assert ef.norm() == 0.0


def test_residual_survives_restart() -> None:
    codec = get_codec("topk", {"chunk": 64, "k": 4, "value_bits": 2})
    steps = updates(6)
    straight = ErrorFeedback(NUMEL)
    restarted = ErrorFeedback(NUMEL)
    for step, delta in enumerate(steps):
        want, _ = straight.step(codec, delta, seed=step)
        data = restarted.to_bytes()
        assert data == ErrorFeedback.from_bytes(data, NUMEL).to_bytes()
        restarted = ErrorFeedback.from_bytes(data, NUMEL)
        got, _ = restarted.step(codec, delta, seed=step)
        assert got == want
    assert torch.equal(straight.residual, restarted.residual)
    assert straight.norm() > 0


def test_to_bytes_is_canonical_safetensors() -> None:
    ef = ErrorFeedback(10)
    ef.step(get_codec("int4", {"block": 4}), torch.linspace(-1, 1, 10))
    data = ef.to_bytes()
    header_len = int.from_bytes(data[:8], "little")
    assert len(data) == 8 + header_len + 40
    assert b'"residual"' in data[8 : 8 + header_len] and b"F32" in data[8 : 8 + header_len]


def test_invalid_error_feedback_bytes() -> None:
    good = ErrorFeedback(10).to_bytes()
    with pytest.raises(PayloadError):
        ErrorFeedback.from_bytes(good[:-1], 10)
    with pytest.raises(PayloadError):
        ErrorFeedback.from_bytes(good, 11)  # another numel
    with pytest.raises(PayloadError):
        ErrorFeedback.from_bytes(b"\xff" * 8 + b"{}", 10)  # huge declared header length
    with pytest.raises(PayloadError):
        ErrorFeedback.from_bytes(b"garbage", 10)
    with pytest.raises(OversizedError):
        ErrorFeedback.from_bytes(good + b"\0" * (1 << 21), 10)
    nan = ErrorFeedback(10)
    nan.residual[3] = float("nan")
    with pytest.raises(NonFiniteError):
        ErrorFeedback.from_bytes(nan.to_bytes(), 10)


def test_invalid_error_feedback_step_inputs() -> None:
    ef = ErrorFeedback(10)
    with pytest.raises(ValueError, match="elements"):
        ef.step(get_codec("fp32"), torch.ones(11))
    with pytest.raises(ValueError):
        ef.step(get_codec("fp32"), torch.ones(10, dtype=torch.float64))
    with pytest.raises(ValueError):
        ErrorFeedback(0)
    assert ef.norm() == 0.0  # nothing changed


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.95])
def test_decay_keeps_that_share_of_what_was_not_sent(decay: float) -> None:
    codec = get_codec("topk", {"chunk": 64, "k": 4, "value_bits": 1})
    kept, plain = ErrorFeedback(NUMEL), ErrorFeedback(NUMEL)
    for delta in updates(4, seed=3):
        residual = kept.residual.clone()
        payload, decoded = kept.step(codec, delta, decay=decay)
        # the payload is the undecayed rule's on the same residual: only what is kept changes
        plain.residual = residual
        plain_payload, plain_decoded = plain.step(codec, delta)
        assert plain_payload == payload and torch.equal(plain_decoded, decoded)
        assert torch.allclose(kept.residual, decay * plain.residual, atol=0, rtol=1e-6)
    if decay == 0.0:
        assert kept.norm() == 0.0
    else:
        assert kept.norm() > 0.0


def test_decay_out_of_range_is_refused() -> None:
    ef = ErrorFeedback(NUMEL)
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="decay"):
            ef.step(get_codec("int8"), updates(1)[0], decay=bad)
    assert ef.norm() == 0.0
