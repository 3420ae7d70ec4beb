"""Run creation: from settings to a signed run spec, dataset blob and genesis model."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

from .identity import Identity, PublicIdentity
from .membership import admission_problem_of_spec
from .messages import RunSpec, Signed, sign
from .tasks import TASK_PRESETS, load_task
from .tensors import (
    decode_flat,
    encode_flat,
    flatten_params,
    numel_of,
    param_shapes,
    sha256_hex,
)


@dataclass
class RunBundle:
    """What the organiser uploads to create a run."""

    signed: Signed[RunSpec]
    dataset: bytes
    genesis: bytes


def task_params(task: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """Resolve ``{"name", "preset"?, "params"?}`` to a task name and full parameters."""
    name = task["name"]
    params: dict[str, Any] = {}
    if task.get("preset"):
        params.update(TASK_PRESETS[name][task["preset"]])
    params.update(task.get("params") or {})
    return name, load_task(name, params).params


def build_run(
    organiser: Identity,
    run_id: str,
    settings: dict[str, Any],
    validators: list[PublicIdentity],
    *,
    quorum: int | None = None,
    seed: str | None = None,
    genesis: bytes | None = None,
) -> RunBundle:
    """Pack the dataset, build the genesis model and sign the spec. ``genesis``: start
    from this model file instead of the task's fresh model (a run that continues another
    run's certified model under a new validator set, specs/protocol.md 5.4a); it must be
    a canonical, finite model file of the task's layout."""
    if not validators:
        raise ValueError("a run needs at least one validator")
    name, params = task_params(settings["task"])
    task = load_task(name, params)
    dataset = task.pack_dataset()
    model = task.make_model()
    shapes = param_shapes(model)
    if genesis is None:
        genesis = encode_flat(flatten_params(model), shapes)
    else:
        decode_flat(genesis, shapes, max_bytes=len(genesis))  # raises PayloadError if not
    n = len(validators)
    spec = RunSpec(
        run_id=run_id,
        round=0,
        created_at=int(time.time()),
        organiser=organiser.public_key.hex(),
        seed=seed or secrets.token_hex(32),
        task={"name": name, "params": dict(task.params)},
        dataset_hash=sha256_hex(dataset),
        dataset_bytes=len(dataset),
        genesis_model_hash=sha256_hex(genesis),
        num_params=numel_of(shapes),
        inner=settings["inner"],
        outer=settings["outer"],
        codec=settings["codec"],
        aggregator=settings["aggregator"],
        schedule=settings["schedule"],
        verification=settings["verification"],
        limits=settings["limits"],
        rewards=settings["rewards"],
        validators=[v.to_json() for v in validators],
        quorum=quorum if quorum is not None else -(-2 * n // 3),  # ceil(2n/3)
        admission=settings.get("admission"),  # absent: open (protocol/membership.py)
    )
    RunSpec.from_body(spec.to_body())
    if (problem := admission_problem_of_spec(spec.admission)) is not None:
        raise ValueError(problem)
    if (problem := spec.quorum_problem() or spec.sharding_problem()
            or spec.masking_problem()) is not None:
        raise ValueError(problem)
    return RunBundle(sign(organiser, spec), dataset, genesis)
