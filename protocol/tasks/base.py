"""The task interface: what a run trains, on which data, with which loss.

A task bundles a model factory, a dataset format and a loss. The organiser
packs the dataset once into a content-addressed blob; every worker and
validator loads that same blob and builds the same model from the task's
canonical parameters, so the inner loop in :mod:`veritrain.protocol.training`
can be recomputed by anyone. Tasks hold no mutable state of their own.

This module also holds the small parameter-validation helpers the built-in
tasks share: a run spec arrives from the network, so its task parameters are
checked key by key (known names only, exact types, bounded ranges) before
anything is built from them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import RejectedInput

#: A task's loaded dataset; its type is private to the task that made it.
Dataset = Any

#: Largest canonical JSON encoding of a task's parameters.
MAX_PARAMS_BYTES = 16 * 1024


class TaskError(RejectedInput):
    """An unknown task name or parameters that do not validate."""

    reason = "bad_task"


@runtime_checkable
class Task(Protocol):
    """One kind of training run: model factory, data format, loss.

    ``params`` is the validated, canonical (JSON-able, defaults filled in)
    parameter mapping; two tasks with equal ``name`` and ``params`` build the
    same model and read the same datasets.
    """

    name: str
    params: Mapping[str, object]

    def make_model(self) -> torch.nn.Module:
        """A fresh CPU model initialised deterministically from ``params["init_seed"]``."""
        ...

    def pack_dataset(self) -> bytes:
        """Organiser side: build the dataset blob that the run content-addresses."""
        ...

    def load_dataset(self, blob: bytes) -> Dataset:
        """Parse a blob (bounded, validated; raises ``PayloadError``)."""
        ...

    def num_train_examples(self, dataset: Dataset) -> int:
        """How many training examples the data assignment draws from."""
        ...

    def make_batch(
        self, dataset: Dataset, indices: torch.Tensor, *, device: torch.device
    ) -> object:
        """The batch for training example ``indices`` (int64 ``[B]``), on ``device``."""
        ...

    def loss(self, model: torch.nn.Module, batch: object) -> torch.Tensor:
        """Scalar mean loss of ``model`` on ``batch``."""
        ...

    def example_losses(self, model: torch.nn.Module, batch: object) -> torch.Tensor:
        """Each example's mean loss, ``[B]``: one forward pass; their mean is ``loss``."""
        ...

    def eval_batches(self, dataset: Dataset, *, device: torch.device) -> Iterable[object]:
        """Fixed held-out batches of equal size, the same every call."""
        ...


# --- parameter validation -------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """Rule for one task parameter: its type, default and bounds.

    ``kind`` is one of ``"int"``, ``"float"``, ``"bool"``, ``"str"``; a
    ``None`` default makes the parameter optional (``None`` allowed).
    """

    kind: str
    default: object
    lo: float | None = None
    hi: float | None = None
    max_len: int = 4096


def canonical_json(obj: object) -> bytes:
    """Sorted-key compact UTF-8 JSON: one encoding per value."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def validate_params(
    task: str, rules: Mapping[str, Param], given: Mapping[str, object] | None
) -> dict[str, object]:
    """Fill defaults into ``given`` and check every value against ``rules``.

    Unknown names, wrong types (a bool is not an int), out-of-range or
    non-finite numbers raise :class:`TaskError`. Ints are accepted where a
    float is expected and stored as floats, so the result is canonical.
    """
    if given is not None and not isinstance(given, Mapping):
        raise TaskError(f"task {task!r}: parameters must be a JSON object")
    given = dict(given or {})
    unknown = sorted(set(given) - set(rules))
    if unknown:
        raise TaskError(f"task {task!r}: unknown parameters {unknown}")
    out: dict[str, object] = {}
    for key, rule in rules.items():
        value = given.get(key, rule.default)
        if value is None and rule.default is None:
            out[key] = None
            continue
        if rule.kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif rule.kind == "float":
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if ok:
                value = float(value)  # type: ignore[arg-type]
                ok = math.isfinite(value)
        elif rule.kind == "bool":
            ok = isinstance(value, bool)
        elif rule.kind == "str":
            ok = isinstance(value, str) and len(value) <= rule.max_len
        else:  # pragma: no cover - a rule table typo is our bug
            raise AssertionError(f"unknown parameter kind {rule.kind!r}")
        if not ok:
            raise TaskError(
                f"task {task!r}: parameter {key!r}={value!r} is not a valid {rule.kind}"
            )
        if rule.kind in ("int", "float"):
            if rule.lo is not None and value < rule.lo:  # type: ignore[operator]
                raise TaskError(f"task {task!r}: parameter {key!r}={value} below minimum {rule.lo}")
            if rule.hi is not None and value > rule.hi:  # type: ignore[operator]
                raise TaskError(f"task {task!r}: parameter {key!r}={value} above maximum {rule.hi}")
        out[key] = value
    return out


def check_json_params(task: str, params: Mapping[str, object] | None) -> dict[str, object]:
    """A user task's parameters: any JSON object, bounded in size."""
    if params is not None and not isinstance(params, Mapping):
        raise TaskError(f"task {task!r}: parameters must be a JSON object")
    params = dict(params or {})
    try:
        encoded = canonical_json(params)
    except (TypeError, ValueError) as exc:
        raise TaskError(f"task {task!r}: parameters are not canonical JSON: {exc}") from exc
    if len(encoded) > MAX_PARAMS_BYTES:
        raise TaskError(f"task {task!r}: parameters exceed {MAX_PARAMS_BYTES} bytes")
    result = json.loads(encoded)
    assert isinstance(result, dict)
    return result


def seeded_generator(seed: int) -> torch.Generator:
    """A private CPU generator, so building a model never touches global RNG state."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def param_int(params: Mapping[str, object], key: str) -> int:
    """A validated int parameter, typed for the checker."""
    value = params[key]
    assert isinstance(value, int)
    return value


def param_float(params: Mapping[str, object], key: str) -> float:
    """A validated float parameter, typed for the checker."""
    value = params[key]
    assert isinstance(value, float)
    return value
