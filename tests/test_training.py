"""The inner loop: bitwise reproducibility, segment recomputation, states, learning."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from veritrain.protocol.data import get_data_assignment
from veritrain.protocol.errors import NonFiniteError, PayloadError
from veritrain.protocol.tasks import (
    TASK_PRESETS,
    CharLMDataset,
    CharLMTask,
    SyntheticTask,
    load_task,
)
from veritrain.protocol.tensors import flatten_params, sha256_hex
from veritrain.protocol.training import (
    ConfigError,
    InnerConfig,
    TrainingDivergedError,
    TrainingState,
    deterministic_mode,
    evaluate,
    local_train,
    relative_distance,
    state_distance,
    train_segment,
)

CPU = torch.device("cpu")
CFG = InnerConfig(steps=6, batch_size=8, lr=3e-3, trail_every=2)


@pytest.fixture(scope="module")
def charlm() -> tuple[CharLMTask, CharLMDataset, torch.Tensor]:
    task = load_task("charlm", {**TASK_PRESETS["charlm"]["tiny"], "corpus_bytes": 200_000})
    assert isinstance(task, CharLMTask)
    return task, task.load_dataset(task.pack_dataset()), flatten_params(task.make_model())


@pytest.fixture(scope="module")
def synthetic() -> tuple[SyntheticTask, object, torch.Tensor]:
    task = SyntheticTask()
    return task, task.load_dataset(task.pack_dataset()), flatten_params(task.make_model())


def assignment(task, ds, cfg: InnerConfig, key: bytes = b"w1", r: int = 0) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return get_data_assignment(
        "test-run",
        r,
        key,
        num_examples=task.num_train_examples(ds),
        steps=cfg.steps,
        batch_size=cfg.batch_size,
    )


# --- reproducibility ------------------------------------------------------------------


def test_two_runs_bitwise_identical(charlm) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = charlm
    a = assignment(task, ds, CFG)
    r1 = local_train(task, ds, base, a, CFG)
    r2 = local_train(task, ds, base, a, CFG)
    assert r1.delta.numpy().tobytes() == r2.delta.numpy().tobytes()
    assert r1.trail == r2.trail and len(r1.trail) == 3 and len(set(r1.trail)) == 3
    assert r1.losses == r2.losses and len(r1.losses) == 6
    assert r1.samples == 48
    assert torch.equal(r1.delta, base - r1.final_flat)
    assert float(r1.delta.abs().max()) > 0
    assert r1.final_state.hash() == r1.trail[-1] and r1.final_state.step == 6


def test_segment_recompute_reproduces_trail(charlm) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = charlm
    a = assignment(task, ds, CFG)
    run = local_train(task, ds, base, a, CFG, keep_states=True)
    assert len(run.states) == 4
    assert run.states[0].hash() == TrainingState.initial(base).hash()
    k = CFG.trail_every
    for s in range(CFG.segments):
        revealed = TrainingState.from_bytes(run.states[s].to_bytes(), numel=base.numel())
        end = train_segment(task, ds, revealed, a[s * k : (s + 1) * k], CFG)
        assert end.hash() == run.trail[s]
        assert state_distance(end, run.states[s + 1]) == 0.0
    # The wrong rows of data give another end state.
    wrong = train_segment(task, ds, run.states[1], a[0:k], CFG)
    assert wrong.hash() != run.trail[1]


def test_trail_granularity_does_not_change_result(synthetic) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = synthetic
    fine = InnerConfig(steps=12, batch_size=16, lr=1e-2, trail_every=1)
    coarse = dataclasses.replace(fine, trail_every=12)
    a = assignment(task, ds, fine)
    r_fine, r_coarse = local_train(task, ds, base, a, fine), local_train(task, ds, base, a, coarse)
    assert torch.equal(r_fine.delta, r_coarse.delta)  # rebuilding AdamW from a state is exact
    assert r_fine.trail[-1] == r_coarse.trail[0] and len(r_fine.trail) == 12


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"key": b"w2"}, id="other-data"),
        pytest.param({"lr": 6e-3}, id="double-lr"),
        pytest.param({"steps": 4}, id="fewer-steps"),
    ],
)
def test_different_work_is_clearly_different(charlm, change: dict[str, object]) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = charlm
    a = assignment(task, ds, CFG)
    honest = local_train(task, ds, base, a, CFG)
    recompute = local_train(task, ds, base, a, CFG)
    cfg = dataclasses.replace(
        CFG,
        lr=change.get("lr", CFG.lr),
        steps=change.get("steps", CFG.steps),  # type: ignore[arg-type]
    )
    other_a = assignment(task, ds, cfg, key=change.get("key", b"w1"))  # type: ignore[arg-type]
    other = local_train(task, ds, base, other_a, cfg)
    assert relative_distance(recompute.delta, honest.delta) < 1e-6
    assert relative_distance(other.delta, honest.delta) > 1e-2


# --- learning -------------------------------------------------------------------------


def test_charlm_tiny_eval_loss_falls(charlm) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = charlm
    cfg = InnerConfig(steps=300, batch_size=16, lr=3e-3, trail_every=300)
    seen: list[int] = []
    run = local_train(
        task, ds, base, assignment(task, ds, cfg), cfg, progress=lambda s, _: seen.append(s)
    )
    assert seen == list(range(1, 301))
    before, after = evaluate(task, ds, base), evaluate(task, ds, run.final_flat)
    assert before > 5.0  # ~ln(256): uniform over bytes
    assert after < 3.0, (before, after)
    assert sum(run.losses[-20:]) / 20 < sum(run.losses[:20]) / 20 - 1.5


def test_synthetic_eval_loss_falls_over_rounds(synthetic) -> None:  # type: ignore[no-untyped-def]
    task, ds, flat = synthetic
    cfg = InnerConfig(steps=10, batch_size=32, lr=1e-2, trail_every=5)
    losses = [evaluate(task, ds, flat)]
    for r in range(3):  # rounds: train, then apply the pseudo-gradient as a plain outer step
        run = local_train(task, ds, flat, assignment(task, ds, cfg, r=r), cfg)
        flat = flat - run.delta
        losses.append(evaluate(task, ds, flat))
    assert losses == sorted(losses, reverse=True)
    assert losses[-1] < 0.6 * losses[0], losses


def test_evaluate_is_deterministic(synthetic) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = synthetic
    assert evaluate(task, ds, base) == evaluate(task, ds, base)
    assert evaluate(task, ds, base) != evaluate(task, ds, base * 0.5)


# --- training state -------------------------------------------------------------------


def small_state() -> TrainingState:
    p = torch.arange(4, dtype=torch.float32)
    return TrainingState(p, p / 10, p / 100, 3)


def test_state_golden_hash() -> None:
    # Pinned: the state file format is part of the protocol (specs/tasks.md).
    s = small_state()
    assert s.hash() == sha256_hex(s.to_bytes())
    assert s.hash() == "7e3ee70a67fabac34efae9ef65aa6eda904e94cf0247dd7a8436047a2568862e"


def test_state_round_trip() -> None:
    s = small_state()
    back = TrainingState.from_bytes(s.to_bytes(), numel=4)
    assert back.step == 3 and back.to_bytes() == s.to_bytes() and back.hash() == s.hash()
    assert torch.equal(back.params, s.params) and torch.equal(back.exp_avg_sq, s.exp_avg_sq)


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda s: dataclasses.replace(s, step=4), id="step"),
        pytest.param(lambda s: dataclasses.replace(s, params=s.params + 1e-7), id="params"),
        pytest.param(lambda s: dataclasses.replace(s, exp_avg=-s.exp_avg), id="exp_avg"),
        pytest.param(
            lambda s: dataclasses.replace(s, exp_avg_sq=s.exp_avg_sq * 2), id="exp_avg_sq"
        ),
    ],
)
def test_state_hash_covers_every_field(other) -> None:  # type: ignore[no-untyped-def]
    s = small_state()
    t = other(s)
    assert t.hash() != s.hash()


def _raw_state(params: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: float) -> bytes:
    from safetensors.torch import save

    named = {"params": params, "exp_avg": m, "exp_avg_sq": v, "step": torch.tensor([step])}
    return save({k: t.clone() for k, t in named.items()})


def test_invalid_state_bytes() -> None:
    good = small_state().to_bytes()
    z = torch.zeros(4)
    for bad in (good[:-1], good + b"\0", b"", good[:8], b"\xff" * len(good)):
        with pytest.raises(PayloadError):
            TrainingState.from_bytes(bad, numel=4)
    with pytest.raises(PayloadError):  # wrong model size
        TrainingState.from_bytes(good, numel=5)
    with pytest.raises(PayloadError):
        TrainingState.from_bytes(_raw_state(z, z, z - 1, 0.0), numel=4)
    with pytest.raises(PayloadError):
        TrainingState.from_bytes(_raw_state(z, z, z, 1.5), numel=4)
    with pytest.raises(PayloadError):
        TrainingState.from_bytes(_raw_state(z, z, z, -1.0), numel=4)
    with pytest.raises(NonFiniteError):
        TrainingState.from_bytes(_raw_state(z + float("inf"), z, z, 0.0), numel=4)
    assert TrainingState.from_bytes(_raw_state(z, z, z, 2.0), numel=4).step == 2


# --- configuration and errors ---------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"steps": 0},
        {"steps": 6, "trail_every": 4},
        {"trail_every": 0},
        {"batch_size": 0},
        {"lr": 0.0},
        {"lr": float("nan")},
        {"betas": (0.9, 1.0)},
        {"eps": 0.0},
        {"weight_decay": -1.0},
        {"grad_clip": 0.0},
        {"steps": True},
    ],
)
def test_invalid_inner_config(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        dataclasses.replace(CFG, **kwargs)  # type: ignore[arg-type]


def test_inner_config_mapping_round_trip() -> None:
    assert InnerConfig.from_mapping(CFG.as_dict()) == CFG
    with pytest.raises(ConfigError):
        InnerConfig.from_mapping({**CFG.as_dict(), "momentum": 0.9})
    with pytest.raises(ConfigError):
        InnerConfig.from_mapping({"steps": 1})


def test_invalid_assignment_shape(synthetic) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = synthetic
    with pytest.raises(ValueError):
        local_train(task, ds, base, torch.zeros(5, 8, dtype=torch.int64), CFG)
    with pytest.raises(ValueError):  # a state of another model
        train_segment(
            task,
            ds,
            TrainingState.initial(torch.zeros(3)),
            torch.zeros(2, 8, dtype=torch.int64),
            CFG,
        )


class NaNTask(SyntheticTask):
    """Loss turns NaN at the third step."""

    calls = 0

    def loss(self, model: torch.nn.Module, batch: object) -> torch.Tensor:
        self.calls += 1
        out = super().loss(model, batch)
        return out * float("nan") if self.calls >= 3 else out


def test_divergence_raises(synthetic) -> None:  # type: ignore[no-untyped-def]
    _, ds, base = synthetic
    task = NaNTask()
    with pytest.raises(TrainingDivergedError, match="step 3"):
        local_train(task, ds, base, assignment(task, ds, CFG), CFG)


def test_deterministic_flag_scoped(synthetic) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = synthetic
    inside: list[bool] = []
    a = assignment(task, ds, CFG)
    assert not torch.are_deterministic_algorithms_enabled()
    local_train(
        task,
        ds,
        base,
        a,
        CFG,
        progress=lambda *_: inside.append(torch.are_deterministic_algorithms_enabled()),
    )
    assert inside == [True] * 6 and not torch.are_deterministic_algorithms_enabled()
    inside.clear()
    local_train(
        task,
        ds,
        base,
        a,
        CFG,
        deterministic=False,
        progress=lambda *_: inside.append(torch.are_deterministic_algorithms_enabled()),
    )
    assert inside == [False] * 6


def test_relative_distance() -> None:
    b = torch.tensor([3.0, 4.0])
    assert relative_distance(b, b) == 0.0
    assert relative_distance(torch.tensor([3.0, 4.5]), b) == pytest.approx(0.1)
    assert relative_distance(torch.zeros(2), torch.zeros(2)) == 0.0
    assert relative_distance(torch.ones(2), torch.zeros(2)) > 1e20
    big = torch.full((10,), 3e38)
    assert relative_distance(big, big * 0.5) == pytest.approx(1.0)  # no float32 overflow
    with pytest.raises(ValueError):
        relative_distance(torch.zeros(2), torch.zeros(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_within_tolerance(charlm) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = charlm
    a = assignment(task, ds, CFG)
    cpu = local_train(task, ds, base, a, CFG, keep_states=True)
    gpu = local_train(task, ds, base, a, CFG, device="cuda", keep_states=True)
    again = local_train(task, ds, base, a, CFG, device="cuda")
    assert gpu.delta.device.type == "cpu" and gpu.trail == again.trail
    assert relative_distance(gpu.delta, cpu.delta) < 1e-3
    seg = train_segment(task, ds, gpu.states[1], a[2:4], CFG, device="cuda")
    assert seg.hash() == gpu.trail[1]


def test_deterministic_mode_stays_on_while_another_thread_is_inside() -> None:
    """Two overlapping blocks in two threads, the first in also the first out: it must not
    switch the deterministic kernels off under the second; the last one out restores the
    setting."""
    import threading

    before = torch.are_deterministic_algorithms_enabled()
    first_in = threading.Event()
    both_in = threading.Barrier(2, timeout=10)
    first_left = threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with deterministic_mode(torch.device("cpu")):
            first_in.set()
            both_in.wait()
        first_left.set()

    def second() -> None:
        assert first_in.wait(10)
        with deterministic_mode(torch.device("cpu")):
            both_in.wait()
            assert first_left.wait(10)
            seen["after_first_left"] = torch.are_deterministic_algorithms_enabled()

    threads = [threading.Thread(target=first, daemon=True),
               threading.Thread(target=second, daemon=True)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not any(th.is_alive() for th in threads)
    assert seen == {"after_first_left": True}
    assert torch.are_deterministic_algorithms_enabled() == before
