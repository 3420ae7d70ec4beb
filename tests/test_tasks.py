"""Tasks: deterministic models, dataset blobs, the registry."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save
from veritrain.protocol.errors import NonFiniteError, OversizedError, PayloadError, RejectedInput
from veritrain.protocol.tasks import TASK_PRESETS, SyntheticTask, Task, TaskError, load_task
from veritrain.protocol.tasks.charlm import (
    CORPUS_MAGIC,
    CharLMTask,
    encode_corpus,
    stdlib_source_files,
)
from veritrain.protocol.tensors import flatten_params

TINY = {**TASK_PRESETS["charlm"]["tiny"], "corpus_bytes": 20_000}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    (root / "b.py").write_bytes(b"print('b')\n" * 200)
    (root / "a.py").write_bytes(b"def a():\n    return 1\n" * 100)
    (root / "sub").mkdir()
    (root / "sub" / "c.py").write_bytes(bytes(range(256)) * 4)
    (root / "notes.txt").write_bytes(b"not python\n")
    return root


# --- models ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,params", [("charlm", TINY), ("synthetic", {})])
def test_model_init_deterministic(name: str, params: dict[str, object]) -> None:
    a = flatten_params(load_task(name, params).make_model())
    b = flatten_params(load_task(name, params).make_model())
    assert a.numpy().tobytes() == b.numpy().tobytes()
    c = flatten_params(load_task(name, {**params, "init_seed": 1}).make_model())
    assert not torch.equal(a, c)


@pytest.mark.parametrize("name,params", [("charlm", TINY), ("synthetic", {})])
def test_model_init_leaves_global_rng_alone(name: str, params: dict[str, object]) -> None:
    before = torch.get_rng_state()
    load_task(name, params).make_model()
    assert torch.equal(before, torch.get_rng_state())


def test_charlm_init_is_gpt2_like() -> None:
    model = load_task("charlm", TINY).make_model()
    named = dict(model.named_parameters())
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, counted once
    assert 0.015 < float(named["transformer.wte.weight"].detach().std()) < 0.025
    assert torch.all(named["transformer.ln_f.weight"] == 1.0)
    assert torch.all(named["transformer.h.0.attn.c_attn.bias"] == 0.0)
    assert float(named["transformer.h.0.mlp.c_proj.weight"].detach().std()) < 0.015  # depth-scaled


def test_charlm_is_causal() -> None:
    model = load_task("charlm", TINY).make_model().eval()
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 1) % 256
    with torch.no_grad():
        lx, ly = model(x), model(y)
    assert torch.equal(lx[:, :20], ly[:, :20])
    assert not torch.equal(lx[:, 20:], ly[:, 20:])


@pytest.mark.parametrize(
    "preset,lo,hi",
    [("tiny", 20_000, 50_000), ("demo", 150_000, 250_000), ("bench", 800_000, 1_300_000)],
)
def test_preset_sizes(preset: str, lo: int, hi: int) -> None:
    params = TASK_PRESETS["charlm"][preset]
    assert json.loads(json.dumps(params)) == params  # canonical JSON-able
    n = sum(p.numel() for p in load_task("charlm", params).make_model().parameters())
    assert lo <= n <= hi


def test_synthetic_is_small() -> None:
    assert sum(p.numel() for p in load_task("synthetic").make_model().parameters()) < 5000


# --- charlm corpus --------------------------------------------------------------------


def test_pack_load_round_trip_directory(corpus_dir: Path) -> None:
    task = load_task("charlm", {**TINY, "corpus_path": str(corpus_dir)})
    blob = task.pack_dataset()
    assert blob == task.pack_dataset()
    ds = task.load_dataset(blob)
    expected = b"".join(
        (corpus_dir / p).read_bytes() for p in ("a.py", "b.py", "sub/c.py")
    )  # sorted relative paths, .py only
    assert ds.file_count == 3
    assert bytes(torch.cat([ds.train, ds.eval]).numpy()) == expected
    assert ds.eval.numel() == max(int(len(expected) * 0.05), 33)


def test_pack_caps_bytes(corpus_dir: Path) -> None:
    task = load_task("charlm", {**TINY, "corpus_path": str(corpus_dir), "corpus_bytes": 3000})
    ds = task.load_dataset(task.pack_dataset())
    assert ds.train.numel() + ds.eval.numel() == 3000
    assert ds.file_count == 2  # a.py (2200 bytes) whole, b.py cut short


def test_pack_stdlib_default() -> None:
    task = load_task("charlm", TINY)
    blob = task.pack_dataset()
    assert blob == task.pack_dataset()
    ds = task.load_dataset(blob)
    assert ds.train.numel() + ds.eval.numel() == 20_000
    assert ds.source.startswith("python-stdlib-") and ds.file_count >= 1


def test_stdlib_walk_skips_tests_and_sorts(tmp_path: Path) -> None:
    for rel in (
        "z.py",
        "a/b.py",
        "a/test/x.py",
        "tests/y.py",
        "idlelib/i.py",
        "site-packages/s.py",
        "a/tests/t.py",
        "m.txt",
        "A.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    found = [p.relative_to(tmp_path).as_posix() for p in stdlib_source_files(tmp_path)]
    assert found == ["A.py", "a/b.py", "z.py"]


def test_make_batch_windows() -> None:
    task = load_task("charlm", TINY)
    ds = task.load_dataset(task.pack_dataset())
    x, y = task.make_batch(ds, torch.tensor([0, 5, 5]), device=torch.device("cpu"))
    assert x.shape == (3, 32) and y.shape == (3, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[1], ds.train[160:192].long())
    assert torch.equal(y[1], ds.train[161:193].long())
    assert task.num_train_examples(ds) == (ds.train.numel() - 1) // 32
    with pytest.raises(IndexError):
        task.make_batch(ds, torch.tensor([task.num_train_examples(ds)]), device=torch.device("cpu"))


def test_eval_batches_fixed_and_equal() -> None:
    task = load_task("charlm", {**TINY, "eval_windows": 20, "eval_batch_size": 8})
    ds = task.load_dataset(task.pack_dataset())
    a = list(task.eval_batches(ds, device=torch.device("cpu")))
    b = list(task.eval_batches(ds, device=torch.device("cpu")))
    assert len(a) == 2 and all(x.shape == (8, 32) for x, _ in a)
    assert all(
        torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b, strict=True)
    )


def _blob(raw_header: bytes, text: bytes = b"y" * 5000) -> bytes:
    return CORPUS_MAGIC + struct.pack("<I", len(raw_header)) + raw_header + text


GOOD_HEADER = (
    b'{"file_count":1,"format":"veritrain/v1/charlm-corpus","source":"t","text_bytes":5000}'
)


def test_valid_handmade_corpus_blob() -> None:
    ds = load_task("charlm", TINY).load_dataset(_blob(GOOD_HEADER))
    assert ds.file_count == 1 and ds.source == "t"
    assert ds.train.numel() + ds.eval.numel() == 5000


@pytest.mark.parametrize(
    "blob",
    [
        pytest.param(_blob(GOOD_HEADER)[:-1], id="truncated-text"),
        pytest.param(_blob(GOOD_HEADER)[:40], id="truncated-header"),
        pytest.param(_blob(GOOD_HEADER)[:10], id="truncated-prefix"),
        pytest.param(b"", id="empty"),
        pytest.param(_blob(GOOD_HEADER) + b"x", id="extra-byte"),
        pytest.param(b"XXCORPUS" + _blob(GOOD_HEADER)[8:], id="bad-magic"),
        pytest.param(CORPUS_MAGIC + struct.pack("<I", 10**9) + GOOD_HEADER, id="huge-header-len"),
        pytest.param(_blob(GOOD_HEADER.replace(b"1,", b"-1,")), id="negative-count"),
        pytest.param(_blob(GOOD_HEADER.replace(b"1,", b"true,")), id="bool-count"),
        pytest.param(_blob(GOOD_HEADER.replace(b"5000", b"5000.0")), id="float-length"),
        pytest.param(_blob(GOOD_HEADER.replace(b'"source"', b'"sourcX"')), id="unknown-field"),
        pytest.param(_blob(GOOD_HEADER.replace(b'"t"', b"7")), id="source-not-str"),
        pytest.param(_blob(GOOD_HEADER.replace(b"corpus", b"corpuX")), id="wrong-format"),
        pytest.param(_blob(GOOD_HEADER.replace(b":1,", b": 1,")), id="non-canonical"),
        pytest.param(_blob(b'{"text_bytes":5000,' + GOOD_HEADER[1:-19] + b"}"), id="unsorted"),
        pytest.param(_blob(GOOD_HEADER[:-1] + b',"file_count":1}'), id="duplicate-key"),
        pytest.param(_blob(b"[1,2]"), id="not-an-object"),
        pytest.param(_blob(b"\xff" + GOOD_HEADER[1:]), id="not-utf8"),
    ],
)
def test_invalid_corpus_blobs(blob: bytes) -> None:
    with pytest.raises(PayloadError):
        load_task("charlm", TINY).load_dataset(blob)


def test_invalid_corpus_oversized_and_too_small() -> None:
    task = load_task("charlm", TINY)
    big = encode_corpus(b"z" * 20_001, file_count=1, source="t")
    with pytest.raises(OversizedError):
        task.load_dataset(big)
    with pytest.raises(PayloadError):
        task.load_dataset(encode_corpus(b"z" * 40, file_count=1, source="t"))


def test_invalid_corpus_random_corruption() -> None:
    task = load_task("charlm", TINY)
    good = task.pack_dataset()
    g = torch.Generator().manual_seed(1)
    for _ in range(50):
        cut = int(torch.randint(0, len(good), (1,), generator=g))
        with pytest.raises(RejectedInput):
            task.load_dataset(good[:cut])


# --- synthetic ------------------------------------------------------------------------


def test_synthetic_round_trip() -> None:
    task = load_task("synthetic")
    blob = task.pack_dataset()
    assert blob == task.pack_dataset()
    ds = task.load_dataset(blob)
    assert task.num_train_examples(ds) == 2048
    x, y = task.make_batch(ds, torch.tensor([3, 1]), device=torch.device("cpu"))
    assert torch.equal(x[0], ds.x_train[3]) and torch.equal(y[1], ds.y_train[1])
    assert len(torch.unique(ds.y_train)) == 4
    other = load_task("synthetic", {"data_seed": 1}).pack_dataset()
    assert other != blob


def _synthetic_blob(task: SyntheticTask, **replace: torch.Tensor) -> bytes:
    ds = task.load_dataset(task.pack_dataset())
    tensors = {
        "x_train": ds.x_train,
        "y_train": ds.y_train,
        "x_eval": ds.x_eval,
        "y_eval": ds.y_eval,
    }
    tensors.update(replace)
    return st_save({k: v.contiguous() for k, v in tensors.items()})


def test_invalid_synthetic_blobs() -> None:
    task = SyntheticTask({"n_train": 64, "n_eval": 16})
    good = task.pack_dataset()
    for bad in (good[:-1], good[:7], b"", good + b"\0", b"\xff" * len(good)):
        with pytest.raises(PayloadError):
            task.load_dataset(bad)
    with pytest.raises(PayloadError):  # another layout
        SyntheticTask({"n_train": 65, "n_eval": 16}).load_dataset(good)
    with pytest.raises(PayloadError):
        task.load_dataset(_synthetic_blob(task, y_train=torch.full((64,), 4)))
    with pytest.raises(PayloadError):
        task.load_dataset(_synthetic_blob(task, y_eval=torch.zeros(16, dtype=torch.int32)))
    nan = torch.zeros(64, 16)
    nan[3, 3] = float("nan")
    with pytest.raises(NonFiniteError):
        task.load_dataset(_synthetic_blob(task, x_train=nan))
    with pytest.raises(OversizedError):
        task.load_dataset(good + b"\0" * (2 << 20))


# --- registry -------------------------------------------------------------------------


class ToyTask(SyntheticTask):
    """A user task: the synthetic task under another name, with its own parameter."""

    name = "toy"


def make_toy_task(params: Mapping[str, object]) -> Task:
    task = ToyTask({"hidden": int(params.get("hidden", 8))})  # type: ignore[call-overload]
    task.params = {**task.params, "user": dict(params)}
    return task


def not_a_task(params: Mapping[str, object]) -> object:
    return {"params": params}


def test_load_user_task() -> None:
    task = load_task(f"{__name__}:make_toy_task", {"hidden": 5})
    assert isinstance(task, ToyTask) and task.name == "toy"
    assert sum(p.numel() for p in task.make_model().parameters()) == 16 * 5 + 5 + 5 * 4 + 4


def test_load_builtins_fill_defaults() -> None:
    assert load_task("charlm").params == TASK_PRESETS["charlm"]["demo"] | {
        "corpus_bytes": 4_000_000
    }
    assert load_task("synthetic", {"n_train": 10}).params["n_train"] == 10
    assert load_task("synthetic", {"label_noise": 1}).params["label_noise"] == 1.0


@pytest.mark.parametrize(
    "name",
    [
        "nope",
        "",
        "a:b:c",
        "os.path",
        ":f",
        "mod:",
        "1mod:f",
        "mod:f()",
        "veritrain_no_such_module_xyz:f",
        "json:no_such_function",
        f"{__name__}:not_a_task",
        f"{__name__}:GOOD_HEADER",
    ],
)
def test_invalid_task_names(name: str) -> None:
    with pytest.raises(TaskError):
        load_task(name)


@pytest.mark.parametrize(
    "name,params",
    [
        ("charlm", {"n_layers": 2}),
        ("charlm", {"n_layer": True}),
        ("charlm", {"n_layer": 2.0}),
        ("charlm", {"n_layer": 0}),
        ("charlm", {"n_embd": 30, "n_head": 4}),
        ("charlm", {"eval_fraction": float("nan")}),
        ("charlm", {"corpus_path": 5}),
        ("synthetic", {"n_classes": 1}),
        ("synthetic", {"hidden": "8"}),
        ("synthetic", [("hidden", 8)]),
    ],
)
def test_invalid_task_params(name: str, params: dict[str, object]) -> None:
    with pytest.raises(TaskError):
        load_task(name, params)


def test_invalid_user_task_params() -> None:
    with pytest.raises(TaskError):
        load_task(f"{__name__}:make_toy_task", {"x": object()})


def test_charlm_task_satisfies_protocol() -> None:
    assert isinstance(CharLMTask(TINY), Task)
