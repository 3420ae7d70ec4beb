"""The inner loop: bitwise reproducibility, commitments, recomputation, replay, learning."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from veritrain.protocol.commitments import CHUNK, chunk_count
from veritrain.protocol.data import get_data_assignment
from veritrain.protocol.tasks import (
    TASK_PRESETS,
    CharLMDataset,
    CharLMTask,
    SyntheticTask,
    load_task,
)
from veritrain.protocol.tensors import flatten_params, load_flat_params
from veritrain.protocol.training import (
    CommitPool,
    ConfigError,
    InnerConfig,
    TrainingDivergedError,
    TrainingState,
    commitment_of,
    deterministic_mode,
    evaluate,
    local_train,
    relative_distance,
    replay_steps,
    state_distance,
    train_segment,
    train_step_at,
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


@pytest.mark.parametrize("make_pool", [lambda: ThreadPoolExecutor(1), lambda: CommitPool(1),
                                       lambda: CommitPool(3)], ids=["executor", "pool1", "pool3"])
def test_two_runs_bitwise_identical(charlm, make_pool) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = charlm
    a = assignment(task, ds, CFG)
    r1 = local_train(task, ds, base, a, CFG)
    with make_pool() as pool:  # hashing on other threads, in parts, changes nothing
        r2 = local_train(task, ds, base, a, CFG, pool=pool)
    assert r1.delta.numpy().tobytes() == r2.delta.numpy().tobytes()
    assert r1.trail == r2.trail and len(r1.trail) == 3 and len(set(r1.trail)) == 3
    assert r1.losses == r2.losses and len(r1.losses) == 6
    assert r1.samples == 48
    assert torch.equal(r1.delta, base - r1.final_flat)
    assert float(r1.delta.abs().max()) > 0
    assert commitment_of(6, base.numel(), r1.final_leaves) == r1.trail[-1]


def _reference_states(task, ds, base, a, cfg):  # type: ignore[no-untyped-def]
    """The inner loop written the obvious way: a model and a fresh AdamW rebuilt from each
    state (copies, no shared buffers), one step at a time."""
    model = task.make_model()
    model.train()
    params = list(model.parameters())
    state = TrainingState.initial(base)
    out = []
    for i in range(cfg.steps):
        load_flat_params(model, state.params)
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False, fused=False)
        offset = 0
        for p in params:
            n = p.numel()
            opt.state[p] = {"step": torch.tensor(float(state.step)),
                            "exp_avg": state.exp_avg[offset:offset + n].view_as(p).clone(),
                            "exp_avg_sq": state.exp_avg_sq[offset:offset + n].view_as(p).clone()}
            offset += n
        with deterministic_mode(CPU):
            opt.zero_grad(set_to_none=True)
            task.loss(model, task.make_batch(ds, a[i])).backward()
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip, foreach=False)
            opt.step()

        def cat(key: str) -> torch.Tensor:
            return torch.cat([opt.state[p][key].detach().reshape(-1) for p in params])  # noqa: B023
        state = TrainingState(torch.cat([p.detach().reshape(-1) for p in params]),
                              cat("exp_avg"), cat("exp_avg_sq"), i + 1)
        out.append(state)
    return out


def test_flat_buffers_train_bitwise_like_the_obvious_loop(charlm) -> None:  # type: ignore[no-untyped-def]
    """Parameters and moments as views of three flat buffers, the optimizer kept across
    steps, give the same bits as rebuilding everything from each state."""
    task, ds, base = charlm
    cfg = dataclasses.replace(CFG, trail_every=1)
    a = assignment(task, ds, cfg)
    seen: list[TrainingState] = []
    run = local_train(task, ds, base, a, cfg, sink=lambda st, _: seen.append(TrainingState(
        *(v.clone() for v in st.vectors()), st.step)))
    ref = _reference_states(task, ds, base, a, cfg)
    assert [st.step for st in seen] == list(range(1, 7))
    for mine, theirs in zip(seen, ref, strict=True):
        assert state_distance(mine, theirs) == 0.0
    assert [st.commitment() for st in ref] == run.trail


@pytest.mark.parametrize("make_pool", [lambda: ThreadPoolExecutor(1), lambda: CommitPool(3)],
                         ids=["executor", "pool3"])
def test_sink_gets_each_state_with_its_leaves_before_it_changes(charlm, make_pool) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = charlm
    a = assignment(task, ds, CFG)
    got: list[tuple[int, str, str]] = []

    def sink(state: TrainingState, leaves: tuple[bytes, bytes, bytes]) -> None:
        time.sleep(0.05)  # a slow sink (a state written to disk): the next step must wait
        got.append((state.step, commitment_of(state.step, state.numel, leaves),
                    state.commitment()))

    with make_pool() as pool:
        run = local_train(task, ds, base, a, CFG, sink=sink, pool=pool)
    assert [g[0] for g in got] == [2, 4, 6]
    assert [g[1] for g in got] == [g[2] for g in got] == run.trail


def test_segment_recompute_reproduces_trail(charlm) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = charlm
    a = assignment(task, ds, CFG)
    kept: dict[int, TrainingState] = {0: TrainingState.initial(base)}
    run = local_train(task, ds, base, a, CFG, sink=lambda st, _: kept.__setitem__(
        st.step, TrainingState(*(v.clone() for v in st.vectors()), st.step)))
    k = CFG.trail_every
    for s in range(CFG.segments):
        end = train_segment(task, ds, kept[s * k], a[s * k:(s + 1) * k], CFG)
        assert end.commitment() == run.trail[s]
        assert state_distance(end, kept[(s + 1) * k]) == 0.0
    # The wrong rows of data give another end state.
    wrong = train_segment(task, ds, kept[k], a[0:k], CFG)
    assert wrong.commitment() != run.trail[1]


def test_step_at_chunks_matches_the_full_step_exactly(charlm) -> None:  # type: ignore[no-untyped-def]
    """AdamW is elementwise after clipping: from the whole start parameters and the start
    moments at some coordinates, one step gives those coordinates' end values bit for bit."""
    task, ds, base = charlm
    cfg = dataclasses.replace(CFG, trail_every=1)
    a = assignment(task, ds, cfg)
    kept: dict[int, TrainingState] = {0: TrainingState.initial(base)}
    local_train(task, ds, base, a, cfg, sink=lambda st, _: kept.__setitem__(
        st.step, TrainingState(*(v.clone() for v in st.vectors()), st.step)))
    n = base.numel()
    index = torch.tensor(sorted({0, 1, 7, n // 3, n // 2 + 5, n - 2, n - 1}))
    for t in (0, 3, 5):
        start, end = kept[t], kept[t + 1]
        moments = None if t == 0 else (start.exp_avg[index], start.exp_avg_sq[index])
        p, m, v = train_step_at(task, ds, start.params, t, moments, index, a[t], cfg)
        assert torch.equal(p, end.params[index]) and torch.equal(m, end.exp_avg[index])
        assert torch.equal(v, end.exp_avg_sq[index])
    # Wrong moments or another row give other values.
    p, _, _ = train_step_at(task, ds, kept[3].params, 3, (kept[3].exp_avg[index] * 2,
                            kept[3].exp_avg_sq[index]), index, a[3], cfg)
    assert not torch.equal(p, kept[4].params[index])
    p, _, _ = train_step_at(task, ds, kept[3].params, 3, (kept[3].exp_avg[index],
                            kept[3].exp_avg_sq[index]), index, a[4], cfg)
    assert not torch.equal(p, kept[4].params[index])


def test_replay_from_a_kept_state_gives_the_same_commitments(charlm) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = charlm
    cfg = dataclasses.replace(CFG, trail_every=1)
    a = assignment(task, ds, cfg)
    kept: dict[int, TrainingState] = {}
    run = local_train(task, ds, base, a, cfg, sink=lambda st, _: kept.__setitem__(
        st.step, TrainingState(*(v.clone() for v in st.vectors()), st.step)))
    assert replay_steps(task, ds, kept[2], a[2:5], cfg) == run.trail[2:5]
    assert replay_steps(task, ds, TrainingState.initial(base), a[0:6], cfg) == run.trail


def _live_tensor_bytes() -> int:
    """Bytes of the distinct storages of every tensor the interpreter holds."""
    import gc

    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def test_worker_memory_does_not_grow_with_the_number_of_steps(charlm) -> None:  # type: ignore[no-untyped-def]
    """Peak tensor memory during local training does not depend on S: states go to the
    sink (a worker's disk), nothing keeps them. Measured inside the sink at every step,
    above what the interpreter held just before the run (other tests' garbage, collected
    or not, is no part of it)."""
    import gc

    task, ds, base = charlm
    peaks = {}
    for steps in (4, 32):
        cfg = InnerConfig(steps=steps, batch_size=8, lr=3e-3, trail_every=1)
        gc.collect()
        before = _live_tensor_bytes()
        seen: list[int] = []
        run = local_train(task, ds, base, assignment(task, ds, cfg), cfg,
                          sink=lambda *_: seen.append(_live_tensor_bytes()))  # noqa: B023
        assert len(run.trail) == steps == len(seen)
        peaks[steps] = max(seen) - before
        del run  # the first run's result must not count in the second's peak
    state_bytes = 12 * base.numel()
    # 28 more states would be 28 x 12 bytes per parameter: allow well under one state.
    assert peaks[32] - peaks[4] < state_bytes / 2, (peaks, state_bytes)


def test_trail_granularity_does_not_change_result(synthetic) -> None:  # type: ignore[no-untyped-def]
    task, ds, base = synthetic
    fine = InnerConfig(steps=12, batch_size=16, lr=1e-2, trail_every=1)
    coarse = dataclasses.replace(fine, trail_every=12)
    a = assignment(task, ds, fine)
    r_fine, r_coarse = local_train(task, ds, base, a, fine), local_train(task, ds, base, a, coarse)
    assert torch.equal(r_fine.delta, r_coarse.delta)  # committing changes nothing it commits
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


def test_state_golden_commitment() -> None:
    """The commitment is part of the protocol: the spec's formula written out here with
    hashlib and blake3 alone, and its test vector (specs/tasks.md, "Training state")."""
    import hashlib

    import blake3

    s = small_state()

    def root(v: torch.Tensor) -> bytes:
        leaf = blake3.blake3(v.numpy().astype("<f4").tobytes()).digest()  # one short chunk
        return hashlib.sha256(b"veritrain/v1/vector-root\x00" + (4).to_bytes(8, "big")
                              + CHUNK.to_bytes(4, "big") + leaf).digest()

    expected = hashlib.sha256(b"veritrain/v1/state\x00" + (3).to_bytes(8, "big")
                              + (4).to_bytes(8, "big") + root(s.params) + root(s.exp_avg)
                              + root(s.exp_avg_sq)).hexdigest()
    assert s.commitment() == expected == (
        "35ae5eef1e55cfc905fd2d48eafd5afce3d805cedca100f7c29df976a47e2e3a")


@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda s: dataclasses.replace(s, step=4), id="step"),
        pytest.param(lambda s: dataclasses.replace(s, params=s.params + 1e-7), id="params"),
        pytest.param(lambda s: dataclasses.replace(s, exp_avg=-s.exp_avg), id="exp_avg"),
        pytest.param(
            lambda s: dataclasses.replace(s, exp_avg_sq=s.exp_avg_sq * 2), id="exp_avg_sq"
        ),
        pytest.param(lambda s: dataclasses.replace(s, params=s.params[:3], exp_avg=s.exp_avg[:3],
                                                   exp_avg_sq=s.exp_avg_sq[:3]), id="numel"),
    ],
)
def test_state_commitment_covers_every_field(other) -> None:  # type: ignore[no-untyped-def]
    s = small_state()
    assert other(s).commitment() != s.commitment()


def test_commitment_of_a_long_state_spans_its_chunks() -> None:
    n = 2 * CHUNK + 5
    params = torch.arange(n, dtype=torch.float32)
    s = TrainingState(params, params / 3, params / 7, 1)
    assert chunk_count(n) == 3
    last = params.clone()
    last[-1] += 1  # a change in the short last chunk
    assert dataclasses.replace(s, params=last).commitment() != s.commitment()


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
    cpu = local_train(task, ds, base, a, CFG)
    kept: dict[int, TrainingState] = {}
    gpu = local_train(task, ds, base, a, CFG, device="cuda", sink=lambda st, _: kept.__setitem__(
        st.step, TrainingState(*(v.clone() for v in st.vectors()), st.step)))
    with CommitPool(2) as pool:
        again = local_train(task, ds, base, a, CFG, device="cuda", pool=pool)
    assert gpu.delta.device.type == "cpu" and gpu.trail == again.trail
    assert relative_distance(gpu.delta, cpu.delta) < 1e-3
    seg = train_segment(task, ds, kept[2], a[2:4], CFG, device="cuda")
    assert seg.commitment() == gpu.trail[1]


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
